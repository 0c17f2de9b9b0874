"""Unit tier (threads only, no library): ``CpuRuntime.nudge(blocking=False)``,
what ``Work.__del__`` calls for a small async call dropped unwaited. A
finaliser runs wherever the collector or a refcount drop happens to run it,
on any thread, inside any lock that thread holds; so it must never wait for
``_mutex`` (a thread inside a ``_mutex`` section may wait for a lock the
finalising thread holds: ``fail()`` cancels tickets under the turnstile's
lock, ``_spawn`` starts a thread under threading's ``_active_limbo_lock``),
and an interrupt at any point CPython delivers one must not leave
``_mutex`` held (issue 33)."""
from __future__ import annotations

import dis
import random
import signal
import sys
import threading
import time

from conftest import ROOT

sys.path.insert(0, ROOT)

import torch  # noqa: E402

from streamcoll._ffi.errors import CommunicatorError  # noqa: E402
from streamcoll.core.streams import CpuRuntime, _Item  # noqa: E402
from streamcoll.core.turnstile import Turnstile  # noqa: E402
from streamcoll.core.work import Work  # noqa: E402

_CALLS = {dis.opmap[n] for n in ("CALL", "CALL_FUNCTION_EX") if n in dis.opmap}


def _idle_runtime():
    """A runtime whose comm thread is started and asleep, with one small
    call queued quietly (its ticket taken) and its dropped-unwaited Work."""
    ts = Turnstile()
    rt = CpuRuntime(torch.device("cpu"), lambda h: None, ts)
    first = _Item(lambda plan, e, h: None, None, None)
    rt._enqueue(first)
    assert rt._wait_item(first, 10)
    deadline = time.monotonic() + 10
    while not rt._work_cv._waiters and time.monotonic() < deadline:  # the comm thread is back asleep
        time.sleep(0.001)
    ran = []
    item = rt.submit(None, lambda plan, e, h: ran.append(1), None, None, quiet=True)
    w = Work(None, rt, None, None, 1, "all_reduce", None, None, here=True)
    return ts, rt, item, w, ran


def test_a_finaliser_never_waits_for_the_runtime_lock_a_thread_failing_the_runtime_takes():
    """Thread F drops the last reference to an unwaited small Work while it
    holds the turnstile's lock (the collector finalising it inside
    ``Turnstile.wait``/``wake``/``cancel``, which allocate under that lock).
    The GIL passes to thread X at the end of a call inside ``nudge`` (a
    switch CPython makes at any call's end); X fails the runtime
    (``mark_failed``: the watchdog, a timed-out wait), which takes ``_mutex``
    and then the turnstile's lock to cancel the queued call's ticket. A
    finaliser that waits for ``_mutex`` there deadlocks both threads, and
    every later call of the process waits on the ticket for ever."""
    ts, rt, item, w, ran = _idle_runtime()
    go = threading.Event()
    switched = []
    errors = []

    def tracer(frame, event, arg):
        code = frame.f_code
        if event != "call" or code.co_name != "nudge" or not code.co_filename.endswith("streams.py"):
            return None
        frame.f_trace_opcodes = True
        prev = [-1]

        def local(frame, event, arg):
            if event == "opcode":
                p, prev[0] = prev[0], frame.f_code.co_code[frame.f_lasti]
                if p in _CALLS and not switched:
                    switched.append(frame.f_lineno)
                    go.set()  # the GIL goes to X here...
                    end = time.monotonic() + 2
                    while not rt._mutex.locked() and time.monotonic() < end:
                        time.sleep(0.001)  # ...until it holds _mutex (or we do)
            return local
        return local

    def finalising():
        nonlocal w
        try:
            with ts._lock:
                sys.settrace(tracer)
                try:
                    del w  # Work.__del__ -> rt.nudge(False)
                finally:
                    sys.settrace(None)
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    def failing():
        go.wait(10)
        try:
            rt.fail(lambda e: CommunicatorError("failed"))
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    f = threading.Thread(target=finalising, daemon=True, name="finalising")
    x = threading.Thread(target=failing, daemon=True, name="failing")
    x.start()
    f.start()
    f.join(10)
    x.join(10)
    stuck = [t.name for t in (f, x) if t.is_alive()]
    assert not stuck, (f"deadlock: {stuck} still blocked 10 s later (the finaliser waits for _mutex, held by "
                       f"fail(), which waits for the turnstile lock the finalising thread holds); "
                       f"switched at line {switched}")
    assert switched and not errors, (switched, errors)
    assert not rt._mutex.locked() and not ts._lock.locked()
    assert item.done and (ran == [1] or item.exc is not None)
    ts.wake()
    assert ts.turn == ts.issued, (ts.turn, ts.issued, ts.skipped)
    rt.close(10)


def test_a_finaliser_skips_the_nudge_when_another_thread_holds_the_lock():
    """Another thread inside a ``_mutex`` section: the finaliser returns at
    once (the watchdog's next pass starts the call), it does not wait."""
    ts, rt, item, w, ran = _idle_runtime()
    inside, leave = threading.Event(), threading.Event()

    def holder():
        with rt._mutex:
            inside.set()
            leave.wait(10)

    h = threading.Thread(target=holder, daemon=True)
    h.start()
    assert inside.wait(10)
    t0 = time.monotonic()
    rt.nudge(False)
    took = time.monotonic() - t0
    leave.set()
    h.join(10)
    assert took < 1.0, f"nudge(False) waited {took:.2f} s for a lock another thread held"
    rt.nudge(False)  # free now: it wakes the comm thread, which runs the quiet call
    assert rt._wait_item(item, 10) and ran == [1]
    del w
    rt.close(10)


def test_a_finaliser_inside_the_runtime_lock_on_its_own_thread_returns():
    """The collector runs the finaliser on a thread inside a ``_mutex``
    section (an allocation there): it must neither wait for the lock its own
    thread holds nor release it."""
    ts, rt, item, w, ran = _idle_runtime()
    done = []

    def body():
        nonlocal w
        with rt._mutex:
            del w  # Work.__del__ -> rt.nudge(False), this thread holding _mutex
            done.append(rt._mutex.locked())

    t = threading.Thread(target=body, daemon=True)
    t.start()
    t.join(10)
    assert not t.is_alive(), "the finaliser waited for the lock its own thread holds"
    assert done == [True], "the finaliser released a lock its thread holds"
    rt.nudge()
    assert rt._wait_item(item, 10) and ran == [1]
    rt.close(10)


def test_an_interrupt_at_any_point_of_a_non_blocking_nudge_leaves_the_lock_free():
    """KeyboardInterrupt at each point CPython delivers one inside
    ``nudge(False)`` (function entry, the end of each call: the trace's
    ``call`` event and the opcode after each CALL), then real signals
    (SIGALRM every 10-50 us for 2 s): ``_mutex`` is never left held."""
    ts, rt, item, w, ran = _idle_runtime()
    k, raised = 1, 0
    while True:
        n = [0]

        def tracer(frame, event, arg, k=k):
            code = frame.f_code
            if event != "call" or not code.co_filename.endswith("streams.py"):
                return None
            frame.f_trace_opcodes = True
            n[0] += 1
            if n[0] == k:
                raise KeyboardInterrupt(k)
            prev = [-1]

            def local(frame, event, arg):
                if event == "opcode":
                    p, prev[0] = prev[0], frame.f_code.co_code[frame.f_lasti]
                    if p in _CALLS:
                        n[0] += 1
                        if n[0] == k:
                            raise KeyboardInterrupt(k)
                return local
            return local

        sys.settrace(tracer)
        try:
            rt.nudge(False)
        except KeyboardInterrupt:
            raised += 1
        finally:
            sys.settrace(None)
        assert not rt._mutex.locked(), f"_mutex left held by an interrupt at point {k}"
        if n[0] < k:
            break
        k += 1
    assert raised >= 2, raised

    # SIGVTALRM (the process's CPU time), not SIGALRM: pytest-timeout's
    code = CpuRuntime.nudge.__code__
    hits, stop = [0], []

    def handler(signum, frame):
        if stop:
            return
        signal.setitimer(signal.ITIMER_VIRTUAL, random.uniform(10e-6, 50e-6))
        if frame is not None and frame.f_code is code:
            hits[0] += 1
            raise KeyboardInterrupt

    old = signal.signal(signal.SIGVTALRM, handler)
    leaks = 0
    try:
        end = time.monotonic() + 2
        signal.setitimer(signal.ITIMER_VIRTUAL, 20e-6)
        while time.monotonic() < end and not leaks:
            try:
                for _ in range(200):
                    rt.nudge(False)
            except KeyboardInterrupt:
                pass
            deadline = time.monotonic() + 1
            while rt._mutex.locked() and time.monotonic() < deadline:
                time.sleep(0.001)  # the comm thread (woken) may hold it a moment
            leaks += rt._mutex.locked()
    finally:
        stop.append(1)
        signal.setitimer(signal.ITIMER_VIRTUAL, 0)
        time.sleep(0.01)
        signal.signal(signal.SIGVTALRM, old)
    assert not leaks, f"_mutex left held after {hits[0]} interrupts inside nudge(False)"
    assert hits[0] > 100, hits
    del w
    rt.close(10)
