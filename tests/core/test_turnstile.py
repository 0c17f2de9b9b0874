"""Unit tier: streamcoll.core.turnstile, the process-wide issue order of oneCCL's
calls (pure logic, threads only)."""
from __future__ import annotations

import sys
import threading
import time

from conftest import ROOT

sys.path.insert(0, ROOT)

import pytest  # noqa: E402

from streamcoll.core.turnstile import Turnstile  # noqa: E402


def _run_in_turn(ts: Turnstile, t: int, log: list, hold_s: float = 0.0) -> None:
    if ts.turn != t:
        ts.wait(t)
    log.append(("in", t))
    time.sleep(hold_s)
    log.append(("out", t))
    ts.leave(t)


def test_calls_run_one_at_a_time_in_ticket_order_whatever_the_thread_start_order():
    ts = Turnstile()
    tickets = [ts.ticket() for _ in range(6)]
    log: list = []
    threads = [threading.Thread(target=_run_in_turn, args=(ts, t, log, 0.01)) for t in reversed(tickets)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(10)
    assert not any(th.is_alive() for th in threads)
    assert log == [(k, t) for t in tickets for k in ("in", "out")], log
    assert ts.turn == 6 and ts.waiting == 0


def test_a_cancelled_ticket_is_skipped_before_and_after_its_turn_came():
    ts = Turnstile()
    a, b, c, d = (ts.ticket() for _ in range(4))
    log: list = []
    th = threading.Thread(target=_run_in_turn, args=(ts, c, log))
    th.start()
    ts.cancel(b)  # b's turn not come yet: remembered
    _run_in_turn(ts, a, log)  # a leaves: b is skipped, c runs
    th.join(10)
    assert log == [("in", a), ("out", a), ("in", c), ("out", c)], log
    assert ts.turn == d
    ts.cancel(d)  # its turn now: passes at once
    assert ts.turn == d + 1 and not ts.skipped
    ts.cancel(a)  # long past: nothing
    assert ts.turn == d + 1 and not ts.skipped


def test_a_wait_that_times_out_cancels_its_ticket():
    ts = Turnstile()
    a, b, c = ts.ticket(), ts.ticket(), ts.ticket()
    t0 = time.monotonic()
    assert ts.wait(b, timeout=0.2) is False
    assert 0.15 < time.monotonic() - t0 < 5
    ts.leave(a)
    assert ts.turn == c  # b skipped


def test_an_interrupted_wait_cancels_its_ticket():
    """KeyboardInterrupt (a signal handler's exception) inside the wait: the
    ticket is cancelled, so the calls issued after it still get their turn."""
    ts = Turnstile()
    a, b, c = ts.ticket(), ts.ticket(), ts.ticket()

    def interrupted(timeout=None):
        raise KeyboardInterrupt

    ts._cond.wait = interrupted  # type: ignore[method-assign]
    with pytest.raises(KeyboardInterrupt):
        ts.wait(b)
    assert ts.waiting == 0 and b in ts.skipped
    ts.leave(a)
    assert ts.turn == c and not ts.skipped


def test_hold_is_reentrant_on_its_thread_and_bounded_for_others():
    ts = Turnstile()
    first = ts.ticket()  # someone issued before: not left yet
    got: list = []

    def late() -> None:
        with ts.hold(timeout=0.2) as ok:
            got.append(ok)

    th = threading.Thread(target=late)
    th.start()
    th.join(10)
    assert got == [False]
    ts.leave(first)
    with ts.hold() as ok1:
        assert ok1
        with ts.hold() as ok2:  # the same turn: no second ticket, no deadlock
            assert ok2
    assert ts.waiting == 0
    after = ts.ticket()
    assert ts.turn == after, (ts.turn, after)


@pytest.mark.parametrize("threads", [2, 4])
def test_many_threads_never_overlap(threads: int):
    ts = Turnstile()
    inside = [0]
    peak = [0]
    lock = threading.Lock()
    order: list = []

    def worker() -> None:
        for _ in range(300):
            with lock:  # the issuer's critical section (exec lock): ticket order is issue order
                t = ts.ticket()
                order.append(t)
            if ts.turn != t:
                ts.wait(t)
            inside[0] += 1
            peak[0] = max(peak[0], inside[0])
            inside[0] -= 1
            ts.leave(t)

    ths = [threading.Thread(target=worker) for _ in range(threads)]
    for th in ths:
        th.start()
    for th in ths:
        th.join(30)
    assert not any(th.is_alive() for th in ths)
    assert peak[0] == 1 and ts.turn == 300 * threads and ts.waiting == 0


def test_a_comm_thread_that_cannot_start_takes_no_ticket(monkeypatch):
    """Issue 33, finding 11: ``Thread.start`` failing in ``CpuRuntime._enqueue``
    (no thread can be started) must not leave a queued item's ticket behind:
    the next call of the process would wait on it for ever."""
    import torch
    from streamcoll.core.streams import CpuRuntime, _Item

    ts = Turnstile()
    rt = CpuRuntime(torch.device("cpu"), lambda h: None, ts)

    def no_thread(self):
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(threading.Thread, "start", no_thread)
    with pytest.raises(RuntimeError, match="can't start"):
        rt._enqueue(_Item(lambda plan, e, h: None, None, None))
    monkeypatch.undo()
    assert rt._pending == 0 and not rt._queue and rt._thread is None
    t = ts.ticket()
    assert ts.turn == t, "a ticket was left behind: every later call waits on it"
    ts.leave(t)
    ran = []
    item = _Item(lambda plan, e, h: ran.append(1), None, None)
    rt._enqueue(item)  # the thread starts now and runs it in its turn
    assert rt._wait_item(item, 10) and ran == [1] and ts.turn == item.ticket + 1
    assert rt.close(10)
