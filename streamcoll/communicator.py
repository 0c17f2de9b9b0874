"""The Communicator: one NCCL or oneCCL communicator plus the two launch
strategies every collective goes through.

``async_op=False``, the current-stream strategy: the C call is launched on
the caller's current stream (CPU: inline on the calling thread). No event, no
cross-stream wait, no ``record_stream``; ordering with the caller's own work is
the stream's. Returns None, as torch.distributed does.

``async_op=True``, the comm-stream strategy: the comm stream cached for the
caller's (device, current stream) waits on an event recorded on the current
stream, the collective is launched on it, a completion event is recorded, and a
:class:`~streamcoll.work.Work` comes back. The tensors stay referenced until
the caller's stream waited on the completion (or, never waited, until the
event fired); with ``record_stream=True`` they are instead marked with
``Tensor.record_stream`` (``STREAMCOLL_RECORD_STREAM=1``).

Everything that can be checked is checked before the first C call, so a bad
argument raises on the calling rank without leaving the others waiting
inside a half-issued collective.
"""
from __future__ import annotations

import contextlib
import os
import threading
import time
import weakref
from datetime import timedelta
from typing import Any, Callable, Dict, List, Optional, Sequence, Union

import numpy as np
import torch

from . import debug as _debug
from .backends import Backend
from .errors import CollectiveTimeout, CommunicatorError
from .ops import ReduceOp, canonical_op, op_key
from .streams import Lane, runtime_for
from .validation import as_tensor, check_list, check_rank, check_same
from .work import REAPER, Work

# Flight recorder (streamcoll.flight, imported lazily so that
# ``python -m streamcoll.flight`` runs without a double import).
_now = time.monotonic_ns
_wref = weakref.ref

__all__ = ["Communicator", "P2POp"]

_Tensor = torch.Tensor
_SUM = ReduceOp.SUM
_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)

DEFAULT_TIMEOUT = 600.0  # seconds, as torch.distributed's default for NCCL


def _seconds(timeout: Union[None, float, timedelta]) -> float:
    if timeout is None:
        return float(os.environ.get("STREAMCOLL_TIMEOUT", DEFAULT_TIMEOUT))
    if isinstance(timeout, timedelta):
        return timeout.total_seconds()
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0:
        raise ValueError(f"timeout: expected a positive number of seconds or a timedelta, got {timeout!r}")
    return float(timeout)


class P2POp:
    """A point-to-point operation for :meth:`Communicator.batch_isend_irecv`
    (the fields of torch.distributed.P2POp: ``op`` is ``isend``/``irecv``
    (streamcoll's or torch's), ``tensor``, ``peer``, ``group``, ``tag``)."""

    __slots__ = ("op", "tensor", "peer", "group", "tag")

    def __init__(self, op: Callable, tensor: torch.Tensor, peer: int, group: Any = None, tag: int = 0) -> None:
        self.op = op
        self.tensor = tensor
        self.peer = peer
        self.group = group
        self.tag = tag


_LIVE: "weakref.WeakSet[Communicator]" = weakref.WeakSet()


def _after_fork_in_child() -> None:
    """A forked child inherits the parent's communicators but not its ranks'
    peers: mark them unusable (no per-call pid check on the hot path), so a
    call raises instead of driving the parent's native communicator."""
    for c in list(_LIVE):
        if not c._destroyed and c._failed is None:
            c._failed = CommunicatorError(
                f"communicator {c.name!r} was created in process {c._pid} and cannot be used after "
                f"fork (in {os.getpid()}); create a new one in the child"
            )
        c._forked = True


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


class Communicator:
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
    ) -> None:
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
        self._cpu = not self._gpu
        self.timeout = _seconds(timeout)
        if record_stream is None:
            record_stream = os.environ.get("STREAMCOLL_RECORD_STREAM", "0") not in ("", "0", "false", "False")
        self.record_stream = bool(record_stream)
        self._store = store
        self.name = name
        self._pid = os.getpid()
        self._seq = 0
        self._failed: Optional[BaseException] = None
        self._destroyed = False
        self._lock = threading.Lock()
        self._coalescing: Optional[list] = None
        self._coalescing_thread: Optional[int] = None
        self._dtypes = backend.dtypes
        self._emulated = backend.emulated(device.type)
        self._op_cache: Dict[Any, tuple] = {}
        stream_ctype = "cudaStream_t" if backend.name == "nccl" else "void *"
        null = ffi.NULL
        cast = ffi.cast
        hcache: Dict[Any, Any] = {None: null, 0: cast(stream_ctype, 0)}

        def native(h):
            c = hcache.get(h)
            if c is None:
                c = hcache[h] = cast(stream_ctype, h)
            return c

        self._rt = runtime_for(device, native)
        self._lanes: Dict[Any, Lane] = {}
        # data_ptr -> its ``void *`` cdata. ffi.cast costs ~0.6 us a call (a
        # third of a small all_reduce's wrapper overhead); the cdata is only an
        # address, owning nothing, so reusing it for the same address is safe.
        # Bounded: cleared when full.
        ptrs: Dict[int, Any] = {}
        self._ptrs = ptrs
        voidp = ffi.typeof("void *")

        def vp(t, _get=ptrs.get):
            a = t.data_ptr()
            p = _get(a)
            if p is None:
                if len(ptrs) >= 4096:
                    ptrs.clear()
                p = ptrs[a] = cast(voidp, a)
            return p

        self._vp = vp
        self._sum_specs: Dict[torch.dtype, tuple] = {}
        # C functions, resolved once (lazily failing ones stay None).
        self._c: Dict[str, Any] = {}
        for coll, fname in backend.funcs.items():
            try:
                self._c[coll] = getattr(self._lib, fname)
            except AttributeError:
                self._c[coll] = None
        self._barrier_buf: Optional[torch.Tensor] = None
        # Reliability (issue 7): flight recorder ring, debug checks, watchdog.
        from . import flight, watchdog
        flight.attach(self)
        _debug.maybe_install(self)
        watchdog.register(self)
        _LIVE.add(self)

    # ------------------------------------------------------------ properties
    @property
    def rank(self) -> int:
        return self._rank

    @property
    def size(self) -> int:
        return self._size

    def get_rank(self) -> int:
        return self._rank

    def get_world_size(self) -> int:
        return self._size

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def backend(self) -> str:
        return self._backend.name

    @property
    def handle(self):
        """The raw ``ncclComm_t`` / ``onecclComm_t`` (cffi pointer)."""
        self._check_usable()
        return self._handle

    @property
    def seq(self) -> int:
        """How many operations were issued on this communicator."""
        return self._seq

    def __repr__(self) -> str:
        state = "destroyed" if self._destroyed else ("failed" if self._failed else "live")
        return (f"<streamcoll.Communicator {self.name} backend={self.backend} device={self._device} "
                f"rank={self._rank} size={self._size} {state}>")

    # ------------------------------------------------------------ lifecycle
    def _check_usable(self) -> None:
        if self._destroyed:
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

    def destroy(self, timeout: Optional[float] = None) -> None:
        """Release the communicator. Idempotent.

        Queued asynchronous work is waited for first (up to ``timeout``,
        default the communicator's); if it does not finish, the communicator
        is marked failed and CollectiveTimeout is raised without freeing the
        native communicator that the stuck call still uses. In a forked child
        this only forgets the parent's communicator (no C call).
        """
        if self._destroyed:
            return
        if os.getpid() != self._pid or getattr(self, "_forked", False):
            self._destroyed = True  # the native communicator is the parent's: no C call
            return
        t = self.timeout if timeout is None else _seconds(timeout)
        if self._failed is not None:
            t = 0.0  # its stuck work already failed (and was reported): do not wait for it again
        finished = self._rt.close(t)
        if self._gpu:
            for lane in list(self._lanes.values()):
                lane.stream.synchronize()
        self._destroyed = True
        if finished is False:
            if self._failed is not None:
                return  # native communicator left allocated: a call still runs inside it
            from .watchdog import handle_timeout
            stuck = self._inflight_async  # the flight entry of the call that did not return
            if stuck is not None:
                op, seq = stuck[1], stuck[0]
                shapes = [tuple(x) for x in self._flight.describe(self, stuck)["shapes"] if x is not None]
            else:
                op, seq, shapes = "destroy", self._seq, []
            raise handle_timeout(self, op, seq, t, shapes,
                                 "destroy: queued asynchronous work did not finish; native communicator left allocated")
        handle, self._handle = self._handle, None
        self._lanes.clear()
        if handle is not None:
            self._backend.destroy(handle, finalize=False)

    def abort(self) -> bool:
        """Abort the native communicator where the library can (NCCL), so
        stuck calls return; marks the communicator unusable. Returns False
        where the library has no abort (oneCCL 2022.2: exit the process)."""
        if self._destroyed or self._handle is None:
            return False
        self._failed = self._failed or CommunicatorError("communicator aborted")
        ok = self._backend.abort(self._handle)
        if ok:
            self._handle = None
            self._destroyed = True
        return ok

    def __enter__(self) -> "Communicator":
        return self

    def __exit__(self, *exc) -> None:
        self.destroy()

    def _timed_out(self, op: str, seq: int, timeout: float, tensors, detail: str = "") -> CollectiveTimeout:
        """Mark failed, dump the flight record, abort (NCCL); the error to raise."""
        shapes = [tuple(t.shape) for t in (tensors or ()) if isinstance(t, _Tensor)]
        from .watchdog import handle_timeout
        return handle_timeout(self, op, seq, timeout, shapes, detail)

    def dump_flight_record(self, path: Optional[str] = None) -> str:
        """Write this rank's flight record (recent operations) as JSON; returns
        the file. ``path``: a file or a directory (default ``STREAMCOLL_FLIGHT_DIR``).
        Read the dumps of all ranks with ``python -m streamcoll.flight analyze DIR``."""
        from .flight import dump
        return dump(self, path, "on request")

    # ------------------------------------------------------------ helpers
    def _t(self, t: Any, name: str) -> torch.Tensor:
        if type(t) is _Tensor and not self._gpu and t.is_cpu and t.is_contiguous():
            return t
        return as_tensor(t, name, self._device, self._dev_type, self._dev_index)

    def _dt(self, t: torch.Tensor, opname: str = "", name: str = "tensor") -> int:
        d = self._dtypes.get(t.dtype)
        if d is None:
            supported = ", ".join(str(x).replace("torch.", "") for x in self._dtypes)
            raise TypeError(
                f"{name}: dtype {t.dtype} is not supported by {opname or 'this collective'} "
                f"on backend {self.backend!r} (supported: {supported})"
            )
        return d

    def _op(self, op: Any, dtype: torch.dtype, opname: str) -> tuple:
        """(C reduction, post kind, factor) for ``op`` on ``dtype``; cached."""
        key = (op_key(op), dtype)
        spec = self._op_cache.get(key)
        if spec is not None:
            return spec
        name, factor = canonical_op(op)
        b = self._backend
        if dtype == torch.bool:
            if name not in b.bool_ops:
                raise TypeError(f"op: {name} is not defined for dtype torch.bool in {opname} "
                                f"on backend {self.backend!r} (SUM, PRODUCT, MIN, MAX are)")
            spec = (b.bool_ops[name], None, 1.0)
        elif name in ("AVG", "PREMUL_SUM") and (name in self._emulated or name == "PREMUL_SUM"):
            if name == "PREMUL_SUM" and dtype not in _FLOATS:
                raise TypeError(f"op: PREMUL_SUM needs a floating dtype in {opname}, got {dtype} "
                                f"on backend {self.backend!r}")
            if name == "AVG" and dtype not in _FLOATS and dtype not in self._dtypes:
                raise TypeError(f"op: AVG is not supported for {dtype} in {opname} on backend {self.backend!r}")
            # SUM, then scale the result in place on the same stream.
            spec = (b.ops["SUM"], name, factor)
        else:
            spec = (b.ops[name], None, 1.0)
        self._op_cache[key] = spec
        return spec

    def _post(self, kind: Optional[str], factor: float, out: torch.Tensor, applies: bool = True):
        if kind is None or not applies:
            return None
        if kind == "AVG":
            n = self._size
            if out.dtype in _FLOATS:
                return lambda: out.div_(n)
            return lambda: out.copy_(torch.div(out, n, rounding_mode="trunc"))
        return lambda: out.mul_(factor)

    def _err(self, fname: str, rc: int):
        return self._backend.binding.error(self._backend.funcs.get(fname, fname), rc, self._handle)

    def _need(self, coll: str):
        f = self._c.get(coll)
        if f is None:
            fname = self._backend.funcs.get(coll)
            if fname is None:
                raise NotImplementedError(f"{coll} is not available on backend {self.backend!r}")
            getattr(self._lib, fname)  # raises FunctionNotFoundError naming the version
        return f

    # ------------------------------------------------------------ launching
    def _launch(self, name: str, fn, post, tensors: tuple, outputs: tuple, async_op: bool, stream) -> Optional[Work]:
        if self._handle is None or self._failed is not None:
            self._check_usable()
        self._seq += 1
        if self._coalescing is not None and self._coalescing_thread == threading.get_ident():
            self._coalescing.append((name, fn, post, tensors, outputs))
            return None
        if not async_op:
            rt = self._rt
            # Flight record (layout in flight.py): one 3-tuple, one list store, no
            # lock; ``_cur`` names the tensors of the call in flight (for a watchdog message).
            seq = self._seq
            self._ring[seq & self._ring_mask] = (seq, name, self._p2p)
            self._cur = tensors
            try:
                if stream is None:
                    rt.run_current(fn, post)
                else:
                    rt.run_on(stream, fn, post)
            except BaseException as x:
                self._flight.failed(seq, x)
                raise
            finally:
                self._done = seq  # synchronous calls up to here returned
                self._cur = None
            return None
        return self._launch_async(name, fn, post, tensors, outputs)

    def _launch_async(self, name, fn, post, tensors, outputs) -> Work:
        rt = self._rt
        if self._gpu and rt.is_capturing():
            raise RuntimeError(
                f"{name}(async_op=True) during CUDA graph capture is not supported; use async_op=False "
                "(it launches on the capturing stream)"
            )
        key = rt.current_key()
        lane = self._lanes.get(key)
        if lane is None:
            lane = self._lanes[key] = rt.new_lane(key)
        seq = self._seq
        e = [seq, name, self._p2p, _now(), tuple(map(_wref, tensors)), 0, 0, "enqueued", None, None]
        self._ring[seq & self._ring_mask] = e
        if not self._gpu:
            fn = self._watched(fn, e)
        token = rt.submit(lane, fn, post, tensors)
        ev = rt.completion_event(lane, token)
        if self._gpu:
            e[5] = e[3]
            e[7] = "launched"
            e[8] = ev  # the watchdog polls it
        stash = None
        if self._gpu:
            if self.record_stream:
                rt.keep_alive(tensors, lane)
            else:
                stash = REAPER.add(ev, tensors)
        return Work(self, rt, lane, ev, self._seq, name, outputs, stash)

    def _watched(self, fn, e: list):
        """``fn`` for the CPU comm thread, recording start, end and state in
        flight entry ``e`` (what the watchdog looks at)."""
        def run(h):
            e[5] = _now()
            e[7] = "running"
            self._inflight_async = e
            try:
                fn(h)
            except BaseException as x:
                e[7] = "failed"
                e[9] = f"{type(x).__name__}: {x}"
                raise
            finally:
                self._inflight_async = None
            e[6] = _now()
            e[7] = "completed"

        return run

    def _complete_future_when_done(self, work: Work) -> None:
        rt = self._rt
        if hasattr(rt, "on_complete"):
            rt.on_complete(work._event, work._set_future)
        else:
            # GPU: poll on a helper thread (the future completes when the GPU work has).
            def _poll(w=work):
                rt.synchronize(w._event, None)
                w._set_future()
            threading.Thread(target=_poll, daemon=True, name="streamcoll-future").start()

    def comm_stream(self, current: Any = None) -> Any:
        """The comm stream (lane) serving the caller's current stream, creating it if needed."""
        rt = self._rt
        key = rt.current_key() if current is None else current
        lane = self._lanes.get(key)
        if lane is None:
            lane = self._lanes[key] = rt.new_lane(key)
        return lane.stream

    @contextlib.contextmanager
    def coalescing(self, async_op: bool = False):
        """Batch the collectives issued in the block into one group launch
        (GroupStart/GroupEnd) with one Work. Yields a handle whose ``work`` is
        the Work (``async_op=True``) once the block exits, and whose
        ``wait()`` waits for it."""
        if self._coalescing is not None:
            raise RuntimeError("coalescing() blocks do not nest")
        handle = _Coalesced()
        self._coalescing = ops = []
        self._coalescing_thread = threading.get_ident()
        try:
            yield handle
        finally:
            self._coalescing = None
            self._coalescing_thread = None
        if ops:
            handle.work = self._launch_group("coalesced", ops, async_op)

    def _launch_group(self, name, ops, async_op):
        gs, ge = self._c["group_start"], self._c["group_end"]
        fns = [o[1] for o in ops]
        posts = [o[2] for o in ops if o[2] is not None]

        def fn(h):
            rc = gs()
            if rc:
                raise self._err("group_start", rc)
            try:
                for f in fns:
                    f(h)
            finally:
                rc = ge()
            if rc:
                raise self._err("group_end", rc)

        post = (lambda: [p() for p in posts]) if posts else None
        tensors = tuple(t for o in ops for t in o[3])
        outputs = tuple(t for o in ops for t in o[4])
        self._seq -= 1  # the group counts once
        return self._launch(name, fn, post, tensors, outputs, async_op, None)

    # ------------------------------------------------------------ collectives
    def all_reduce(self, tensor, op=_SUM, async_op: bool = False, *, stream=None) -> Optional[Work]:
        """Reduce ``tensor`` across ranks in place (torch.distributed.all_reduce)."""
        if type(tensor) is _Tensor and not self._gpu and tensor.is_cpu and tensor.is_contiguous():
            t = tensor
        else:
            t = self._t(tensor, "tensor")
        dtype = t.dtype
        d = self._dtypes.get(dtype)
        if d is None:
            d = self._dt(t, "all_reduce")
        if op is _SUM:  # skips hashing the key (Enum.__hash__ is Python code)
            spec = self._sum_specs.get(dtype)
            if spec is None:
                spec = self._sum_specs[dtype] = self._op(op, dtype, "all_reduce")
        else:
            spec = self._op_cache.get((op, dtype)) if op.__hash__ is not None else None
            if spec is None:
                spec = self._op(op, dtype, "all_reduce")
        red = spec[0]
        n = t.numel()
        f = self._c["all_reduce"]
        comm = self._handle
        a = t.data_ptr()
        ptr = self._ptrs.get(a)
        if ptr is None:
            ptr = self._vp(t)
        if spec[1] is None:
            post = None
            rt = self._rt
            if (not async_op and stream is None and self._cpu and comm is not None
                    and self._failed is None and self._coalescing is None):
                # The hot path, inlined: what _launch + CpuRuntime.run_current
                # do for a synchronous host call, without the closure and two
                # frames (about 1.5 us of a ~10 us call). Same flight record,
                # same lock, same ordering rule (queued async work first).
                lock = rt.exec_lock
                lock.acquire()
                if not rt._pending:
                    seq = self._seq = self._seq + 1
                    self._ring[seq & self._ring_mask] = (seq, "all_reduce", self._p2p)
                    self._cur = (t,)
                    try:
                        rc = f(ptr, ptr, n, d, red, comm, rt._null)
                    finally:
                        lock.release()
                        self._done = seq
                        self._cur = None
                    if rc:
                        exc = self._err("all_reduce", rc)
                        self._flight.failed(seq, exc)
                        raise exc
                    return None
                lock.release()
        else:
            post = self._post(spec[1], spec[2], t)

        def fn(h):
            rc = f(ptr, ptr, n, d, red, comm, h)
            if rc:
                raise self._err("all_reduce", rc)

        return self._launch("all_reduce", fn, post, (t,), (t,), async_op, stream)

    allreduce = all_reduce

    def broadcast(self, tensor, src: int = 0, async_op: bool = False, *, stream=None) -> Optional[Work]:
        """Copy ``tensor`` of rank ``src`` to every rank (in place)."""
        t = self._t(tensor, "tensor")
        src = check_rank(src, "src", self._size)
        d = self._dt(t, "broadcast")
        n, comm, ptr, f = t.numel(), self._handle, self._vp(t), self._c["broadcast"]

        def fn(h):
            rc = f(ptr, ptr, n, d, src, comm, h)
            if rc:
                raise self._err("broadcast", rc)

        return self._launch("broadcast", fn, None, (t,), (t,), async_op, stream)

    def reduce(self, tensor, dst: int = 0, op=_SUM, async_op: bool = False, *, stream=None) -> Optional[Work]:
        """Reduce ``tensor`` onto rank ``dst`` (in place there; other ranks' tensors are unchanged)."""
        t = self._t(tensor, "tensor")
        dst = check_rank(dst, "dst", self._size)
        d = self._dt(t, "reduce")
        red, kind, factor = self._op(op, t.dtype, "reduce")
        post = self._post(kind, factor, t, self._rank == dst)
        n, comm, ptr, f = t.numel(), self._handle, self._vp(t), self._c["reduce"]
        # oneCCL writes the receive buffer on every rank; non-roots get a scratch one.
        if self._rank != dst and self._backend.name == "oneccl":
            scratch = torch.empty_like(t)
            rptr = self._vp(scratch)
        else:
            scratch, rptr = None, ptr

        def fn(h):
            rc = f(ptr, rptr, n, d, red, dst, comm, h)
            if rc:
                raise self._err("reduce", rc)

        keep = (t,) if scratch is None else (t, scratch)
        return self._launch("reduce", fn, post, keep, (t,), async_op, stream)

    def all_gather_into_tensor(self, output_tensor, input_tensor, async_op: bool = False, *, stream=None) -> Optional[Work]:
        """Gather every rank's ``input_tensor`` into ``output_tensor`` (rank order, dim 0)."""
        out = self._t(output_tensor, "output_tensor")
        inp = self._t(input_tensor, "input_tensor")
        check_same(inp, out, "input_tensor", "output_tensor")
        d = self._dt(inp, "all_gather_into_tensor", "input_tensor")
        n = inp.numel()
        if out.numel() != n * self._size:
            raise ValueError(
                f"output_tensor: expected {n * self._size} elements (world size {self._size} x "
                f"input_tensor's {n}), got {out.numel()}"
            )
        comm, ip, op_, f = self._handle, self._vp(inp), self._vp(out), self._c["all_gather"]

        def fn(h):
            rc = f(ip, op_, n, d, comm, h)
            if rc:
                raise self._err("all_gather", rc)

        return self._launch("all_gather_into_tensor", fn, None, (inp, out), (out,), async_op, stream)

    _all_gather_base = all_gather_into_tensor

    def all_gather(self, tensor_list, tensor, async_op: bool = False, *, stream=None) -> Optional[Work]:
        """Gather every rank's ``tensor`` into ``tensor_list[rank]``."""
        inp = self._t(tensor, "tensor")
        lst = check_list(tensor_list, "tensor_list", self._size)
        outs = [self._t(o, f"tensor_list[{i}]") for i, o in enumerate(lst)]
        for i, o in enumerate(outs):
            check_same(inp, o, "tensor", f"tensor_list[{i}]")
            if o.numel() != inp.numel():
                raise ValueError(f"tensor_list[{i}]: expected {inp.numel()} elements like tensor, got {o.numel()}")
        flat = torch.empty((self._size * inp.numel(),), dtype=inp.dtype, device=inp.device)
        d = self._dt(inp, "all_gather")
        n, comm, ip, fp, f = inp.numel(), self._handle, self._vp(inp), self._vp(flat), self._c["all_gather"]

        def fn(h):
            rc = f(ip, fp, n, d, comm, h)
            if rc:
                raise self._err("all_gather", rc)

        def post():
            for i, o in enumerate(outs):
                o.view(-1).copy_(flat[i * n:(i + 1) * n])

        return self._launch("all_gather", fn, post, (inp, flat, *outs), tuple(outs), async_op, stream)

    def reduce_scatter_tensor(self, output, input, op=_SUM, async_op: bool = False, *, stream=None) -> Optional[Work]:
        """Reduce ``input`` across ranks and leave block ``rank`` of the result in ``output``."""
        out = self._t(output, "output")
        inp = self._t(input, "input")
        check_same(inp, out, "input", "output")
        n = out.numel()
        if inp.numel() != n * self._size:
            raise ValueError(
                f"input: expected {n * self._size} elements (world size {self._size} x output's {n}), got {inp.numel()}"
            )
        d = self._dt(inp, "reduce_scatter_tensor", "input")
        red, kind, factor = self._op(op, inp.dtype, "reduce_scatter_tensor")
        post = self._post(kind, factor, out)
        comm, ip, op_, f = self._handle, self._vp(inp), self._vp(out), self._c["reduce_scatter"]

        def fn(h):
            rc = f(ip, op_, n, d, red, comm, h)
            if rc:
                raise self._err("reduce_scatter", rc)

        return self._launch("reduce_scatter_tensor", fn, post, (inp, out), (out,), async_op, stream)

    _reduce_scatter_base = reduce_scatter_tensor

    def reduce_scatter(self, output, input_list, op=_SUM, async_op: bool = False, *, stream=None) -> Optional[Work]:
        """Reduce the lists across ranks; ``output`` gets the reduction of everyone's ``input_list[rank]``."""
        out = self._t(output, "output")
        lst = check_list(input_list, "input_list", self._size)
        ins = [self._t(x, f"input_list[{i}]") for i, x in enumerate(lst)]
        for i, x in enumerate(ins):
            check_same(out, x, "output", f"input_list[{i}]")
            if x.numel() != out.numel():
                raise ValueError(f"input_list[{i}]: expected {out.numel()} elements like output, got {x.numel()}")
        self._dt(out, "reduce_scatter", "output")
        self._op(op, out.dtype, "reduce_scatter")
        flat = torch.cat([x.reshape(-1) for x in ins]) if ins else out.new_empty(0)
        return self.reduce_scatter_tensor(out, flat, op, async_op, stream=stream)

    def all_to_all_single(self, output, input, output_split_sizes=None, input_split_sizes=None,
                          async_op: bool = False, *, stream=None) -> Optional[Work]:
        """All-to-all on dim 0 blocks, even (no split sizes) or uneven."""
        out = self._t(output, "output")
        inp = self._t(input, "input")
        check_same(inp, out, "input", "output")
        d = self._dt(inp, "all_to_all_single", "input")
        size = self._size
        if output_split_sizes is None and input_split_sizes is None:
            if inp.numel() % size:
                raise ValueError(f"input: expected a number of elements divisible by world size {size}, got {inp.numel()}")
            if out.numel() != inp.numel():
                raise ValueError(f"output: expected {inp.numel()} elements like input, got {out.numel()}")
            n = inp.numel() // size
            f = self._c.get("all_to_all")
            if f is not None:
                comm, ip, op_ = self._handle, self._vp(inp), self._vp(out)

                def fn(h):
                    rc = f(ip, op_, n, d, comm, h)
                    if rc:
                        raise self._err("all_to_all", rc)

                return self._launch("all_to_all_single", fn, None, (inp, out), (out,), async_op, stream)
            send = [n] * size
            recv = [n] * size
        else:
            row_in = inp[0].numel() if inp.dim() > 0 and inp.shape[0] else (inp.numel() // max(inp.shape[0], 1) if inp.dim() else 1)
            row_out = out[0].numel() if out.dim() > 0 and out.shape[0] else (out.numel() // max(out.shape[0], 1) if out.dim() else 1)
            send = self._splits(input_split_sizes, inp, "input_split_sizes", row_in)
            recv = self._splits(output_split_sizes, out, "output_split_sizes", row_out)
        return self._alltoallv(inp, out, send, recv, async_op, stream)

    def _splits(self, splits, t, name, row) -> List[int]:
        size = self._size
        if splits is None:
            if t.dim() == 0 or t.shape[0] % size:
                raise ValueError(f"{name}: not given, so dim 0 of the tensor ({tuple(t.shape)}) must divide by world size {size}")
            return [t.numel() // size] * size
        if len(splits) != size:
            raise ValueError(f"{name}: expected {size} split sizes (one per rank), got {len(splits)}")
        if any((isinstance(s, bool) or not isinstance(s, (int, np.integer)) or s < 0) for s in splits):
            raise ValueError(f"{name}: expected non-negative ints, got {list(splits)}")
        if sum(splits) != (t.shape[0] if t.dim() else 0):
            raise ValueError(f"{name}: split sizes sum to {sum(splits)} but dim 0 of the tensor is {t.shape[0] if t.dim() else 0}")
        return [int(s) * row for s in splits]

    def _alltoallv(self, inp, out, send: List[int], recv: List[int], async_op, stream):
        d = self._dt(inp)
        comm = self._handle
        f = self._c.get("all_to_all_v")
        if f is not None:
            ffi = self._ffi
            sc = ffi.new("size_t[]", send)
            rc_ = ffi.new("size_t[]", recv)
            ip, op_ = self._vp(inp), self._vp(out)

            def fn(h):
                rc = f(ip, sc, op_, rc_, d, comm, h)
                if rc:
                    raise self._err("all_to_all_v", rc)
        else:
            fn = self._sendrecv_fn(inp, out, send, recv, d)
        return self._launch("all_to_all_single", fn, None, (inp, out), (out,), async_op, stream)

    def _sendrecv_fn(self, inp, out, send, recv, d):
        """All-to-all(v) as grouped Send/Recv (NCCL has no AlltoAllV)."""
        esz = inp.element_size()
        so = np.concatenate(([0], np.cumsum(send)[:-1])).tolist()
        ro = np.concatenate(([0], np.cumsum(recv)[:-1])).tolist()
        ib, ob = inp.data_ptr(), out.data_ptr()
        cast = self._ffi.cast
        sends = [(cast("void *", ib + so[p] * esz), send[p], p, d) for p in range(self._size) if send[p]]
        recvs = [(cast("void *", ob + ro[p] * esz), recv[p], p, d) for p in range(self._size) if recv[p]]
        return self._p2p_group(sends, recvs)

    def _p2p_group(self, sends, recvs):
        """One group launch of Send/Recv; entries are ``(ptr, count, peer, dtype)``."""
        fs, fr, gs, ge = self._c["send"], self._c["recv"], self._c["group_start"], self._c["group_end"]
        comm = self._handle

        def fn(h):
            rc = gs()
            if rc:
                raise self._err("group_start", rc)
            err = None
            for p, c, peer, d in sends:
                rc = fs(p, c, d, peer, comm, h)
                if rc and err is None:
                    err = ("send", rc)
            for p, c, peer, d in recvs:
                rc = fr(p, c, d, peer, comm, h)
                if rc and err is None:
                    err = ("recv", rc)
            rc = ge()
            if err is not None:
                raise self._err(*err)
            if rc:
                raise self._err("group_end", rc)

        return fn

    def all_to_all(self, output_tensor_list, input_tensor_list, async_op: bool = False, *, stream=None) -> Optional[Work]:
        """Send ``input_tensor_list[j]`` to rank j; receive rank j's into ``output_tensor_list[j]``."""
        outs = [self._t(o, f"output_tensor_list[{i}]") for i, o in
                enumerate(check_list(output_tensor_list, "output_tensor_list", self._size))]
        ins = [self._t(x, f"input_tensor_list[{i}]") for i, x in
               enumerate(check_list(input_tensor_list, "input_tensor_list", self._size))]
        for i in range(self._size):
            check_same(ins[0], ins[i], "input_tensor_list[0]", f"input_tensor_list[{i}]")
            check_same(ins[0], outs[i], "input_tensor_list[0]", f"output_tensor_list[{i}]")
        d = self._dt(ins[0], "all_to_all", "input_tensor_list")
        me = self._rank
        if outs[me].numel() != ins[me].numel():
            raise ValueError(f"output_tensor_list[{me}]: expected {ins[me].numel()} elements "
                             f"(input_tensor_list[{me}] is sent to this rank itself), got {outs[me].numel()}")
        vp = self._vp
        sends = [(vp(ins[p]), ins[p].numel(), p, d) for p in range(self._size) if p != me and ins[p].numel()]
        recvs = [(vp(outs[p]), outs[p].numel(), p, d) for p in range(self._size) if p != me and outs[p].numel()]
        fn = self._p2p_group(sends, recvs)
        src, dstt = ins[me], outs[me]
        post = lambda: dstt.copy_(src.view(dstt.shape) if src.shape != dstt.shape else src)  # noqa: E731
        return self._launch("all_to_all", fn, post, (*ins, *outs), tuple(outs), async_op, stream)

    def gather(self, tensor, gather_list=None, dst: int = 0, async_op: bool = False, *, stream=None) -> Optional[Work]:
        """Gather ``tensor`` of every rank into ``gather_list`` on rank ``dst``."""
        t = self._t(tensor, "tensor")
        dst = check_rank(dst, "dst", self._size)
        d = self._dt(t, "gather")
        me = self._rank
        if me == dst:
            lst = check_list(gather_list, "gather_list", self._size)
            outs = [self._t(o, f"gather_list[{i}]") for i, o in enumerate(lst)]
            for i, o in enumerate(outs):
                check_same(t, o, "tensor", f"gather_list[{i}]")
                if o.numel() != t.numel():
                    raise ValueError(f"gather_list[{i}]: expected {t.numel()} elements like tensor, got {o.numel()}")
        else:
            if gather_list:
                raise ValueError(f"gather_list: expected None or [] on non-destination rank {me} (dst is {dst})")
            outs = []
        n = t.numel()
        f = self._c.get("gather")
        if f is not None:  # NCCL >= 2.28: one native call into a flat buffer on the root
            flat = torch.empty(n * self._size, dtype=t.dtype, device=t.device) if me == dst else t
            comm, ip, fp = self._handle, self._vp(t), self._vp(flat)

            def fn(h):
                rc = f(ip, fp, n, d, dst, comm, h)
                if rc:
                    raise self._err("gather", rc)

            def post():
                for i, o in enumerate(outs):
                    o.view(-1).copy_(flat[i * n:(i + 1) * n])

            return self._launch("gather", fn, post if me == dst else None, (t, flat, *outs), tuple(outs),
                                async_op, stream)
        # oneCCL has no Gather: Send/Recv in one group (a oneCCL log line
        # "not completed event is destroyed" may appear; results are complete).
        vp = self._vp
        sends = [] if me == dst or not n else [(vp(t), n, dst, d)]
        recvs = [(vp(o), n, p, d) for p, o in enumerate(outs) if p != me and n]
        fn = self._p2p_group(sends, recvs)
        post = (lambda: outs[me].view(-1).copy_(t.view(-1))) if me == dst else None
        return self._launch("gather", fn, post, (t, *outs), tuple(outs), async_op, stream)

    def scatter(self, tensor, scatter_list=None, src: int = 0, async_op: bool = False, *, stream=None) -> Optional[Work]:
        """Scatter ``scatter_list`` of rank ``src``: rank i receives element i into ``tensor``."""
        t = self._t(tensor, "tensor")
        src = check_rank(src, "src", self._size)
        d = self._dt(t, "scatter")
        me = self._rank
        n = t.numel()
        if me == src:
            lst = check_list(scatter_list, "scatter_list", self._size)
            ins = [self._t(x, f"scatter_list[{i}]") for i, x in enumerate(lst)]
            for i, x in enumerate(ins):
                check_same(t, x, "tensor", f"scatter_list[{i}]")
                if x.numel() != n:
                    raise ValueError(f"scatter_list[{i}]: expected {n} elements like tensor, got {x.numel()}")
        else:
            if scatter_list:
                raise ValueError(f"scatter_list: expected None or [] on non-source rank {me} (src is {src})")
            ins = []
        f = self._c.get("scatter")
        if f is not None:  # oneCCL, NCCL >= 2.28: one native call from a flat buffer on the root
            flat = torch.cat([x.reshape(-1) for x in ins]) if me == src else t
            comm, fp, tp = self._handle, self._vp(flat), self._vp(t)

            def fn(h):
                rc = f(fp, tp, n, d, src, comm, h)
                if rc:
                    raise self._err("scatter", rc)

            return self._launch("scatter", fn, None, (t, flat), (t,), async_op, stream)
        vp = self._vp
        sends = [(vp(x), n, p, d) for p, x in enumerate(ins) if p != me and n]
        recvs = [] if me == src or not n else [(vp(t), n, src, d)]
        fn = self._p2p_group(sends, recvs)
        post = (lambda: t.view(-1).copy_(ins[me].view(-1))) if me == src else None
        return self._launch("scatter", fn, post, (t, *ins), (t,), async_op, stream)

    # ------------------------------------------------------------ point to point
    def _p2p_args(self, kind: str, tensor, peer, name: str):
        t = self._t(tensor, "tensor")
        peer = check_rank(peer, name, self._size)
        if peer == self._rank:
            raise ValueError(f"{name}: expected a rank other than this one ({self._rank})")
        d = self._dt(t, kind)
        return t, peer, d

    def _p2p_fn(self, kind: str, t, peer: int, d):
        f, comm, p, n = self._c[kind], self._handle, self._vp(t), t.numel()
        self._p2p += 1  # flight record: collectives are aligned across ranks without p2p ops

        def fn(h):
            rc = f(p, n, d, peer, comm, h)
            if rc:
                raise self._err(kind, rc)

        return fn

    def send(self, tensor, dst: int, tag: int = 0, *, stream=None) -> None:
        """Send ``tensor`` to rank ``dst``; returns when it may be reused."""
        t, peer, d = self._p2p_args("send", tensor, dst, "dst")
        self._launch("send", self._p2p_fn("send", t, peer, d), None, (t,), (t,), False, stream)

    def recv(self, tensor, src: int, tag: int = 0, *, stream=None) -> int:
        """Receive into ``tensor`` from rank ``src``; returns ``src`` (as torch does)."""
        if src is None:
            raise ValueError("src: receiving from any source is not supported; pass the sender's rank")
        t, peer, d = self._p2p_args("recv", tensor, src, "src")
        self._launch("recv", self._p2p_fn("recv", t, peer, d), None, (t,), (t,), False, stream)
        return peer

    def isend(self, tensor, dst: int, tag: int = 0, *, stream=None) -> Work:
        t, peer, d = self._p2p_args("send", tensor, dst, "dst")
        return self._launch("isend", self._p2p_fn("send", t, peer, d), None, (t,), (t,), True, stream)

    def irecv(self, tensor, src: int, tag: int = 0, *, stream=None) -> Work:
        if src is None:
            raise ValueError("src: receiving from any source is not supported; pass the sender's rank")
        t, peer, d = self._p2p_args("recv", tensor, src, "src")
        return self._launch("irecv", self._p2p_fn("recv", t, peer, d), None, (t,), (t,), True, stream)

    def batch_isend_irecv(self, p2p_op_list: Sequence[Any]) -> List[Work]:
        """Issue the P2POps as one group launch; returns a one-Work list (as torch's coalesced path)."""
        if not isinstance(p2p_op_list, (list, tuple)) or not p2p_op_list:
            raise ValueError("p2p_op_list: expected a non-empty list of P2POp")
        sends, recvs, keep = [], [], []
        for i, p in enumerate(p2p_op_list):
            opname = getattr(getattr(p, "op", None), "__name__", "")
            if opname in ("isend", "send"):
                kind, name = "send", "peer"
            elif opname in ("irecv", "recv"):
                kind, name = "recv", "peer"
            else:
                raise ValueError(f"p2p_op_list[{i}].op: expected isend or irecv, got {getattr(p, 'op', None)!r}")
            grp = getattr(p, "group", None)
            if grp is not None and grp is not self:
                raise ValueError(f"p2p_op_list[{i}].group: expected this communicator or None")
            t, peer, d = self._p2p_args(kind, p.tensor, p.peer, f"p2p_op_list[{i}].{name}")
            (sends if kind == "send" else recvs).append((self._vp(t), t.numel(), peer, d))
            keep.append(t)
        fn = self._p2p_group(sends, recvs)
        self._p2p += 1
        return [self._launch("batch_isend_irecv", fn, None, tuple(keep), tuple(keep), True, None)]

    def barrier(self, async_op: bool = False, device_ids=None) -> Optional[Work]:
        """Wait until every rank reached the barrier (a one-element all_reduce)."""
        buf = self._barrier_buf
        if buf is None:
            buf = self._barrier_buf = torch.zeros(1, dtype=torch.int32, device=self._device)
        w = self.all_reduce(buf, _SUM, async_op)
        if not async_op and self._gpu:
            torch.cuda.current_stream(self._device).synchronize() if self._dev_type == "cuda" else None
        return w

    # ------------------------------------------------------------ split
    def split(self, color: Optional[int], key: int = 0, timeout=None) -> Optional["Communicator"]:
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
        c = int(c) if c >= 0 else -1
        mine = torch.tensor([c, int(key)], dtype=torch.int64, device=self._device)
        allv = torch.empty(2 * self._size, dtype=torch.int64, device=self._device)
        self.all_gather_into_tensor(allv, mine)
        pairs = allv.view(self._size, 2).cpu().tolist()
        self._seq += 1
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
        newh = self._backend.split(self._handle, c, new_rank)
        if c < 0:
            return None
        return Communicator(
            self._backend, self._device, newh, new_rank, len(members),
            self.timeout if timeout is None else timeout, self.record_stream, self._store,
            name=f"{self.name}/split{c}",
        )


class _Coalesced:
    """What ``Communicator.coalescing()`` yields: ``work`` after the block."""

    __slots__ = ("work",)

    def __init__(self) -> None:
        self.work: Optional[Work] = None

    def wait(self, timeout=None) -> bool:
        return True if self.work is None else self.work.wait(timeout)
