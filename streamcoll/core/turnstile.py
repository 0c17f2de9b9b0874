"""One C call at a time in the process, in issue order: for a library whose
calls may not overlap in two threads (oneCCL: what was measured is in
docs/design.md, section 'The turnstile and its rule').

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

Interrupts: an exception raised at any bytecode where CPython
delivers one (a signal handler's KeyboardInterrupt: after a call returns, at
a function's entry, at a loop's back edge) must leave no ticket without a
call and no turn held. So a ticket is taken with no call (:meth:`take`),
inside the ``try`` whose ``finally`` passes the turn or cancels it; the turn is passed
by a store in the holder's own frame (a call into :meth:`leave` can be
interrupted at its entry); and a waiter re-reads the turn every
:data:`POLL_S` seconds, so a wake-up lost to an interrupt delays it, never
blocks it. Left to the standard library: ``threading.Condition.wait``
itself (an interrupt in its re-acquisition), ``contextlib``'s own frames
around :meth:`hold` (a generator left at its ``yield`` is closed when
collected, which passes the turn).
"""
from __future__ import annotations

import contextlib
import threading
import time
from typing import Any, Callable, Dict, Iterator, Optional, Set

__all__ = ["Turnstile", "POLL_S"]

POLL_S = 0.1  # a waiter re-reads the turn this often (a wake-up lost to an interrupt)


class Turnstile:
    """Tickets in issue order; one holder of the turn at a time."""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # taken with ``with``: a C-level enter/exit (Condition's are Python)
        self._cond = threading.Condition(self._lock)
        self.issued = 0  # the next ticket: taken with ``t = ts.issued; ts.issued = t + 1`` (see take)
        self.turn = 0  # the ticket whose call may run now
        self.waiting = 0  # threads waiting in wait() (read by the holder that passes the turn)
        self.skipped: Set[int] = set()  # cancelled tickets not reached yet
        self._owner: Optional[int] = None  # the thread inside hold(): nested holds are the same turn
        # CPU runtimes that queue work without waking their comm thread (small
        # async calls, CpuRuntime.submit(quiet=True); registered before the
        # ticket of their first such call, until closed): wait() wakes them
        self.sleepers: Dict[int, Any] = {}
        # Who waits, who holds, kept on the slow paths only: ticket -> what waits
        # for its turn (a flight entry or a life-cycle call's text); the life-cycle call holding the turn.
        self.waiters: Dict[int, Any] = {}
        self.holder: Optional[str] = None
        # set by streamcoll.diagnostics.watchdog: text naming the call that holds the turn now (a scan of the
        # communicators; the hot path records nothing)
        self.describe_holder: Callable[["Turnstile"], str] = lambda ts: self.holder or "an earlier call"

    def wait(self, t: int, timeout: Optional[float] = None, what: Any = None) -> bool:
        """Block until ticket ``t``'s turn; False after ``timeout`` seconds
        (the ticket is then cancelled). An exception while waiting (e.g.
        KeyboardInterrupt) cancels the ticket too. ``what``: the waiting
        call (a flight entry, whose ``behind`` names the holder while it
        waits, or a text), for the reports (:attr:`waiters`)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        if self.sleepers:
            self.wake_sleepers()
        try:
            if what is not None:
                self.waiters[t] = what
                if hasattr(what, "behind"):
                    try:
                        what.behind = self.describe_holder(self)
                    except Exception:  # a report must not break the call
                        what.behind = "an earlier call"
            with self._lock:
                self.waiting += 1
                try:
                    self._settle()
                    while self.turn != t:
                        left = None if deadline is None else deadline - time.monotonic()
                        if left is not None and left <= 0:
                            self._cancel(t)
                            return False
                        self._cond.wait(POLL_S if left is None or left > POLL_S else left)
                        self._settle()
                finally:
                    self.waiting -= 1
        except BaseException:
            if self.turn != t:
                self.cancel(t)
            raise
        finally:
            if what is not None:
                self.waiters.pop(t, None)
                if hasattr(what, "behind"):
                    what.behind = None
        return True

    def wake_sleepers(self) -> None:
        """Wake the comm threads of quietly queued work: a ticket before the
        waiter's may be theirs. Not under the condition (a runtime's lock
        is taken before it elsewhere)."""
        for rt in list(self.sleepers.values()):
            rt.nudge()

    def ticket(self) -> int:
        """Take the next ticket (tests, tools; the library's own takers
        inline it, see :meth:`take`)."""
        t = self.issued; self.issued = t + 1  # noqa: E702
        return t

    @staticmethod
    def take() -> None:
        """How a ticket is taken: ``t = ts.issued; ts.issued = t + 1``, one
        line, no call. Between the read and the write there is no point
        where CPython delivers an interrupt or switches threads (its eval
        breaker is checked at calls, function entries and loop back edges
        only; int arithmetic runs no Python code): an atomic take under the
        GIL that leaves the ticket in a local the ``finally`` reads (a C
        call's result, ``t = counter()``, can be dropped by an interrupt
        between the call and the store). 47 ns, against 58 for a C counter
        call and 240 for the list-and-islice form that is atomic without
        that argument."""
        raise TypeError("documentation only")

    def leave(self, t: int) -> None:
        """End ticket ``t``'s turn (its holder only). The generated launchers
        do this inline: set :attr:`turn`, then :meth:`wake` if anyone waits
        or a ticket is to be skipped."""
        self.turn = t + 1
        if self.waiting or self.skipped:
            self.wake()

    def wake(self) -> None:
        """After the turn moved: skip cancelled tickets, wake the waiters."""
        with self._lock:
            self._settle()
            self._cond.notify_all()

    def cancel(self, t: int) -> None:
        """Ticket ``t``'s call will not run: its turn is skipped."""
        with self._lock:
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
    def hold(self, timeout: Optional[float] = None, what: Optional[str] = None) -> Iterator[bool]:
        """A ticket now and its turn for the ``with`` body (a life-cycle call
        made on the calling thread: init, split, destroy). Yields False if
        the turn did not come within ``timeout`` (the body must then not
        call the library). Re-entrant on one thread. ``what``: the call, as
        the reports name it while it waits (:attr:`waiters`) or holds
        (:attr:`holder`)."""
        me = threading.get_ident()
        if self._owner == me:
            yield True
            return
        t = -1
        try:
            t = self.issued; self.issued = t + 1  # noqa: E702 - one line, no call: see take()
            if self.turn != t and not self.wait(t, timeout, what):
                yield False  # cancelled by the wait
                return
            self._owner = me
            self.holder = what
            yield True
        finally:
            if t >= 0:
                if self.turn == t:  # held: pass it here, not through a call that an interrupt could stop at entry
                    if self._owner == me:
                        self._owner = None
                        self.holder = None
                    self.turn = t + 1
                    if self.waiting or self.skipped:
                        self.wake()
                else:  # its turn never came (interrupted before): skip it
                    self.cancel(t)
