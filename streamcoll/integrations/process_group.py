"""A torch.distributed backend named ``"streamcoll"``.

``import streamcoll`` registers it, so existing torch.distributed code (and
``DistributedDataParallel``) runs on streamcoll's communicators::

    import streamcoll, torch.distributed as dist
    dist.init_process_group("streamcoll")          # torchrun's env://
    model = torch.nn.parallel.DistributedDataParallel(model)

The process group is a Python subclass of ``torch.distributed.ProcessGroup``
(the C++ ``Backend`` class cannot be subclassed from Python). Why Python: the
Communicator already does the work; this layer only maps torch's calling
convention onto it: the tensor lists of the C++ API, the option objects
(``AllreduceOptions.reduceOp``, ``BroadcastOptions.rootRank``, ...,
``asyncOp``) and torch Works whose futures complete with the outputs.

One Communicator per device type, created on the first collective that uses
that device (every rank issues the same collectives, so they create it
together), over the store torch hands the creator: cpu tensors go to oneCCL,
cuda tensors to NCCL, xpu tensors to oneCCL.

``opts.asyncOp`` False (``dist.all_reduce(t)``) launches on the current
stream, as streamcoll's own ``async_op=False`` does; True (``async_op=True``,
DDP's buckets) uses the comm-stream strategy. ``opts.timeout``, where set
(torch's option objects leave it unset, -1 ms; zero or negative count as
unset), is the call's own ``timeout=`` (a per-call deadline, see the
collectives' docstrings); a barrier's keeps its own meaning
(:meth:`ProcessGroupStreamcoll.barrier`). Collectives torch has that
streamcoll does not implement raise NotImplementedError naming them.
"""
from __future__ import annotations

import functools
import linecache
import re
import threading
import warnings
from datetime import timedelta
from typing import Any, Callable, Dict, Generator, List, Optional, Sequence

import torch
import torch.distributed as dist

from ..core import spec
from ..core.callbacks import Future
from ..core.communicator import Communicator
from ..core.timeouts import torch_seconds
from .._ffi.errors import CollectiveTimeout, CommunicatorError, RendezvousError
from .c10d_debug import install as _install_torch_hooks, set_group_timeout
from .torch_version import require_torch

__all__ = ["ProcessGroupStreamcoll", "StreamcollWork", "create_process_group", "register_backend", "BACKEND_NAME"]

BACKEND_NAME = "streamcoll"


class StreamcollWork(dist._Work):
    """A torch Work over a :class:`streamcoll.Work` (or over a collective
    that already completed inline, ``work=None``).

    ``wait()`` has streamcoll's semantics (GPU: the current stream waits; CPU:
    the thread blocks); ``get_future()`` completes with the output tensors
    once the collective completed, and ``is_completed()`` is True from then on.
    """

    # Class-level defaults: the generated fast paths (``_pg_source``) build a
    # Work with torch's own constructor and set only ``_work``, ``_outputs``
    # and ``_op`` (a Python ``__init__`` is half a microsecond per call).
    _work: Any = None
    _outputs: Sequence[torch.Tensor] = ()
    _op = "collective"
    _timeout: Optional[float] = None  # seconds a wait() without its own timeout waits (barrier's opts.timeout)
    _fut: Optional[torch.futures.Future] = None

    # torch's constructor alone (no Python ``__init__``): :meth:`over` and the
    # generated fast paths set the fields.
    __init__ = dist._Work.__init__  # type: ignore[assignment]

    @classmethod
    def over(cls, work: Any, outputs: Sequence[torch.Tensor], op: str,
             timeout: Optional[float] = None) -> "StreamcollWork":
        """The Work over streamcoll Work ``work`` (None: completed) whose
        result is ``outputs``; ``timeout``: seconds a ``wait()`` without its
        own timeout waits (a barrier's ``opts.timeout``)."""
        w = cls()
        w._work = work
        w._outputs = list(outputs)
        w._op = op
        if timeout is not None:
            w._timeout = timeout
        return w

    def wait(self, timeout: Any = None) -> bool:
        w = self._work
        if w is not None:
            if timeout is None and self._timeout is None:
                w.wait()
            else:
                t = torch_seconds(timeout)
                w.wait(self._timeout if t is None else t)
        return True

    def synchronize(self) -> None:
        if self._work is not None:
            self._work.synchronize()

    def is_completed(self) -> bool:
        return self._work is None or self._work.is_completed()

    def is_success(self) -> bool:
        return self._work is None or self._work.is_success()

    def exception(self) -> Optional[BaseException]:
        return None if self._work is None else self._work.exception()

    def result(self) -> List[torch.Tensor]:
        return list(self._outputs)

    def __await__(self) -> Generator[Any, None, List[torch.Tensor]]:
        """``await dist.all_reduce(t, async_op=True)`` in a coroutine: the
        streamcoll Work's await (:meth:`streamcoll.Work.__await__`: the loop
        runs on; the error, or past the communicator's timeout what
        ``wait()`` raises), then this Work's outputs."""
        return self._await().__await__()

    async def _await(self) -> List[torch.Tensor]:
        if self._work is not None:
            await self._work
        return list(self._outputs)


    def get_future(self) -> torch.futures.Future:
        fut = self._fut
        if fut is None:
            if self._work is None:
                fut = Future()
                fut.set_result(list(self._outputs))
            else:
                fut = self._work.get_future()
            self._fut = fut
        return fut

    def __repr__(self) -> str:
        return f"<StreamcollWork {self._op} {'completed' if self.is_completed() else 'pending'}>"


def _not_implemented(name: str) -> Callable:
    def method(self, *args, **kwargs):
        raise NotImplementedError(
            f"{name} is not implemented by the streamcoll process group backend; "
            f"use a gloo/nccl group for it (dist.new_group(backend=...))"
        )

    method.__name__ = name
    method.__doc__ = f"Not implemented by the streamcoll backend: raises NotImplementedError naming {name}."
    return method


class ProcessGroupStreamcoll(dist.ProcessGroup):
    """torch.distributed ProcessGroup running on streamcoll Communicators."""

    def __init__(self, store: Any, rank: int, size: int, timeout: Optional[timedelta] = None) -> None:
        super().__init__(rank, size)  # type: ignore[call-arg]  # torch's stub lacks this overload
        self._store = store
        self._rank = rank
        self._size = size
        self._timeout = timeout
        self._comms: Dict[str, Communicator] = {}  # device type -> its communicator
        self._lock = threading.Lock()
        self._coalescing: Optional[tuple] = None
        self._last_comm: Optional[Communicator] = None  # the last collective's (a barrier's device)
        # What the generated fast paths read (``_refresh_fast``): the cpu communicator, and the
        # others by device type, while the group is usable and not coalescing; else None / {}.
        self._fast_cpu: Optional[Communicator] = None
        self._fast_other: Dict[str, Communicator] = {}
        self._group_name: Optional[str] = None
        self._failed: Optional[BaseException] = None  # why the group is unusable (abort), or None
        self._world = False  # init_process_group's group (create_process_group sets it)

    # -- identity -----------------------------------------------------------
    def getBackendName(self) -> str:
        """``"streamcoll"``, the name the backend is registered under."""
        return BACKEND_NAME

    def _set_group_name(self, name: str) -> None:
        """Keep the name torch assigns (``_new_process_group_helper`` calls
        this). The C++ base class stores the name in its registered backends,
        and a Python process group registers none, so its ``group_name``
        would raise "ProcessGroup name not set"; DeviceMesh, FSDP2, DTensor,
        functional collectives and ``destroy_process_group(group)`` all look
        a group up by this name."""
        if not isinstance(name, str):
            raise TypeError(f"name: expected a str, got {type(name).__name__}")
        self._group_name = name
        super()._set_group_name(name)  # type: ignore[arg-type]  # GroupName is a str

    @property
    def group_name(self) -> str:  # type: ignore[override]  # torch types it GroupName, a str
        """The name torch registered this group under (``_set_group_name``)."""
        if self._group_name is None:
            raise RuntimeError("ProcessGroup name not set: this streamcoll process group was not created by "
                               "torch.distributed (init_process_group/new_group), which names it")
        return self._group_name

    def __repr__(self) -> str:
        return f"<ProcessGroupStreamcoll rank={self._rank} size={self._size} comms={list(self._comms)}>"

    # -- torch's backend API (streamcoll.integrations.c10d_debug) ----------------------
    supports_splitting = False
    supports_coalescing = False
    supports_time_estimate = False
    supports_shrinking = False

    def _get_backend(self, device: Any) -> "ProcessGroupStreamcoll":  # type: ignore[override]  # it is its own backend
        """The backend object of ``device``: this group (it is its own backend;
        torch's C++ one raised "No backend type associated with device type")."""
        torch.device(device)  # a bad device raises as torch's does
        return self

    def supports_tensor_alloc(self, device: Any) -> bool:
        """False: torch allocates FSDP's buffers itself (no backend allocator)."""
        return False

    def _set_default_timeout(self, timeout: timedelta) -> None:
        """The group's timeout from now on (``dist.breakpoint``, ``_set_pg_timeout``)."""
        set_group_timeout(self, timeout)

    def set_timeout(self, timeout: timedelta) -> None:
        """torch's ``ProcessGroup.set_timeout``: :meth:`_set_default_timeout`."""
        self._set_default_timeout(timeout)

    # -- communicators ------------------------------------------------------
    def _in_launchers_job(self) -> bool:
        """Whether torch's world (this group's if it is the world, else the
        default group's) is the launcher's job, the same on every rank of
        that world: its store is then the launcher's rendezvous, whose keys
        the job's scope leads (``new_communicator``'s ``job_scoped``). A
        world of another size met through a store given to
        ``init_process_group`` (an srun step's tasks and a server started
        with python) shares that store across jobs: no job's scope."""
        from ..startup.topology import _job_size
        size = self._size if self._world or not dist.is_initialized() else dist.get_world_size()
        return size == _job_size()

    def communicator(self, device: Any, op: str = "collective") -> Communicator:
        """The Communicator serving ``device``'s type (created on first use: a
        collective call, so every rank must reach it). ``op`` names that
        collective in the timeout error if another rank never reaches it:
        the wait is then on the store (the ranks exchange the library's
        unique id there), whose own error would name only a store key.

        One communicator per device *type*, keyed and namespaced in the store
        by the type alone (``streamcoll/cuda/``): each process drives one
        device of a type (rank 0 ``cuda:0``, rank 1 ``cuda:1`` on a 2-GPU
        host), so a key with the index would put the ranks of one
        communicator under different store keys and the rendezvous would
        never complete. A tensor on another device of a type already served
        raises ValueError naming both devices."""
        if self._failed is not None:
            raise self._failed_error(op)
        dev = torch.device(device)
        key = dev.type
        c = self._comms.get(key)
        if c is None:
            from ..startup.bootstrap import group_topology, new_communicator
            with self._lock:
                c = self._comms.get(key)
                if c is None:
                    if dev.index is None and dev.type in ("cuda", "xpu"):
                        dev = torch.device(dev.type, getattr(torch, dev.type).current_device())
                    store = dist.PrefixStore(f"streamcoll/{key}/", self._store)
                    # The world group's name is fixed: made eagerly (before torch names the group) or at
                    # the first collective, every rank's communicator meets under one name.
                    label = "world" if self._world else (self._group_name if self._group_name is not None
                                                          else "unnamed")
                    try:
                        c = new_communicator(device=dev, timeout=self._timeout, store=store, rank=self._rank,
                                             world_size=self._size, name=f"pg{label}-{key}",
                                             known_topology=group_topology(self),
                                             job_scoped=self._in_launchers_job())
                    except (dist.DistStoreError, RendezvousError) as e:
                        # the store timing out, or the rendezvous naming the ranks that never came; not
                        # a store that stopped answering (its host left: no timeout ran, none is reported)
                        if isinstance(e, dist.DistStoreError) and "imeout" not in str(e):
                            raise
                        if isinstance(e, RendezvousError) and not e.timed_out:
                            raise
                        t = torch_seconds(self._timeout)
                        raise CollectiveTimeout(
                            op, 0, t if t is not None else float("nan"), [], self._rank, self._size,
                            f"timed out waiting for the other ranks: the group's first collective on {dev} "
                            f"creates its communicator on every rank together, and not every rank reached "
                            f"this {op} (store: {e})") from e
                    self._comms[key] = c
                    self._refresh_fast()
                    return c
        have = getattr(c, "device", None)
        if dev.index is not None and isinstance(have, torch.device) and have.index is not None \
                and have.index != dev.index:
            raise ValueError(f"device: this process's streamcoll group serves {have} (one device per process "
                             f"and device type); got a tensor on {dev}")
        return c

    def _refresh_fast(self) -> None:
        """Point the generated fast paths at the communicators they may use:
        all of them while the group is usable and not coalescing, none
        otherwise (every call then takes the general lines, which raise,
        queue or create). Called wherever one of those changes.

        Checked again after publishing: ``abort()``/``shutdown()`` from
        another thread may set ``_failed`` (then refresh) between the check
        and the assignments of a refresh after a communicator's creation;
        either its refresh comes after ours, or ours sees ``_failed``."""
        comms = self._comms if self._failed is None and self._coalescing is None else {}
        self._fast_other = {k: c for k, c in comms.items() if k != "cpu"}
        self._fast_cpu = comms.get("cpu")
        if comms and (self._failed is not None or self._coalescing is not None):
            self._fast_other, self._fast_cpu = {}, None

    def _fast_accel(self, t: torch.Tensor) -> Optional[Communicator]:
        """A fast path's communicator for a non-cpu tensor: its device type's,
        if that serves the tensor's device index; else None (general path)."""
        c = self._fast_other.get(t.device.type) if self._fast_other else None
        return c if c is not None and t.get_device() == c.device.index else None

    def _failed_error(self, op: str) -> CommunicatorError:
        return CommunicatorError(f"{op}: this streamcoll process group cannot be used: {self._failed}; "
                                 "create a new one (dist.new_group / init_process_group)")

    def _comm(self, t: Any, name: str, op: str = "collective") -> Communicator:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
        dev = t.device
        if dev.type not in ("cpu", "cuda", "xpu"):
            raise ValueError(f"{name}: the streamcoll backend supports cpu, cuda and xpu tensors, got {dev}")
        c = self.communicator(dev, op)
        self._last_comm = c
        return c

    @staticmethod
    def _one(tensors: Any, name: str) -> torch.Tensor:
        """The one tensor of a one-tensor list, or a single tensor (the C++
        API's single-tensor overloads: ``pg.allreduce(t)``, ``pg.broadcast(t, root)``)."""
        if isinstance(tensors, torch.Tensor):
            return tensors
        if not isinstance(tensors, (list, tuple)) or len(tensors) != 1:
            n = len(tensors) if isinstance(tensors, (list, tuple)) else type(tensors).__name__
            raise ValueError(f"{name}: expected a list of exactly one tensor (one device per process), got {n}")
        return tensors[0]

    @staticmethod
    def _async(opts: Any) -> bool:
        return bool(getattr(opts, "asyncOp", True))

    def _work(self, w: Any, outputs: Sequence[torch.Tensor], op: str) -> StreamcollWork:
        return StreamcollWork.over(w, outputs, op)

    def _run(self, comm: Communicator, op: str, outputs: Sequence[torch.Tensor], opts: Any,
             launch: Callable[[bool], Any]) -> StreamcollWork:
        if self._coalescing is not None:
            # start_coalescing ... end_coalescing: queued into one group launch.
            launch(False)
            self._coalescing[2].extend(outputs)
            return self._work(None, outputs, op)
        return self._work(launch(self._async(opts)), outputs, op)

    # -- collectives --------------------------------------------------------
    # allreduce, broadcast, reduce, allgather, all_gather_single, reduce_scatter,
    # reduce_scatter_single, all_to_all_single, alltoall, gather, scatter, send,
    # recv: generated from the declarations (``pg``, ``pg_params``, ``pg_map``
    # in streamcoll.core.spec), see _install_pg_methods below.

    def allreduce_coalesced(self, tensors: List[torch.Tensor], opts: Any = None) -> StreamcollWork:
        """All-reduce each of ``tensors`` in one group launch (one Work)."""
        if not tensors:
            return self._work(None, [], "allreduce_coalesced")
        op = opts.reduceOp if opts is not None else dist.ReduceOp.SUM
        c = self._comm(tensors[0], "tensors[0]")
        return self._grouped(c, "allreduce_coalesced", list(tensors), opts,
                             [functools.partial(c.all_reduce, t, op, timeout=_opts_limit(opts)) for t in tensors])

    def all_gather_single_coalesced(self, outputs: List[torch.Tensor], inputs: List[torch.Tensor],
                                    opts: Any = None) -> StreamcollWork:
        """All-gather each input into its output in one group launch (one Work)."""
        if not inputs:
            return self._work(None, [], "all_gather_single_coalesced")
        c = self._comm(inputs[0], "inputs[0]")
        return self._grouped(c, "all_gather_single_coalesced", list(outputs), opts,
                             [functools.partial(c.all_gather_into_tensor, o, i, timeout=_opts_limit(opts))
                              for o, i in zip(outputs, inputs)])

    allgather_into_tensor_coalesced = all_gather_single_coalesced  # type: ignore[assignment]

    def reduce_scatter_single_coalesced(self, outputs: List[torch.Tensor], inputs: List[torch.Tensor],
                                        opts: Any = None) -> StreamcollWork:
        """Reduce-scatter each input into its output in one group launch (one Work)."""
        if not inputs:
            return self._work(None, [], "reduce_scatter_single_coalesced")
        c = self._comm(inputs[0], "inputs[0]")
        op = opts.reduceOp if opts is not None else dist.ReduceOp.SUM
        return self._grouped(c, "reduce_scatter_single_coalesced", list(outputs), opts,
                             [functools.partial(c.reduce_scatter_tensor, o, i, op, timeout=_opts_limit(opts))
                              for o, i in zip(outputs, inputs)])

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced  # type: ignore[assignment]

    def _barrier_device(self, opts: Any) -> torch.device:
        """The device of a barrier, in torch's documented order (see
        ``torch.distributed.barrier``): ``opts.device_ids[0]`` (on the
        accelerator), the group's bound device (``init_process_group(
        device_id=...)``), the device of the last collective (a barrier
        orders after it), ``opts.device`` (what torch passes: the current
        accelerator device, or cpu), cpu."""
        ids = list(getattr(opts, "device_ids", None) or [])
        dev = getattr(opts, "device", None)
        if ids:  # torch sets opts.device to (accelerator type, ids[0]) with them; cpu where none is
            if isinstance(dev, torch.device):
                return torch.device("cpu") if dev.type == "cpu" else dev
            return torch.device("cuda", ids[0]) if torch.cuda.is_available() else torch.device("cpu")
        bound = getattr(self, "bound_device_id", None)
        if bound is not None:
            return torch.device(bound)
        if self._last_comm is not None:
            return self._last_comm.device
        if dev is not None:
            return torch.device(dev)
        return torch.device("cpu")

    def barrier(self, opts: Any = None) -> StreamcollWork:
        """A barrier on the communicator of :meth:`_barrier_device`'s device.

        ``opts.timeout`` (``dist.barrier(timeout=...)``) bounds the wait: past
        it :class:`~streamcoll.CollectiveTimeout` names the barrier and the
        timeout (with ``async_op=True``, ``wait()`` without a timeout of its
        own waits that long). The barrier itself stays queued in the
        communicator, so the late ranks' barriers still meet it and the
        ranks stay in step; the communicator is not failed (a timeout
        shorter than the communicator's means slow, not stuck)."""
        dev = self._barrier_device(opts)
        if dev.type not in ("cpu", "cuda", "xpu"):
            raise ValueError(f"opts.device: the streamcoll backend supports cpu, cuda and xpu, got {dev}")
        c = self.communicator(dev, "barrier")
        t = torch_seconds(getattr(opts, "timeout", None))
        if t is None:
            return self._work(c.barrier(self._async(opts)), [], "barrier")
        w = c.barrier(True)
        if self._async(opts):
            return StreamcollWork.over(w, [], "barrier", timeout=t)
        w.synchronize(t)  # the host waits, as the synchronous barrier does (CUDA too)
        return self._work(None, [], "barrier")

    # -- coalescing (torch's _coalescing_manager with a device) -------------
    def _grouped(self, c: Communicator, op: str, outputs: List[torch.Tensor], opts: Any,
                 launches: List[Callable[[], Any]]) -> StreamcollWork:
        if self._coalescing is not None:
            for f in launches:
                f()
            self._coalescing[2].extend(outputs)
            return self._work(None, outputs, op)
        async_op = self._async(opts)
        with c.coalescing(async_op=async_op) as h:
            for f in launches:
                f()
        return self._work(h.work, outputs, op)

    def start_coalescing(self, device: Any) -> None:
        """Begin batching collectives on ``device``'s communicator (torch's
        ``_coalescing_manager``); :meth:`end_coalescing` launches them as one group."""
        if self._coalescing is not None:
            raise RuntimeError("start_coalescing: the streamcoll process group is already coalescing")
        c = self.communicator(device)
        cm = c.coalescing(async_op=True)
        h = cm.__enter__()
        self._coalescing = (cm, h, [])
        self._refresh_fast()

    def end_coalescing(self, device: Any) -> StreamcollWork:
        """Launch the collectives batched since :meth:`start_coalescing`; one Work."""
        if self._coalescing is None:
            raise RuntimeError("end_coalescing: start_coalescing was not called")
        cm, h, outs = self._coalescing
        self._coalescing = None
        self._refresh_fast()
        cm.__exit__(None, None, None)
        return self._work(h.work, outs, "coalesced")

    _start_coalescing = start_coalescing
    _end_coalescing = end_coalescing

    # -- what streamcoll does not implement ----------------------------------
    recv_anysource = _not_implemented("recv_anysource")
    monitored_barrier = _not_implemented("monitored_barrier")
    split_group = _not_implemented("split_group")
    merge_remote_group = _not_implemented("merge_remote_group")

    # -- lifecycle ----------------------------------------------------------
    def shutdown(self) -> None:
        """Destroy the communicators (idempotent); torch calls it from
        ``destroy_process_group``. Afterwards the group is unusable."""
        if self._failed is None:
            self._failed = CommunicatorError("process group was shut down")
        comms, self._comms = list(self._comms.values()), {}
        self._refresh_fast()
        for c in comms:
            c.destroy()

    def abort(self) -> None:
        """Abort the communicators where the library can (NCCL), else mark them
        failed; the group stays failed: every later collective raises
        CommunicatorError at once (as gloo's does), instead of creating new
        communicators through the store, which a survivor of a dead peer
        would wait on for the group's whole timeout."""
        if self._failed is None:
            self._failed = CommunicatorError("process group was aborted")
        self._refresh_fast()
        for c in list(self._comms.values()):
            if not c.abort():
                c.mark_failed(RuntimeError("process group aborted"))


def _one(tensors: Any, name: str) -> torch.Tensor:
    return ProcessGroupStreamcoll._one(tensors, name)


def _nonempty(tensors: Any, name: str) -> Any:
    if not tensors:
        raise ValueError(f"{name}: expected one tensor per rank, got an empty list")
    return tensors


# torch's RedOpType singletons (dist.ReduceOp.SUM, ...) by value. The
# ReduceOp that AllreduceOptions.reduceOp returns is a new object wrapping a
# new RedOpType on every access, which no fast path can recognise by
# identity (every process-group call took the general path, and
# the planner re-derived the reduction from the unhashable op each time).
# Keyed by the enum's int: hashing a RedOpType costs a microsecond, int() a
# fifth of that.
_CANONICAL = {int(getattr(dist.ReduceOp, n)): getattr(dist.ReduceOp, n)
              for n in ("SUM", "AVG", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR")
              if hasattr(dist.ReduceOp, n)}


def _op(opts: Any, op: Any = None) -> Any:
    """The reduction: ``op`` where an overload passes it separately
    (``reduce(tensor, root, op)``), else the one in ``opts``: torch's option
    object, a ReduceOp itself (``allreduce(tensors, op)``), or None or a root
    rank (overloads without one): SUM. A torch ReduceOp other than
    PREMUL_SUM (whose factor it carries) comes back as torch's canonical
    RedOpType object, the spelling the generated fast paths take."""
    if op is None:
        if opts is None or isinstance(opts, int):
            return dist.ReduceOp.SUM
        op = opts if isinstance(opts, (dist.ReduceOp, dist.ReduceOp.RedOpType)) else opts.reduceOp
    if type(op) is dist.ReduceOp:  # not RedOpType (which isinstance counts as one too)
        return _CANONICAL.get(int(op.op), op)  # type: ignore[attr-defined]  # torch's stub lacks .op
    return op


def _root(opts: Any) -> int:
    """The root: ``opts.rootRank``, or the rank the single-tensor overloads pass in its place."""
    if opts is None:
        return 0
    if isinstance(opts, int):
        return opts
    return opts.rootRank


# What torch's option objects hold while no timeout was set (-1 ms): unset, as None, zero and negative are.
_UNSET = dist.AllreduceOptions().timeout


def _opts_limit(opts: Any) -> Optional[float]:
    """``opts.timeout`` in seconds where torch's option object has one set
    (the call's own deadline), else None (the communicator's timeout); an
    overload passing a ReduceOp or a root rank instead of options has none."""
    t = getattr(opts, "timeout", None)
    return None if t is None or t == _UNSET else torch_seconds(t)


def _timed(work: StreamcollWork, timeout: Any) -> StreamcollWork:
    """``work`` whose ``wait()`` without a timeout of its own waits ``timeout``
    (the C++ overloads' ``timeout`` argument; None: the communicator's)."""
    t = torch_seconds(timeout)
    if t is not None:
        work._timeout = t
    return work


# Option reads inlined for torch's option objects: ``opts.reduceOp``
# builds a new ReduceOp per read, and comparing it with SUM is a fraction of
# ``_op``'s canonicalisation; any other spelling goes through the function.
_INLINE = {
    "_op(opts)": "_SUM if type(opts) in _ROPTS and opts.reduceOp == _SUM else _op(opts)",
    "_op(opts, op)": "_SUM if op is None and type(opts) in _ROPTS and opts.reduceOp == _SUM else _op(opts, op)",
    "_root(opts)": "opts.rootRank if type(opts) in _RTOPTS else _root(opts)",
}
_ROPTS = tuple(getattr(dist, n) for n in ("AllreduceOptions", "ReduceOptions", "ReduceScatterOptions")
               if hasattr(dist, n))
_RTOPTS = tuple(getattr(dist, n) for n in ("BroadcastOptions", "ReduceOptions", "GatherOptions", "ScatterOptions")
                if hasattr(dist, n))


def _pg_source(s: Any) -> List[str]:
    """The ProcessGroup method(s) serving collective ``s``, from its declaration."""
    m = s.pg_map
    lines = [f"def {s.pg[0]}(self, {s.pg_params}):"]
    for p in s.params:
        if p.name in m:
            # _one(x, 'x') inline for the usual one-tensor list (a frame less per call)
            expr = re.sub(r"^_one\((\w+), '(\w+)'\)$",
                          r"\1[0] if type(\1) is list and len(\1) == 1 else _one(\1, '\2')", m[p.name])
            expr = _INLINE.get(expr, expr)
            lines.append(f"    {p.name} = {expr}")
    # the device: the first input tensor, else the first tensor, else element 0 of the first input list
    first = next((p for p in s.buffers if p.name in m and p.kind == "tensor" and not p.role == "out"), None) \
        or next((p for p in s.buffers if p.name in m and p.kind == "tensor"), None) \
        or next(p for p in s.buffers if p.name in m and p.role == "in")
    expr = m[first.name]
    mm = re.match(r"_one\((\w+), '(\w+)'\)", expr)
    src_name = mm.group(2) if mm else expr.split("(")[-1].split(",")[0].split(")")[0]
    if first.kind == "tensor":
        dev, label = first.name, (f"{src_name}[0]" if mm else src_name)
    else:
        dev, label = f"{first.name}[0]", f"{src_name}[0]"
    lines.append(f"    c = self._comm({dev}, {label!r}, {s.pg[0]!r})")
    outs = " + ".join(f"[{p.name}]" if p.kind == "tensor" else f"list({p.name} or [])"
                      for p in s.buffers if p.mutable or s.async_mode == "always") or "[]"
    args = ", ".join(p.name for p in s.params if p.name in m)
    timed = bool(re.search(r"\btimeout\b", s.pg_params))
    if s.async_mode != "always":
        # opts.timeout, where set: the call's own deadline (_opts_limit inline: no frame while unset)
        lines.insert(len(lines) - 1, "    _lim = None if getattr(opts, 'timeout', _UNSET) == _UNSET else _opts_limit(opts)")
        # The usual call, in one frame of ours besides the communicator's
        # generated fast path: the group is usable and not
        # coalescing, the tensor's device type already has its communicator
        # on that device; the Work is made here. Anything else: the general
        # lines below (which create the communicator, check the device, raise).
        lines.insert(len(lines) - 1,
                     f"    if type({dev}) is _Tensor and (c := self._fast_cpu if {dev}.is_cpu "
                     f"else self._fast_accel({dev})) is not None:\n"
                     f"        self._last_comm = c\n"
                     f"        w = _Work()\n"
                     f"        w._work = c.{s.name}({args}, getattr(opts, 'asyncOp', True), timeout=_lim)\n"
                     f"        w._outputs = {outs}\n"
                     f"        w._op = {s.pg[0]!r}\n"
                     + (f"        return w if timeout is None else _timed(w, timeout)" if timed else "        return w"))
    if s.async_mode == "always":
        call = f"self._work(c.{s.name}({args}), {outs}, {s.pg[0]!r})"
    else:
        call = f"self._run(c, {s.pg[0]!r}, {outs}, opts, lambda a: c.{s.name}({args}, a, timeout=_lim))"
    if timed:
        call = f"_timed({call}, timeout)"
    lines.append(f"    return {call}")
    return lines


def _install_pg_methods() -> None:
    for s in spec.TABLE.values():
        if not s.pg:
            continue
        src = "\n".join(_pg_source(s)) + "\n"
        filename = f"<streamcoll generated ProcessGroupStreamcoll.{s.pg[0]}>"
        linecache.cache[filename] = (len(src), None, src.splitlines(True), filename)
        ns: Dict[str, Any] = {"_one": _one, "_op": _op, "_root": _root, "_nonempty": _nonempty, "_timed": _timed,
                              "_UNSET": _UNSET, "_opts_limit": _opts_limit,
                              "_Tensor": torch.Tensor, "_Work": StreamcollWork,
                              "_SUM": dist.ReduceOp.SUM, "_ROPTS": _ROPTS, "_RTOPTS": _RTOPTS}
        exec(compile(src, filename, "exec"), ns)
        fn = ns[s.pg[0]]
        fn.__doc__ = f"torch.distributed's {s.pg[0]} on streamcoll's {s.name}."
        for name in s.pg:
            setattr(ProcessGroupStreamcoll, name, fn)


_install_pg_methods()


def _opts_from(op: Any) -> Any:
    """An AllreduceOptions for the ``allreduce(tensors, op)`` overload."""
    o = dist.AllreduceOptions()
    if op is not None:
        o.reduceOp = op
    return o


def _eager_cpu() -> bool:
    """Whether the world group makes its oneCCL communicator at once
    (``STREAMCOLL_EAGER_INIT``, default ``auto``: where oneCCL loads and no
    CUDA GPU is visible: a GPU job may never make a cpu collective, and
    should not pay for, or fail on, a oneCCL communicator it never uses)."""
    from ..core.env_vars import read_choice
    mode = read_choice("STREAMCOLL_EAGER_INIT", ("auto", "1", "0"), "auto")
    if mode != "auto":
        return mode == "1"
    from ..startup.bootstrap import is_available
    return not torch.cuda.is_available() and is_available("oneccl")


def create_process_group(store: Any, rank: int, world_size: int, timeout: Optional[timedelta] = None
                         ) -> ProcessGroupStreamcoll:
    """The creator torch.distributed calls for ``backend="streamcoll"``.

    For the world group (the one ``init_process_group`` makes: torch has no
    default group yet) the cpu communicator is made here, on every rank
    together, before any sub-group can make one: oneCCL's shared-memory
    transport serves later communicators only among its first one's members
    (docs/design.md, section 'A process's first oneCCL communicator spans
    the world'). ``STREAMCOLL_EAGER_INIT=0``
    makes it lazy (first cpu collective), as every other group's is, and so
    does ``auto`` where CUDA is available; a process whose first oneCCL
    communicator is not the whole world then runs oneCCL over TCP
    (:func:`streamcoll.startup.env_defaults.agreed_defaults`).
    """
    require_torch('backend="streamcoll"', "on older torch, measured: FSDP2 and DTensor values differ from gloo's "
                  "and an aborted group hangs (2.7), DDP's constructor hangs (2.6 and older)")
    pg = ProcessGroupStreamcoll(store, rank, world_size, timeout)
    pg._world = not dist.is_initialized()
    if pg._world and _eager_cpu():
        pg.communicator(torch.device("cpu"), "init_process_group")
    return pg


def register_backend() -> None:
    """Register the ``"streamcoll"`` backend with torch.distributed (idempotent).

    Registered without ``devices=``: with ``devices=["cpu"]`` torch 2.13's
    DDP fails to construct ("No backend type associated with device type
    cpu"); without it torch assumes cpu and cuda (and xpu where present) and
    warns, a warning silenced here.
    """
    if not dist.is_available():
        return
    _install_torch_hooks(ProcessGroupStreamcoll)  # _set_pg_timeout (dist.breakpoint) reaches streamcoll groups
    if BACKEND_NAME.upper() in getattr(dist.Backend, "_plugins", {}):
        return
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dist.Backend.register_backend(BACKEND_NAME, create_process_group)
