"""Work: the handle an ``async_op=True`` collective returns.

It mirrors torch.distributed's Work (``wait()``, ``is_completed()``,
``is_success()``, ``exception()``, ``get_future()``, ``result()``), plus
``synchronize()``: block the host until the collective finished.

Lifetime of the tensors (stash mode, the default): the Work keeps references
to the collective's inputs and outputs until the caller's stream has been
made to wait on the completion event (``wait()``), so the caching allocator
cannot hand their memory to someone else while the comm stream still uses
it. Works nobody waits on (a fire-and-forget ``isend``) are covered by the
:class:`Reaper` (until the event fired); on the CPU the comm thread holds
them until the C call returned.

The async contract (torch's): an ``async_op=True`` call returns without
waiting for its peers; ``wait(timeout)`` bounds the wait (past it,
:class:`~streamcoll.CollectiveTimeout`); futures complete, and their
callbacks run, on the callback thread in completion order
(:mod:`streamcoll.core.callbacks`), never on the thread issuing collectives.

A small CPU async call (``Communicator.inline_async_bytes``) is queued
without waking the comm thread and starts at the first of: ``wait()`` (which
runs it on the caller's thread), a query or ``wait(timeout)``, a later call
behind it, its 1 ms deadline (``streams.QUIET_START_NS``). The rule and its
measurements: docs/design.md, section 'When a small async call starts'.
"""
from __future__ import annotations

import threading
import time
from typing import Any, Callable, Dict, Generator, List, Optional

import torch

from . import helper_threads
from .callbacks import Future
from .._ffi.errors import CollectiveTimeout, CommunicatorError
from .timeouts import seconds as _seconds  # the one check of timeout arguments



__all__ = ["Work", "PostedWork", "Reaper", "POSTING", "launch_posted", "awaited", "Awaiters"]

# Communicators holding posted p2p ops not launched yet (id -> communicator):
# what every blocking call in the process launches first (launch_posted), and
# what turns the fast paths off on every communicator while it is not empty
# (Communicator._refresh_fast_paths reads it). When posted ops go out: streamcoll.core.p2p.
POSTING: Dict[int, Any] = {}
POSTING_LOCK = threading.RLock()


def launch_posted(keep: Any = None) -> None:
    """Launch the posted p2p ops of every communicator in the process but
    ``keep`` (whose posted ops were issued after what its caller waits on):
    called before anything that blocks on other ranks (a synchronous call, a
    wait), so that no rank blocks while a peer may be waiting on an op this
    process posted."""
    for c in list(POSTING.values()):
        if c is not keep:
            c._flush_posted()


class Reaper:
    """Holds tensors of un-waited GPU Works until their completion events fire.

    One daemon thread per process, started on first use, polling every
    ``interval`` seconds; entries are ``[event, tensors]`` lists, cleared by
    ``Work.wait()`` when the caller's stream took over the ordering.
    """

    def __init__(self, interval: float = 0.002) -> None:
        self.interval = interval
        self._entries: List[list] = []
        self._lock = threading.Lock()
        self._thread: Optional[threading.Thread] = None

    def add(self, event: Any, tensors: Any, device: Optional[int] = None) -> list:
        entry = [event, tensors, device]
        with self._lock:
            self._entries.append(entry)
            if self._thread is None:
                self._thread = helper_threads.Thread(target=self._loop, name="streamcoll-reaper", daemon=True)
                self._thread.start()
        return entry

    def __len__(self) -> int:
        return len(self._entries)

    def reap(self) -> int:
        """Drop entries whose event has fired or whose Work was waited; returns how many remain."""
        with self._lock:
            keep = []
            for e in self._entries:
                if e[1] is None:
                    continue
                try:
                    if e[2] is not None:
                        # the event's own GPU (not a new context on GPU 0), and
                        # thread-local capture mode (not invalidating a user's capture)
                        helper_threads.prepare(e[2])
                    done = e[0].query()
                except Exception:
                    # e.g. queried during a CUDA graph capture: unknown is not done;
                    # dropping the tensors could hand memory the GPU still uses to the allocator
                    done = False
                if done:
                    e[1] = None
                else:
                    keep.append(e)
            self._entries = keep
            return len(keep)

    def _loop(self) -> None:
        while True:
            time.sleep(self.interval)
            if self._entries:
                self.reap()


REAPER = Reaper()


class Awaiters:
    """The asyncio futures awaiting one Work: one callback on the Work's
    torch future wakes them all (an await cancelled before the completion
    takes its entry out: polling a long collective with ``wait_for`` does
    not pile up callbacks, loops or futures)."""

    __slots__ = ("waiting", "arrived", "lock")

    def __init__(self) -> None:
        self.waiting: set = set()
        self.arrived = False
        self.lock = threading.Lock()

    def arrive(self, _: Any = None) -> None:
        with self.lock:
            self.arrived = True
            waiting, self.waiting = self.waiting, set()
        for loop, fut in waiting:
            try:
                loop.call_soon_threadsafe(_settle, fut)
            except RuntimeError:  # its loop closed meanwhile: no task awaits it
                pass


def _settle(fut: Any) -> None:
    if not fut.done():  # the awaiting task may have been cancelled
        fut.set_result(None)


_AWAITERS_LOCK = threading.Lock()  # one Awaiters per Work, whichever loops await it first


async def awaited(work: Any, future: Callable[[], torch.futures.Future], timeout: Optional[float],
                  expired: Callable[[float], BaseException], finish: Callable[[], Any]) -> Any:
    """Await ``work`` (whose torch future ``future()`` gives) from a
    running asyncio loop, then return ``finish()``. The future completes on
    streamcoll's callback thread (or at once); the completion reaches the
    loop through ``call_soon_threadsafe``, so the loop never blocks. An
    await from a loop running on the callback thread itself (inside a
    future's callback) first hands the callback role to another thread, as
    ``Future.wait`` does there. Past ``timeout`` seconds (the
    communicator's, as ``wait()``), ``expired(timeout)`` is raised."""
    import asyncio  # not at import: streamcoll's import does not pay for asyncio
    from .callbacks import CALLBACKS
    aw = work._awaiters
    if aw is None:
        with _AWAITERS_LOCK:
            aw = work._awaiters
            if aw is None:
                aw = work._awaiters = Awaiters()
                future().add_done_callback(aw.arrive)  # runs at once if complete
    if not aw.arrived:
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        entry = (loop, fut)
        with aw.lock:
            if not aw.arrived:
                aw.waiting.add(entry)
        if CALLBACKS.on_callback_thread():
            CALLBACKS.hand_over()  # the completion this await needs runs on the callback thread
        timer = None if timeout is None else loop.call_later(timeout, _settle, fut)
        try:
            await fut
        finally:
            if timer is not None:
                timer.cancel()
            with aw.lock:
                aw.waiting.discard(entry)
        if not aw.arrived:
            raise expired(timeout)  # type: ignore[arg-type]
    return finish()


class Work:
    """Handle of one asynchronous collective (or one coalesced group)."""

    __slots__ = (
        "_comm", "_rt", "_lane", "_event", "_outputs", "_stash", "_future",
        "_waited", "_here", "_awaiters", "_limit", "seq", "op", "__weakref__",
    )

    def __init__(self, comm, rt, lane, event, seq: int, op: str, outputs, stash, here: bool = False,
                 limit: Optional[float] = None) -> None:
        self._comm = comm
        self._rt = rt
        self._lane = lane
        self._event = event
        self._outputs = outputs
        self._stash = stash  # reaper entry (GPU stash mode) or None
        self._future: Optional[torch.futures.Future] = None
        self._waited = False
        self._here = here  # small CPU call: wait() without a timeout may run it (CpuRuntime.run_here)
        self._awaiters: Optional[Awaiters] = None  # asyncio awaits (``__await__``)
        self._limit = limit  # the call's own timeout (seconds), None: the communicator's
        self.seq = seq
        self.op = op

    # -- torch.distributed.Work API -------------------------------------
    def _error(self) -> Optional[BaseException]:
        """The one failure state every reader consults (wait, synchronize,
        exception, is_success, is_completed, the future): the error the call
        ended with (CPU: the C call's, or the failure ``mark_failed`` gave the
        work it ended), else, once the communicator failed, the failure of
        work that was unfinished then (its flight entry says failed) or is
        still unfinished (a GPU runtime reports no per-event errors, and an
        aborted NCCL kernel's results are not to be trusted)."""
        exc = self._rt.error(self._event)
        comm = self._comm
        if exc is None and comm._failed is not None:
            e = comm._flight.at(self.seq)
            if (e is not None and e.state == "failed") or not self._rt.query(self._event):
                exc = comm._work_failure(self.op, self.seq)
        return exc

    def is_completed(self) -> bool:
        """Whether the collective finished, or failed (never blocks)."""
        if self._here:
            self._rt.nudge()
        return self._rt.query(self._event) or (self._comm._failed is not None and self._error() is not None)

    def is_success(self) -> bool:
        """Whether the collective completed without an error (never blocks)."""
        if self._here:
            self._rt.nudge()
        return self._rt.query(self._event) and self._error() is None

    def exception(self) -> Optional[BaseException]:
        """The error the collective ended with, or None."""
        if self._here:
            self._rt.nudge()
        return self._error()

    def wait(self, timeout: Optional[float] = None) -> bool:
        """Make the caller's current stream wait for the collective.

        On a GPU this does not block the host. On the CPU the current stream is
        the calling thread, so it blocks until the collective completed.
        ``timeout`` (seconds or a timedelta; default: the call's timeout,
        that is the ``timeout=`` it was given, else the communicator's)
        bounds a host block, and past it :class:`~streamcoll.CollectiveTimeout`
        is raised. Which of two things happened is in the error
        (``stuck``) and its message: with a timeout shorter than the
        call's, the call is only slow, the communicator stays usable
        and waiting again may succeed (the watchdog declares it stuck once it
        has run for the call's timeout); with the call's
        timeout (or longer) the call is stuck, and the communicator is marked
        failed. A failed collective raises its error (:meth:`exception`).
        Posted p2p ops of other communicators are launched first.
        A small CPU call not started yet (the module docstring) is run here,
        on the calling thread, when no ``timeout`` is given: it then blocks as
        a synchronous call does, and the communicator's timeout is the
        watchdog's, as for a synchronous call; pass a ``timeout`` (or give
        the call its own ``timeout=``) for a wait that raises instead.
        Returns True.
        """
        comm = self._comm
        t = (comm.timeout if self._limit is None else self._limit) if timeout is None else _seconds(timeout)
        if POSTING:
            launch_posted(comm)
        if comm._failed is not None:
            self._raise_if_failed()
        if self._here:  # a small CPU call, queued quietly: run it here, or start it
            # (not one given its own timeout: inline, the caller could not raise at its deadline)
            if timeout is None and self._limit is None and self._rt.run_here(self._event):
                if self._event.item.exc is not None or comm._failed is not None:
                    self._raise_if_failed()
                self._waited = True  # _release(): a CPU Work stashes nothing
                return True
            self._rt.nudge()
        if not self._rt.wait_current(self._event, t):
            raise self._timeout(t)
        self._raise_if_failed()
        self._release()
        return True

    def synchronize(self, timeout: Optional[float] = None) -> None:
        """Block the host until the collective completed (CUDA: event synchronize)."""
        comm = self._comm
        t = (comm.timeout if self._limit is None else self._limit) if timeout is None else _seconds(timeout)
        if POSTING:
            launch_posted(comm)
        if comm._failed is not None:
            self._raise_if_failed()
        if self._here:
            self._rt.nudge()
        if not self._rt.synchronize(self._event, t):
            raise self._timeout(t)
        self._raise_if_failed()
        self._release()

    def _timeout(self, t: float) -> CollectiveTimeout:
        """The error of a wait that ran out after ``t`` s: slow (shorter than
        the call's timeout, its own or the communicator's; nothing failed)
        or stuck (failed)."""
        comm = self._comm
        own = self._limit
        limit, whose = (comm.timeout, "the communicator's timeout") if own is None else (own, "the call's own timeout")
        if t < limit and comm._failed is None:
            shapes = [tuple(x.shape) for x in (self._outputs or ()) if isinstance(x, torch.Tensor)]
            return CollectiveTimeout(
                self.op, self.seq, t, shapes, comm.rank, comm.size,
                f"the call is still running (slow, not declared stuck): communicator {comm.name!r} stays "
                f"usable and waiting again may succeed; it is declared stuck (and failed) once the call has "
                f"run for {whose} ({limit:g} s)", stuck=False)
        return comm._timed_out(self.op, self.seq, t, self._outputs,
                               f"declared stuck ({whose}, {limit:g} s, passed): the communicator is failed",
                               own=own is not None)

    def _raise_if_failed(self) -> None:
        """Raise :meth:`_error`, if any: work of a failed communicator that
        was unfinished when it failed raises at once instead of waiting again
        for a call that cannot complete, also once the stream ran it
        after all."""
        exc = self._error()
        if exc is not None:
            raise exc

    def result(self) -> List[torch.Tensor]:
        """The output tensors (valid once the collective completed)."""
        return list(self._outputs)

    def __await__(self) -> Generator[Any, None, List[torch.Tensor]]:
        """``await work`` in a coroutine: the event loop runs on while the
        collective is in flight, and the await returns its output tensors
        (what :meth:`get_future` gives) once it completed, after
        :meth:`wait` (not blocking then: on a GPU the loop thread's current
        stream waits for it), or raises its error; past the communicator's
        timeout, what ``wait()`` raises then (:class:`CollectiveTimeout`,
        the communicator declared stuck). Cancelling the awaiting task
        (``asyncio.wait_for`` past its own deadline) leaves the collective
        running, as dropping a Work does; wait for it or await it again."""
        return awaited(self, self.get_future, self._comm.timeout if self._limit is None else self._limit,
                       self._timeout, self._finish).__await__()

    def _finish(self) -> List[torch.Tensor]:
        self.wait()
        return list(self._outputs)

    def get_future(self) -> torch.futures.Future:
        """A torch Future completed with the output tensors when the collective
        has completed (set with the exception if it failed). It completes, and
        its callbacks run, on streamcoll's callback thread
        (:mod:`streamcoll.core.callbacks`), never on the thread that runs
        collectives, so a callback may issue a collective and wait on it.
        Its completion is registered before a small call queued quietly is
        started: started first, the call could complete in between, and the
        future would be set here, on the caller's thread, ahead of earlier
        completions still waiting on the callback thread. The future of a
        call that completed already is returned completed while the callback
        thread has caught up with earlier completions; otherwise it
        completes behind them, a moment later (``wait()`` on it, not
        ``value()``)."""
        fut = self._future
        if fut is None:
            if POSTING:
                launch_posted(self._comm)  # its waiter will block: as wait()
            fut = self._future = Future()
            self._comm._complete_future_when_done(self)
            if self._here:
                self._rt.nudge()
        return fut

    def _set_future(self) -> None:
        fut = self._future
        if fut is None or fut.done():
            return
        exc = self._error()
        if exc is not None:
            fut.set_exception(exc)
        else:
            fut.set_result(list(self._outputs))

    def _release(self) -> None:
        self._waited = True
        st = self._stash
        if st is not None:
            st[1] = None  # the caller's stream now orders any reuse
            self._stash = None

    def __del__(self) -> None:
        # No C calls here: only hand the completion event back to its lane's
        # pool, unless the flight entry of this op still holds it (GPU: the
        # watchdog polls it; reusing it would make the entry track a later op
        # with this one's start time). Such an event is freed with its entry.
        try:
            ev = self._event
            if self._here and not self._waited:
                self._rt.nudge(False)  # dropped unwaited (fire and forget): its call must still go out
            if ev is not None:
                self._event = None
                e = self._comm._flight.at(self.seq)
                if e is not None and e.event is ev:
                    return  # its flight entry still watches it: a re-record would make the entry track a later op
                self._rt.release_event(self._lane, ev)
        except Exception:
            pass

    def __repr__(self) -> str:
        state = "completed" if self.is_completed() else "pending"
        return f"<streamcoll.Work {self.op} seq={self.seq} {state}>"


POSTED_AWAIT_GRACE_S = 0.002  # how long an await of posted ops lets the loop's other tasks post theirs


class PostedWork(Work):
    """Handle of a posted point-to-point op (``isend``, ``irecv``,
    ``batch_isend_irecv``) that has not been launched yet: posted ops go out
    together, as one group (why, and when: :mod:`streamcoll.core.p2p`).

    Until then ``seq`` is 0; afterwards every method is the group's Work's.
    """

    __slots__ = ("_group", "_exc")

    def __init__(self, comm: Any, op: str, outputs: Any) -> None:
        super().__init__(comm, comm._rt, None, None, 0, op, outputs, None)
        self._group: Optional[Work] = None
        self._exc: Optional[BaseException] = None

    def _launched(self) -> Optional[Work]:
        """The group Work this op went out with, launching the posted ops of
        every communicator now if they have not been (a waiter blocks next);
        None if it was ended without a launch (``_exc``: the launch failed,
        or the communicator failed first)."""
        g = self._group
        if g is None and self._exc is None:
            launch_posted()
            g = self._group
        return g

    @property
    def posted(self) -> bool:
        """True while the op waits to be launched with the others posted."""
        return self._group is None and self._exc is None

    def _queried(self) -> Optional[Work]:
        """What a status query sees: the group Work, launching this
        communicator's posted ops only if they include a send (a poll loop
        over an exchange must terminate). A lone posted receive stays posted:
        launched by a poll, it would occupy the comm thread while the send
        posted after it waits behind it (both ranks: a deadlock torch's
        semantics do not have)."""
        g = self._group
        if g is None and self._exc is None and self._comm._posted_sends():
            self._comm._flush_posted()
            g = self._group
        return g

    def is_completed(self) -> bool:
        g = self._queried()
        return self._exc is not None if g is None else g.is_completed()

    def is_success(self) -> bool:
        g = self._queried()
        return False if g is None else g.is_success()

    def exception(self) -> Optional[BaseException]:
        g = self._queried()
        return self._exc if g is None else g.exception()

    def wait(self, timeout: Optional[float] = None) -> bool:
        g = self._launched()
        if g is None:
            raise self._exc  # type: ignore[misc]
        return g.wait(self._limit if timeout is None else timeout)  # its own timeout=, else the group's

    def synchronize(self, timeout: Optional[float] = None) -> None:
        g = self._launched()
        if g is None:
            raise self._exc  # type: ignore[misc]
        g.synchronize(self._limit if timeout is None else timeout)

    def get_future(self) -> torch.futures.Future:
        fut = self._future
        if fut is None:
            g = self._launched()
            if g is None:
                fut = torch.futures.Future()
                fut.set_exception(self._exc)  # type: ignore[arg-type]
            else:
                outs = list(self._outputs)
                fut = g.get_future().then(lambda f: (f.value(), outs)[1])
            self._future = fut
        return fut

    def __await__(self) -> Generator[Any, None, List[torch.Tensor]]:
        """As :meth:`Work.__await__`, once the posted op went out. An await
        is a wait that does not block its thread, so other tasks of the
        loop may still post the matching ops: it first lets them run and
        launches the posted ops as a status query does (only with a send
        among them: a lone receive launched would hold the comm thread while
        a send posted after it waits behind it, on every rank), and launches
        them anyway after :data:`POSTED_AWAIT_GRACE_S`, as ``wait()`` does
        at once. A send that another task posts later than that on the same
        communicator waits behind the receive, as with ``wait()`` in another
        thread: post both before awaiting either."""
        return self._posted_await().__await__()

    async def _posted_await(self) -> List[torch.Tensor]:
        import asyncio
        await asyncio.sleep(0)  # the tasks ready now run first (they may post the matching send)
        end = time.monotonic() + POSTED_AWAIT_GRACE_S
        pause = 0.0001
        while self._queried() is None and self._exc is None:
            if time.monotonic() >= end:
                self._launched()
                break
            await asyncio.sleep(pause)
            pause = min(pause * 2, 0.0005)
        g = self._group
        if g is None:
            raise self._exc  # type: ignore[misc]
        lim = self._limit if self._limit is not None else g._limit
        return await awaited(self, self.get_future, self._comm.timeout if lim is None else lim, g._timeout,
                             self._finish)

    def __repr__(self) -> str:
        if self.posted:
            return f"<streamcoll.Work {self.op} posted>"
        return f"<streamcoll.Work {self.op} seq={self.seq} {'completed' if self.is_completed() else 'pending'}>"
