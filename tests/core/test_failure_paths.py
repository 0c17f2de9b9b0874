"""Failure paths and posted point-to-point (issue 22, and issue 21's finding 4).

Tiers: world-size-1 tests on the real oneCCL (the queue, the failure state
every reader of a Work consults, saved fast paths, destroy after a failure;
a queued Python plan stands in for a call that blocks, so the timing is
decided by the test, not by a race); the watchdog's init guard; tests on the
shared 2-rank world (posted p2p against gloo in the same test, directly and
through the ``"streamcoll"`` process group; the flight analysis of a healthy
p2p exchange); and scenarios in rank processes of their own
(``python tests/core/test_failure_paths.py SCENARIO``), where a failure leaves a
oneCCL call stuck for good and the point is how the processes end.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from datetime import timedelta
from typing import Dict, List, Optional

# tests/ (conftest, world and the other helpers) on the path, also when this
# file runs as a rank's script (python tests/core/test_failure_paths.py ...)
TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROOT = os.path.dirname(TESTS)
if TESTS not in sys.path:
    sys.path.insert(0, TESTS)

from world import Processes, free_port  # noqa: E402


# ============================================================ rank scenarios
def _out(data: dict) -> None:
    path = os.path.join(os.environ["FAILURE_OUT"], f"rank{os.environ['RANK']}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(data, f)
    os.replace(path + ".tmp", path)


def _posted_after_abort() -> None:
    """Finding 2: rank 0 posts an isend and aborts before anything launched
    it; rank 1's irecv must receive nothing."""
    import torch
    import streamcoll
    rank = int(os.environ["RANK"])
    c = streamcoll.init(backend="oneccl", device="cpu", timeout=30)
    res: Dict[str, object] = {}
    if rank == 0:
        w = c.isend(torch.full((4,), 7.0), 1)
        c.abort()
        try:
            w.wait()
            res["wait"] = None
        except streamcoll.CollectiveError as e:
            res["wait"] = type(e).__name__
        res["is_success"] = w.is_success()
        res["exception"] = type(w.exception()).__name__
    else:
        y = torch.zeros(4)
        w = c.irecv(y, 0)
        try:
            w.wait(timeout=3.0)  # shorter than the communicator's: slow, not stuck
            res["received"] = True
        except streamcoll.CollectiveTimeout:
            res["received"] = False
        res["y"] = y.tolist()
        c.abort()  # the receive stays inside oneCCL: the exit must not run its teardown
    _out(res)
    sys.exit(0)


def _abort_then_exit() -> None:
    """Finding 5: an async all_reduce stuck (rank 1 is gone), then
    ``abort(); sys.exit(0)``: the exit must be clean, with its status."""
    import torch
    import streamcoll
    rank = int(os.environ["RANK"])
    c = streamcoll.init(backend="oneccl", device="cpu", timeout=30)
    if rank == 1:
        _out({"gone": True})
        os._exit(0)
    w = c.all_reduce(torch.ones(4), async_op=True)
    time.sleep(1.0)
    _out({"completed": w.is_completed(), "abort": c.abort(), "exiting_at": time.time()})
    sys.exit(0)


def _queued_abort_late_peer() -> None:
    """Finding 1 as reported: rank 0 queues two async all_reduces and aborts
    while rank 1 joins late; neither Work may report success, and the second
    must not run after the abort."""
    import torch
    import streamcoll
    rank = int(os.environ["RANK"])
    c = streamcoll.init(backend="oneccl", device="cpu", timeout=30)
    res: Dict[str, object] = {}
    if rank == 0:
        a, b = torch.ones(4), torch.ones(4)
        w1 = c.all_reduce(a, async_op=True)
        w2 = c.all_reduce(b, async_op=True)
        f1, f2 = w1.get_future(), w2.get_future()
        time.sleep(0.5)
        c.abort()
        time.sleep(2.5)  # rank 1 has joined by now: the first call ran to its end
        for k, w, f in (("w1", w1, f1), ("w2", w2, f2)):
            try:
                w.wait()
                res[k + "_wait"] = None
            except streamcoll.CollectiveError as e:
                res[k + "_wait"] = type(e).__name__
            res[k + "_success"] = w.is_success()
            res[k + "_exception"] = None if w.exception() is None else type(w.exception()).__name__
            res[k + "_future_failed"] = f.done() and _future_failed(f)
        res["b"] = b.tolist()
    else:
        time.sleep(1.5)
        x = torch.ones(4)
        c.all_reduce(x, async_op=True).wait()
        res["x"] = x.tolist()
        c.abort()  # rank 0 never runs the second one: nothing more to do here
    _out(res)
    sys.exit(0)


def _future_failed(f) -> bool:
    try:
        f.value()
        return False
    except Exception:
        return True


SCENARIOS = {"posted_after_abort": _posted_after_abort, "abort_then_exit": _abort_then_exit,
             "queued_abort_late_peer": _queued_abort_late_peer}

if __name__ == "__main__":
    SCENARIOS[sys.argv[1]]()
    sys.exit(0)


# ===================================================================== tests
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import streamcoll  # noqa: E402
from streamcoll.diagnostics import flight, watchdog  # noqa: E402
from streamcoll._ffi.errors import CollectiveTimeout, CommunicatorError  # noqa: E402
from streamcoll.core.spec import Plan  # noqa: E402

from conftest import get_world, needs_oneccl  # noqa: E402


def _comm(**kw):
    return streamcoll.new_communicator(backend="oneccl", device="cpu", rank=0, world_size=1,
                                       store=dist.HashStore(), **kw)


def _plan(fn, t) -> Plan:
    """A plan whose 'C call' is ``fn(handle)``: what a call blocked on a late peer looks like to the queue."""
    return Plan(fn, (), None, (t,), (t,), "broadcast")


def _failed_everywhere(w, f, exc_type=CommunicatorError) -> None:
    """Issue 21 (4): wait, exception, is_success, is_completed and the future agree."""
    assert w.is_completed()
    assert not w.is_success()
    assert isinstance(w.exception(), exc_type), repr(w.exception())
    with pytest.raises(exc_type):
        w.wait()
    # the future completes on the callback thread (streamcoll.core.callbacks), a moment later
    deadline = time.monotonic() + 10
    while not f.done() and time.monotonic() < deadline:
        time.sleep(0.005)
    assert f.done()
    with pytest.raises(Exception):
        f.value()


# --------------------------------------------------------- world size 1
@needs_oneccl
def test_queued_work_of_a_failed_communicator_never_runs_and_reports_failure(monkeypatch):
    """Finding 1: work queued behind a running call when the communicator
    fails is ended at once (failed), never run; the running call's Work
    fails too, also once its call returned; every reader says so."""
    monkeypatch.setenv("STREAMCOLL_WATCHDOG", "off")
    monkeypatch.setenv("STREAMCOLL_INLINE_ASYNC_BYTES", "0")  # queued work: the comm thread's
    c = _comm(name="queued-fail")
    gate = threading.Event()
    ran: List[str] = []
    t = torch.ones(2)
    try:
        w1 = c._launch("broadcast", _plan(lambda h: (gate.wait(10), ran.append("first"), 0)[2], t), True, None)
        w2 = c._launch("broadcast", _plan(lambda h: (ran.append("second"), 0)[1], t), True, None)
        f1, f2 = w1.get_future(), w2.get_future()
        time.sleep(0.2)
        assert not w1.is_completed() and not w2.is_completed()
        c.mark_failed(RuntimeError("injected failure"))
        _failed_everywhere(w2, f2)  # at once: nothing runs it any more
        _failed_everywhere(w1, f1)  # its call still runs: failed, the result is not to be trusted
        gate.set()
        time.sleep(0.3)
        assert ran == ["first"]
        _failed_everywhere(w1, f1)
        _failed_everywhere(w2, f2)
        assert c.flight.at(w2.seq).state == "failed"
    finally:
        gate.set()
        c.destroy()


@needs_oneccl
def test_destroy_does_not_wait_its_timeout_behind_a_failed_communicators_stuck_call(monkeypatch, caplog):
    """oneCCL's calls take turns (streamcoll.core.turnstile): a call stuck inside a
    failed communicator A (its peer gone; oneCCL cannot abort) holds the turn
    for good. Destroying a healthy B then waits ABORT_LOCK_WAIT_S, not B's
    timeout, and says why, leaving B's native communicator allocated."""
    from streamcoll.core.communicator import ABORT_LOCK_WAIT_S
    monkeypatch.setenv("STREAMCOLL_WATCHDOG", "off")
    monkeypatch.setenv("STREAMCOLL_INLINE_ASYNC_BYTES", "0")  # the stuck call: the comm thread's
    a, b = _comm(name="stuck-a"), _comm(name="healthy-b", timeout=60)
    gate = threading.Event()
    try:
        w = a._launch("broadcast", _plan(lambda h: (gate.wait(30), 0)[1], torch.ones(2)), True, None)
        time.sleep(0.2)
        a.mark_failed(RuntimeError("peer gone"))
        t0 = time.monotonic()
        with caplog.at_level("WARNING", logger="streamcoll"):
            b.destroy()
        took = time.monotonic() - t0
        assert ABORT_LOCK_WAIT_S - 0.5 < took < ABORT_LOCK_WAIT_S + 5, took
        assert "left allocated" in caplog.text and "healthy-b" in caplog.text, caplog.text
        assert b._destroyed
        with pytest.raises(CommunicatorError):
            w.wait()
    finally:
        gate.set()
        time.sleep(0.2)
        a.destroy()


@needs_oneccl
def test_work_declared_stuck_fails_in_every_reader(monkeypatch, tmp_path):
    """Issue 21 (4): a call declared stuck (wait() raised CollectiveTimeout)
    that completes afterwards is still failed for exception(), is_success()
    and the future, not only for wait()."""
    monkeypatch.setenv("STREAMCOLL_WATCHDOG", "off")
    monkeypatch.setenv("STREAMCOLL_FLIGHT_DIR", str(tmp_path))
    monkeypatch.setenv("STREAMCOLL_INLINE_ASYNC_BYTES", "0")  # a running async call: the comm thread's
    c = _comm(name="stuck-then-done", timeout=0.5)
    t = torch.ones(2)
    try:
        w = c._launch("broadcast", _plan(lambda h: (time.sleep(1.5), 0)[1], t), True, None)
        f = w.get_future()
        with pytest.raises(CollectiveTimeout):
            w.wait()
        time.sleep(1.5)  # the call has returned
        assert w.is_completed()
        assert not w.is_success()
        exc = w.exception()
        assert isinstance(exc, CommunicatorError) and isinstance(exc.__cause__, CollectiveTimeout), repr(exc)
        with pytest.raises(CommunicatorError, match="did not complete within 0.5 s"):
            f.value()
        with pytest.raises(CommunicatorError, match="did not complete within 0.5 s"):
            w.wait()
    finally:
        c.destroy()


@needs_oneccl
def test_saved_fast_paths_follow_coalescing_failure_and_destroy(monkeypatch):
    """Finding 4: a fast path saved before coalescing()/mark_failed/destroy
    (``f = c.all_reduce``, ``functools.partial(c.all_reduce, ...)``, as the
    process group's coalesced collectives build) decides as the method would:
    grouped in the block, refused after failure and destroy, no C call."""
    import functools
    monkeypatch.setenv("STREAMCOLL_WATCHDOG", "off")
    c = _comm(name="saved-fast")
    try:
        assert c.fast_path
        f = c.all_reduce
        p = functools.partial(c.all_reduce, torch.ones(2))
        seq0 = c.seq
        with c.coalescing(async_op=True) as h:
            f(torch.ones(3))
            p()
            assert c.seq == seq0  # nothing issued inside the block
        assert c.seq == seq0 + 1 and h.work is not None and h.work.op == "coalesced"
        h.wait()
        c.mark_failed(RuntimeError("injected failure"))
        with pytest.raises(CommunicatorError, match="injected failure"):
            f(torch.ones(3))
        assert c.seq == seq0 + 1
    finally:
        c.destroy()
    d = _comm(name="saved-fast-destroyed")
    g = d.all_reduce
    d.destroy()
    with pytest.raises(CommunicatorError, match="destroyed"):
        g(torch.ones(3))


@needs_oneccl
def test_destroy_of_a_failed_idle_communicator_frees_it(monkeypatch):
    """Finding 6: mark_failed (what ProcessGroupStreamcoll.abort does) and
    destroy() free the native communicator when nothing runs in it."""
    monkeypatch.setenv("STREAMCOLL_WATCHDOG", "off")
    comms = [_comm(name=f"failed-idle{i}") for i in range(5)]
    for c in comms:
        c.all_reduce(torch.ones(2), async_op=True).wait()  # the comm thread exists, idle
        c.mark_failed(RuntimeError("injected failure"))
        c.destroy()
    assert [c._handle is None for c in comms] == [True] * 5


# ---------------------------------------------------------------- watchdog
def test_an_init_guard_fires_once_in_fail_mode(monkeypatch):
    """Finding 8: a guard past its timeout in STREAMCOLL_WATCHDOG=fail mode
    reports once, not on every pass."""
    monkeypatch.setenv("STREAMCOLL_WATCHDOG", "fail")
    wd = watchdog.Watchdog()
    with wd.guard("init of communicator 'guarded' (test)", 0.3):
        time.sleep(2.5)  # fires at 1.3 s (timeout + grace); passes every 0.05 s after
    assert len(wd.fired) == 1, len(wd.fired)
    assert "init of communicator 'guarded' (test) has not completed" in wd.fired[0]
    assert not wd._guards


# -------------------------------------------- the shared world: posted p2p
def _gloo_init(port: int, rank: int, size: int, backend: str = "gloo") -> None:
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size,
                            timeout=timedelta(seconds=20))


def _scenario_a(irecv, isend, peer: int, rank: int) -> List[float]:
    """3(a): irecv, one status query, then isend; wait both."""
    y = torch.zeros(4)
    r = irecv(y, peer)
    r.is_completed()
    s = isend(torch.full((4,), float(rank + 1)), peer)
    r.wait()
    s.wait()
    return y.tolist()


def _scenario_b(rank: int, isend, recv, all_reduce_b) -> List[float]:
    """3(b): rank 0 posts an isend on A, all-reduces on B, then waits; rank 1
    receives on A, then all-reduces on B."""
    x = torch.full((4,), 5.0) if rank == 0 else torch.zeros(4)
    y = torch.full((2,), float(rank + 1))
    if rank == 0:
        w = isend(x, 1)
        all_reduce_b(y)
        w.wait()
    else:
        recv(x, 0)
        all_reduce_b(y)
    return x.tolist() + y.tolist()


def _scenarios_on_process_group(backend: str, port: int, r: int, n: int) -> tuple:
    """3(a) and 3(b) through torch.distributed on ``backend`` (B: a new group)."""
    _gloo_init(port, r, n, backend)
    try:
        b = dist.new_group(list(range(n)))
        got = (_scenario_a(dist.irecv, dist.isend, 1 - r, r),
               _scenario_b(r, dist.isend, dist.recv, lambda y: dist.all_reduce(y, group=b)))
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return got


def _p2p_progress(comm, port_gloo: int, port_sc: int):
    r, n = comm.rank, comm.size
    peer = 1 - r
    out: Dict[str, object] = {}
    # gloo: what torch's semantics give
    out["gloo_a"], out["gloo_b"] = _scenarios_on_process_group("gloo", port_gloo, r, n)
    # streamcoll directly: A a split of the world's communicator, B a split of A
    A = comm.split(0, timeout=8)
    B = A.split(0)
    try:
        out["direct_a"] = _scenario_a(A.irecv, A.isend, peer, r)
        out["direct_b"] = _scenario_b(r, A.isend, A.recv, B.all_reduce)
        A.barrier()
    finally:
        B.destroy()
        A.destroy()
    # through the "streamcoll" process group
    out["pg_a"], out["pg_b"] = _scenarios_on_process_group("streamcoll", port_sc, r, n)
    return out


@needs_oneccl
@pytest.mark.world
def test_posted_p2p_progresses_as_on_gloo():
    """Finding 3: (a) both ranks irecv, query the status once, then isend;
    (b) rank 0 isends on A, all-reduces on B (a split of A), then waits,
    while rank 1 receives on A then all-reduces on B. gloo finishes both;
    so must streamcoll, directly and through the process group, with gloo's
    values. (In 3(b) rank 0's send on A's comm thread and its all_reduce on
    B ran inside oneCCL at the same time, which corrupted oneCCL's state in
    1-2 runs of 5: ``test_calls_on_two_communicators_run_one_at_a_time``.)"""
    w = get_world(2)
    res = w.run(_p2p_progress, free_port(), free_port(), timeout=90)
    for r, out in enumerate(res):
        assert out["gloo_a"] == [float(2 - r)] * 4, out
        for how in ("direct", "pg"):
            assert out[f"{how}_a"] == out["gloo_a"], (r, how, out)
            assert out[f"{how}_b"] == out["gloo_b"], (r, how, out)


def _two_communicators(comm, port_gloo: int, iters: int):
    """Per iteration: an async all_reduce on A, a sync one on B, an async one
    on B, a sync one on A, then both waits (one thread; A and B two
    communicators of the same ranks), on gloo groups and on streamcoll
    communicators (a split of the world's and an independent one)."""
    r, n = comm.rank, comm.size

    def pattern(ar_a, ar_b):
        got = []
        for i in range(iters):
            xa, yb = torch.full((4,), float(r + i)), torch.full((3,), float(2 * r + i))
            zb, ua = torch.full((5,), float(r - i)), torch.full((2,), float(i * r + 1))
            w1 = ar_a(xa, async_op=True)
            ar_b(yb)
            w2 = ar_b(zb, async_op=True)
            ar_a(ua)
            w1.wait()
            w2.wait()
            got.append(xa.tolist() + yb.tolist() + zb.tolist() + ua.tolist())
        return got

    out: Dict[str, object] = {}
    _gloo_init(port_gloo, r, n)
    try:
        ga, gb = dist.new_group(list(range(n))), dist.new_group(list(range(n)))
        out["gloo"] = pattern(lambda t, async_op=False: dist.all_reduce(t, group=ga, async_op=async_op),
                              lambda t, async_op=False: dist.all_reduce(t, group=gb, async_op=async_op))
    finally:
        dist.destroy_process_group()
    a = comm.split(0)
    b = streamcoll.new_communicator(store=comm.store, rank=r, world_size=n, name="independent")
    try:
        out["split_and_independent"] = pattern(a.all_reduce, b.all_reduce)
    finally:
        b.destroy()
        a.destroy()
    return out


@needs_oneccl
@pytest.mark.world
def test_calls_on_two_communicators_run_one_at_a_time():
    """oneCCL may not be entered by two threads of a process at once: an
    async all_reduce running on A's comm thread beside a synchronous one on B
    corrupted its state (``flow_control.cpp:49 return_credit: unexpected
    credits 1025``) within 300 iterations, and a plain lock deadlocks (ranks
    can take it in different orders). Calls run one at a time in issue order
    (streamcoll.core.turnstile): the values are gloo's for the same program."""
    w = get_world(2)
    res = w.run(_two_communicators, free_port(), 150, timeout=120)
    for r, out in enumerate(res):
        assert len(out["gloo"]) == 150, (r, len(out["gloo"]))
        assert out["split_and_independent"] == out["gloo"], (r, out["split_and_independent"][:2], out["gloo"][:2])


# ----------------------------------------- the shared world: flight analysis
def _healthy_exchange(comm, path: str):
    r = comm.rank
    c = comm.split(0)
    try:
        x, y = torch.full((4,), float(r)), torch.zeros(4)
        c.all_reduce(torch.ones(2))  # a collective before: the p2p_group's number would repeat its
        if r == 0:
            a, b = c.isend(x, 1), c.irecv(y, 1)
            a.wait()
            b.wait()
        else:
            c.irecv(y, 0).wait()
            c.send(x, 0)
        z = torch.ones(2)
        c.all_reduce(z)
        c.all_reduce(z, async_op=True).wait()
        c.dump_flight_record(path)
        return y.tolist(), z.tolist()
    finally:
        c.destroy()


@needs_oneccl
@pytest.mark.world
def test_flight_analysis_is_silent_on_a_healthy_p2p_exchange(tmp_path):
    """Finding 7: a grouped p2p launch (p2p_group) is point to point for the
    analysis; an all_reduce, then one rank's isend+irecv against the other's
    irecv then send, then all_reduces, is no mismatch."""
    w = get_world(2)
    res = w.run(_healthy_exchange, str(tmp_path))
    assert res[0][0] == [1.0] * 4 and res[1][0] == [0.0] * 4, res
    findings = flight.analyze([str(tmp_path)])
    assert findings == [], [f.message for f in findings]
    cli = subprocess.run([sys.executable, "-m", "streamcoll.flight", "analyze", str(tmp_path)],
                         capture_output=True, text=True, timeout=60,
                         env=dict(os.environ, PYTHONPATH=ROOT))
    assert cli.returncode == 0, cli.stdout + cli.stderr


# -------------------------------------------------- ranks of their own
# The async calls of these scenarios are the comm thread's (queued work on a
# late or dead peer), whatever their size: small ones would run inline.
COMM_THREAD = {"STREAMCOLL_INLINE_ASYNC_BYTES": "0"}

class Ranks(Processes):
    """The rank processes of one scenario (:class:`world.Processes`: each in
    its own session, killed with all it started at the end)."""

    def __init__(self, scenario: str, size: int, tmp, env: Optional[dict] = None) -> None:
        super().__init__(str(tmp))
        self.start_ranks([sys.executable, __file__, scenario], size,
                         dict({"FAILURE_OUT": self.dir, "STREAMCOLL_FLIGHT_DIR": os.path.join(self.dir, "flight"),
                               "STREAMCOLL_WATCHDOG": "fail", "PYTHONPATH": ROOT}, **(env or {})))

    def wait(self, timeout: float) -> None:
        self.wait_all(timeout)
        self.kill()

    def describe(self) -> str:
        out = []
        for r in range(len(self.procs)):
            with open(os.path.join(self.dir, f"stderr{r}")) as f:
                out.append(f"--- rank {r}: exit {self.rc(r)}, {self.result(r)}\n{f.read()[-3000:]}")
        return "\n".join(out)


@needs_oneccl
@pytest.mark.world
def test_a_posted_op_is_not_launched_after_the_communicator_failed(tmp_path):
    """Finding 2: ``w = isend(x, 1); abort(); w.wait()``: the wait raises,
    and rank 1 receives nothing (the op is ended with the failure, never
    launched; on NCCL the plan would use the freed handle)."""
    ranks = Ranks("posted_after_abort", 2, tmp_path)
    ranks.wait(60)
    info = ranks.describe()
    assert ranks.rc(0) == 0 and ranks.rc(1) == 0, info
    r0, r1 = ranks.result(0), ranks.result(1)
    assert r0["wait"] == "CommunicatorError" and r0["is_success"] is False, info
    assert r0["exception"] == "CommunicatorError", info
    assert r1["received"] is False and r1["y"] == [0.0] * 4, info


@needs_oneccl
@pytest.mark.world
def test_abort_on_oneccl_makes_the_exit_safe(tmp_path):
    """Finding 5: a stuck async all_reduce (the peer is gone), then
    ``abort(); sys.exit(0)``: the process ends promptly with status 0 (no
    SIGSEGV in oneCCL's teardown, no hang)."""
    ranks = Ranks("abort_then_exit", 2, tmp_path, COMM_THREAD)
    ranks.wait(60)
    info = ranks.describe()
    res = ranks.result(0)
    assert res.get("completed") is False and res.get("abort") is False, info
    assert ranks.rc(0) == 0, info
    assert ranks.ended[0] - res["exiting_at"] < 5.0, info


@needs_oneccl
@pytest.mark.world
def test_queued_work_after_abort_with_a_late_peer(tmp_path):
    """Finding 1 with two ranks: neither of rank 0's Works reports success
    after its abort, in any reader, and the second all_reduce never ran
    (its tensor is untouched)."""
    ranks = Ranks("queued_abort_late_peer", 2, tmp_path, COMM_THREAD)
    ranks.wait(60)
    info = ranks.describe()
    assert ranks.rc(0) == 0 and ranks.rc(1) == 0, info
    r0 = ranks.result(0)
    for k in ("w1", "w2"):
        assert r0[k + "_wait"] == "CommunicatorError", info
        assert r0[k + "_success"] is False and r0[k + "_exception"] == "CommunicatorError", info
        assert r0[k + "_future_failed"] is True, info
    assert r0["b"] == [1.0] * 4, info
    assert ranks.result(1)["x"] == [2.0] * 4, info


# ------------------------- the shared world: the process group's coalesced ops
def _pg_coalesced(comm, port: int):
    r, n = comm.rank, comm.size
    _gloo_init(port, r, n, "streamcoll")
    try:
        pg = dist.distributed_c10d._get_default_group()
        a, b = torch.full((2,), float(r + 1)), torch.full((3,), float(r + 1))
        dist.all_reduce(torch.ones(1))  # creates the group's communicator
        c = pg.communicator(torch.device("cpu"))
        seq0 = c.seq
        pg.allreduce_coalesced([a, b]).wait()
        outs = [torch.empty(2 * n), torch.empty(n)]
        pg.allgather_into_tensor_coalesced(outs, [torch.full((2,), float(r)), torch.full((1,), float(r))]).wait()
        return c.seq - seq0, a.tolist(), b.tolist(), [o.tolist() for o in outs]
    finally:
        dist.destroy_process_group()


@needs_oneccl
@pytest.mark.world
def test_process_group_coalesced_ops_go_out_as_one_group():
    """Finding 4 through the process group: allreduce_coalesced and
    allgather_into_tensor_coalesced build partials of the communicator's
    (fast-path) methods before coalescing(): each call is one group launch
    (one sequence number), not ops run inline one by one."""
    w = get_world(2)
    res = w.run(_pg_coalesced, free_port())
    n = 2
    for r, (nseq, a, b, outs) in enumerate(res):
        assert nseq == 2, res  # two group launches
        assert a == [3.0] * 2 and b == [3.0] * 3, res
        assert outs == [[float(k) for k in range(n) for _ in range(2)], [float(k) for k in range(n)]], res


_DESTROY_UNDER_LAUNCH = r"""
import sys, threading, time
import torch, torch.distributed as dist
import streamcoll
errs, calls = [], [0]
for rnd in range(8):
    c = streamcoll.new_communicator(backend="oneccl", device="cpu", rank=0, world_size=1,
                                    store=dist.HashStore(), name=f"stress{rnd}")
    x = torch.ones(1 << 14)
    stop = threading.Event()

    def hammer():
        try:
            while not stop.is_set():
                c.all_reduce(x)
                calls[0] += 1
        except streamcoll.CommunicatorError as e:
            errs.append(("refused", str(e)[:60]))
        except BaseException as e:
            errs.append(("other", f"{type(e).__name__}: {e}"[:200]))
    t = threading.Thread(target=hammer)
    t.start()
    time.sleep(0.02)
    c.destroy()
    stop.set()
    t.join(10)
bad = [e for e in errs if e[0] != "refused"]
print("calls", calls[0], "refused", sum(e[0] == "refused" for e in errs), "bad", bad)
sys.exit(1 if bad else 0)
"""


def test_destroy_while_another_thread_launches():
    """Issue 27 (9): destroy() (and abort() where the library can) take the
    exec lock that every launch holds from reading the handle to the end of
    its C call, so another thread's fast-path call never runs on a freed
    native communicator: it finishes first, and the next one is refused with
    CommunicatorError. Before, the native communicator was freed under the
    running call (seen: a crash with a native backtrace in 20 of 20 rounds'
    worth of runs)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST")}
    p = subprocess.run([sys.executable, "-c", _DESTROY_UNDER_LAUNCH], capture_output=True, text=True, timeout=240,
                       env=env)
    assert p.returncode == 0, (p.stdout + p.stderr)[-3000:]
    assert "bad []" in p.stdout and "refused 8" in p.stdout, p.stdout
