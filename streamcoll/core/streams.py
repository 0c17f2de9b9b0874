"""Device runtimes and the per-(device, current stream) comm-stream cache.

The Communicator's launch strategies are written once against the small
:class:`Runtime` interface; one adapter per device type supplies streams and
events:

- :class:`CudaRuntime`: CUDA streams and events through torch; the native
  handle handed to NCCL is the ``cudaStream_t``.
- :class:`XpuRuntime`: XPU streams and events through torch; the handle handed
  to oneCCL is the ``sycl::queue*``.
- :class:`CpuRuntime`: the host analogue. The "current stream" is the calling
  thread (a collective on it runs inline and returns when complete); a "comm
  stream" is a lane feeding the communicator's comm thread, which executes
  every queued call in issue order; an event is a marker that the comm thread
  passes. All lanes of one communicator feed the same thread, so cross-rank
  order is issue order, which oneCCL needs.

A :class:`Lane` is what the cache holds per key: the comm stream, the current
stream it serves, the one reusable "inputs ready" event (a stream wait takes
the event's state at the time of the wait, so re-recording it for the next
call is safe) and a pool of completion events that Works return when they are
released.
"""
from __future__ import annotations

import collections
import functools
import operator
import threading
import time
from typing import Any, Callable, Dict, List, Optional

import torch

from .._ffi.errors import CommunicatorError

__all__ = ["Runtime", "CpuRuntime", "CudaRuntime", "XpuRuntime", "Lane", "runtime_for"]


#: How long a quietly queued call (a small CPU async call,
#: ``Communicator.inline_async_bytes``) may wait for its issuer to run it
#: itself (``Work.wait()``: no thread hand-off) before the comm thread starts
#: it: the most a peer waits on a call this rank issued and then did other
#: things before waiting (the rule: :mod:`streamcoll.core.work`).
QUIET_START_NS = 1_000_000

#: How often :meth:`CpuRuntime.close` looks whether the communicator failed
#: while it waits for the comm thread (destroy after a call past its own timeout).
CLOSE_SLICE_S = 0.05


class Lane:
    """A comm stream serving one (device, current stream) key."""

    __slots__ = ("key", "stream", "current", "handle", "ready", "pool", "created")

    def __init__(self, key: Any, stream: Any, current: Any, handle: Any, ready: Any) -> None:
        self.key = key
        self.stream = stream
        self.current = current
        self.handle = handle
        self.ready = ready
        self.pool: List[Any] = []
        self.created = 0  # completion events ever made for this lane


class Runtime:
    """What the launch strategies need from a device type."""

    device_type = ""
    mod: Any = None  # torch.cuda / torch.xpu for the GPU runtimes

    def __init__(self, device: torch.device, native: Callable[[Any], Any]) -> None:
        self.device = device
        # int handle (or None) -> the cdata the C call takes; cached by the caller.
        self.native = native
        # Held while a call is issued (sequence number + C launch, or + queueing
        # on the CPU comm thread): one issuer at a time, so sequence order is
        # issue order (see streamcoll.core.launch).
        # Re-entrant: abort() and destroy() take it too (they must not free the
        # native communicator under another thread's launch),
        # and a launch's own rc hook may abort (non-blocking NCCL).
        self.exec_lock = threading.RLock()
        self._null = native(None)

    # current stream ----------------------------------------------------
    def current_key(self) -> Any:
        """Hashable identity of the caller's current stream; cheap."""
        raise NotImplementedError

    def current_handle(self) -> Any:
        """Native handle of the caller's current stream for the C call."""
        raise NotImplementedError

    def current_stream(self) -> Any:
        """The caller's current stream as :meth:`new_lane` takes it (what a
        lane made later, from another stream, must still serve)."""
        return self.current_key()

    def stream_handle(self, stream: Any) -> Any:
        raise NotImplementedError

    def new_lane(self, key: Any, current: Any = None) -> Lane:
        """The comm stream for key ``key``, serving stream ``current`` (default: the current one)."""
        raise NotImplementedError

    # launching ------------------------------------------------------------
    def run_post(self, post: Callable[[], Any], stream: Any) -> None:
        """Run a plan's post-op (torch ops finishing the result, e.g. the AVG
        division) on the current stream or on ``stream``."""
        if stream is None:
            post()
        else:
            with self.mod.stream(stream):
                post()

    def submit(self, lane: Lane, runner: Callable[[Any, Any, Any], None], plan: Any, entry: Any,
               quiet: bool = False) -> Any:
        """Launch ``runner(plan, entry, handle)`` on ``lane``'s comm stream,
        after the caller's prior work on its current stream. Called with the
        exec lock held. ``quiet``: the CPU runtime's (see CpuRuntime.submit)."""
        raise NotImplementedError

    # events ---------------------------------------------------------------
    def completion_event(self, lane: Lane, token: Any) -> Any:
        """An event (from the lane's pool) marking the completion of the work
        ``submit`` just launched (``token`` is what ``submit`` returned)."""
        raise NotImplementedError

    def release_event(self, lane: Lane, event: Any) -> None:
        lane.pool.append(event)

    def query(self, event: Any) -> bool:
        raise NotImplementedError

    def error(self, event: Any) -> Optional[BaseException]:
        """The failure of the work behind ``event``, if the runtime knows it."""
        return None

    def wait_current(self, event: Any, timeout: Optional[float]) -> bool:
        """Make the caller's current stream wait for ``event``. GPU: no host
        block. CPU: the current stream is the thread, so it blocks (up to
        ``timeout`` seconds; returns False on timeout)."""
        raise NotImplementedError

    def synchronize(self, event: Any, timeout: Optional[float]) -> bool:
        """Block the host until ``event`` completes (False on timeout)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self.query(event):
            if deadline is not None and time.monotonic() > deadline:
                return False
            time.sleep(0.0002)
        return True

    def nudge(self, blocking: bool = True) -> None:
        """Start work queued without a wake-up (CPU); nothing elsewhere."""

    def keep_alive(self, tensors, lane: Lane) -> None:
        """record_stream mode: tell the caching allocator the comm stream uses these."""
        for t in tensors:
            t.record_stream(lane.stream)

    def is_capturing(self) -> bool:
        return False

    def fail(self, error_for: Callable[[Any], BaseException]) -> None:
        """End the work not yet run with a failure (the CPU comm thread's
        queue). A GPU stream's work cannot be taken back: after ncclCommAbort
        it ends, and its Works read the failure from the flight record."""

    def close(self, timeout: Optional[float] = None) -> bool:
        """Stop serving; False if queued work did not finish within ``timeout``."""
        return True


# ---------------------------------------------------------------- CPU ----
class _Item:
    """One queued call on the CPU comm thread: ``runner(plan, entry, handle)``."""

    __slots__ = ("runner", "plan", "entry", "done", "exc", "callbacks", "ticket", "quiet", "started", "t_quiet")

    def __init__(self, runner, plan, entry, quiet: bool = False) -> None:
        self.quiet = quiet  # queued without waking the comm thread (CpuRuntime.submit)
        self.t_quiet = 0  # quiet: when it was queued (monotonic ns); it starts by t_quiet + quiet_start_ns
        self.ticket = -1  # its turn in the process (Backend.turnstile), taken when queued; -1: none
        self.runner = runner
        self.plan = plan
        self.entry = entry
        self.done = False
        self.started = False  # _run took it (its call runs or ran, or it failed): never queued again
        self.exc: Optional[BaseException] = None
        self.callbacks: Optional[list] = None


class _TryLock:
    """``with _TryLock(lock) as got:`` takes ``lock`` only if it is free
    (``got``), never waiting; the body releases it (``if got: try: ...
    finally: lock.release()``). The acquire is made by the ``with`` itself,
    C code all the way (``__enter__`` is a property whose getter,
    ``operator.attrgetter``, hands ``BEFORE_WITH`` a
    ``functools.partial(lock.acquire, False)``), so there is no point where
    CPython delivers an interrupt (a call's end, a function's entry, a back
    edge) between a successful acquire and the body's ``try``: only the store
    of ``got`` and its test. (``acquire(False)`` as a call: an interrupt at
    that call's end, before its result is stored, leaks the lock.)"""

    __slots__ = ("_acquire",)
    __enter__ = property(operator.attrgetter("_acquire"))

    def __init__(self, lock: Any, timeout: float = 0.0) -> None:
        """``timeout`` > 0: wait up to that long for it (an interrupt while it waits: not taken)."""
        self._acquire = (functools.partial(lock.acquire, True, timeout) if timeout > 0
                         else functools.partial(lock.acquire, False))

    def __exit__(self, *exc: Any) -> None:
        return None  # the body released the lock, if it took it


class CpuEvent:
    """Passed when the comm thread has finished the item it marks."""

    __slots__ = ("item",)

    def __init__(self) -> None:
        self.item: Optional[_Item] = None


class CpuRuntime(Runtime):
    """Host buffers: the current stream is the caller's thread; the comm
    stream is one comm thread per communicator, started on first use.

    ``exec_lock`` is held around every inline C call and around queueing;
    an inline call runs only while nothing is queued or running on the comm
    thread (``_pending == 0``, checked under the lock), and queueing needs the
    lock, so the comm thread never runs beside an inline call and needs no
    lock of its own. A synchronous call made while async work is queued goes
    through the queue too, so it cannot overtake that work.

    Where the library may not be entered by two threads of the process at
    once (oneCCL, ``turnstile``), every queued item takes a ticket when it is
    queued and the comm thread runs it in its turn; inline calls take theirs
    in the generated launcher. So all communicators' calls run one at a
    time, in the order the process issued them.

    An item queued quietly (``submit(quiet=True)``: a small async call) does
    not wake the comm thread; :meth:`nudge` does, or a waiter runs it itself
    (:meth:`run_here`: the queue's first item, nothing running; the comm
    thread waits meanwhile). Waiters of items wait on their own condition,
    so a completion does not wake an idle comm thread.
    """

    device_type = "cpu"

    def __init__(self, device: torch.device, native, turnstile: Any = None, name: str = "streamcoll-comm") -> None:
        super().__init__(device, native)
        self.turnstile = turnstile
        self._name = name
        self._queue: collections.deque = collections.deque()
        self._mutex = lock = threading.Lock()  # the lock of the conditions (taken bare where none is used: cheaper)
        self._try_mutex = _TryLock(lock)  # nudge(blocking=False): taken only if free, never waited for
        self._cond = threading.Condition(lock)  # what queueing notifies (nobody waits on it)
        # The comm thread waits for work on _work_cv, waiters of items on
        # _done_cv (_waiters counts them), one lock: queueing quietly and a
        # completion do not wake an idle comm thread (submit and nudge do)
        self._work_cv = threading.Condition(lock)
        self._done_cv = threading.Condition(lock)
        self._waiters = 0
        self._pending = 0
        self._idle = False   # the comm thread waits with no deadline: queueing quietly wakes it (_loop)
        self._hurry = False  # nudged: quietly queued work starts now, not at its deadline
        self._last_quiet = 0  # when the last quiet call was queued (monotonic ns)
        self.quiet_start_ns = QUIET_START_NS
        self._thread: Optional[threading.Thread] = None
        self._closed = False
        self._failed = False
        self.running: Optional[_Item] = None

    def current_key(self):
        return threading.get_ident()

    def current_handle(self):
        return self._null

    def stream_handle(self, stream):
        return None

    def new_lane(self, key, current: Any = None) -> Lane:
        return Lane(key, self, key, self._null, None)

    def submit(self, lane: Lane, runner, plan, entry, quiet: bool = False) -> _Item:
        """Queue ``runner(plan, entry, handle)``; ``quiet``: without waking
        the comm thread (:meth:`nudge` does; see ``streamcoll.core.work``)."""
        item = _Item(runner, plan, entry, quiet)
        ts = self.turnstile
        if quiet and ts is not None and id(self) not in ts.sleepers:
            # before its ticket: whoever waits for a later turn wakes this comm thread (Turnstile.wait)
            ts.sleepers[id(self)] = self
        self._enqueue(item)  # wakes the comm thread unless quiet
        return item

    def nudge(self, blocking: bool = True) -> None:
        """Start quietly queued work: wake the comm thread if work waits
        for it (someone is about to wait with a timeout, query, or block
        behind it). ``blocking=False`` (a finaliser, which may run inside
        this runtime's own critical section): not if the lock is taken (the
        watchdog's next pass starts the work then)."""
        if blocking:
            with self._mutex:  # not acquire() then try: an interrupt between them would leak the lock
                if self._queue and self.running is None:
                    self._hurry = True
                    self._work_cv.notify()
            return
        # A finaliser never waits for the lock: the thread it runs on may
        # hold a lock that a thread inside a _mutex section waits for (fail()
        # cancels tickets under the turnstile's lock; _spawn starts a thread
        # under threading's). So not ``locked()`` then ``with``: the GIL can
        # pass between them (a deadlock, tests/core/test_finalizer_nudge.py); and
        # not ``acquire(False)`` then ``try``: an interrupt at the end of
        # that call leaked the lock (the interrupt tier). _TryLock: see there.
        with self._try_mutex as got:
            if got:
                try:
                    if self._queue and self.running is None:
                        self._hurry = True
                        self._work_cv.notify()
                finally:
                    self._mutex.release()

    def _enqueue(self, item: _Item) -> None:
        """Queue ``item`` with its ticket. The comm thread is
        started first: if that fails (``Thread.start`` raising) no ticket was
        taken and nothing was queued. The comm thread is woken before the
        append (it runs once we release the lock). The ticket, the count
        and the append follow with no point between them
        where CPython delivers an interrupt; an exception after the ticket
        and before the append (none can be raised there but by a tracer)
        cancels it."""
        with self._mutex:
            if self._closed or self._failed:
                raise CommunicatorError("the communicator's comm thread has been stopped" if self._closed
                                        else "the communicator failed: its comm thread takes no more work")
            if self._thread is None:
                self._spawn()
            # woken now, it takes _mutex after us and finds the item: a notify
            # after the append could be lost to an interrupt, the item never seen.
            # Quiet: only an idle comm thread (one waiting with a deadline finds it then)
            if item.quiet:
                e = item.entry  # a call's flight entry: its issue time, read, not taken again
                self._last_quiet = item.t_quiet = e.t_enq if e is not None else time.monotonic_ns()
                if self._idle:
                    self._work_cv.notify()
            else:
                if self._queue:
                    # quiet calls queued before it start now, not at their deadline: it runs
                    # behind them (a synchronous call waits for it; its peers for both)
                    self._hurry = True
                self._work_cv.notify()
            n = self._pending  # changed only under _mutex
            ts = self.turnstile
            try:
                if ts is not None:  # under the exec lock too: issue order (Turnstile.take)
                    t = item.ticket = ts.issued; ts.issued = t + 1  # noqa: E702 - one line: see Turnstile.take
                self._pending = n + 1
                self._queue.append(item)
            except BaseException:
                if not (self._queue and self._queue[-1] is item):  # not queued: undo
                    self._pending = n
                    if item.ticket >= 0:
                        ts.cancel(item.ticket)
                raise

    def _spawn(self) -> None:
        """Start the comm thread (``_mutex`` held). Raises if the thread
        cannot start; an interrupt inside ``Thread.start`` may leave a thread
        started and unrecorded: :meth:`_loop` then records itself, and a
        second one started meanwhile finds it and ends."""
        th = threading.Thread(target=self._loop, name=self._name, daemon=True)
        th.start()
        self._thread = th

    def _loop(self) -> None:
        me = threading.current_thread()
        with self._mutex:
            other = self._thread
            if other is not None and other is not me and other.is_alive():
                return  # another comm thread serves (see _spawn)
            self._thread = me
        q = self._queue
        cond = self._work_cv
        now = time.monotonic_ns
        while True:
            with cond:
                # running set and not popped here: an item a waiter runs on its own thread (run_here)
                while True:
                    if q and self.running is None:
                        head = q[0]
                        if not head.quiet or self._hurry:
                            break
                        # quietly queued: its issuer may still run it itself (run_here) until its
                        # deadline, quiet_start_ns after it was issued; then this thread starts it
                        left = head.t_quiet + self.quiet_start_ns - now()
                        if left <= 0:
                            break
                        cond.wait(left / 1e9)
                        continue
                    if self._closed and not q and self.running is None:
                        return
                    if not q:
                        self._hurry = False
                    # nothing to start now (an empty queue, or a waiter runs the head): while quiet
                    # calls flow, look again within quiet_start_ns unasked (their queueing wakes no
                    # one); idle after a quiet spell, then the next quiet call wakes this thread
                    if now() - self._last_quiet < self.quiet_start_ns:
                        cond.wait(self.quiet_start_ns / 1e9)
                    else:
                        self._idle = True
                        cond.wait()
                        self._idle = False
                item = q.popleft()
                self.running = item  # under the lock: fail() sees it either queued or running
            self._run(item)

    def _run(self, item: _Item) -> None:
        """Run ``item`` (taken from the queue as :attr:`running`) in its turn
        and complete it: on the comm thread, or on a waiter's thread
        (:meth:`run_here`), where an exception (a KeyboardInterrupt) may land
        at any line: the item is completed whatever happens (its error is
        the waiter's). Its completion callbacks are handed on before
        :attr:`running` clears, so the next item, on either thread, is
        handed on after them: in completion order."""
        ts = self.turnstile
        item.started = True
        try:
            try:
                if ts is not None and ts.turn != item.ticket:
                    ts.wait(item.ticket, None, item.entry)  # behind the calls issued before it, on every communicator
                if item.exc is None:  # failed while it waited for its turn: not run
                    item.runner(item.plan, item.entry, self._null)
            except BaseException as e:  # delivered to whoever waits on the item
                if item.exc is None:  # a failure fail() recorded first stays the reason
                    item.exc = e
            finally:
                if ts is not None and ts.turn == item.ticket:
                    ts.turn = item.ticket + 1  # Turnstile.leave inline: an interrupt at a call's entry would keep the turn
                    if ts.waiting or ts.skipped:
                        ts.wake()  # (interrupted: waiters re-read the turn every POLL_S)
                elif ts is not None:
                    ts.cancel(item.ticket)  # its wait interrupted (at its entry, say): the turn skips it
        finally:
            self._complete(item)

    def _complete(self, item: _Item) -> None:
        """Mark ``item`` done, release its waiters, hand on its callbacks, clear :attr:`running`."""
        with self._mutex:
            item.plan = None  # host memory is free to reuse once the call returned
            item.done = True
            self._pending -= 1
            cbs = item.callbacks
            item.callbacks = None  # no Work <-> item reference cycle once fired
            if self._waiters:
                self._done_cv.notify_all()
            if not cbs:  # _ran(), inline: the common case
                self.running = None
                if self._queue and self._thread is not threading.current_thread():
                    self._work_cv.notify()
                return
        try:
            for cb in cbs:
                cb()
        finally:
            with self._mutex:
                self._ran()

    def _ran(self) -> None:
        """The running item is finished (lock held): a comm thread that
        waited while a waiter ran it (:meth:`run_here`) takes the next."""
        self.running = None
        if self._queue and self._thread is not threading.current_thread():
            self._work_cv.notify()

    def run_here(self, event: CpuEvent) -> bool:
        """Run the work behind ``event`` on the calling thread if the comm
        thread has not started it and it is next (first in the queue, nothing
        running); returns whether it did (it then completed, or failed:
        :meth:`error`). What ``Work.wait()`` without a timeout does for a
        small call queued quietly (``submit(quiet=True)``, the rule in
        :mod:`streamcoll.core.work`): the caller blocks until completion anyway,
        and running the call itself saves both thread hand-offs. The call
        still runs in its turn (:attr:`turnstile`), its flight entry is
        stamped as on the comm thread, and the comm thread waits for it."""
        item = event.item
        if item is None or item.done:
            return False
        q = self._queue
        try:  # from before the pop: an interrupt after it (the lock's exit, popleft's return) is handled
            with self._mutex:
                if self.running is not None or not q or q[0] is not item or item.exc is not None:
                    return False
                self.running = item  # a store: no point where an interrupt lands before popleft
                q.popleft()
            self._run(item)
        except BaseException:
            if item.started and not item.done:  # interrupted on _run's way out: complete it here
                self._complete(item)
            elif not item.done:  # interrupted before it ran: back to the head of the queue, for the comm thread
                with self._mutex:
                    if self.running is item:
                        if not q or q[0] is not item:
                            q.appendleft(item)
                        self.running = None
                        self._work_cv.notify()
            raise
        return True

    def fail(self, error_for: Callable[[Any], BaseException]) -> None:
        """End the queued work with a failure: the one place that does it
        (``Communicator.mark_failed`` calls it). Queued items are removed
        and completed with ``error_for(entry)``, never run; the running one,
        inside a C call that may never return (oneCCL cannot abort), gets
        the failure as its result whatever the call returns, and its waiters
        and callbacks are released now. Later submissions raise."""
        fired: List[Callable[[], None]] = []
        with self._mutex:  # C-level enter/exit (a Condition's are Python: an interrupt there leaks the lock)
            self._failed = True
            queued = list(self._queue)
            self._queue.clear()
            for it in queued:
                if self.turnstile is not None:
                    self.turnstile.cancel(it.ticket)  # never runs: its turn is skipped
                it.exc = error_for(it.entry)
                it.plan = None
                it.done = True
                self._pending -= 1
            run = self.running
            if run is not None and run.exc is None:
                run.exc = error_for(run.entry)
            for it in queued + ([run] if run is not None else []):
                if it.callbacks:
                    fired += it.callbacks
                it.callbacks = None
            self._work_cv.notify_all()
            self._done_cv.notify_all()
        for cb in fired:
            cb()

    def _wait_item(self, item: _Item, timeout: Optional[float]) -> bool:
        if item.done or item.exc is not None:
            return True
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._mutex:
            self._waiters += 1
            try:
                while not (item.done or item.exc is not None):
                    if deadline is None:
                        self._done_cv.wait()
                    else:
                        left = deadline - time.monotonic()
                        if left <= 0:
                            return False
                        self._done_cv.wait(left)
            finally:
                self._waiters -= 1
        return True

    def drain(self, timeout: Optional[float] = None) -> bool:
        """Wait until the work queued so far has completed (or the
        communicator failed, which ends it): what a synchronous call that
        must act after that work, before its own C call, waits for (its
        first-call check: :class:`streamcoll.core.checks.Signatures`). Quietly
        queued work is started now. ``timeout``: a call's own timeout (False
        once it passed); None: stuck work is the watchdog's, whose failure
        ends it."""
        end = None if timeout is None else time.monotonic() + timeout
        with self._mutex:
            if self._queue and self.running is None:
                self._hurry = True
                self._work_cv.notify()
            self._waiters += 1
            try:
                while self._pending and not self._failed:
                    if end is None:
                        self._done_cv.wait()
                    else:
                        left = end - time.monotonic()
                        if left <= 0:
                            return False
                        self._done_cv.wait(left)
            finally:
                self._waiters -= 1
        return True

    def completion_event(self, lane: Lane, token: _Item) -> CpuEvent:
        ev = lane.pool.pop() if lane.pool else None
        if ev is None:
            ev = CpuEvent()
            lane.created += 1
        ev.item = token
        return ev

    def release_event(self, lane: Lane, event: CpuEvent) -> None:
        event.item = None
        lane.pool.append(event)

    def query(self, event: CpuEvent) -> bool:
        return event.item is None or event.item.done

    def error(self, event: CpuEvent):
        return None if event.item is None else event.item.exc

    def wait_current(self, event: CpuEvent, timeout):
        return event.item is None or self._wait_item(event.item, timeout)

    synchronize = wait_current

    def on_complete(self, event: CpuEvent, cb: Callable[[], None]) -> None:
        """Run ``cb`` once the work behind ``event`` completed (maybe now)."""
        item = event.item
        with self._mutex:
            if item is not None and not item.done and item.exc is None:
                if item.callbacks is None:
                    item.callbacks = []
                item.callbacks.append(cb)
                return
        cb()

    def keep_alive(self, tensors, lane) -> None:
        # Host memory has no stream-ordered allocator: the queued item holds
        # the tensors until the C call returned, in either mode.
        pass

    def pending(self) -> int:
        return self._pending

    def close(self, timeout: Optional[float] = None) -> bool:
        """Stop the comm thread after the queued work; False if that work did
        not finish within ``timeout``, or the communicator failed meanwhile
        (:meth:`fail` ended it; a call it left inside the library may never
        return). An idle thread counts as finished even
        if it has not exited yet (``timeout`` 0 after a failure): it runs no
        more C calls, so the native communicator may be freed."""
        if self.turnstile is not None:
            self.turnstile.sleepers.pop(id(self), None)
        with self._mutex:
            self._closed = True
            self._work_cv.notify_all()
            t = self._thread
        if t is not None and t is not threading.current_thread():
            # in slices: a failure meanwhile (a call's own timeout, the watchdog)
            # ended the queued work, and a call stuck inside the library (oneCCL
            # cannot abort) would keep the thread for the whole timeout
            end = None if timeout is None else time.monotonic() + timeout
            while True:
                left = None if end is None else end - time.monotonic()
                t.join(CLOSE_SLICE_S if left is None else max(0.0, min(left, CLOSE_SLICE_S)))
                if not t.is_alive() or self._failed or (left is not None and left <= CLOSE_SLICE_S):
                    break
            if t.is_alive():
                with self._mutex:
                    return self.running is None and not self._queue
        return True


# --------------------------------------------------------------- CUDA ----
class _TorchGpuRuntime(Runtime):
    """Shared by CUDA and XPU: torch streams and events."""

    def __init__(self, device: torch.device, native) -> None:
        super().__init__(device, native)
        self.index = device.index if device.index is not None else self.mod.current_device()

    def current_stream(self) -> Any:
        return self.mod.current_stream(self.index)

    def new_lane(self, key, current: Any = None) -> Lane:
        """A comm stream serving ``current`` (default: the caller's current stream)."""
        mod = self.mod
        if current is None:
            current = mod.current_stream(self.index)
        stream = mod.Stream(device=self.index)
        ready = mod.Event()
        return Lane(key, stream, current, self.native(self.stream_handle(stream)), ready)

    def submit(self, lane: Lane, runner, plan, entry, quiet: bool = False) -> None:
        # Inputs ready: the comm stream waits for everything queued on the
        # caller's stream so far (record-then-wait, like torch's wait_stream).
        lane.ready.record(lane.current)
        lane.stream.wait_event(lane.ready)
        if plan.post is None:
            runner(plan, entry, lane.handle)
        else:
            with self.mod.stream(lane.stream):
                runner(plan, entry, lane.handle)

    def completion_event(self, lane: Lane, token=None):
        ev = lane.pool.pop() if lane.pool else None
        if ev is None:
            ev = self.mod.Event()
            lane.created += 1
        ev.record(lane.stream)
        return ev

    def query(self, event) -> bool:
        return event.query()

    def wait_current(self, event, timeout) -> bool:
        self.mod.current_stream(self.index).wait_event(event)
        return True


class CudaRuntime(_TorchGpuRuntime):
    device_type = "cuda"
    mod = torch.cuda

    def __init__(self, device: torch.device, native) -> None:
        super().__init__(device, native)
        raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
        idx = self.index
        self.raw_current = raw if raw is not None else (lambda i: torch.cuda.current_stream(i).cuda_stream)
        if raw is not None:
            # The cudaStream_t of the current stream without building a
            # torch.cuda.Stream object (what torch's own launchers use). The
            # legacy default stream is handle 0, which NCCL takes as is.
            self.current_key = lambda: raw(idx)  # type: ignore[assignment]

    def current_key(self):
        return torch.cuda.current_stream(self.index).cuda_stream

    def current_handle(self):
        return self.native(self.current_key())

    def stream_handle(self, stream) -> int:
        return stream.cuda_stream

    def is_capturing(self) -> bool:
        """Whether this communicator's device's current stream is capturing
        (not the current device's: they differ on a multi-GPU host)."""
        if torch.cuda.current_device() == self.index:
            return torch.cuda.is_current_stream_capturing()
        with torch.cuda.device(self.index):
            return torch.cuda.is_current_stream_capturing()


class XpuRuntime(_TorchGpuRuntime):
    device_type = "xpu"
    mod = getattr(torch, "xpu", None)

    def current_key(self):
        return self.mod.current_stream(self.index).sycl_queue

    def current_handle(self):
        return self.native(self.current_key())

    def stream_handle(self, stream) -> int:
        return stream.sycl_queue


def runtime_for(device: torch.device, native: Callable[[Any], Any], turnstile: Any = None) -> Runtime:
    """The adapter for ``device``; ``native(handle)`` turns an int stream
    handle (None on the host) into the C argument; ``turnstile``: the
    library's process-wide issue order (``Backend.turnstile``), if it needs one."""
    if device.type == "cpu":
        return CpuRuntime(device, native, turnstile)
    if device.type == "cuda":
        return CudaRuntime(device, native)
    if device.type == "xpu":
        return XpuRuntime(device, native)
    raise ValueError(f"device: expected cpu, cuda or xpu, got {device}")
