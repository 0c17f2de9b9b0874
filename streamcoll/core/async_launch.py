"""The comm-stream strategy of :class:`~streamcoll.Communicator`
(``async_op=True``): the lanes (a comm stream, or the CPU comm thread, per
current stream of the caller), the queued launch with its sequence number
and flight entry, the run of a queued plan (host or device), and the
completion of a Work's future on the callback thread.

The Communicator inherits :class:`AsyncLaunch`: its methods are the
Communicator's own (``Communicator._launch_async``, ``comm_stream``), found
on the class, so having them here adds no Python frame to any call path.
What they read of the communicator is declared at the top of the class; the
Communicator's ``__init__`` sets it. Posted point-to-point ops go out
through :meth:`AsyncLaunch._launch_async` (:mod:`streamcoll.core.p2p`).
"""
from __future__ import annotations

import functools
import threading
import time
import weakref
from typing import TYPE_CHECKING, Any, Dict, Optional

import torch

from . import callbacks as _callbacks
from . import helper_threads
from . import hooks as _hooks
from . import recorder as _recorder
from .._ffi.errors import UsageError
from .launch import build_sync_launcher
from .recorder import FlightEntry
from .spec import Plan
from .streams import _TryLock
from .work import REAPER, Work

if TYPE_CHECKING:  # pragma: no cover
    from .backends import Backend
    from .recorder import FlightRecorder
    from .streams import Lane, Runtime

__all__ = ["AsyncLaunch"]

_now = time.monotonic_ns
_get_ident = threading.get_ident
_wref = weakref.ref


def _complete_on_device(index: Optional[int], work: Work) -> None:
    """Complete ``work``'s future on the callback thread, with the
    communicator's CUDA device current there (``index``; None: not CUDA),
    as on streamcoll's other helper threads: its callbacks' CUDA work then
    goes to that device, not to GPU 0 of every rank."""
    if index is not None:
        helper_threads.prepare(index)
    work._set_future()


def _fail_future(fut: torch.futures.Future, exc: BaseException) -> None:
    """Set ``exc`` on ``fut`` unless it completed meanwhile (on the callback thread)."""
    if not fut.done():
        fut.set_exception(exc)


class AsyncLaunch:
    """The comm-stream strategy and the completion of its Works (a base of
    :class:`~streamcoll.Communicator`)."""

    if TYPE_CHECKING:  # what these methods use of the Communicator (set by its __init__)
        _backend: Backend
        _rt: Runtime
        _lanes: Dict[Any, Lane]
        _flight: FlightRecorder
        _gpu: bool
        _dev_type: str
        _dev_index: Optional[int]
        _usable: bool
        _failed: Optional[BaseException]
        _seq: int
        _p2p: int
        _deadlines: Dict[int, float]
        _deadlines_cap: int
        _launch_sync_limit: Any
        record_stream: bool
        timeout: float
        name: str

        def _check_usable(self) -> None: ...
        def _raise_rc(self, cname: str, rc: int) -> None: ...
        def _timed_out(self, op: str, seq: int, timeout: float, tensors: Any, detail: str = "",
                       own: bool = False) -> Any: ...

    def comm_stream(self, current: Any = None) -> Any:
        """The comm stream serving ``current`` (a stream of this device;
        default: the caller's current stream), creating it if needed: what
        ``async_op=True`` launches on while ``current`` is the current stream."""
        rt = self._rt
        if current is None or not self._gpu:
            key = rt.current_key() if current is None else current
            stream = None
        else:
            key, stream = rt.stream_handle(current), current
        lane = self._lanes.get(key)
        if lane is None:
            lane = self._lanes[key] = rt.new_lane(key, stream)
        return lane.stream

    def _run_queued_sync(self, name: str, plan: Plan) -> None:
        """A synchronous CPU call made while async work is queued: it goes
        behind that work through the comm thread (issue order), and the
        caller waits. Takes the exec lock (the launcher has released it)."""
        rt = self._rt
        with rt.exec_lock:
            if not self._usable:
                self._check_usable()
            seq, e = self._new_async_entry(name, plan)
            item = rt.submit(None, self._execute_host, plan, e)  # type: ignore[arg-type]  # CPU: no lane
        rt._wait_item(item, None)  # type: ignore[attr-defined]  # only the CPU runtime queues
        if item.exc is not None:
            raise item.exc
        return None

    def _launch_limited(self, name: str, plan: Plan, stream: Any, limit: float) -> None:
        """A synchronous call given its own ``timeout=`` (``limit`` seconds,
        checked). On the CPU it runs on the comm thread, behind the work
        issued before it (issue order, as :meth:`_run_queued_sync`), and the
        caller waits up to ``limit`` from the issue: past it the call is
        declared stuck (:class:`~streamcoll.CollectiveTimeout` naming the
        limit; the communicator is failed, NCCL's aborted, oneCCL's left
        failed with the call inside it: ``Communicator._timed_out``). An
        inline call could not raise: a oneCCL call waiting for its peers
        cannot be interrupted, and oneCCL cannot abort. Its first-call check
        is deferred to the comm thread too (the general method), so the
        deadline bounds it as well. On a GPU the call is enqueued on the
        stream as any synchronous call, its flight entry carrying the limit,
        which the watchdog applies to its completion event."""
        t0 = time.monotonic()
        rt = self._rt
        lock = rt.exec_lock
        # The exec lock, waited for up to the deadline: another thread's
        # synchronous call holds it inline for as long as its C call runs
        # (waiting for its peers, maybe for good); a plain ``with`` waited
        # for that call before this one's deadline counted at all. The
        # launcher below takes it again (an RLock).
        with _TryLock(lock, limit) as got:  # not acquire() then try: see _TryLock
            if not got:
                raise self._not_issued(name, plan, limit)
            try:
                if self._gpu:
                    f = self.__dict__.get("_launch_sync_limit")
                    if f is None:
                        f = self._launch_sync_limit = build_sync_launcher(self, limited=True)
                    f(name, plan, stream, limit)
                else:
                    if not self._usable:
                        self._check_usable()
                    seq, e = self._new_async_entry(name, plan)
                    e.limit = (seq, limit)
                    item = rt.submit(None, self._execute_host, plan, e)  # type: ignore[arg-type]  # CPU: no lane
            finally:
                lock.release()
        if self._gpu:
            self._deadline_issued(None, limit)
            return None
        self._deadline_issued(seq, limit)
        # the deadline counts from the call: the wait for the lock and the queueing included
        if not rt._wait_item(item, limit - (time.monotonic() - t0)):  # type: ignore[attr-defined]  # CPU only
            raise self._timed_out(
                name, seq, limit, plan.outputs or plan.keep,
                f"its own timeout ({limit:g} s, given to this call; the communicator's is {self.timeout:g} s) "
                "passed: declared stuck, the communicator is failed", own=True)
        if item.exc is not None:
            raise item.exc
        return None

    def _deadline_issued(self, seq: Optional[int], limit: float) -> None:
        """A call given its own timeout was issued (``seq``: its number; None:
        recorded by the launcher): the watchdog keeps a pass interval short
        enough for it (``Communicator._deadlines``, pruned by the watchdog once
        the call finished; here too, past the flight ring, where nothing
        watches it) and is told at once (:data:`streamcoll.core.hooks.on_deadline`)."""
        d = self._deadlines
        if seq is not None:
            d[seq] = limit
        if len(d) > self._deadlines_cap:
            # Calls faster than the watchdog's passes prune them (or no watchdog,
            # STREAMCOLL_WATCHDOG=off): forget those finished or out of the ring
            # here, and look again only once as many again were added (a scan on
            # every call past 64 cost 27 us a call at the ring's 1,024).
            fr = self._flight
            lo = self._seq - fr.capacity
            for s in list(d):
                e = fr.at(s)
                if s <= lo or e is None or (not e.sync and e.state in (_recorder.COMPLETED, _recorder.FAILED)):
                    d.pop(s, None)
            self._deadlines_cap = max(64, 2 * len(d))
        for h in _hooks.on_deadline:
            h(self, limit)

    def _not_issued(self, name: str, plan: Optional[Plan], limit: float, why: str = "") -> BaseException:
        """The error of a call given its own timeout (``limit`` s) that could
        not be issued within it (``why``; default: another thread's call
        holds the communicator, the exec lock: a synchronous call, inline,
        for as long as its C call runs). Declared stuck, as past the deadline
        of an issued call: the communicator is failed (its calls raise from
        now on, the holder's included once it returns). Nothing of this call
        was issued: it took no sequence number (the error names the next one)."""
        why = why or ("another thread's call on this communicator held it all that time (a synchronous call "
                      "runs inline, holding the communicator until its C call returns)")
        return self._timed_out(
            name, self._seq + 1, limit, (plan.outputs or plan.keep) if plan is not None else (),
            f"its own timeout ({limit:g} s, given to this call; the communicator's is {self.timeout:g} s) passed "
            f"before it could be issued: {why}. This call was not issued; declared stuck, the communicator is failed",
            own=True)

    def _new_async_entry(self, name: str, plan: Plan) -> tuple:
        """Take the next sequence number and record it (exec lock held)."""
        seq = self._seq = self._seq + 1
        if plan.p2p:
            self._p2p += 1
        e = FlightEntry(seq, name, self._p2p, False, _now(), tuple(map(_wref, plan.keep)), _recorder.ENQUEUED)
        fr = self._flight
        fr.ring[seq & fr.mask] = e
        return seq, e

    def _execute_host(self, plan: Plan, e: FlightEntry, h: Any) -> None:
        """Run a queued plan on the CPU comm thread, stamping its flight entry."""
        fr = self._flight
        e.t_start = _now()
        e.state = _recorder.RUNNING
        fr.inflight = e
        try:
            rc = plan.fn(*plan.args, h)
            if rc:
                self._raise_rc(plan.cname, rc)
            if plan.post is not None:
                plan.post()
        except BaseException as x:
            e.state = _recorder.FAILED
            e.error = f"{type(x).__name__}: {x}"
            raise
        finally:
            fr.inflight = None
        e.t_end = _now()
        if e.state == _recorder.RUNNING:  # not failed meanwhile (mark_failed)
            e.state = _recorder.COMPLETED

    def _execute_device(self, plan: Plan, e: FlightEntry, h: Any) -> None:
        """Launch a plan on a GPU comm stream (completion is the event's)."""
        ts = self._backend.turnstile
        if ts is None:  # NCCL: calls on different communicators may run at once; nothing on this path
            rc = plan.fn(*plan.args, h)
            if rc:
                self._raise_rc(plan.cname, rc)
        else:  # oneCCL on XPU: one call at a time in the process, in issue order (its last error too)
            with ts.hold():
                rc = plan.fn(*plan.args, h)
                if rc:
                    self._raise_rc(plan.cname, rc)
        if plan.post is not None:
            plan.post()

    def _launch_async(self, name: str, plan: Plan, key: Any = None, current: Any = None, here: Any = False,
                      limit: Optional[float] = None, _held: bool = False) -> Work:
        """Queue ``plan`` on the comm stream serving ``key`` (default: the
        caller's current stream; ``current``: that stream, where the caller's
        current one is another: posted ops launched later) and return its
        Work; ``limit``: the call's own timeout (its flight entry and Work
        carry it; the wait for the exec lock is bounded by it:
        :meth:`_not_issued`), None: the communicator's. ``_held``: the
        caller holds the exec lock already."""
        if not self._usable:
            self._check_usable()  # every launcher: posted ops flushed after a failure are not launched
        rt = self._rt
        if limit is not None and not _held:
            # a call given its own timeout waits for the exec lock (another
            # thread's inline call may hold it for good) up to that timeout
            # (as _launch_limited), then issues below, the lock taken again (an RLock)
            lock = rt.exec_lock
            with _TryLock(lock, limit) as got:
                if not got:
                    raise self._not_issued(name, plan, limit)
                try:
                    return self._launch_async(name, plan, key, current, here, limit, True)
                finally:
                    lock.release()
        if self._gpu and rt.is_capturing():
            # before a sequence number is taken: nothing was issued
            raise UsageError(
                f"{name}(async_op=True) during CUDA graph capture is not supported; use async_op=False "
                "(it launches on the capturing stream)"
            )
        if key is None:
            key = rt.current_key()
        lane = self._lanes.get(key)
        if lane is None:
            lane = self._lanes[key] = rt.new_lane(key, current)
        with rt.exec_lock:  # not acquire() then try: an interrupt between them would keep it
            seq, e = self._new_async_entry(name, plan)
            if limit is not None:
                e.limit = (seq, limit)
            if self._gpu:
                try:
                    rt.submit(lane, self._execute_device, plan, e)
                except BaseException as x:
                    e.state = _recorder.FAILED
                    e.error = f"{type(x).__name__}: {x}"
                    raise
                ev = rt.completion_event(lane, None)
                e.t_start = e.t_enq
                e.state = _recorder.LAUNCHED
                e.event = ev  # the watchdog polls it
            else:
                item = rt.submit(lane, self._execute_host, plan, e, here)
                ev = rt.completion_event(lane, item)
        stash = None
        if self._gpu:
            if self.record_stream:
                rt.keep_alive(plan.keep, lane)
            else:
                stash = REAPER.add(ev, plan.keep, self._dev_index if self._dev_type == "cuda" else None)
        if limit is not None:
            self._deadline_issued(seq, limit)
        return Work(self, rt, lane, ev, seq, name, plan.outputs, stash, bool(here), limit)

    def _complete_future_when_done(self, work: Work) -> None:
        """Complete ``work``'s future once the collective has: the comm thread
        (CPU) or a poller (GPU) sees it done and hands the completion to the
        callback thread (:mod:`streamcoll.core.callbacks`), which runs the
        future's callbacks: they may issue collectives and wait on them.

        A collective that completed already: its future is set here, on the
        caller's thread, only while the callback thread is caught up (every
        earlier completion handed out, :meth:`CallbackThread.caught_up`; no
        callback is attached yet, so nothing runs but the result, and the
        future is returned completed). Otherwise its completion goes to the
        callback thread behind them: set here, a ``then()`` would run at
        once on the caller's thread, ahead of (or beside) earlier
        completions' callbacks, against the completion-order rule."""
        rt = self._rt
        if rt.query(work._event):
            cb = _callbacks.CALLBACKS  # CallbackThread.caught_up, inline (the method call is half its cost)
            if not cb._queue and (cb._owner is None or cb._owner == _get_ident()):  # queue first: see there
                work._set_future()
            else:
                _callbacks.complete(functools.partial(_complete_on_device, self._dev_index
                                                      if self._dev_type == "cuda" else None, work))
        elif hasattr(rt, "on_complete"):
            rt.on_complete(work._event, lambda w=work: _callbacks.complete(w._set_future))
        else:
            # GPU: poll on a helper thread (the future completes when the GPU work has).
            def _poll(w: Work = work) -> None:
                try:
                    if self._dev_type == "cuda":
                        # the communicator's GPU (not a context on GPU 0 of every rank), in
                        # thread-local capture mode (not invalidating a user's graph capture)
                        helper_threads.prepare(self._dev_index)
                    ev = w._event
                    # until done, or failed (an NCCL kernel stuck without an abort never completes)
                    while not rt.query(ev) and self._failed is None:
                        time.sleep(0.0002)
                except BaseException as e:  # the future must complete, or its waiters hang
                    fut = w._future
                    if fut is not None and not fut.done():
                        _callbacks.complete(functools.partial(_fail_future, fut, e))
                    return
                _callbacks.complete(functools.partial(_complete_on_device, self._dev_index
                                                      if self._dev_type == "cuda" else None, w))
            helper_threads.Thread(target=_poll, daemon=True, name="streamcoll-future").start()
