"""Where the futures of Works complete, and so where their callbacks run.

Setting a torch Future's result runs its ``then()``/``add_done_callback``
callbacks on the calling thread. A Work completes on a thread that must keep
making progress for *other* Works: the CPU comm thread (it runs every queued
call of its communicator) or a GPU poller. Run a callback there and a
callback that issues a collective and waits on it (PyTorch's PowerSGD DDP
hook does exactly that) waits on the very thread that should run the
collective: a deadlock. torch completes futures on the completing thread only
where that cannot happen (ProcessGroupNCCL marks its CUDA futures complete
at launch, so callbacks run on the caller's thread, stream-ordered; gloo
completes on one of its worker threads).

The callback thread: one per process, :data:`CALLBACKS`. Works hand it the
completion of their futures (:func:`complete`), which it runs one at a time,
**in the order the Works completed**: callbacks that issue collectives then
issue them in the same order on every rank (they run one after the other,
never racing each other), which a pool of threads would not guarantee.

A single thread alone would deadlock as soon as a callback waits on a future
that this same thread has to complete (PowerSGD's callback waits on the
all_reduce it just issued). So waiting hands the role over: a
:class:`Future` (what ``Work.get_future()`` returns, a
``torch.futures.Future``) that is waited on from the callback thread first
makes another thread the callback thread (an idle one, else a new one),
which carries on with the completions in order, including the one the
waiter needs; the waiting thread finishes its callback and becomes idle.
Futures derived with ``then()`` are :class:`Future` too, so waiting on a
chain hands over as well. Not covered: blocking on a completion of
streamcoll's through a path that does not call ``Future.wait`` in Python
(``torch.futures.wait_all``, a C++ caller's wait) from inside a callback.

Idle threads exit after :data:`IDLE_S` seconds; at most one thread runs
completions at any time, the others are callbacks still blocked in a wait.
"""
from __future__ import annotations

import collections
import logging
import threading
from typing import Any, Callable, Deque, Optional

import torch

from . import helper_threads

__all__ = ["Future", "CallbackThread", "CALLBACKS", "complete", "IDLE_S"]

log = logging.getLogger("streamcoll")

IDLE_S = 10.0  # an idle callback thread exits after this many seconds


class CallbackThread:
    """Runs completions in order on one thread at a time (see the module doc)."""

    def __init__(self, idle_s: float = IDLE_S, name: str = "streamcoll-callbacks") -> None:
        self._lock = threading.Lock()  # taken with ``with``: C-level enter/exit (an interrupt cannot leak it)
        self._cond = threading.Condition(self._lock)
        self._queue: Deque[Callable[[], Any]] = collections.deque()
        self._owner: Optional[int] = None  # ident of the thread running completions now
        self._idle = 0                     # threads waiting for the role
        self._threads = 0
        self._idle_s = idle_s
        self._name = name
        self._local = threading.local()

    @property
    def threads(self) -> int:
        """How many callback threads exist now (running, idle or blocked in a callback)."""
        return self._threads

    def submit(self, fn: Callable[[], Any]) -> None:
        """Run ``fn`` on the callback thread after every completion submitted before it."""
        with self._lock:
            self._queue.append(fn)
            self._wake()

    def _wake(self) -> None:
        """Called with the lock held: make sure some thread will take the role."""
        if self._owner is not None:
            return  # the running thread takes the next completion when it is done
        if self._idle:
            self._cond.notify()
            return
        self._threads += 1
        helper_threads.Thread(target=self._loop, name=self._name, daemon=True).start()  # prepare() acts there

    def caught_up(self) -> bool:
        """Whether a future completed now on the calling thread overtakes no
        completion submitted before this call: none is queued, and none runs
        on another thread (a callback blocked in a wait after its hand-over
        counts as handed out; on the callback thread itself, the completion
        it runs is the caller's own, begun earlier).

        Read without the lock (with it the check cost 200 ns, without it
        about 50, inline 25: it is on ``get_future()``'s path), the queue
        first, then the owner: a completion is popped and its owner
        set in one critical section, so a completion queued before the first
        read is either seen queued or, popped by then, seen running by the
        second (or finished). The other order could see the owner before a
        take-over and the queue after it, and answer True while one runs."""
        if self._queue:
            return False
        owner = self._owner
        return owner is None or owner == threading.get_ident()

    def on_callback_thread(self) -> bool:
        """Whether the calling thread is the one running completions now."""
        return self._owner == threading.get_ident()

    def hand_over(self) -> None:
        """Called on the callback thread before it blocks: another thread
        continues with the completions (the one this thread waits for among
        them); this thread finishes its callback afterwards."""
        with self._lock:
            if self._owner != threading.get_ident():
                return
            self._owner = None
            if self._queue:
                self._wake()

    def _loop(self) -> None:
        me = threading.get_ident()
        cond = self._cond
        while True:
            with cond:
                while self._owner is not None or not self._queue:
                    self._idle += 1
                    woke = cond.wait(self._idle_s)
                    self._idle -= 1
                    if not woke and (self._owner is not None or not self._queue):
                        self._threads -= 1
                        return
                self._owner = me
                fn = self._queue.popleft()
            try:
                fn()
            except BaseException:  # noqa: BLE001 - a completion must not end the thread
                log.exception("streamcoll: a future completion raised on the callback thread")
            fn = None  # type: ignore[assignment]  # not kept (the Work, its tensors, its communicator) while this thread idles
            with cond:
                if self._owner == me:
                    self._owner = None  # and loops: completions queued meanwhile are taken next, here


CALLBACKS = CallbackThread()


def complete(fn: Callable[[], Any]) -> None:
    """Run ``fn`` (setting a future's result, so its callbacks) on the callback thread."""
    CALLBACKS.submit(fn)


class Future(torch.futures.Future):
    """A ``torch.futures.Future`` whose ``wait()`` from the callback thread
    first hands the callback role to another thread (see the module doc),
    and whose ``then()`` returns one of its own kind."""

    def wait(self) -> Any:
        if not self.done() and CALLBACKS.on_callback_thread():
            CALLBACKS.hand_over()
        return super().wait()

    def then(self, callback: Callable[[torch.futures.Future], Any]) -> "Future":  # type: ignore[override]
        derived = super().then(callback)
        out = Future()

        def forward(f: torch.futures.Future) -> None:
            try:
                out.set_result(f.value())
            except BaseException as e:  # noqa: BLE001 - the callback's error goes to the waiter
                out.set_exception(e)

        derived.add_done_callback(forward)
        return out
