"""The callback thread (streamcoll.core.callbacks): completions run in order, one
at a time, off the threads that run collectives; a callback that waits on a
future the callback thread has yet to complete hands the role over instead
of deadlocking. Real threads, no library needed."""
from __future__ import annotations

import threading
import time

from streamcoll.core.callbacks import CallbackThread, Future
import streamcoll.core.callbacks as callbacks


def test_completions_run_in_order_one_at_a_time():
    ct = CallbackThread(idle_s=0.5)
    seen, running, overlap = [], [0], []
    done = threading.Event()

    def job(k):
        def fn():
            running[0] += 1
            overlap.append(running[0])
            time.sleep(0.001)
            seen.append(k)
            running[0] -= 1
            if k == 49:
                done.set()
        return fn

    for k in range(50):
        ct.submit(job(k))
    assert done.wait(10)
    assert seen == list(range(50))
    assert max(overlap) == 1


def test_a_callback_waiting_on_a_later_completion_hands_over(monkeypatch):
    """The PowerSGD shape: completion 1's callback waits on a future that
    completion 2 (queued behind it, on the same callback thread) sets."""
    ct = CallbackThread(idle_s=0.5)
    monkeypatch.setattr(callbacks, "CALLBACKS", ct)
    later = Future()
    out = []
    done = threading.Event()

    def first():
        out.append(("first waits", threading.get_ident()))
        out.append(("got", later.wait()))
        done.set()

    ct.submit(first)
    time.sleep(0.05)  # first is blocked in wait(): before the hand-over this never completed
    ct.submit(lambda: later.set_result(7))
    assert done.wait(5), out
    assert out[1] == ("got", 7)


def test_then_returns_a_handing_over_future():
    f = Future()
    g = f.then(lambda x: x.value() + 1)
    assert isinstance(g, Future)
    f.set_result(1)
    assert g.wait() == 2
    h = Future().then(lambda x: 1 / 0)
    assert isinstance(h, Future)
