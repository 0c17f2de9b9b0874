"""The process group's fast path (issue 35): the reduction and root read
inline, the communicator read from ``_fast_cpu`` / ``_fast_accel`` (kept by
``_refresh_fast``), the Work built by torch's constructor alone. Each
spelling torch has for an op or a root, against gloo in the same processes;
the group's usability across abort/shutdown/destroy of a sub-group whose
fast path was warm; coalescing then plain calls; a bare StreamcollWork.
"""
from __future__ import annotations

import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

import streamcoll  # noqa: F401  (importing registers the backend)
from streamcoll._ffi.errors import CommunicatorError
from streamcoll.integrations.process_group import ProcessGroupStreamcoll, StreamcollWork

from conftest import get_world, needs_oneccl
from world import free_port

def _init(backend: str, port: int, rank: int, size: int, timeout: float = 60) -> None:
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size,
                            timeout=timedelta(seconds=timeout))


def _spellings(comm, backend: str, port: int):
    """Each reduction (both spellings: ``ReduceOp.X``, a RedOpType, and a
    ``ReduceOp`` object, which only ``_op`` canonicalises) through
    all_reduce (sync and async), reduce to rank 1, reduce_scatter_tensor and
    reduce_scatter; the C++ overloads with an op or a root of their own;
    roots other than 0; coalescing with and without a device then plain
    calls (the fast path off, then on again)."""
    r, n = comm.rank, comm.size
    _init(backend, port, r, n)
    pg = dist.distributed_c10d._get_default_group()
    R = dist.ReduceOp
    out = {}
    try:
        for dtype in (torch.float32, torch.int32):
            for name in ("SUM", "MIN", "MAX", "PRODUCT"):
                for sp in ("type", "obj"):
                    op = getattr(R, name) if sp == "type" else R(getattr(R, name))
                    key = f"{name} {dtype} {sp}"
                    for a in (False, True):
                        x = (torch.tensor([3, 5, 6, 12]) * (r + 1) + r).to(dtype)
                        w = dist.all_reduce(x, op=op, async_op=a)
                        if w is not None:
                            w.wait()
                        out[f"all_reduce {key} async={a}"] = x.tolist()
                    y = (torch.tensor([3, 5, 6, 12]) * (r + 2)).to(dtype)
                    dist.reduce(y, dst=1, op=op)
                    out[f"reduce {key}"] = y.tolist() if r == 1 else None
                    o = torch.zeros(2, dtype=dtype)
                    dist.reduce_scatter_tensor(o, (torch.arange(4) * (r + 1) + 1).to(dtype), op=op)
                    out[f"reduce_scatter_tensor {key}"] = o.tolist()
                    o = torch.zeros(2, dtype=dtype)
                    dist.reduce_scatter(o, [(torch.arange(2) * (r + 1) + k + 1).to(dtype) for k in range(n)], op=op)
                    out[f"reduce_scatter {key}"] = o.tolist()

        def t():
            return torch.full((2,), float(r + 2))
        for label, call in [("allreduce([t], MAX)", lambda x: pg.allreduce([x], R.MAX)),
                            ("allreduce([t], ReduceOp(PRODUCT))", lambda x: pg.allreduce([x], R(R.PRODUCT))),
                            ("allreduce(t)", lambda x: pg.allreduce(x)),
                            ("allreduce(t, MIN)", lambda x: pg.allreduce(x, R.MIN)),
                            ("broadcast(t, 1)", lambda x: pg.broadcast(x, 1)),
                            ("reduce(t, 1, MAX)", lambda x: pg.reduce(x, 1, R.MAX)),
                            ("reduce(t, 1, ReduceOp(PRODUCT))", lambda x: pg.reduce(x, 1, R(R.PRODUCT)))]:
            x = t()
            assert call(x).wait()
            out[label] = x.tolist() if not label.startswith("reduce(") or r == 1 else None
        o = dist.ReduceOptions()
        o.rootRank, o.reduceOp, o.asyncOp = 1, R.MIN, False
        x = t()
        pg.reduce([x], o).wait()
        out["reduce([t], ReduceOptions(root 1, MIN))"] = x.tolist() if r == 1 else None
        b = dist.BroadcastOptions()
        b.rootRank, b.asyncOp = 1, False
        x = t()
        pg.broadcast([x], b).wait()
        out["broadcast([t], BroadcastOptions(root 1))"] = x.tolist()
        g = [torch.zeros(2) for _ in range(n)] if r == 1 else None
        dist.gather(t(), g, dst=1)
        out["gather dst=1"] = [a.tolist() for a in g] if g else None
        s = torch.zeros(2)
        dist.scatter(s, [torch.full((2,), 10.0 + k) for k in range(n)] if r == 1 else None, src=1)
        out["scatter src=1"] = s.tolist()
        x = t()
        w = dist.broadcast(x, src=1, async_op=True)
        out["broadcast src=1 future"] = [a.tolist() for a in w.get_future().wait()]

        # coalescing (gloo has no start_coalescing: the device form on streamcoll only), then plain calls
        cm_ = dist.distributed_c10d._coalescing_manager
        a, c = t(), t()
        with cm_(async_ops=True) as cm:
            dist.all_reduce(a, op=R.MAX)
            dist.all_reduce(c, op=R.MAX)
        cm.wait()
        out["coalesced MAX"] = (a.tolist(), c.tolist())
        x = t()
        dist.all_reduce(x)
        out["after coalesced"] = x.tolist()
        if backend == "streamcoll":
            a = t()
            with cm_(device=torch.device("cpu"), async_ops=True) as cm:
                dist.all_reduce(a)
                assert pg._fast_cpu is None  # coalescing: every call takes the general lines
            cm.wait()
            assert pg._fast_cpu is not None
            out["coalesced device"] = a.tolist()
        else:
            out["coalesced device"] = [float(sum(k + 2 for k in range(n)))] * 2
        x = t()
        dist.all_reduce(x, op=R.MAX)
        out["after coalesced device"] = x.tolist()
        x = t()
        dist.broadcast(x, src=1)
        out["broadcast after coalesced device"] = x.tolist()
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return out


def _retired_sub_group(comm, backend: str, port: int, how: str):
    """A sub-group whose fast path is warm (two collectives on it) retired by
    ``how``; then each generated method on it, timed, and the world group
    still working."""
    r, n = comm.rank, comm.size
    _init(backend, port, r, n, timeout=8)
    sub = dist.new_group(backend=backend)
    out = {}
    try:
        for k in range(2):
            x = torch.full((2,), float(r + 1))
            dist.all_reduce(x, group=sub)  # the first one creates a sub-group's communicator (general lines)
            out[f"sub {k}"] = x.tolist()
        dist.barrier(group=sub)
        if how == "destroy":
            dist.destroy_process_group(sub)
        else:
            getattr(sub, how)()
        res = {}
        for name, f in [("allreduce", lambda: sub.allreduce(torch.ones(2))),
                        ("allreduce opts", lambda: sub.allreduce([torch.ones(2)], dist.AllreduceOptions())),
                        ("broadcast", lambda: sub.broadcast(torch.ones(2), 1)),
                        ("reduce", lambda: sub.reduce(torch.ones(2), 1, dist.ReduceOp.MAX)),
                        ("allgather", lambda: sub.allgather([[torch.ones(2) for _ in range(n)]], [torch.ones(2)])),
                        ("barrier", lambda: sub.barrier())]:
            t0 = time.monotonic()
            try:
                f().wait()
                res[name] = None
            except Exception as e:  # noqa: BLE001 - compared in the parent
                res[name] = (type(e).__name__, time.monotonic() - t0, str(e))
        out["after"] = res
        x = torch.full((2,), float(r + 1))
        dist.all_reduce(x)
        out["world"] = x.tolist()
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return out


@pytest.fixture(scope="module")
def w2():
    return get_world(2)


@needs_oneccl
@pytest.mark.world
def test_every_spelling_of_an_op_or_root_matches_gloo(w2):
    gloo = w2.run(_spellings, "gloo", free_port(), timeout=120)
    sc = w2.run(_spellings, "streamcoll", free_port(), timeout=120)
    assert sc == gloo
    assert sc[1]["reduce(t, 1, MAX)"] == [3.0, 3.0] and sc[0]["scatter src=1"] == [10.0, 10.0]
    assert sc[0]["after coalesced device"] == [3.0, 3.0]


@needs_oneccl
@pytest.mark.world
@pytest.mark.parametrize("how", ["abort", "shutdown", "destroy"])
def test_retired_sub_group_raises_at_once_on_every_method(w2, how):
    sc = w2.run(_retired_sub_group, "streamcoll", free_port(), how, timeout=60)
    for out in sc:
        assert out["sub 0"] == out["sub 1"] == [3.0, 3.0] and out["world"] == [3.0, 3.0]
        for name, got in out["after"].items():
            assert got is not None, name
            kind, took, msg = got
            assert kind == "CommunicatorError" and took < 1.0, (name, got)
            assert "this streamcoll process group cannot be used" in msg, (name, msg)


def test_a_bare_work_is_a_completed_one():
    """``StreamcollWork()`` (torch's constructor alone, what the fast path
    builds before setting its fields) is a completed Work with no result."""
    w = StreamcollWork()
    assert w.wait() and w.wait(timeout=timedelta(seconds=1)) and w.is_completed() and w.is_success()
    assert w.exception() is None and w.result() == [] and w.get_future().value() == []
    w.synchronize()
    assert repr(w) == "<StreamcollWork collective completed>"
    assert isinstance(w, dist.Work)
    w2 = StreamcollWork.over(None, [torch.ones(1)], "barrier", timeout=3.0)
    assert w2._timeout == 3.0 and StreamcollWork()._timeout is None  # over() sets the instance's, not the class's


@needs_oneccl
@pytest.mark.parametrize("how", ["abort", "shutdown"])
def test_abort_racing_communicator_creation_leaves_no_fast_path(monkeypatch, how):
    """``abort()``/``shutdown()`` from another thread landing inside the
    creating thread's ``_refresh_fast`` (after it read ``_failed`` as None,
    before it set ``_fast_cpu``): here made deterministic by running it from
    ``_comms.items()``. The group is failed; the fast path must not point at
    the (aborted or destroyed) communicator, or every later call bypasses the
    group's check and raises the communicator's error ("create a new one with
    streamcoll.init()") instead of the group's."""
    monkeypatch.setenv("STREAMCOLL_WATCHDOG", "off")
    pg = ProcessGroupStreamcoll(dist.HashStore(), 0, 1, timedelta(seconds=10))
    fired = []

    class Racing(dict):
        def items(self):
            if not fired:
                fired.append(True)
                getattr(pg, how)()
            return super().items()

    pg._comms = Racing()
    try:
        pg.allreduce(torch.ones(2)).wait()
    except CommunicatorError:
        pass  # the communicator was aborted/destroyed under this very call
    assert fired and pg._failed is not None
    assert pg._fast_cpu is None and pg._fast_other == {}
    with pytest.raises(CommunicatorError, match="this streamcoll process group cannot be used"):
        pg.allreduce(torch.ones(2))
    pg.shutdown()
