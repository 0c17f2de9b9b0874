"""Bad input (issue 3): each case raises, on the calling rank, an exception
naming the argument and what was expected, before any C call, so no rank is
left waiting inside a half-issued collective; the communicator stays usable.

What follows from the declaration table (every tensor parameter
non-contiguous, on another device, not a tensor, of another dtype; every rank
out of range, negative, of another type; every list and split-size list of
the wrong length; every declared size relation off by one; an unknown op) is
tested for every collective by ``tests/core/test_launch.py``
(``test_bad_input_of_every_declared_parameter_is_named``). Here: what the
table does not describe (sparse layouts, numpy strides, which dtypes and ops
a library supports, tags, peers, root-only lists, split sums, P2POps, the
group argument, split)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import streamcoll
from streamcoll import ReduceOp


def _cases(comm):
    size = comm.size
    ok = torch.ones(4)
    return [
        ("sparse coo", lambda: streamcoll.all_reduce(torch.sparse_coo_tensor([[0, 1]], [1.0, 2.0], (3,))),
         TypeError, ["tensor", "sparse tensors are not supported"]),
        ("sparse csr", lambda: streamcoll.broadcast(torch.eye(3).to_sparse_csr(), 0), TypeError,
         ["tensor", "sparse", "sparse_csr"]),
        ("all_gather_coalesced rows", lambda: streamcoll.all_gather_coalesced([[torch.empty(4)]] * size, [ok, ok]),
         ValueError, ["output_tensor_lists[0]", "2 tensors"]),
        ("all_gather_coalesced numel", lambda: streamcoll.all_gather_coalesced([[torch.empty(3)]] * size, [ok]),
         ValueError, ["output_tensor_lists[0][0]", "4"]),
        ("non-contiguous numpy", lambda: streamcoll.all_reduce(np.ones((4, 4), np.float32).T), ValueError,
         ["tensor", "C-contiguous"]),
        ("unsupported dtype", lambda: streamcoll.all_reduce(torch.ones(2, dtype=torch.complex64)), TypeError,
         ["tensor", "complex64", "all_reduce", "oneccl"]),
        ("unsupported int16", lambda: streamcoll.all_reduce(torch.ones(2, dtype=torch.int16)), TypeError,
         ["int16", "oneccl"]),
        ("torch BAND", lambda: streamcoll.all_reduce(ok, op=torch.distributed.ReduceOp.BAND), TypeError,
         ["op", "BAND"]),
        ("premul on ints", lambda: streamcoll.all_reduce(torch.ones(2, dtype=torch.int32),
                                                         op=streamcoll.premul_sum(2.0)), TypeError,
         ["PREMUL_SUM", "int32"]),
        ("avg on bool", lambda: streamcoll.all_reduce(torch.ones(2, dtype=torch.bool), op=ReduceOp.AVG),
         TypeError, ["AVG", "bool"]),
        ("all_gather list numel", lambda: streamcoll.all_gather([torch.empty(3)] * size, ok),
         ValueError, ["tensor_list[0]", "4"]),
        ("send to self", lambda: streamcoll.send(ok, comm.rank), ValueError, ["dst", "other"]),
        ("recv any source", lambda: streamcoll.recv(ok, None), ValueError, ["src", "any source"]),
        ("send tag", lambda: streamcoll.send(ok, (comm.rank + 1) % size, tag=1), ValueError,
         ["tag", "not supported", "tag=0"]),
        ("irecv tag", lambda: streamcoll.irecv(ok, (comm.rank + 1) % size, tag=2), ValueError, ["tag"]),
        ("recv tag type", lambda: streamcoll.recv(ok, (comm.rank + 1) % size, tag="a"), TypeError, ["tag", "int"]),
        ("batch tag", lambda: streamcoll.batch_isend_irecv([streamcoll.P2POp(streamcoll.isend, ok,
                                                                             (comm.rank + 1) % size, tag=3)]),
         ValueError, ["p2p_op_list[0].tag"]),
        ("gather list on root", lambda: streamcoll.gather(ok, None, dst=comm.rank), TypeError, ["gather_list"]),
        ("gather list on non-root", lambda: streamcoll.gather(ok, [ok] * size, dst=(comm.rank + 1) % size),
         ValueError, ["gather_list", "non-destination"]),
        ("scatter list numel", lambda: streamcoll.scatter(ok, [torch.ones(3)] * size, src=comm.rank),
         ValueError, ["scatter_list[0]"]),
        ("a2a splits sum", lambda: streamcoll.all_to_all_single(torch.empty(size), torch.ones(size),
                                                                [1] * size, [2] * size),
         ValueError, ["input_split_sizes", "sum"]),
        ("a2a even divisibility", lambda: streamcoll.all_to_all_single(torch.empty(size * 2 + 1),
                                                                       torch.ones(size * 2 + 1)),
         ValueError, ["input", "divisible"]),
        ("a2a list length", lambda: streamcoll.all_to_all([ok] * size, [ok] * (size - 1)), ValueError,
         ["input_tensor_list"]),
        ("batch empty", lambda: streamcoll.batch_isend_irecv([]), ValueError, ["p2p_op_list"]),
        ("batch bad op", lambda: streamcoll.batch_isend_irecv([streamcoll.P2POp(print, ok, 0)]), ValueError,
         ["p2p_op_list[0].op"]),
        ("group type", lambda: streamcoll.all_reduce(ok, group="world"), TypeError, ["group", "Communicator"]),
        ("split color type", lambda: comm.split("red"), TypeError, ["color"]),
    ]


def w_bad_inputs(comm):
    failures = []
    for name, call, exc, words in _cases(comm):
        try:
            call()
        except exc as e:
            msg = str(e)
            missing = [w for w in words if w not in msg]
            if missing:
                failures.append(f"{name}: message {msg!r} lacks {missing}")
        except Exception as e:  # noqa: BLE001
            failures.append(f"{name}: expected {exc.__name__}, got {type(e).__name__}: {e}")
        else:
            failures.append(f"{name}: no exception")
    # Nothing was half-issued: the next collective matches on every rank.
    t = torch.full((3,), float(comm.rank))
    streamcoll.all_reduce(t)
    assert t.tolist() == [float(sum(range(comm.size)))] * 3
    return failures


def w_use_after_destroy(comm):
    sub = streamcoll.new_communicator(backend="oneccl", device="cpu", rank=comm.rank, world_size=comm.size,
                                      store=comm._store, name="short-lived")
    t = torch.ones(2)
    sub.all_reduce(t)
    sub.destroy()
    sub.destroy()  # idempotent
    try:
        sub.all_reduce(t)
    except streamcoll.CommunicatorError as e:
        assert "destroyed" in str(e), e
    else:
        raise AssertionError("a destroyed communicator accepted a collective")
    try:
        sub.split(0)
    except streamcoll.CommunicatorError:
        pass
    else:
        raise AssertionError("split on a destroyed communicator")
    # the default communicator is unaffected
    comm.all_reduce(t)
    assert t.tolist() == [float(comm.size * comm.size)] * 2
    return True


def test_bad_input_raises_clearly_before_any_c_call(world):
    res = world.run(w_bad_inputs)
    for r, failures in enumerate(res):
        assert failures == [], f"rank {r}:\n" + "\n".join(failures)


def test_use_after_destroy(world2):
    assert world2.run(w_use_after_destroy) == [True, True]


def test_backend_device_mismatch_is_a_clear_error():
    from streamcoll.core.backends import resolve
    with pytest.raises(ValueError, match="nccl.*cpu"):
        resolve("nccl", torch.device("cpu"))
    with pytest.raises(ValueError, match="oneccl.*cuda"):
        resolve("oneccl", torch.device("cuda", 0))
    with pytest.raises(ValueError, match="backend"):
        resolve("mpi", torch.device("cpu"))


def test_init_argument_errors():
    import torch.distributed as dist
    with pytest.raises(ValueError, match="rank"):
        streamcoll.new_communicator(backend="oneccl", rank=2, world_size=2, store=dist.HashStore())
    with pytest.raises(ValueError, match="world_size"):
        streamcoll.new_communicator(backend="oneccl", rank=0, world_size=0, store=dist.HashStore())
    with pytest.raises(ValueError, match="timeout"):
        streamcoll.new_communicator(backend="oneccl", rank=0, world_size=1, timeout=-1, store=dist.HashStore())
    with pytest.raises(ValueError, match="device"):
        streamcoll.new_communicator(backend="oneccl", device="tpu", rank=0, world_size=1, store=dist.HashStore())
    with pytest.raises(streamcoll.CommunicatorError, match="init"):
        streamcoll.all_reduce(torch.ones(1))
