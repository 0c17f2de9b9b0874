"""The watchdog: no collective hangs silently.

A synchronous CPU collective runs inline in the C call on the caller's
thread: it cannot be interrupted from Python, and oneCCL 2022.2 has no
abort. So, like ProcessGroupNCCL's default error handling
(``TORCH_NCCL_ASYNC_ERROR_HANDLING``), one watchdog thread per process ends
the process with a clear message when an operation outlives its
communicator's timeout:

- it looks at each live communicator's flight recorder
  (:mod:`streamcoll.core.recorder`) every ``min(0.5 s, timeout / 10)``; a
  synchronous call is given ``timeout``, async work ``timeout + grace``;
- a call given its own ``timeout=`` carries it in its flight entry
  (``FlightEntry.limit``) and gets that limit instead; the pass interval
  shrinks to ``min(0.5 s, limit / 10)`` while such a call is unfinished
  (``Communicator._deadlines``, pruned here), and a new one wakes the thread
  at once (:func:`deadline_issued`). A synchronous CPU call given one is
  waited on by its caller, who raises first; the watchdog is its backstop;
- on a hang it first asks every rank of the communicator where it stands
  (:mod:`streamcoll.diagnostics.hang_report`: up to ``STREAMCOLL_HANG_REPORT_S``,
  2 s, all of it where a rank is dead) and says it in the message; at the end
  of each pass it wakes the hang report's thread, which answers the other
  ranks' questions (no store request on this thread);
- then it hands the communicator to :mod:`streamcoll.diagnostics.failure`
  (mark failed, dump, report, abort, and by default end the process);
- each pass also starts the small CPU async calls queued quietly
  (:mod:`streamcoll.core.work`) that nothing has touched since.

Init is watched the same way through :func:`guard`; non-blocking NCCL
communicators (``STREAMCOLL_NCCL_NONBLOCKING=1``) are polled by
:func:`streamcoll.core.backends.nccl_wait_ready` instead. The communicator
never imports this module: importing it fills the slots of
:mod:`streamcoll.core.hooks` (:func:`register`, :func:`handle_timeout`,
:func:`skip_native_teardown`), and the package's ``__init__`` imports it.
Why a watchdog, what counts as a hang, and the timings: docs/design.md,
section 'The watchdog'.
"""
from __future__ import annotations

import contextlib
import itertools
import logging
import os
import threading
import weakref
from typing import Any, Dict, Iterator, List, Optional, Tuple

from ..core import helper_threads, hooks as _hooks, recorder
from . import hang_answer, hang_report
from .failure import (EXIT_CODE, after_failure, dump_quietly, exit_now, what_to_do, handle_timeout, mode,
                      skip_native_teardown, who_and_where)
from ..core.backends import BACKENDS
from ..core.checks import WAITING
from .._ffi.errors import CollectiveTimeout

__all__ = ["EXIT_CODE", "register", "deadline_issued", "handle_timeout", "skip_native_teardown", "guard", "mode",
           "Watchdog", "WATCHDOG", "running_calls"]

log = logging.getLogger("streamcoll.diagnostics.watchdog")

GRACE_S = 1.0  # async work only: a Work.wait timing out at the same moment raises first
INTERVAL_S = 0.5  # longest pass interval: a hang is reported within timeout + 2 intervals
SCAN = 256  # newest entries of each communicator looked at per pass


def _shapes(comm: Any, e: Any) -> list:
    shapes = comm.flight.describe(comm, e)["shapes"]
    return [tuple(s) if s is not None else None for s in shapes] if shapes is not None else []


# ------------------------------------------------------------------ the thread
class Watchdog:
    """One per process; started by the first communicator."""

    def __init__(self) -> None:
        self._comms: "weakref.WeakSet[Any]" = weakref.WeakSet()
        self._guards: Dict[int, list] = {}
        self._keys = itertools.count()
        self._lock = threading.Lock()
        self._thread: Optional[threading.Thread] = None
        self._wake = threading.Event()
        self._sleeping = INTERVAL_S  # the interval of the wait in progress (deadline_issued compares)
        self.fired: List[str] = []
        self.passes = 0  # passes of the thread's loop (tests: the hang report's polls per pass)

    def add(self, comm: Any) -> None:
        if mode() == "off" and comm.is_gpu:
            return  # off: CPU communicators only, for the start of quietly queued calls (check)
        with self._lock:
            self._comms.add(comm)
            self._start()

    def _start(self) -> None:
        if self._thread is None or not self._thread.is_alive():
            self._thread = helper_threads.Thread(target=self._loop, name="streamcoll-watchdog", daemon=True)
            self._thread.start()

    def _interval(self, comms: List[Any]) -> float:
        ts = [c.timeout for c in comms] + [g[2] for g in list(self._guards.values()) if not g[4]]
        # the own timeouts of calls still unfinished (pruned by check once they finished)
        ts += [t for c in comms if c.failure is None for t in list(c._deadlines.values())]
        return min([INTERVAL_S] + [max(0.05, t / 10) for t in ts])

    def deadline_issued(self, comm: Any, limit: float) -> None:
        """A call was issued with its own timeout of ``limit`` seconds: wake
        the thread now if that needs a shorter interval than the one it
        sleeps (its next interval counts the limit)."""
        if max(0.05, limit / 10) < self._sleeping and self._thread is not None:
            self._wake.set()

    def _loop(self) -> None:
        while True:
            with self._lock:
                comms = [c for c in self._comms if not c.destroyed]
            try:
                if mode() == "off":  # CPU communicators only: start their quietly queued calls, nothing else
                    for c in comms:
                        if c.failure is None:
                            c._rt.nudge()
                            # the finished calls given a timeout: else the interval kept their
                            # limit / 10 (50 ms after one timeout=0.5 call) for good
                            _prune_deadlines(c, c.flight)
                else:
                    self.check(comms)
                    # the hang report's thread checks for another rank's alarm: no store request here
                    hang_report.after_pass(comms)
            except Exception as e:  # never let the watchdog die silently
                log.error("streamcoll watchdog: internal error: %r", e)
            self.passes += 1
            self._sleeping = self._interval(comms)
            self._wake.wait(self._sleeping)
            self._wake.clear()

    def check(self, comms: List[Any]) -> None:
        now = recorder.now_ns()
        for g in list(self._guards.values()):
            what, start, timeout, detail, fired = g
            if not fired and (now - start) / 1e9 > timeout + GRACE_S:
                g[4] = True  # reported once; the guarded call may stay stuck (fail mode): not again
                self._fire_guard(what, timeout, detail, (now - start) / 1e9)
        for comm in comms:
            if comm.destroyed or comm.failure is not None:
                continue
            # small CPU async calls queued without waking the comm thread start
            # within a pass even if nothing in the process touches them (streamcoll.core.work)
            comm._rt.nudge()
            fr = comm.flight
            limit = comm.timeout + GRACE_S
            hung = None
            if comm.is_gpu and comm.device.type == "cuda":
                _use_device(comm.device.index)
                err = _nccl_async_error(comm)
                if err is not None:
                    self._fire_error(comm, err)
                    continue
            # A synchronous call in flight: a sync entry after the last that returned. An inline
            # call holds the exec lock, so nothing is issued after it: it is the newest entry, and
            # the scan goes newest first (after many async ops the oldest unfinished ones are
            # async). Its start is not recorded (hot path); its age counts from when it was first seen.
            last = comm.seq
            running = _running_sync(comm, last)
            if running is None:
                fr.running_since = None
            else:
                rs = fr.running_since
                if rs is None or rs[0] != running.seq:
                    fr.running_since = (running.seq, now)
                else:
                    own = running.own_limit(rs[0])  # a call given its own timeout= (GPU host call, say)
                    if (now - rs[1]) / 1e9 > (comm.timeout if own is None else own):  # no Work: no grace
                        hung = (running, (now - rs[1]) / 1e9)
            if hung is None:
                hung = overdue(comm, fr, watched(comm, fr, last), now, limit)
            if hung is not None:
                self._fire(comm, *hung)
            elif comm.failure is None:
                fr.resolve(comm, last)
                _prune_deadlines(comm, fr)

    # -- on a hang ---------------------------------------------------------
    def _fire(self, comm: Any, e: Any, age: float) -> None:
        op, seq = e.op, e.seq
        queued = not e.sync and e.state == recorder.ENQUEUED  # before mark_failed, which says failed
        behind = _running_note(comm) if queued else ""
        own = e.own_limit(seq)
        t = comm.timeout if own is None else own
        whose = "" if own is None else f", the call's own timeout=; the communicator's is {comm.timeout:g} s"
        shapes = _shapes(comm, e)
        m = mode()
        exc = CollectiveTimeout(op, seq, t, shapes, comm._rank, comm._size,
                                f"detected by the watchdog after {age:.1f} s"
                                + ("" if own is None else f" (its own timeout=; the communicator's is "
                                                         f"{comm.timeout:g} s)"))
        comm.mark_failed(exc)
        report = who_and_where(comm, op, seq)  # every rank asked through the store (bounded), then the dump
        path = dump_quietly(comm, f"watchdog: {op} #{seq} running for {age:.1f} s")
        cause = report.cause() if report is not None else None
        lines = [
            "",
            f"streamcoll watchdog: {op} (sequence number {seq}) on communicator {comm.name!r} "
            f"({comm._backend.name}, {comm._device}) has not completed after {age:.1f} s "
            f"(timeout {t:g} s{whose}) on rank {comm._rank} of {comm._size}; tensor shapes {shapes}; "
            f"strategy {'sync (inline)' if e.sync else 'async'}.",
            (f"  It has not entered {comm._backend.name}: {_waiting_note(e)}; look at that call first "
             "(the one stuck there)." if getattr(e, "behind", None) else
             f"  It has not started: it is queued on the communicator's comm thread behind "
             f"{behind}; look at that call first." if queued else
             f"  Likely cause: {cause}." if cause else
             "  Likely cause: another rank died, hung, or called a different collective (or the same one with "
             "other shapes) at this point."),
        ] + ([report.text("  ")] if report is not None else []) + [
            f"  Flight record: {path}",
            f"  Collect every rank's dump and run: python -m streamcoll.flight analyze "
            f"{os.path.dirname(path) if os.path.isabs(path) else recorder.default_dir()}",
            f"  What to do: {what_to_do(comm)}.",
        ]
        if m == "exit":
            lines.append(f"  Ending this process now with exit code {EXIT_CODE} "
                         f"(STREAMCOLL_WATCHDOG=fail keeps it running; the timeout is set per communicator "
                         f"with streamcoll.init(timeout=...) or STREAMCOLL_TIMEOUT).")
        else:
            lines.append("  The communicator is marked failed: its later calls raise at once "
                         "(STREAMCOLL_WATCHDOG=fail).")
        self._end(comm, "\n".join(lines), m)

    def _announce(self, msg: str) -> None:
        self.fired.append(msg)
        _report(msg)

    def _end(self, comm: Any, msg: str, m: str) -> None:
        """Say what happened, abort an NCCL communicator, then end the process
        (``exit``) or make its exit safe (``fail``)."""
        self._announce(msg)
        after_failure(comm)
        if m == "exit":
            exit_now()

    def _fire_error(self, comm: Any, err: BaseException) -> None:
        """An NCCL communicator reported an asynchronous error (a kernel failed
        or a peer died): the same handling as a hang, naming the error."""
        m = mode()
        comm.mark_failed(err)
        path = dump_quietly(comm, f"watchdog: asynchronous error {err}")
        msg = (f"\nstreamcoll watchdog: communicator {comm.name!r} ({comm.device}) on rank {comm.rank} of "
               f"{comm.size} reported an asynchronous error: {err}\n  Flight record: {path}\n"
               f"  What to do: {what_to_do(comm)}.")
        if m == "exit":
            msg += f"\n  Ending this process now with exit code {EXIT_CODE}."
        self._end(comm, msg, m)

    def _fire_guard(self, what: str, timeout: float, detail: Any, age: float) -> None:
        if callable(detail):  # computed now, when the facts are in (which ranks finished)
            try:
                detail = detail()
            except Exception as e:
                detail = f"(no detail: {type(e).__name__}: {e})"
        behind = _init_waits_behind(what)
        rule = ("two communicators created at once from two threads, the ranks ordering them "
                "differently (each init holds the process's turn for its whole rendezvous): create "
                "communicators like collectives, in one order on every rank (from one thread, or "
                "ordered by a lock and the same order everywhere)")
        queued = _waiting_behind_init(what)
        if behind:  # not inside the library's rendezvous: the peers are not the question
            detail = f"it has not entered the library: it waits for its turn behind {behind}"
            cause = rule
        elif queued:
            cause = (f"{'; '.join(queued)} of this process wait(s) for the turn behind it: {rule}; "
                     "or another rank did not start, died, or uses a different address/port")
        else:
            cause = "another rank did not start, died, or uses a different address/port"
        msg = (f"\nstreamcoll watchdog: {what} has not completed after {age:.1f} s (timeout {timeout:g} s)"
               + (f"; {detail}" if detail else "")
               + f".\n  Likely cause: {cause}."
               + (f"\n  Ending this process now with exit code {EXIT_CODE}." if mode() == "exit" else ""))
        self._announce(msg)
        if mode() == "exit":
            exit_now()

    # -- guards for calls outside a communicator (init) ---------------------
    # (_init_waits_behind: module level, below)
    @contextlib.contextmanager
    def guard(self, what: str, timeout: float, detail: Any = "") -> Iterator[None]:
        """Watch a blocking native call that is not a collective (init).
        ``detail``: text, or a callable giving it when the guard fires."""
        if mode() == "off":
            yield
            return
        key = next(self._keys)
        with self._lock:
            self._guards[key] = [what, recorder.now_ns(), timeout, detail, False]  # ..., fired
            self._start()
        self._wake.set()  # recompute the interval for this timeout
        try:
            yield
        finally:
            self._guards.pop(key, None)


def _use_device(index: Optional[int]) -> None:
    """The watchdog thread's CUDA calls go to the communicator's GPU (a
    thread that never set a device makes a context on GPU 0: ~0.5 GiB each),
    in thread-local capture mode (its event queries must not invalidate a
    user's global-mode graph capture): :func:`streamcoll.core.helper_threads.prepare`."""
    if index is None:
        return
    helper_threads.prepare(index)


def _nccl_async_error(comm: Any) -> Optional[BaseException]:
    """``ncclCommGetAsyncError`` of a live NCCL communicator: the error a
    synchronous GPU collective hit after its host call returned (those are
    otherwise invisible here: their flight entries completed at launch)."""
    b = comm._backend
    if b.name != "nccl" or comm.destroyed or comm.failure is not None or comm._handle is None:
        return None
    ffi, lib = b.ffi, b.lib()
    state = ffi.new("ncclResult_t *")
    # Under the communicator's exec lock, which abort() and destroy() take
    # before freeing the handle; a launch holding it now (or
    # a host call stuck in NCCL) only skips this pass.
    lock = comm._rt.exec_lock
    if not lock.acquire(blocking=False):
        return None
    try:
        h = comm._handle
        if h is None or comm.failure is not None:
            return None
        rc = lib.ncclCommGetAsyncError(h, state)
    finally:
        lock.release()
    if rc:
        return b.binding.error("ncclCommGetAsyncError", rc, h)
    s = int(state[0])
    if s == 0 or s == b.binding.const("ncclInProgress"):
        return None
    return b.binding.error("asynchronous error (ncclCommGetAsyncError)", s, h)


def watched(comm: Any, fr: Any, last: int) -> List[Any]:
    """The entries whose completion the watchdog checks: the async call
    running on the CPU comm thread and the calls given their own timeout
    queued behind it (``Communicator._deadlines``); on a GPU, the async entries among the
    newest :data:`SCAN` and the synchronous ones that returned with a
    completion event (:mod:`streamcoll.core.sync_events`): their kernels may still
    run, or never finish."""
    inflight = fr.inflight
    cands = [inflight] if inflight is not None else []
    if not comm.is_gpu and comm._deadlines:
        # calls given their own timeout, queued behind the running one: theirs
        # may pass first (on a GPU the async entries below are all looked at)
        for sq in list(comm._deadlines):
            e = fr.at(sq)
            if e is not None and e is not inflight and not e.sync:
                cands.append(e)
    if comm.is_gpu:
        done = fr.done
        for e in fr.recent(last, SCAN):
            if not e.sync:
                cands.append(e)
            else:
                ev = e.event
                if ev is not None and e.seq <= done and getattr(ev, "seen", 0) != e.seq:
                    cands.append(e)  # returned, with an event not yet seen complete
    return cands


def overdue(comm: Any, fr: Any, cands: List[Any], now: int, limit: float) -> Optional[Tuple[Any, float]]:
    """(entry, age in s) of the first of ``cands`` still unfinished after
    ``limit`` seconds (an entry of a call given its own timeout: that plus
    :data:`GRACE_S`, counted from its issue also while it is queued), or
    None. Async entries found completed let go of their events (not
    queried again)."""
    for e in cands:
        seq = e.seq  # before the state: the launch thread may reuse a sync entry's slot meanwhile
        st = fr.state(comm, e)
        if st == recorder.RUNNING:
            if e.sync:
                continue  # inside its host call again (the slot was reused): _running_sync's business
            age = (now - (e.t_start or e.t_enq)) / 1e9
        elif st == recorder.LAUNCHED and e.event is not None:
            age = (now - e.t_enq) / 1e9
        elif st == recorder.ENQUEUED and e.own_limit(seq) is not None:
            age = (now - e.t_enq) / 1e9  # queued behind a call that runs (CPU): its timeout counts from its issue
        else:
            if st == recorder.COMPLETED:
                if not e.sync and e.state == recorder.LAUNCHED:
                    e.state = recorder.COMPLETED  # no need to query it again
                    e.event = None
                elif e.sync and e.event is not None:
                    e.event.seen = seq  # a reused slot has a new number: this marks only the old one
            continue
        own = e.own_limit(seq)
        if age > (limit if own is None else own + GRACE_S):
            return e, age
    return None


def _running_note(comm: Any) -> str:
    """The call running on ``comm``'s CPU comm thread, as a report names it."""
    e = comm.flight.inflight
    if e is None:
        return "earlier work"
    return f"#{e.seq} {e.op} (running for {(recorder.now_ns() - (e.t_start or e.t_enq)) / 1e9:.1f} s)"


def _prune_deadlines(comm: Any, fr: Any) -> None:
    """Forget the own timeouts (``Communicator._deadlines``) of calls that
    finished, or that nothing watches (the ring no longer holds them; a
    synchronous GPU call that got no completion event, ``STREAMCOLL_SYNC_EVENTS``),
    so the pass interval grows back."""
    d = comm._deadlines
    if not d:
        return
    for sq in list(d):
        e = fr.at(sq)
        if (e is None or (e.sync and comm.is_gpu and e.event is None and sq <= fr.done)
                or fr.state(comm, e) in (recorder.COMPLETED, recorder.FAILED)):
            d.pop(sq, None)


def _running_sync(comm: Any, last: int) -> Any:
    """The flight entry of the synchronous call in flight on ``comm``, or
    None: a sync entry after the last that returned. An inline call holds
    the exec lock, so nothing is issued after it: it is the newest entry, and
    the scan goes newest first (after many async ops the oldest unfinished
    ones are async)."""
    fr = comm.flight
    for sq in range(last, max(fr.done, last - SCAN), -1):
        e = fr.at(sq)
        if e is not None and e.sync and sq not in fr.errors:
            return e
    return None


def turn_holder(ts: Any) -> str:
    """The call holding ``ts``'s turn now, as a
    report names it: a life-cycle call's text, the comm thread's item whose
    ticket is the turn, or the synchronous call in flight that is not
    itself waiting (only one call is inside the library at a time). Read
    without locks, for a report."""
    if ts.holder:
        return ts.holder
    waiting = {id(w) for w in list(ts.waiters.values())}
    with WATCHDOG._lock:
        comms = [c for c in WATCHDOG._comms if not c.destroyed and c._backend.turnstile is ts]
    for comm in comms:
        run = getattr(comm._rt, "running", None)
        if run is not None and run.ticket == ts.turn and run.entry is not None:
            return f"communicator {comm.name!r} #{run.entry.seq} {run.entry.op} (async, its comm thread)"
    for comm in comms:
        e = _running_sync(comm, comm.seq)
        if e is not None and id(e) not in waiting:
            return f"communicator {comm.name!r} #{e.seq} {e.op} (synchronous)"
    return "an earlier call of this process"


def _waiting_note(e: Any) -> str:
    """For a report on call ``e``: that it waits for its turn, behind whom ("" if it does not)."""
    behind = getattr(e, "behind", None)
    return (f"waiting for its turn behind {behind}, not inside the library (one call at a time in "
            f"the process, in issue order)") if behind else ""


def running_calls() -> List[str]:
    """One line per native call in flight in this process now (synchronous
    calls, and async work on a CPU comm thread), for messages such as the
    one on a Ctrl-C during a stuck call."""
    waits = list(WAITING.values())
    checking = {(c, sq) for c, sq, _ in waits}
    out = []
    now = recorder.now_ns()
    with WATCHDOG._lock:
        comms = [c for c in WATCHDOG._comms if not c.destroyed]
    for comm in comms:
        fr = comm.flight
        e = _running_sync(comm, comm.seq)
        if e is not None:
            rs = fr.running_since
            age = f", running for {(now - rs[1]) / 1e9:.1f} s" if rs is not None and rs[0] == e.seq else ""
            w = _waiting_note(e)
            out.append(f"{e.op} (sequence number {e.seq}, synchronous) on communicator {comm.name!r} "
                       f"(rank {comm.rank} of {comm.size}, {comm.backend}{age})" + (f": {w}" if w else ""))
        run = getattr(comm._rt, "running", None)
        if run is not None and run.entry is not None and getattr(run.entry, "behind", None):
            out.append(f"{run.entry.op} (sequence number {run.entry.seq}, async, comm thread) on communicator "
                       f"{comm.name!r} (rank {comm.rank} of {comm.size}, {comm.backend}): "
                       f"{_waiting_note(run.entry)}")
        inf = fr.inflight
        if inf is not None and (comm, inf.seq) not in checking:  # a deferred check's call is not in the library yet
            out.append(f"{inf.op} (sequence number {inf.seq}, async, comm thread) on communicator "
                       f"{comm.name!r} (rank {comm.rank} of {comm.size}, {comm.backend}, running for "
                       f"{(now - (inf.t_start or inf.t_enq)) / 1e9:.1f} s)")
    out.extend(line for c, _, line in waits if not c.destroyed)
    for b in list(BACKENDS.values()):
        ts = b.turnstile
        if ts is not None:
            for w in list(ts.waiters.values()):
                if isinstance(w, str):  # a life-cycle call (init, split, destroy)
                    out.append(f"{w}: waiting for its turn behind {turn_holder(ts)}, not inside the library")
    return out


def _report(msg: str) -> None:
    """A watchdog report: the ``streamcoll.diagnostics.watchdog`` logger at error level
    (on stderr where the program configured no logging)."""
    try:
        log.error("%s", msg)
    except Exception:
        pass


WATCHDOG = Watchdog()


def deadline_issued(comm: Any, limit: float) -> None:
    """A call was issued with its own timeout (``streamcoll.core.hooks.on_deadline``)."""
    WATCHDOG.deadline_issued(comm, limit)


def register(comm: Any) -> None:
    """Watch ``comm`` (called by ``Communicator.__init__``)."""
    ts = comm._backend.turnstile
    if ts is not None:
        ts.describe_holder = turn_holder
    WATCHDOG.add(comm)
    WATCHDOG._wake.set()  # a shorter timeout shortens the polling interval at once


def _init_waits_behind(what: str) -> str:
    """The holder of the turn that the guarded call ``what`` waits for, or ""."""
    for b in list(BACKENDS.values()):
        ts = b.turnstile
        if ts is not None and what in list(ts.waiters.values()):
            return turn_holder(ts)
    return ""


def _waiting_behind_init(what: str) -> List[str]:
    """The life-cycle calls waiting for the turn that the guarded call ``what`` holds."""
    out: List[str] = []
    for b in list(BACKENDS.values()):
        ts = b.turnstile
        if ts is not None and ts.holder == what:
            out += [w for w in list(ts.waiters.values()) if isinstance(w, str)]
    return out


def guard(what: str, timeout: float, detail: Any = ""):
    return WATCHDOG.guard(what, timeout, detail)


# ------------------------------------------------------- attached to the core
# (streamcoll.core.hooks: the communicator never imports this module)
hang_answer.attach(_running_sync, running_calls)  # what the hang report's answers say of the calls in flight
_hooks.on_create.append(register)
_hooks.on_deadline.append(deadline_issued)
_hooks.on_timeout = handle_timeout
_hooks.teardown_guard = skip_native_teardown
