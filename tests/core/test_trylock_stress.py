"""Unit tier (threads and real signals, no library): ``streams._TryLock``
under interrupts. SIGUSR2 every 10-50 us (from a sender process) raises
KeyboardInterrupt in the main thread wherever CPython delivers it inside the code under test (the
function using the ``with``, and ``_TryLock.__exit__``, a Python frame),
while other threads enter the same ``_TryLock`` instance and get
asynchronous exceptions (``PyThreadState_SetAsyncExc``, delivered at the
same points). A lock is never left held: a plain Lock taken with
``acquire(False)`` (``CpuRuntime.nudge(blocking=False)``'s shape) and an
RLock taken with ``acquire(True, timeout)``, interrupted while it waits and
re-entered by its owner (``Communicator.destroy``/``abort``'s shape, the
count left as it was). The control, ``acquire(False)`` then ``try``, leaks
the lock within the same stress, which shows the harness reaches the
window between a call's end and a ``try``."""
from __future__ import annotations

import ctypes
import os
import random
import signal
import subprocess
import sys
import threading
import time

import pytest

from conftest import ROOT

sys.path.insert(0, ROOT)

from streamcoll.core import streams  # noqa: E402
from streamcoll.core.streams import _TryLock  # noqa: E402


class _Async(BaseException):
    """What the injector raises in the other threads."""


def _trylock_body(tl, lock):
    with tl as got:
        if got:
            try:
                pass
            finally:
                lock.release()
    return got


def _control_body(tl, lock):
    got = lock.acquire(False)
    if got:
        try:
            pass
        finally:
            lock.release()
    return got


def _timeout_body(tl, lock):  # abort()'s shape: the try first, the release if got
    with tl as got:
        try:
            pass
        finally:
            if got:
                lock.release()
    return got


_TARGETS = {_trylock_body.__code__, _control_body.__code__, _timeout_body.__code__}
_STREAMS = streams.__file__  # and any frame of streams.py (_TryLock.__exit__; an __enter__ made in Python)


_SENDER = r"""
import os, random, sys, time
pid = int(sys.argv[1])
while os.getppid() == pid:
    os.kill(pid, int(sys.argv[2]))
    time.sleep(random.uniform(10e-6, 50e-6))
"""


class _Signals:
    """SIGUSR2 from a sender process every 10-50 us (asked: the sleep's
    slack makes it 60-110 us); KeyboardInterrupt when it lands in a target
    frame. A process, not an itimer: ITIMER_REAL is pytest-timeout's, and the
    CPU-time timers fire on the scheduler's tick (a few ms)."""

    def __init__(self):
        self.hits = 0
        self.stopped = False
        self.old = None
        self.sender = None

    def handler(self, signum, frame):
        if not self.stopped and frame is not None and (frame.f_code in _TARGETS
                                                       or frame.f_code.co_filename == _STREAMS):
            self.hits += 1
            raise KeyboardInterrupt

    def __enter__(self):
        self.old = signal.signal(signal.SIGUSR2, self.handler)
        self.sender = subprocess.Popen([sys.executable, "-c", _SENDER, str(os.getpid()), str(int(signal.SIGUSR2))])
        return self

    def __exit__(self, *exc):
        self.stopped = True
        self.sender.kill()
        self.sender.wait()
        time.sleep(0.01)
        signal.signal(signal.SIGUSR2, self.old)


class _NoSignals:
    hits = 0

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None


def _hammer(body, lock, tl, seconds, stop_early=lambda: False, threads=2, signals=True):
    """The main thread (signals) and ``threads`` threads (asynchronous
    exceptions) enter ``body`` for ``seconds``; returns (main iterations,
    signal hits)."""
    done = []

    def worker():
        while True:
            try:
                while not done:
                    for _ in range(50):
                        body(tl, lock)
                return
            except _Async:
                pass

    workers = [threading.Thread(target=worker, daemon=True) for _ in range(threads)]
    for t in workers:
        t.start()

    def injector():
        while not done:
            for t in workers:
                if t.is_alive():
                    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(t.ident), ctypes.py_object(_Async))
            time.sleep(random.uniform(20e-6, 200e-6))

    inj = threading.Thread(target=injector, daemon=True)
    inj.start()
    iters = 0
    with (_Signals() if signals else _NoSignals()) as sig:
        end = time.monotonic() + seconds
        while time.monotonic() < end and not stop_early():
            try:
                for _ in range(50):
                    body(tl, lock)
                    iters += 1
            except KeyboardInterrupt:
                pass
    done.append(1)
    inj.join(10)
    for t in workers:
        t.join(10)
    assert not any(t.is_alive() for t in workers + [inj]), "a stress thread did not stop (blocked on the lock?)"
    return iters, sig.hits


@pytest.mark.timeout(60)
@pytest.mark.parametrize("how", ["signals", "async exceptions"])
def test_the_control_leaks_the_lock_under_the_same_stress(how):
    lock = threading.Lock()

    def leaked():  # held now and still 50 and 100 ms later (another thread's own hold lasts microseconds,
        # but a holder descheduled on a loaded machine kept it past 10 ms: seen in CI, 0 iterations)
        return lock.locked() and not time.sleep(0.05) and lock.locked() and not time.sleep(0.05) and lock.locked()

    iters, hits = _hammer(_control_body, lock, None, 10, stop_early=leaked,
                          threads=0 if how == "signals" else 2, signals=how == "signals")
    time.sleep(0.05)
    assert lock.locked(), (f"acquire(False) then try did not leak in {iters} iterations and {hits} interrupts "
                           f"({how}): the stress does not reach the window it is meant to")


@pytest.mark.timeout(60)
def test_a_shared_trylock_never_leaks_its_lock_under_signals_and_async_exceptions():
    lock = threading.Lock()
    tl = _TryLock(lock)  # one instance entered by all three threads at once (CpuRuntime._try_mutex)
    iters, hits = _hammer(_trylock_body, lock, tl, 4)
    time.sleep(0.05)
    assert not lock.locked(), f"_TryLock left its lock held ({iters} iterations, {hits} interrupts)"
    assert hits > 200 and iters > 1000, (hits, iters)


@pytest.mark.timeout(60)
def test_an_rlock_taken_with_a_timeout_is_never_leaked_nor_its_count_changed():
    """A holder thread keeps the RLock most of the time, so the main thread
    waits inside ``acquire(True, timeout)`` (a signal there raises with the
    lock not taken: the body is skipped); a third of the rounds the main
    thread already owns it (the count goes 1 -> 2 -> 1)."""
    lock = threading.RLock()
    tl = _TryLock(lock, 0.0005)
    done, bad = [], []

    def holder():
        while not done:
            with lock:
                time.sleep(random.uniform(0, 300e-6))
            time.sleep(random.uniform(0, 100e-6))

    h = threading.Thread(target=holder, daemon=True)
    h.start()
    iters = 0
    with _Signals() as sig:
        end = time.monotonic() + 4
        while time.monotonic() < end:
            if random.random() < 0.33:
                with lock:
                    try:
                        _timeout_body(tl, lock)
                    except KeyboardInterrupt:
                        pass
                    if "count=1 " not in repr(lock) + " ":
                        bad.append(repr(lock))
            else:
                try:
                    _timeout_body(tl, lock)
                except KeyboardInterrupt:
                    pass
            iters += 1
            if lock._is_owned():
                bad.append(repr(lock))
                while lock._is_owned():
                    lock.release()
    done.append(1)
    h.join(10)
    assert not h.is_alive(), "the holder thread is blocked: the RLock was left held"
    assert not bad, bad[:5]
    assert sig.hits > 200 and iters > 1000, (sig.hits, iters)
