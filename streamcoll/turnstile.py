"""One C call at a time in the process, in issue order: for a library whose
calls may not overlap in two threads (oneCCL: :attr:`Backend.turnstile
<streamcoll.backends.Backend.turnstile>` says what was measured).

Why issue order and not a lock: every rank of a job issues its calls in
program order, and ranks only agree on an order the program gives. With a
plain lock, rank 0's comm thread could take it for ``A.all_reduce(x,
async_op=True)`` while rank 1's caller took it first for the
``B.all_reduce(y)`` issued after it: each would then wait inside the library
for the other's call (measured: a deadlock within 300 iterations). Here each
call takes a ticket when it is issued (under its communicator's exec lock,
in the critical section that takes its sequence number or queues it) and
runs when its ticket's turn comes: a synchronous call goes behind the async
work issued before it, on any communicator, as it does behind its own.

The turn passes without a lock on the common path: the holder sets
:attr:`turn` and takes the condition only if someone waits (the waiter
counts itself under the condition before it reads the turn, and the holder
writes the turn before it reads the count, so no wake-up is lost under the
GIL). A ticket whose call will never run (its work ended by a failure, a
wait interrupted) is cancelled: the turn skips it.
"""
from __future__ import annotations

import contextlib
import itertools
import threading
import time
from typing import Any, Dict, Iterator, Optional, Set

__all__ = ["Turnstile"]


class Turnstile:
    """Tickets in issue order; one holder of the turn at a time."""

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self.ticket = itertools.count().__next__  # the next ticket (atomic under the GIL)
        self.turn = 0  # the ticket whose call may run now
        self.waiting = 0  # threads waiting in wait() (read by the holder that passes the turn)
        self.skipped: Set[int] = set()  # cancelled tickets not reached yet
        self._owner: Optional[int] = None  # the thread inside hold(): nested holds are the same turn
        # CPU runtimes that queue work without waking their comm thread (small
        # async calls, CpuRuntime.submit(quiet=True); registered before the
        # ticket of their first such call, until closed): wait() wakes them
        self.sleepers: Dict[int, Any] = {}

    def wait(self, t: int, timeout: Optional[float] = None) -> bool:
        """Block until ticket ``t``'s turn; False after ``timeout`` seconds
        (the ticket is then cancelled). An exception while waiting (e.g.
        KeyboardInterrupt) cancels the ticket too."""
        deadline = None if timeout is None else time.monotonic() + timeout
        if self.sleepers:
            self.wake_sleepers()
        with self._cond:
            self.waiting += 1
            try:
                self._settle()
                while self.turn != t:
                    left = None if deadline is None else deadline - time.monotonic()
                    if left is not None and left <= 0:
                        self._cancel(t)
                        return False
                    self._cond.wait(left)
                    self._settle()
            except BaseException:
                if self.turn != t:
                    self._cancel(t)
                raise
            finally:
                self.waiting -= 1
        return True

    def wake_sleepers(self) -> None:
        """Wake the comm threads of quietly queued work: a ticket before the
        waiter's may be theirs. Not under the condition (a runtime's lock
        is taken before it elsewhere)."""
        for rt in list(self.sleepers.values()):
            rt.nudge()

    def leave(self, t: int) -> None:
        """End ticket ``t``'s turn (its holder only). The generated launchers
        do this inline: set :attr:`turn`, then :meth:`wake` if anyone waits
        or a ticket is to be skipped."""
        self.turn = t + 1
        if self.waiting or self.skipped:
            self.wake()

    def wake(self) -> None:
        """After the turn moved: skip cancelled tickets, wake the waiters."""
        with self._cond:
            self._settle()
            self._cond.notify_all()

    def cancel(self, t: int) -> None:
        """Ticket ``t``'s call will not run: its turn is skipped."""
        with self._cond:
            self._cancel(t)

    def _cancel(self, t: int) -> None:
        if t < self.turn:
            return  # its turn already passed (it ran, or was skipped)
        self.skipped.add(t)
        self._settle()
        self._cond.notify_all()

    def _settle(self) -> None:
        while self.turn in self.skipped:
            self.skipped.discard(self.turn)
            self.turn += 1

    @contextlib.contextmanager
    def hold(self, timeout: Optional[float] = None) -> Iterator[bool]:
        """A ticket now and its turn for the ``with`` body (a life-cycle call
        made on the calling thread: init, split, destroy). Yields False if
        the turn did not come within ``timeout`` (the body must then not
        call the library). Re-entrant on one thread."""
        me = threading.get_ident()
        if self._owner == me:
            yield True
            return
        t = self.ticket()
        if self.turn != t and not self.wait(t, timeout):
            yield False
            return
        self._owner = me
        try:
            yield True
        finally:
            self._owner = None
            self.leave(t)
