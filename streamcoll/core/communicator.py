"""The Communicator: one NCCL or oneCCL communicator, its life cycle, and
the collectives, each derived from its declaration in :mod:`streamcoll.core.spec`.

Two strategies, written once (:mod:`streamcoll.core.launch`):
``async_op=False`` launches on the caller's current stream (CPU: inline on
the calling thread) and returns None; ``async_op=True`` launches on the comm
stream cached for the caller's (device, current stream) and returns a
:class:`~streamcoll.core.work.Work`. Each collective method is generated
from the table: the general method (bad input raises before any C call;
:mod:`streamcoll.core.general_methods`) and, per communicator, a fast path
for the synchronous common case.

This module holds the life cycle, hooks, failure and the general launch
(:meth:`Communicator._launch`). The other concerns are bases of the class
(their methods are its own): :class:`~streamcoll.core.fast_paths.FastPaths`,
:class:`~streamcoll.core.p2p.PostedOps` (when posted point-to-point ops go
out, and what differs from torch: :mod:`streamcoll.core.p2p`) and
:class:`~streamcoll.core.async_launch.AsyncLaunch`. :meth:`_refresh_fast_paths`
decides whether it may issue, :meth:`mark_failed` ends pending work,
:meth:`abort` tears down; the diagnostics attach through
:mod:`streamcoll.core.hooks`, never imported here. On oneCCL every call of
the process runs in its turn (:class:`streamcoll.core.turnstile.Turnstile`).

Design: docs/design.md, sections 'The Communicator: its bases, failure
and hooks', 'The two launch strategies', 'The turnstile and its rule'.
"""
from __future__ import annotations

import dataclasses
import itertools
import logging
import os
import threading
import weakref
from datetime import timedelta
from typing import Any, Callable, Dict, List, Optional, Union

import numpy as np
import torch

from . import checks as _checks
from . import general_methods
from . import hooks as _hooks
from . import recorder as _recorder
from . import spec as _spec
from . import work as _work
from ._methods import CollectiveMethods
from .backends import Backend, make_nonblocking, nccl_wait_ready
from .env_vars import read_int
from .._ffi.errors import CollectiveTimeout, CommunicatorError
from .fast_paths import FastPaths
from .launch import build_sync_launcher
from .p2p import _P2P_SYNC, _POSTED, P2POp, PostedOps  # noqa: F401  (P2POp: importable from here, as before)
from .plans import PlanContext
from .spec import Plan
from .streams import Lane, _TryLock, runtime_for
from .sync_events import for_communicator as _sync_events_for
from .timeouts import DEFAULT_TIMEOUT, env_timeout as _env_timeout, seconds as _seconds  # noqa: F401
from .work import POSTING, Work, launch_posted

log = logging.getLogger("streamcoll")

__all__ = ["Communicator", "P2POp", "LaunchRecord", "HookHandle", "communicator_by_id"]

_Tensor = torch.Tensor


@dataclasses.dataclass(frozen=True)
class LaunchRecord:
    """What a pre-launch hook receives: the communicator, the collective's
    declaration, its arguments by parameter name, and the strategy."""

    comm: "Communicator"
    spec: _spec.CollectiveSpec
    args: Dict[str, Any]
    async_op: bool

    @property
    def name(self) -> str:
        return self.spec.name


class HookHandle:
    """Returned by the ``register_*_hook`` methods; ``remove()`` detaches."""

    __slots__ = ("_remove",)

    def __init__(self, remove: Callable[[], None]) -> None:
        self._remove: Optional[Callable[[], None]] = remove

    def remove(self) -> None:
        r, self._remove = self._remove, None
        if r is not None:
            r()


LIVE: "weakref.WeakSet[Communicator]" = weakref.WeakSet()

# How long abort() and destroy() wait for another thread's launch on the same
# communicator to finish its C call before freeing the native communicator
# (a host call stuck inside the library is what abort() is for: it goes on).
ABORT_LOCK_WAIT_S = 2.0
_BY_ID: "weakref.WeakValueDictionary[int, Communicator]" = weakref.WeakValueDictionary()
_IDS = itertools.count(1)


def communicator_by_id(cid: int) -> Optional["Communicator"]:
    """The live communicator with ``Communicator.id == cid``, or None."""
    return _BY_ID.get(cid)


def live_count(backend: str) -> int:
    """How many of this process's communicators on ``backend`` are not
    destroyed (oneCCL tears its transport down with the last of them)."""
    return sum(1 for c in list(LIVE) if c.backend == backend and not c.destroyed)


# STREAMCOLL_INLINE_ASYNC_BYTES's default (Communicator.inline_async_bytes):
# measured with benchmarks/inline_async.py, see docs/benchmarks.md.
INLINE_ASYNC_BYTES = 65536


# A barrier's cost is the peers' arrival, not its bytes: async, it wakes the
# comm thread at once (what a health check or dist.barrier(timeout=) expects).
_NEVER_INLINE = frozenset({"barrier"})


def _nbytes(plan: Plan) -> int:
    """The bytes of a plan's largest buffer (what the inline-async threshold compares)."""
    return max((t.nbytes for t in plan.keep if isinstance(t, torch.Tensor)), default=0)


def _after_fork_in_child() -> None:
    """A forked child inherits the parent's communicators but not its ranks'
    peers: mark them unusable (no per-call pid check on the hot path), so a
    call raises instead of driving the parent's native communicator."""
    # the parent's posted ops are not the child's; a parent thread may have held the lock at fork
    _work.POSTING_LOCK = threading.RLock()
    POSTING.clear()
    _checks.WAITING.clear()  # the parent's threads waiting in a check are not the child's
    for c in list(LIVE):
        c._forked = True
        c._posted = []
        c._post_lock = threading.Lock()
        if not c._destroyed and c._failed is None:
            c.mark_failed(CommunicatorError(
                f"communicator {c.name!r} was created in process {c._pid} and cannot be used after "
                f"fork (in {os.getpid()}); create a new one in the child"
            ))


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


class Communicator(FastPaths, PostedOps, CollectiveMethods):
    """A communicator over ``size`` ranks on one device.

    Made by :func:`streamcoll.init` (or :meth:`split`); methods have the names,
    argument order, defaults and return conventions of the torch.distributed
    functions, without the ``group`` argument.
    """

    def __init__(
        self,
        backend: Backend,
        device: torch.device,
        handle: Any,
        rank: int,
        size: int,
        timeout: Union[None, float, timedelta] = None,
        record_stream: Optional[bool] = None,
        store: Any = None,
        name: str = "default",
        *,
        own: Dict[str, str],
        scope: Optional[str] = None,
    ) -> None:
        # ``scope``: a name of this communicator unique on its store's server and equal on every rank
        # (bootstrap's, from its unique id and a random nonce rank 0 draws at the rendezvous; a split's
        # child derives its own). Diagnostics key their store entries by it on one connection per
        # server; None: keys relative to ``store``. Set before anything can see the communicator (the
        # watchdog's pass polls it for the hang report).
        self.scope = scope
        self._backend = backend
        self._ffi = ffi = backend.ffi
        self._lib = backend.lib()
        self._handle = handle
        self._rank = rank
        self._size = size
        self._device = device
        self._dev_type = device.type
        self._dev_index = device.index if device.type != "cpu" else None
        self._gpu = device.type != "cpu"
        self.timeout = _seconds(timeout)
        if record_stream is None:
            record_stream = os.environ.get("STREAMCOLL_RECORD_STREAM", "0") not in ("", "0", "false", "False")
        self.record_stream = bool(record_stream)
        self._store = store
        self.name = name
        # streamcoll's own settings that must agree (env.OWN): those agreed at the rendezvous
        # (env.check_own's, passed by bootstrap; a split's: its parent's), so a rank's
        # environment changed later cannot make it differ
        self._own = dict(own)
        self._pid = os.getpid()
        self.id = next(_IDS)  # what compiled code receives for this communicator (an int)
        _BY_ID[self.id] = self
        self._forked = False
        self._seq = 0
        self._p2p = 0
        self._failed: Optional[BaseException] = None
        self._destroyed = False
        self._usable = False   # may issue: set by _refresh_fast_paths, the one place that decides
        self._fast_ok = False  # may take a fast path: read by the generated fast paths (one attribute)
        self._coalescing: Optional[list] = None
        self._coalescing_thread: Optional[int] = None
        # posted p2p ops not launched yet: (plan, PostedWork), all under one current-stream key
        self._posted: List[tuple] = []
        self._posted_key: Any = None
        self._posted_stream: Any = None  # the stream the posted ops were posted under (GPU: what their lane serves)
        self._post_lock = threading.Lock()
        self._pre_hooks: List[Callable[[LaunchRecord], Any]] = []
        self._rc_hooks: List[Callable[[str, int], bool]] = []
        self._debug: Any = None
        self.nonblocking = False  # NCCL config blocking=0 (set by backends.make_nonblocking)
        self.topology: Any = None  # which ranks share a host (set by bootstrap; streamcoll.startup.topology)
        stream_ctype = "cudaStream_t" if backend.name == "nccl" else "void *"
        cast = ffi.cast
        hcache: Dict[Any, Any] = {None: ffi.NULL, 0: cast(stream_ctype, 0)}

        def native(h: Any) -> Any:
            c = hcache.get(h)
            if c is None:
                c = hcache[h] = cast(stream_ctype, h)
            return c

        self._rt = runtime_for(device, native, backend.turnstile)
        # CPU async calls up to this many bytes are queued quietly (see inline_async_bytes)
        self._inline_async = 0 if self._gpu else read_int("STREAMCOLL_INLINE_ASYNC_BYTES", INLINE_ASYNC_BYTES, 0)
        self._lanes: Dict[Any, Lane] = {}
        self._deadlines: Dict[int, float] = {}  # seq -> own timeout of calls given one (AsyncLaunch._deadline_issued)
        self._deadlines_cap = 64  # _deadlines' size past which _deadline_issued prunes it (then twice what is left)
        self._cx = PlanContext(self)
        self._flight = _recorder.attach(self)
        self._sync_events = _sync_events_for(self)
        self._launch_sync = build_sync_launcher(self)
        self._fast: Dict[str, Callable[..., Any]] = {}
        # first-call checks (debug.Signatures), read by the fast paths, and the per-call checks,
        # with the values the ranks agreed on (not this process's environment now)
        self._sig = _checks.signatures_for(self, int(self._own["STREAMCOLL_SIGNATURE_CHECKS"]))
        self._build_fast_paths()
        _checks.maybe_install(self, self._own["STREAMCOLL_DEBUG_CHECKS"] == "1")
        for h in _hooks.on_create:  # the watchdog watches it (streamcoll.core.hooks)
            h(self)
        LIVE.add(self)

    # ------------------------------------------------------------ properties
    @property
    def rank(self) -> int:
        """This process's rank in the communicator."""
        return self._rank

    @property
    def size(self) -> int:
        """The number of ranks."""
        return self._size

    def get_rank(self) -> int:
        """:attr:`rank` (torch.distributed's spelling)."""
        return self._rank

    def get_world_size(self) -> int:
        """:attr:`size` (torch.distributed's spelling)."""
        return self._size

    @property
    def device(self) -> torch.device:
        """The device the communicator's tensors live on."""
        return self._device

    @property
    def backend(self) -> str:
        """``"nccl"`` or ``"oneccl"``."""
        return self._backend.name

    @property
    def handle(self) -> Any:
        """The raw ``ncclComm_t`` / ``onecclComm_t`` (cffi pointer)."""
        self._check_usable()
        return self._handle

    @property
    def seq(self) -> int:
        """How many operations were issued on this communicator."""
        return self._seq

    @property
    def flight(self) -> _recorder.FlightRecorder:
        """This communicator's flight recorder (recent operations)."""
        return self._flight

    @property
    def failure(self) -> Optional[BaseException]:
        """Why the communicator failed, or None."""
        return self._failed

    @property
    def destroyed(self) -> bool:
        """Whether :meth:`destroy` ran (later calls raise CommunicatorError)."""
        return self._destroyed

    @property
    def is_gpu(self) -> bool:
        """Whether the device is a GPU (CUDA or XPU): async work runs on comm streams."""
        return self._gpu

    @property
    def store(self) -> Any:
        """The torch.distributed store the communicator was created with (prefixed)."""
        return self._store

    def __repr__(self) -> str:
        state = "destroyed" if self._destroyed else ("failed" if self._failed else "live")
        return (f"<streamcoll.Communicator {self.name} backend={self.backend} device={self._device} "
                f"rank={self._rank} size={self._size} {state}>")

    # ------------------------------------------------------------ hooks
    def register_pre_hook(self, hook: Callable[[LaunchRecord], Any]) -> HookHandle:
        """Call ``hook(LaunchRecord)`` before each collective is planned (it may
        raise to stop it: no C call is made). While any is registered the
        fast paths are off."""
        self._pre_hooks.append(hook)
        self._refresh_fast_paths()

        def remove() -> None:
            if hook in self._pre_hooks:
                self._pre_hooks.remove(hook)
            self._refresh_fast_paths()

        return HookHandle(remove)

    def register_rc_hook(self, hook: Callable[[str, int], bool]) -> HookHandle:
        """``hook(c_function, result_code)`` runs when a C call returns a
        non-zero code; returning True means it handled it (non-blocking NCCL:
        ``ncclInProgress`` polled to completion), otherwise the error raises."""
        self._rc_hooks.append(hook)
        return HookHandle(lambda: self._rc_hooks.remove(hook) if hook in self._rc_hooks else None)

    def mark_failed(self, exc: BaseException, replace: bool = False) -> None:
        """Mark the communicator failed (later calls raise ``exc`` at once);
        ``replace``: a more detailed error replaces the one already set.

        The one place that ends pending work on failure: posted p2p ops are
        ended without a launch (their plans may hold a handle an abort
        frees), the CPU comm thread's queued work is ended without running
        and the running call's result is failed (:meth:`CpuRuntime.fail`),
        and the flight entries of unfinished work say failed (what a GPU
        Work reads). Every reader of those Works then reports the failure
        (:meth:`Work._error`)."""
        if self._failed is None or replace:
            self._failed = exc
        self._refresh_fast_paths()
        if not self._forked:  # a forked child has no comm thread, and its locks may be the parent's
            with self._post_lock:
                posted, self._posted = self._posted, []
            self._posting_changed()
            for _, w in posted:
                w._exc = self._work_failure(w.op, 0)
            self._rt.fail(lambda e: self._work_failure(e.op, e.seq))
        # Async work still in flight failed with it: its Work raises even if the
        # stream later runs it to its end (an aborted NCCL communicator's
        # results, or work queued behind a stuck call, are not to be trusted).
        fr = self._flight
        for e in fr.recent(self._seq, fr.capacity):
            if e.sync or e.state not in (_recorder.ENQUEUED, _recorder.RUNNING, _recorder.LAUNCHED):
                continue
            if e.state == _recorder.LAUNCHED and e.event is not None:
                try:
                    if e.event.query():
                        continue  # it had finished
                except Exception:
                    pass
            e.state = _recorder.FAILED
            e.error = e.error or f"communicator failed while it was in flight: {self._failed}"

    def _work_failure(self, op: str, seq: int) -> CommunicatorError:
        """The error of ``op`` ended (or left untrustworthy) by the communicator's failure."""
        what = f"{op} (sequence number {seq})" if seq else f"{op} (posted, not launched)"
        exc = CommunicatorError(f"{what} cannot complete: communicator {self.name!r} failed earlier: {self._failed}")
        exc.__cause__ = self._failed
        return exc

    def _pre(self, spec: _spec.CollectiveSpec, args: tuple, async_op: bool) -> None:
        rec = LaunchRecord(self, spec, dict(zip(spec.param_names, args)), bool(async_op))
        for h in list(self._pre_hooks):
            h(rec)

    # ------------------------------------------------------------ lifecycle
    def _check_usable(self) -> None:
        """Raise why the communicator may not issue (``_usable`` is False)."""
        if self._destroyed or self._handle is None:
            raise CommunicatorError(f"communicator {self.name!r} was destroyed; create a new one with streamcoll.init()")
        if self._failed is not None:
            raise CommunicatorError(
                f"communicator {self.name!r} failed earlier and cannot be used: {self._failed}"
            ) from self._failed
        if os.getpid() != self._pid:
            raise CommunicatorError(
                f"communicator {self.name!r} was created in process {self._pid} and cannot be used "
                f"after fork (in {os.getpid()}); create a new one in the child"
            )
        if not self._usable:
            raise CommunicatorError(f"communicator {self.name!r} cannot be used")

    def destroy(self, timeout: Optional[float] = None) -> None:
        """Release the communicator. Idempotent.

        Queued asynchronous work is waited for first (up to ``timeout``,
        default the communicator's); if it does not finish, the communicator
        is marked failed and CollectiveTimeout is raised without freeing the
        native communicator that the stuck call still uses. A failed
        communicator is not waited for: NCCL's is aborted (:meth:`abort`,
        the teardown after a failure), oneCCL's is freed once no call runs
        in it (an idle comm thread counts as finished) and left allocated
        while one does. In a forked child this only forgets the parent's
        communicator (no C call).
        """
        if self._destroyed:
            return
        if os.getpid() != self._pid or self._forked:
            self._destroyed = True  # the native communicator is the parent's: no C call
            self._refresh_fast_paths()
            return
        if self._failed is not None and self.abort():
            return  # NCCL after a failure: ncclCommAbort is the teardown (a kernel may be stuck; no synchronize)
        t = self.timeout if timeout is None else _seconds(timeout)
        if POSTING and self._failed is None:
            launch_posted()  # posted sends and receives go out, as torch's would have, before it blocks
        if self._failed is not None:
            t = 0.0  # its stuck work already failed (and was reported): do not wait for it again
        finished = self._rt.close(t)
        if self._gpu:
            for lane in list(self._lanes.values()):
                lane.stream.synchronize()
        self._destroyed = True
        self._refresh_fast_paths()
        if finished is False:
            if self._failed is not None:
                return  # native communicator left allocated: a call still runs inside it
            stuck = self._flight.inflight  # the flight entry of the call that did not return
            if stuck is not None:
                op, seq = stuck.op, stuck.seq
                shapes = [tuple(x) for x in self._flight.describe(self, stuck)["shapes"] if x is not None]
            else:
                op, seq, shapes = "destroy", self._seq, []
            raise _hooks.on_timeout(self, op, seq, t, shapes, "destroy: queued asynchronous work did not "
                                    "finish; native communicator left allocated")
        if self._failed is None:
            _checks.release(self)  # the keys its checks left in the store, once no rank reads them
        lock = self._rt.exec_lock  # not under another thread's launch or the watchdog's query
        # not acquire() then try: an interrupt at that call's end kept the lock (streams._TryLock)
        with _TryLock(lock, ABORT_LOCK_WAIT_S) as got:
            if not got:
                log.warning("streamcoll: destroy(%s): another thread is inside a call on it; the native "
                            "communicator is left allocated (freeing it under that call would crash)", self.name)
                return
            try:
                handle, self._handle = self._handle, None
                self._refresh_fast_paths()
                self._lanes.clear()
                if self._sync_events is not None:
                    self._sync_events.close()
            finally:
                lock.release()
        if handle is not None:
            wait = max(t, ABORT_LOCK_WAIT_S)
            if self._backend.turnstile is not None and any(
                    c is not self and c._backend is self._backend and c._failed is not None and c._in_library()
                    for c in list(LIVE)):
                # a call inside a failed communicator may hold the turn and never return
                # (oneCCL cannot abort): do not wait this communicator's whole timeout for it
                wait = ABORT_LOCK_WAIT_S
            with self._backend.serial(wait, f"destroy of communicator {self.name!r}") as turn:
                if not turn:
                    log.warning("streamcoll: destroy(%s): an earlier oneCCL call of this process has not returned "
                                "within %.1f s (its calls run one at a time, in issue order); the native "
                                "communicator is left allocated", self.name, wait)
                    return
                self._backend.destroy(handle, finalize=False)

    def abort(self) -> bool:
        """Abort the native communicator where the library can (NCCL), so
        stuck calls return; marks the communicator failed (its pending work
        ends with the failure: :meth:`mark_failed`). Returns False where the
        library has no abort (oneCCL 2022.2): a call still inside it then
        never returns, and the process's exit skips the native teardown
        (which would crash under it) and keeps its status
        (:func:`streamcoll.diagnostics.watchdog.skip_native_teardown`): end the process.

        The one teardown after a failure, for each library: the watchdog and
        timed-out waits call it too. A communicator that :meth:`destroy`
        left allocated (a call still ran in it) is aborted here as well."""
        if self._handle is None:
            return False  # freed: destroyed or aborted
        self.mark_failed(self._failed or CommunicatorError("communicator aborted"))
        if self._forked or os.getpid() != self._pid:
            return False  # the native communicator is the parent's
        busy = self._in_library()
        if not self._backend.can_abort:
            ok = False
        else:
            # Not under another thread's launch: launchers hold the exec lock
            # from reading the handle to the end of the C call (and the sync
            # event's record), the watchdog while it queries the handle. A
            # host call stuck inside NCCL (a blocking communicator) is what an
            # abort is for: after ABORT_LOCK_WAIT_S it aborts without the lock,
            # as ncclCommAbort allows from another thread.
            lock = self._rt.exec_lock
            with _TryLock(lock, ABORT_LOCK_WAIT_S) as got:  # not got = acquire() then try (see destroy)
                try:
                    if self._handle is None:
                        return False  # another thread aborted it meanwhile
                    ok = self._backend.abort(self._handle)
                    if ok:
                        self._handle = None
                        self._destroyed = True
                        self._refresh_fast_paths()
                        if self._sync_events is not None:
                            self._sync_events.close()
                finally:
                    if got:
                        lock.release()
        if not ok and busy:
            _hooks.teardown_guard()  # streamcoll.diagnostics.watchdog.skip_native_teardown
        return ok

    def _in_library(self) -> bool:
        """Whether a C call of this communicator may be running now: a
        synchronous call in flight or the CPU comm thread inside one."""
        return self._flight.cur is not None or getattr(self._rt, "running", None) is not None

    def __enter__(self) -> "Communicator":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.destroy()

    def _timed_out(self, op: str, seq: int, timeout: float, tensors: Any, detail: str = "",
                   own: bool = False) -> CollectiveTimeout:
        """Mark failed, dump the flight record, abort (NCCL); the error to raise
        (``own``: the call's own ``timeout=`` passed, a deadline the caller set)."""
        shapes = [tuple(t.shape) for t in (tensors or ()) if isinstance(t, _Tensor)]
        return _hooks.on_timeout(self, op, seq, timeout, shapes, detail, own=own)  # streamcoll.diagnostics.watchdog.handle_timeout

    def dump_flight_record(self, path: Optional[str] = None) -> str:
        """Write this rank's flight record (recent operations) as JSON; returns
        the file. ``path``: a file or a directory (default ``STREAMCOLL_FLIGHT_DIR``).
        Read the dumps of all ranks with ``python -m streamcoll.flight analyze DIR``."""
        return _recorder.dump(self, path, "on request")

    # ------------------------------------------------------------ launching
    def _raise_rc(self, cname: str, rc: int) -> None:
        """A C call returned ``rc``: an rc hook may handle it; else raise the library error."""
        for h in self._rc_hooks:
            if h(cname, rc):
                return
        raise self._backend.binding.error(self._backend.funcs.get(cname, cname), rc, self._handle)

    def _launch(self, name: str, plan: Plan, async_op: Any, stream: Any, limit: Optional[float] = None
                ) -> Optional[Work]:
        """The one entry of both strategies (general path); ``limit``: the
        call's own timeout in seconds (checked), None: the communicator's."""
        if async_op is not False and async_op is not True:
            if not isinstance(async_op, (bool, np.bool_)):
                raise TypeError(f"async_op: expected a bool, got {async_op!r}")
            async_op = bool(async_op)
        if not self._usable:
            self._check_usable()
        if stream is not None and not async_op:  # with async_op: the ValueError below
            self._check_stream(name, stream)
        if self._coalescing is not None and self._coalescing_thread == threading.get_ident():
            self._coalescing.append((name, plan, limit))
            return None
        if async_op:
            if stream is not None:
                raise ValueError(f"stream: {name}(async_op=True) launches on the comm stream of the current "
                                 "stream; make the stream current (torch.cuda.stream(s)) instead of passing stream=")
            if name in _POSTED:
                return self._post(name, plan, limit)
            if self._posted:
                self._flush_posted()
            return self._launch_async(name, plan, here=(self._inline_async and name not in _NEVER_INLINE
                                                        and _nbytes(plan) <= self._inline_async), limit=limit)
        if self._posted and name in _P2P_SYNC and stream is None:
            # with the posted ops in one group: a blocking send/recv after
            # an irecv/isend must not wait behind them (nor they behind it)
            self._post(name, plan, limit).wait()
            return None
        if POSTING:
            launch_posted()  # it blocks: nothing this process posted may be what a peer waits on
        if limit is not None:  # its own deadline (AsyncLaunch._launch_limited)
            self._launch_limited(name, plan, stream, limit)
            return None
        return self._launch_sync(name, plan, stream)

    def _check_stream(self, name: str, stream: Any) -> None:
        """``stream=`` must be a stream of this communicator's device type.
        On the CPU the one stream is the calling thread: a CPU stream
        (``torch.cpu.current_stream()``, what device-agnostic code passes)
        is accepted and changes nothing; anything else is an error instead
        of being ignored."""
        if self._gpu:
            if hasattr(stream, "cuda_stream") or hasattr(stream, "sycl_queue") or isinstance(stream, torch.Stream):
                return
        elif isinstance(stream, torch.cpu.Stream) or (isinstance(stream, torch.Stream)
                                                       and getattr(stream, "device_type", None) in ("cpu", 0)):
            return
        raise TypeError(f"stream: {name} on a {self._dev_type} communicator expects a {self._dev_type} stream "
                        f"(torch.{self._dev_type}.Stream) or None, got {stream!r}")

    def _posting_changed(self) -> None:
        """Keep :data:`streamcoll.core.work.POSTING` (the communicators holding
        posted ops) in step with ``_posted``; when it turns empty or
        non-empty, every live communicator's fast paths are refreshed (a
        synchronous call anywhere must launch posted ops first)."""
        with _work.POSTING_LOCK:
            was = bool(POSTING)
            if self._posted:
                POSTING[id(self)] = self
            else:
                POSTING.pop(id(self), None)
            if was != bool(POSTING):
                for c in list(LIVE):
                    c._refresh_fast_paths()

    def split(self, color: Optional[int], key: int = 0, timeout: Any = None) -> Optional["Communicator"]:
        """A communicator of the ranks passing the same ``color``, ordered by
        ``(key, rank)`` (the library's CommSplit). Every rank must call it; a
        rank passing ``color=None`` (or a negative color) gets None.

        Rank and size of the new communicator are computed here from an
        all_gather of (color, key) on this one: oneCCL 2022.2's CommCount and
        CommUserRank return wrong values on split communicators.
        """
        self._check_usable()
        c = -1 if color is None else color
        if isinstance(c, bool) or not isinstance(c, (int, np.integer)):
            raise TypeError(f"color: expected an int or None, got {color!r}")
        if isinstance(key, bool) or not isinstance(key, (int, np.integer)):
            raise TypeError(f"key: expected an int, got {key!r}")
        if self._pre_hooks:
            self._pre(_SPLIT, (color, key), False)
        c = int(c) if c >= 0 else -1
        mine = torch.tensor([c, int(key)], dtype=torch.int64, device=self._device)
        allv = torch.empty(2 * self._size, dtype=torch.int64, device=self._device)
        ag = _spec.TABLE["all_gather_into_tensor"]
        self._launch("split", ag.planner(self._cx, allv, mine), False, None)
        pairs = allv.view(self._size, 2).cpu().tolist()
        # Every rank now knows every (color, key): the new ranks are computed
        # here, and the library is given each rank's new index as its key
        # (same order; oneCCL rejects negative keys, torch/NCCL allow them).
        members = sorted((k, r) for r, (cc, k) in enumerate(pairs) if cc == c) if c >= 0 else []
        if not self._backend.split_orders_by_key:
            # oneCCL 2022.2 ignores the key and orders by parent rank. Every
            # rank sees every pair, so all of them raise here, together.
            for cc in {cc for cc, _ in pairs if cc >= 0}:
                by_key = [r for _, r in sorted((k, r) for r, (c2, k) in enumerate(pairs) if c2 == cc)]
                if by_key != sorted(by_key):
                    raise ValueError(
                        f"key: backend {self.backend!r} orders split communicators by parent rank and "
                        f"ignores keys; the keys given for color {cc} would order ranks {by_key}. "
                        "Pass keys in parent-rank order (or equal keys)."
                    )
        new_rank = [r for _, r in members].index(self._rank) if c >= 0 else 0
        # every rank of this communicator splits it as often (split is collective): the k-th split's
        # children have names no other communicator has, which keys what they keep in the store
        k = self._splits = getattr(self, "_splits", 0) + 1
        newh = self._backend.split(self._handle, c, new_rank, in_progress_ok=self.nonblocking)
        if c < 0:
            return None
        if self.nonblocking:
            # the child inherits blocking=0: ncclCommSplit may return while it
            # initialises. Ready (or aborted and raised) before a Communicator,
            # and with it the watchdog, ever holds the handle.
            nccl_wait_ready(self._backend, newh, self.timeout if timeout is None else timeout, "split",
                            new_rank, len(members))
        child = adopt(self._backend, newh, lambda: Communicator(
            self._backend, self._device, newh, new_rank, len(members),
            self.timeout if timeout is None else timeout, self.record_stream, self._store,
            name=f"{self.name}/split{c}" if k == 1 else f"{self.name}/split{c}.{k}", own=self._own,
            scope=None if self.scope is None else
            f"{self.scope}/{self.name}/split{c}" + ("" if k == 1 else f".{k}") + f"/{len(members)}",
        ))
        if self.topology is not None:  # derived from this one's: no store, no exchange
            child.topology = self.topology.subgroup([r for _, r in members], new_rank)
        if self.nonblocking:
            make_nonblocking(child)
        return child


def adopt(backend: Any, handle: Any, make: Callable[[], "Communicator"]) -> "Communicator":
    """``make()``, the Communicator that owns native ``handle``; if it
    raises (a KeyboardInterrupt in its construction), the native
    communicator is freed, not left allocated with nobody to free it (oneCCL
    has a bounded number of communicator ids)."""
    try:
        return make()
    except BaseException:
        for c in list(LIVE):  # registered before it was interrupted: it owns the handle now
            if getattr(c, "_handle", None) == handle:
                c._handle = None
                c._destroyed = True
        with backend.serial():
            backend.destroy(handle, finalize=False)
        raise


# split is checked by debug mode like a collective (every rank calls it).
_SPLIT = _spec.CollectiveSpec(name="split", params=(_spec.ParamSpec("color", _spec.ANY),
                                                   _spec.ParamSpec("key", _spec.ANY, 0)),
                              doc="", planner=lambda cx: None)  # type: ignore[arg-type,return-value]


general_methods.install(Communicator)
