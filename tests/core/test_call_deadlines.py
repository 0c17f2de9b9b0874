"""Per-call deadlines: ``timeout=`` on every collective and point-to-point
call (the Communicator methods, the module functions, torch's
``opts.timeout`` through the process group), as torchcomms has them.

Real ranks over real oneCCL (a world of 2 with ``STREAMCOLL_WATCHDOG=fail``,
so that a rank whose communicator failed keeps running and reports); every
scenario that fails a communicator makes a fresh one with ``split`` (the
pooled one stays usable), and every rank run has a timeout. A peer is late
by a ``time.sleep``: past the deadline of the other rank's call, or within it.
A oneCCL call past its deadline stays inside the library until the late
peer arrives (oneCCL cannot abort); the pooled communicator's barrier at
the end of a scenario waits behind it (one oneCCL call at a time in a
process), so the failed communicator is destroyed only after it returned.
Where torch.distributed has the same bound (``AllreduceOptions.timeout``,
``Work.wait(timeout)`` of an ``irecv``), the same scenario runs on gloo and
the timings are compared.
"""
from __future__ import annotations

import os
import tempfile
import time
from datetime import timedelta

import numpy as np
import pytest
import torch
import torch.distributed as dist

import streamcoll
from streamcoll import CollectiveTimeout, CommunicatorError

from conftest import get_world, needs_oneccl
from world import free_port

_ENV: dict = {}  # the world's environment, made once per session (the ranks re-import this module)
LATE = 3.0  # how late the late rank is, seconds
DEADLINE = 1.0  # the short per-call deadline


@pytest.fixture
def w2():
    if not _ENV:
        _ENV.update(STREAMCOLL_WATCHDOG="fail",
                    STREAMCOLL_FLIGHT_DIR=tempfile.mkdtemp(prefix="streamcoll-deadline-dumps-"))
    return get_world(2, env=_ENV)


def _err(e: BaseException, t0: float) -> dict:
    return {"type": type(e).__name__, "msg": str(e), "took": time.monotonic() - t0,
            "timeout": getattr(e, "timeout", None), "stuck": getattr(e, "stuck", None)}


def _expired(res: dict, deadline: float = DEADLINE, op: str = "all_reduce") -> None:
    """``res`` (from :func:`_err`) is the CollectiveTimeout of a call past
    its own ``deadline``: named, in time, declared stuck."""
    assert res["type"] == "CollectiveTimeout", res
    assert res["timeout"] == deadline and res["stuck"] is True, res
    assert op in res["msg"] and f"within {deadline:g} s" in res["msg"], res
    assert "own timeout" in res["msg"] and "failed" in res["msg"], res
    assert deadline - 0.1 < res["took"] < deadline + 2.0, res


# ------------------------------------------------------------ rank scenarios
def _short_deadline(comm, how: str):
    """Rank 1 is LATE s late; rank 0's call was given DEADLINE s (the
    communicator's timeout is 60 s). ``how``: the call's form."""
    c = comm.split(0, timeout=60)
    t = torch.ones(4)
    c.all_reduce(t)  # warm: connections and the first-call check of this signature
    out: dict = {}
    try:
        if comm.rank == 1:
            time.sleep(LATE)
            t.fill_(1.0)
            if how == "recv":
                c.send(torch.full((4,), 7.0), 0)
            else:
                c.all_reduce(t)
            out["late"] = t.tolist()
        else:
            t.fill_(1.0)
            t0 = time.monotonic()
            try:
                if how == "method":
                    c.all_reduce(t, timeout=DEADLINE)
                elif how == "timedelta":
                    c.all_reduce(t, timeout=timedelta(seconds=DEADLINE))
                elif how == "module":
                    streamcoll.all_reduce(t, group=c, timeout=DEADLINE)
                elif how == "recv":
                    c.recv(t, 1, timeout=DEADLINE)
                elif how == "async_wait":
                    w = c.all_reduce(t, async_op=True, timeout=DEADLINE)
                    out["returned"] = time.monotonic() - t0
                    w.wait()
                out["ok"] = time.monotonic() - t0
            except CollectiveTimeout as e:
                out["err"] = _err(e, t0)
            out["failure"] = type(c.failure).__name__ if c.failure is not None else None
            t1 = time.monotonic()
            try:
                c.all_reduce(torch.ones(4))
                out["later"] = None
            except CommunicatorError as e:
                out["later"] = (type(e).__name__, time.monotonic() - t1, str(e)[:300])
            dumps = os.environ["STREAMCOLL_FLIGHT_DIR"]
            out["dumps"] = sorted(f for f in os.listdir(dumps) if f.startswith(c.name.replace("/", "_") + "."))
    finally:
        comm.barrier()  # rank 0: behind its call stuck in the failed communicator until rank 1 met it
        c.destroy()
    return out


def _async_unwaited(comm):
    """Rank 0 issues an async call with DEADLINE s and never waits: the
    watchdog fails it past DEADLINE plus its 1 s grace."""
    c = comm.split(0, timeout=60)
    t = torch.ones(4)
    c.all_reduce(t)
    out: dict = {}
    try:
        if comm.rank == 1:
            time.sleep(LATE)
            c.all_reduce(t)
        else:
            t0 = time.monotonic()
            w = c.all_reduce(t, async_op=True, timeout=DEADLINE)
            while c.failure is None and time.monotonic() - t0 < 10:
                time.sleep(0.01)
            out["failed_after"] = time.monotonic() - t0
            out["failure"] = str(c.failure)
            out["completed"] = w.is_completed()
            out["exception"] = type(w.exception()).__name__
            try:
                w.wait()
                out["wait"] = None
            except CommunicatorError as e:
                out["wait"] = type(e).__name__
    finally:
        comm.barrier()
        c.destroy()
    return out


def _long_deadline(comm, how: str):
    """The communicator's timeout is 1 s; rank 1 is 2.5 s late; rank 0's call
    was given 8 s: it completes, and nothing fails."""
    c = comm.split(0, timeout=1.0)
    t = torch.full((4,), float(comm.rank + 1))
    # warm with another shape: the late call's signature is new, so its first-call check waits for
    # the late peer in the store too, bounded by the call's own timeout, not the communicator's 1 s
    c.all_reduce(torch.ones(3))
    out: dict = {}
    try:
        if comm.rank == 1:
            time.sleep(2.5)
            t.fill_(2.0)
            if how == "p2p":
                c.send(torch.full((4,), 9.0), 0)
            else:
                c.all_reduce(t)
        else:
            t.fill_(1.0)
            t0 = time.monotonic()
            if how == "sync":
                c.all_reduce(t, timeout=8)
            elif how == "p2p":
                c.recv(t, 1, timeout=timedelta(seconds=8))
            elif how == "async":
                w = c.all_reduce(t, async_op=True, timeout=8)
                t1 = time.monotonic()
                try:  # a wait shorter than the call's own timeout: slow, not stuck (Work.wait's semantics)
                    w.wait(0.3)
                    out["short_wait"] = None
                except CollectiveTimeout as e:
                    out["short_wait"] = _err(e, t1)
                w.wait()  # the call's own timeout, not the communicator's 1 s
            out["took"] = time.monotonic() - t0
        out["result"] = t.tolist()
        out["failure"] = None if c.failure is None else str(c.failure)
        t.fill_(1.0)
        c.all_reduce(t)  # still usable
        out["after"] = t.tolist()
    finally:
        c.destroy()
    return out


def _irecv_deadline(comm, backend: str, port: int):
    """Rank 1 sends LATE s late; rank 0 waits for its receive at most
    DEADLINE s: streamcoll's ``irecv(timeout=)``, gloo's
    ``irecv().wait(timeout)`` (torch's own bound on a p2p op)."""
    r = comm.rank
    out: dict = {}
    if backend == "gloo":
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=r, world_size=2,
                                timeout=timedelta(seconds=30))
    c = comm.split(0, timeout=60) if backend == "streamcoll" else None
    t = torch.zeros(4)
    try:
        if r == 1:
            time.sleep(LATE)
            x = torch.full((4,), 5.0)
            try:
                dist.send(x, 0) if c is None else c.send(x, 0)
            except Exception as e:  # noqa: BLE001 - gloo's late send after the peer gave up
                out["late_send"] = type(e).__name__
        else:
            t0 = time.monotonic()
            try:
                if c is None:
                    dist.irecv(t, 1).wait(timeout=timedelta(seconds=DEADLINE))
                else:
                    c.irecv(t, 1, timeout=DEADLINE).wait()
                out["ok"] = time.monotonic() - t0
            except Exception as e:  # noqa: BLE001 - compared in the parent
                out["err"] = _err(e, t0)
    finally:
        comm.barrier()
        if c is not None:
            c.destroy()
        if backend == "gloo":
            dist.destroy_process_group()
    return out


def _pg_opts_timeout(comm, backend: str, port: int, long: bool):
    """Through torch.distributed: ``ProcessGroup.allreduce(tensors, opts)``
    with ``opts.timeout`` set (torch's AllreduceOptions field). ``long``:
    the group's timeout is 1 s and ``opts.timeout`` 8 s, rank 1 2.5 s late
    (completes); else the group's is 60 s, ``opts.timeout`` 1 s, rank 1 LATE s
    late (rank 0 fails after about 1 s)."""
    r = comm.rank
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=r, world_size=2,
                            timeout=timedelta(seconds=1 if long else 60))
    pg = dist.distributed_c10d._get_default_group()
    out: dict = {}
    try:
        t = torch.ones(4)
        dist.all_reduce(t)  # the group's communicator exists and this signature was checked
        opts = dist.AllreduceOptions()
        opts.timeout = timedelta(seconds=8 if long else DEADLINE)
        t.fill_(float(r + 1))
        if r == 1:
            time.sleep(2.5 if long else LATE)
        t0 = time.monotonic()
        try:
            pg.allreduce([t], opts).wait()
            out["ok"] = time.monotonic() - t0
            out["result"] = t.tolist()
        except Exception as e:  # noqa: BLE001 - compared in the parent
            out["err"] = _err(e, t0)
    finally:
        comm.barrier()  # streamcoll, rank 0: behind its stuck call until rank 1 met it
        dist.destroy_process_group()
    return out


def _two_threads(comm):
    """Two threads of rank 0 issue at once on one communicator, one with a
    long deadline (8 s), one with a short one (DEADLINE); rank 1 is LATE s
    late: the short one fails at its own deadline, not the other's."""
    import threading
    c = comm.split(0, timeout=60)
    t = torch.ones(4)
    c.all_reduce(t)
    out: dict = {}
    try:
        if comm.rank == 1:
            time.sleep(LATE)
            c.all_reduce(t)  # meets the long call (the short one was ended unrun with the failure)
        else:
            res: dict = {}

            def call(name: str, limit: float, delay: float) -> None:
                time.sleep(delay)
                t0 = time.monotonic()
                try:
                    c.all_reduce(torch.ones(4), timeout=limit)
                    res[name] = ("ok", time.monotonic() - t0)
                except Exception as e:  # noqa: BLE001
                    res[name] = (type(e).__name__, time.monotonic() - t0, getattr(e, "timeout", None))

            th = [threading.Thread(target=call, args=("long", 8.0, 0.0)),
                  threading.Thread(target=call, args=("short", DEADLINE, 0.2))]
            for x in th:
                x.start()
            for x in th:
                x.join(20)
            out.update(res)
    finally:
        comm.barrier()
        c.destroy()
    return out


# ------------------------------------------------------------------ tests
@needs_oneccl
@pytest.mark.parametrize("how", ["method", "timedelta", "module", "async_wait"])
def test_a_deadline_shorter_than_the_communicators_fails_the_call(w2, how):
    res = w2.run(_short_deadline, how, timeout=60)
    r0, r1 = res
    _expired(r0["err"])
    if how == "async_wait":
        assert r0["returned"] < 0.5, r0  # async_op=True still returns at once
    assert r0["failure"] == "CollectiveTimeout", r0
    kind, took, msg = r0["later"]
    assert kind == "CommunicatorError" and took < 0.1 and "failed earlier" in msg, r0
    assert r0["dumps"], r0  # the flight record, as past the communicator's timeout
    # the late rank's call met rank 0's, still inside oneCCL (it cannot abort): it completed
    assert r1["late"] == [2.0] * 4, r1


@needs_oneccl
def test_a_point_to_point_call_past_its_deadline_fails(w2):
    r0, r1 = w2.run(_short_deadline, "recv", timeout=60)
    _expired(r0["err"], op="recv")
    assert r0["later"][0] == "CommunicatorError", r0


@needs_oneccl
def test_an_unwaited_async_call_fails_past_its_deadline_by_the_watchdog(w2):
    r0, _ = w2.run(_async_unwaited, timeout=60)
    # the call's 1 s, the async grace (1 s), at most a pass interval (0.1 s) and scheduling
    assert DEADLINE + 0.9 < r0["failed_after"] < DEADLINE + 2.5, r0
    assert "within 1 s" in r0["failure"] and "own timeout" in r0["failure"], r0
    assert r0["completed"] and r0["exception"] in ("CommunicatorError", "CollectiveTimeout"), r0
    assert r0["wait"] in ("CommunicatorError", "CollectiveTimeout"), r0


@needs_oneccl
@pytest.mark.parametrize("how", ["sync", "async", "p2p"])
def test_a_deadline_longer_than_the_communicators_lets_a_late_peer_finish(w2, how):
    r0, r1 = w2.run(_long_deadline, how, timeout=60)
    assert 2.0 < r0["took"] < 6.0, r0
    assert r0["failure"] is None and r1["failure"] is None, (r0, r1)
    assert r0["result"] == ([9.0] * 4 if how == "p2p" else [3.0] * 4), r0
    assert r0["after"] == [2.0] * 4 and r1["after"] == [2.0] * 4, (r0, r1)
    if how == "async":
        sw = r0["short_wait"]
        assert sw["type"] == "CollectiveTimeout" and sw["stuck"] is False and sw["timeout"] == 0.3, sw
        assert "own timeout (8 s)" in sw["msg"], sw


@needs_oneccl
def test_irecv_deadline_like_gloos_wait_timeout(w2):
    gloo = w2.run(_irecv_deadline, "gloo", free_port(), timeout=60)
    sc = w2.run(_irecv_deadline, "streamcoll", free_port(), timeout=60)
    g, s = gloo[0]["err"], sc[0]["err"]
    assert DEADLINE - 0.1 < g["took"] < DEADLINE + 2.0, gloo
    _expired(s, op="irecv")


@needs_oneccl
def test_process_group_opts_timeout_like_gloo(w2):
    gloo = w2.run(_pg_opts_timeout, "gloo", free_port(), False, timeout=60)
    sc = w2.run(_pg_opts_timeout, "streamcoll", free_port(), False, timeout=60)
    g, s = gloo[0]["err"], sc[0]["err"]
    assert DEADLINE - 0.1 < g["took"] < DEADLINE + 2.0, gloo
    _expired(s, op="all_reduce")


@needs_oneccl
def test_process_group_opts_timeout_longer_than_the_groups_like_gloo(w2):
    gloo = w2.run(_pg_opts_timeout, "gloo", free_port(), True, timeout=60)
    sc = w2.run(_pg_opts_timeout, "streamcoll", free_port(), True, timeout=60)
    for res in (gloo, sc):
        assert "err" not in res[0] and 2.0 < res[0]["ok"] < 6.0, (gloo, sc)
        assert res[0]["result"] == [3.0] * 4, (gloo, sc)


@needs_oneccl
def test_two_threads_with_different_deadlines(w2):
    r0, _ = w2.run(_two_threads, timeout=60)
    short, long = r0["short"], r0["long"]
    assert short[0] == "CollectiveTimeout" and short[2] == DEADLINE, r0
    assert DEADLINE - 0.1 < short[1] < DEADLINE + 2.0, r0
    # the long one ran first (it holds the comm thread); the short one's failure fails the communicator
    assert long[0] in ("CommunicatorError", "CollectiveTimeout", "ok"), r0


# ------------------------------------------------------- bad values, no world
def _bad_values():
    return [0, -1, 0.0, -0.5, float("nan"), float("inf"), -float("inf"), "5", True, False, [1], timedelta(0),
            timedelta(seconds=-1), np.float32("nan")]


@needs_oneccl
def test_bad_timeouts_raise_before_any_c_call(monkeypatch):
    """Every entry point refuses a bad ``timeout=`` naming it, before the
    pre-launch hooks (which may exchange through the store), the planner or
    any C call: nothing is issued, no sequence number is taken."""
    monkeypatch.setenv("STREAMCOLL_WATCHDOG", "off")
    c = streamcoll.new_communicator(backend="oneccl", device="cpu", rank=0, world_size=1,
                                    store=dist.HashStore())
    hooked = []
    h = c.register_pre_hook(lambda rec: hooked.append(rec.name))
    t = torch.ones(4)
    calls = [
        lambda to: c.all_reduce(t, timeout=to),
        lambda to: c.all_reduce(t, async_op=True, timeout=to),
        lambda to: c.broadcast(t, 0, timeout=to),
        lambda to: c.all_gather_into_tensor(torch.empty(4), t, timeout=to),
        lambda to: c.send(t, 0, timeout=to),
        lambda to: c.recv(t, 0, timeout=to),
        lambda to: c.isend(t, 0, timeout=to),
        lambda to: c.irecv(t, 0, timeout=to),
        lambda to: c.batch_isend_irecv([streamcoll.P2POp(streamcoll.isend, t, 0)], timeout=to),
        lambda to: c.barrier(timeout=to),
        lambda to: streamcoll.all_reduce(t, group=c, timeout=to),
        lambda to: streamcoll.barrier(group=c, timeout=to),
        lambda to: streamcoll.batch_isend_irecv([streamcoll.P2POp(streamcoll.isend, t, 0, group=c)], timeout=to),
    ]
    try:
        seq = c.seq
        for bad in _bad_values():
            for i, call in enumerate(calls):
                with pytest.raises((TypeError, ValueError), match="^timeout: "):
                    call(bad)
        assert c.seq == seq and hooked == [] and not c._posted, (c.seq, hooked)
        h.remove()
        # the good spellings work, and a call without timeout= still takes the fast path
        c.all_reduce(t, timeout=5)
        c.all_reduce(t, timeout=timedelta(milliseconds=1500))
        c.all_reduce(t, timeout=np.float64(2.5))
        c.all_reduce(t, async_op=True, timeout=3).wait()
        assert c.fast_path and c.failure is None
    finally:
        c.destroy()


@needs_oneccl
def test_the_flight_record_and_work_carry_the_call_limit(monkeypatch, tmp_path):
    monkeypatch.setenv("STREAMCOLL_WATCHDOG", "off")
    c = streamcoll.new_communicator(backend="oneccl", device="cpu", rank=0, world_size=1,
                                    store=dist.HashStore(), timeout=30)
    try:
        t = torch.ones(2)
        c.all_reduce(t, timeout=4)
        w = c.all_reduce(t, async_op=True, timeout=timedelta(seconds=2))
        assert w._limit == 2.0
        w.wait()
        c.all_reduce(t)
        e = [x for x in c.flight.entries() if x.seq in (1, 2, 3)]
        assert [x.own_limit() for x in e] == [4.0, 2.0, None]
        path = c.dump_flight_record(str(tmp_path))
        import json
        with open(path) as f:
            entries = json.load(f)["entries"]
        assert [x.get("timeout_s") for x in entries] == [4.0, 2.0, None]
        # a slot that a later call reuses does not inherit the limit (keyed by sequence number)
        e[0].seq += c.flight.capacity
        assert e[0].own_limit() is None
    finally:
        c.destroy()


def test_per_call_timeouts_are_in_every_signature():
    import inspect
    from streamcoll.core import spec
    for name in spec.TABLE:
        m = getattr(streamcoll.Communicator, name)
        f = getattr(streamcoll, name)
        for fn in (m, f):
            p = inspect.signature(fn).parameters["timeout"]
            assert p.kind is inspect.Parameter.KEYWORD_ONLY and p.default is None, (name, fn)
            assert "``timeout``" in fn.__doc__, name


@needs_oneccl
def test_timeout_inside_torch_compile_is_refused_and_plain_calls_still_compile(monkeypatch):
    """The custom ops carry no deadline: ``timeout=`` in a compiled region
    raises NotImplementedError naming it (as ``stream=`` does); the same
    collective without it compiles and runs as before."""
    import torch._dynamo
    monkeypatch.setenv("STREAMCOLL_WATCHDOG", "off")
    c = streamcoll.new_communicator(backend="oneccl", device="cpu", rank=0, world_size=1,
                                    store=dist.HashStore())

    def with_timeout(t):
        streamcoll.all_reduce(t, group=c, timeout=5)
        return t * 2

    def plain(t):
        streamcoll.all_reduce(t, group=c)
        return t * 2

    try:
        torch._dynamo.reset()
        with pytest.raises(Exception, match="timeout=.*not supported inside torch.compile"):
            torch.compile(with_timeout, backend="aot_eager", fullgraph=True)(torch.ones(2))
        torch._dynamo.reset()
        out = torch.compile(plain, backend="aot_eager", fullgraph=True)(torch.ones(2))
        assert out.tolist() == [2.0, 2.0]
    finally:
        torch._dynamo.reset()
        c.destroy()


@needs_oneccl
def test_the_watchdog_interval_follows_pending_deadlines(monkeypatch):
    """A call given a short timeout shortens the watchdog's pass interval
    (min(0.5 s, limit / 10), at least 0.05 s) while it is unfinished; once
    the watchdog saw it finish, the interval is the communicator's again."""
    from streamcoll.diagnostics.watchdog import WATCHDOG
    monkeypatch.setenv("STREAMCOLL_WATCHDOG", "off")  # no pass prunes while the interval is read
    monkeypatch.setenv("STREAMCOLL_INLINE_ASYNC_BYTES", "0")
    c = streamcoll.new_communicator(backend="oneccl", device="cpu", rank=0, world_size=1,
                                    store=dist.HashStore(), timeout=600)
    try:
        assert WATCHDOG._interval([c]) == 0.5
        c._deadlines[10**9] = 2.0  # as a pending call given timeout=2 (a pass prunes it: not in the ring)
        assert WATCHDOG._interval([c]) == pytest.approx(0.2)
        c._deadlines[10**9 + 1] = 0.1
        assert WATCHDOG._interval([c]) == 0.05
        monkeypatch.setenv("STREAMCOLL_WATCHDOG", "fail")  # the passes look again (mode is read each pass)
        deadline = time.monotonic() + 5
        while c._deadlines and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not c._deadlines and WATCHDOG._interval([c]) == 0.5
        w = c.all_reduce(torch.ones(2), async_op=True, timeout=3)
        w.wait()
        deadline = time.monotonic() + 5
        while c._deadlines and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not c._deadlines and c.failure is None
    finally:
        c.destroy()


@needs_oneccl
def test_group_launches_take_the_strictest_limit(monkeypatch):
    """A coalescing block (and a group of posted p2p ops) is one launch: its
    limit is the shortest its calls were given, the communicator's counted
    for calls given none; none given: the communicator's (None)."""
    monkeypatch.setenv("STREAMCOLL_WATCHDOG", "off")
    c = streamcoll.new_communicator(backend="oneccl", device="cpu", rank=0, world_size=1,
                                    store=dist.HashStore(), timeout=30)
    try:
        assert c._strictest([None, None]) is None
        assert c._strictest([5.0, None]) == 5.0
        assert c._strictest([50.0, None]) == 30.0
        assert c._strictest([50.0, 40.0]) == 40.0
        with c.coalescing(async_op=True) as h:
            c.all_reduce(torch.ones(2), timeout=50)
            c.all_reduce(torch.ones(3), timeout=7)
            c.all_reduce(torch.ones(4))
        assert h.work._limit == 7.0 and c.flight.at(h.work.seq).own_limit() == 7.0
        h.wait()
        with c.coalescing(async_op=True) as h:
            c.all_reduce(torch.ones(2))
        assert h.work._limit is None
        h.wait()
    finally:
        c.destroy()


@needs_oneccl
def test_the_limited_sync_launcher_records_the_limit(monkeypatch):
    """The synchronous launcher a GPU call given timeout= takes (compiled
    from the same template; exercised here on the CPU): its entry carries
    the limit, keyed by its sequence number, and the watchdog is told."""
    from streamcoll.core import launch, spec
    monkeypatch.setenv("STREAMCOLL_WATCHDOG", "off")
    c = streamcoll.new_communicator(backend="oneccl", device="cpu", rank=0, world_size=1,
                                    store=dist.HashStore(), timeout=30)
    try:
        f = launch.build_sync_launcher(c, limited=True)
        t = torch.ones(2)
        f("all_reduce", spec.TABLE["all_reduce"].planner(c._cx, t, streamcoll.ReduceOp.SUM), None, 4.5)
        e = c.flight.at(c.seq)
        assert e.sync and e.own_limit() == 4.5 and c._deadlines[c.seq] == 4.5
        assert "e.limit" not in launch.generated_source("all_reduce/cpu/oneccl")  # the fast path: unchanged
        assert "e.limit" not in launch.generated_source("launch_sync/cpu")
    finally:
        c.destroy()
