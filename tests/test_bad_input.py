"""Bad input (issue 3): each case raises, on the calling rank, an exception
naming the argument and what was expected, before any C call, so no rank is
left waiting inside a half-issued collective; the communicator stays usable."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import streamcoll
from streamcoll import ReduceOp


def _cases(comm):
    size = comm.size
    ok = torch.ones(4)
    nc = torch.ones(4, 4).t()  # non-contiguous
    meta = torch.ones(4, device="meta")  # a tensor on another device
    return [
        ("non-contiguous", lambda: streamcoll.all_reduce(nc), ValueError, ["tensor", "contiguous"]),
        ("sparse coo", lambda: streamcoll.all_reduce(torch.sparse_coo_tensor([[0, 1]], [1.0, 2.0], (3,))),
         TypeError, ["tensor", "sparse tensors are not supported"]),
        ("sparse csr", lambda: streamcoll.broadcast(torch.eye(3).to_sparse_csr(), 0), TypeError,
         ["tensor", "sparse", "sparse_csr"]),
        ("all_gather_coalesced rows", lambda: streamcoll.all_gather_coalesced([[torch.empty(4)]] * size, [ok, ok]),
         ValueError, ["output_tensor_lists[0]", "2 tensors"]),
        ("all_gather_coalesced numel", lambda: streamcoll.all_gather_coalesced([[torch.empty(3)]] * size, [ok]),
         ValueError, ["output_tensor_lists[0][0]", "4"]),
        ("wrong device", lambda: streamcoll.all_reduce(meta), ValueError, ["tensor", "cpu", "meta"]),
        ("not a tensor", lambda: streamcoll.all_reduce([1.0, 2.0]), TypeError, ["tensor", "torch.Tensor", "list"]),
        ("non-contiguous numpy", lambda: streamcoll.all_reduce(np.ones((4, 4), np.float32).T), ValueError,
         ["tensor", "C-contiguous"]),
        ("unsupported dtype", lambda: streamcoll.all_reduce(torch.ones(2, dtype=torch.complex64)), TypeError,
         ["tensor", "complex64", "all_reduce", "oneccl"]),
        ("unsupported int16", lambda: streamcoll.all_reduce(torch.ones(2, dtype=torch.int16)), TypeError,
         ["int16", "oneccl"]),
        ("bad op", lambda: streamcoll.all_reduce(ok, op="XOR"), TypeError, ["op"]),
        ("torch BAND", lambda: streamcoll.all_reduce(ok, op=torch.distributed.ReduceOp.BAND), TypeError,
         ["op", "BAND"]),
        ("premul on ints", lambda: streamcoll.all_reduce(torch.ones(2, dtype=torch.int32),
                                                         op=streamcoll.premul_sum(2.0)), TypeError,
         ["PREMUL_SUM", "int32"]),
        ("avg on bool", lambda: streamcoll.all_reduce(torch.ones(2, dtype=torch.bool), op=ReduceOp.AVG),
         TypeError, ["AVG", "bool"]),
        ("all_gather size", lambda: streamcoll.all_gather_into_tensor(torch.empty(size * 4 + 1), ok),
         ValueError, ["output_tensor", str(size * 4)]),
        ("all_gather dtype", lambda: streamcoll.all_gather_into_tensor(torch.empty(size * 4, dtype=torch.float64), ok),
         TypeError, ["output_tensor", "float32"]),
        ("all_gather list length", lambda: streamcoll.all_gather([torch.empty(4)] * (size + 1), ok),
         ValueError, ["tensor_list", str(size)]),
        ("all_gather list numel", lambda: streamcoll.all_gather([torch.empty(3)] * size, ok),
         ValueError, ["tensor_list[0]", "4"]),
        ("reduce_scatter size", lambda: streamcoll.reduce_scatter_tensor(torch.empty(4), torch.ones(4 * size + 2)),
         ValueError, ["input", str(4 * size)]),
        ("reduce_scatter dtype", lambda: streamcoll.reduce_scatter_tensor(torch.empty(4, dtype=torch.int32),
                                                                          torch.ones(4 * size)),
         TypeError, ["output", "float32"]),
        ("broadcast src range", lambda: streamcoll.broadcast(ok, src=size), ValueError, ["src", f"[0, {size})"]),
        ("broadcast src negative", lambda: streamcoll.broadcast(ok, src=-1), ValueError, ["src"]),
        ("broadcast src type", lambda: streamcoll.broadcast(ok, src=0.0), TypeError, ["src", "int"]),
        ("broadcast src bool", lambda: streamcoll.broadcast(ok, src=True), TypeError, ["src"]),
        ("reduce dst", lambda: streamcoll.reduce(ok, dst=size + 3), ValueError, ["dst"]),
        ("send to self", lambda: streamcoll.send(ok, comm.rank), ValueError, ["dst", "other"]),
        ("send peer range", lambda: streamcoll.send(ok, size), ValueError, ["dst"]),
        ("recv any source", lambda: streamcoll.recv(ok, None), ValueError, ["src", "any source"]),
        ("isend peer", lambda: streamcoll.isend(ok, -2), ValueError, ["dst"]),
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
        ("a2a splits length", lambda: streamcoll.all_to_all_single(torch.empty(size), torch.ones(size),
                                                                    [1] * (size + 1), [1] * size),
         ValueError, ["output_split_sizes", str(size)]),
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
    from streamcoll.backends import resolve
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
