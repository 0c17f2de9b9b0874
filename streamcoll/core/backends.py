"""What differs between NCCL and oneCCL, as data: function names, the dtype
and reduction tables, and which reductions each library lacks (so the
Communicator applies a fallback or raises, never returns a wrong answer).

Enum values are read from the cffi declarations (``streamcoll/_native/*.h``), never
retyped here.
"""
from __future__ import annotations

import contextlib
import os
import time
from typing import Any, Callable, ContextManager, Dict, Optional, Tuple

import torch

from .._ffi._common import Binding
from .._ffi.errors import CollectiveTimeout, CommunicatorError
from .spec import c_functions
from .turnstile import Turnstile

__all__ = ["Backend", "get_backend", "BACKEND_FOR_DEVICE"]

# torch dtype -> the enum suffix both libraries use (ncclFloat32, onecclFloat32).
# bool travels as uint8, with SUM/PRODUCT mapped to MAX/MIN (logical or/and),
# as ProcessGroupNCCL does.
_DTYPE_SUFFIX = {
    torch.int8: "Int8",
    torch.uint8: "Uint8",
    torch.bool: "Uint8",
    torch.int32: "Int32",
    torch.int64: "Int64",
    torch.float16: "Float16",
    torch.bfloat16: "Bfloat16",
    torch.float32: "Float32",
    torch.float64: "Float64",
}
_NCCL_EXTRA_DTYPES = {}
for _name, _suffix in (("float8_e4m3fn", "Float8e4m3"), ("float8_e5m2", "Float8e5m2")):
    if hasattr(torch, _name):
        _NCCL_EXTRA_DTYPES[getattr(torch, _name)] = _suffix

_OP_SUFFIX = {"SUM": "Sum", "PRODUCT": "Prod", "MIN": "Min", "MAX": "Max", "AVG": "Avg"}
_BOOL_OPS = {"SUM": "Max", "PRODUCT": "Min", "MIN": "Min", "MAX": "Max"}

# C functions that are not collectives (life cycle, groups, composers' parts).
# The collectives' C functions come from their declarations (streamcoll.core.spec).
_LIFECYCLE = {
    "nccl": {
        "group_start": "ncclGroupStart",
        "group_end": "ncclGroupEnd",
        "get_unique_id": "ncclGetUniqueId",
        "init_rank": "ncclCommInitRank",
        "init_rank_config": "ncclCommInitRankConfig",
        "split": "ncclCommSplit",
        "finalize": "ncclCommFinalize",
        "destroy": "ncclCommDestroy",
        "abort": "ncclCommAbort",
        "count": "ncclCommCount",
        "user_rank": "ncclCommUserRank",
    },
    "oneccl": {
        "all_to_all_v": "onecclAllToAllV",
        "group_start": "onecclGroupStart",
        "group_end": "onecclGroupEnd",
        "get_unique_id": "onecclGetUniqueId",
        "init_rank": "onecclCommInitRank",
        "init_rank_config": "onecclCommInitRankConfig",
        "split": "onecclCommSplit",
        "finalize": "onecclCommFinalize",
        "destroy": "onecclCommDestroy",
        "count": "onecclCommCount",
        "user_rank": "onecclCommUserRank",
    },
}
_FUNCS = {lib: {**c_functions(lib), **rest} for lib, rest in _LIFECYCLE.items()}

# Reductions a library accepts but does not implement for a device type:
# oneCCL 2022.2 on the CPU fails AVG with "Unsupported onecclRedOp_t value"
# and returns NotImplemented for PreMulSum. streamcoll then reduces with SUM
# and scales the result.
_EMULATED_OPS = {
    ("oneccl", "cpu"): frozenset({"AVG", "PREMUL_SUM"}),
    ("oneccl", "xpu"): frozenset({"PREMUL_SUM"}),
    ("nccl", "cuda"): frozenset(),
}

# Reductions computed through a wider dtype: (library, device) -> {dtype:
# the dtype the library reduces in instead}. Measured here (AVX2, no
# AVX512): oneCCL 2022.2's CPU bf16 reduction narrows float32 to bf16 by
# truncation, so at 2 ranks 27% of bf16 SUM results differ from the correctly
# rounded sum (gloo: 0%) and the mean error is 1.44x gloo's (3 ranks 1.78x);
# CCL_BF16=avx512f or avx512bf, its other implementations, crash the process
# on this CPU. Reducing in float32 and rounding once (to nearest even) is
# exact at 2 ranks and better than gloo's per-step rounding at more; it costs
# a conversion each way and twice the bytes on the wire (at 2 ranks all_reduce
# SUM/PRODUCT takes the pair form instead: plans.PlanContext.pair_op).
# STREAMCOLL_WIDEN_BF16=0 turns it off (the library's own bf16 reduction).
_WIDENED = {
    ("oneccl", "cpu"): {torch.bfloat16: torch.float32},
}

BACKEND_FOR_DEVICE = {"cpu": "oneccl", "xpu": "oneccl", "cuda": "nccl"}
_DEVICES_FOR_BACKEND = {"oneccl": ("cpu", "xpu"), "nccl": ("cuda",)}


class Backend:
    """One library as the Communicator sees it."""

    def __init__(self, name: str, binding: Binding, prefix: str) -> None:
        self.name = name
        self.binding = binding
        self.ffi = binding.ffi
        self.prefix = prefix
        self.funcs = _FUNCS[name]
        const = binding.const
        self.dtypes: Dict[torch.dtype, int] = {
            dt: const(prefix + sfx) for dt, sfx in _DTYPE_SUFFIX.items()
        }
        if name == "nccl":
            self.dtypes.update({dt: const(prefix + sfx) for dt, sfx in _NCCL_EXTRA_DTYPES.items()})
        self.ops: Dict[str, int] = {n: const(prefix + s) for n, s in _OP_SUFFIX.items()}
        self.bool_ops: Dict[str, int] = {n: const(prefix + s) for n, s in _BOOL_OPS.items()}
        self.uid_type = "ncclUniqueId" if name == "nccl" else "onecclUniqueId"
        self.comm_type = "ncclComm_t" if name == "nccl" else "onecclComm_t"
        self.config_type = "ncclConfig_t" if name == "nccl" else "onecclConfig_t"
        # oneCCL 2022.2's CommSplit ignores the key (measured: keys 2,1,0
        # still give parent-rank order).
        self.split_orders_by_key = name == "nccl"
        # oneCCL's Reduce writes the receive buffer on every rank: non-roots
        # pass a scratch one (NCCL only writes it on the root).
        self.nonroot_recv_scratch = name == "oneccl"
        # Whether abort() can end a native communicator (NCCL's ncclCommAbort;
        # oneCCL 2022.2 declares onecclCommAbort not implemented).
        self.can_abort = "abort" in self.funcs
        # oneCCL may not be entered by two threads of one process at once,
        # whatever the communicators (what was measured: docs/design.md,
        # section 'The turnstile and its rule'). Every oneCCL call of the
        # process runs in its turn, in issue order (streamcoll.core.turnstile
        # says why not a lock). NCCL allows concurrent calls on different
        # communicators: None.
        self.turnstile: Optional[Turnstile] = Turnstile() if name == "oneccl" else None

    def serial(self, timeout: Optional[float] = None, what: Optional[str] = None) -> ContextManager[bool]:
        """The context a C call made on the calling thread runs in (life
        cycle: init, split, destroy): its turn where the library needs one
        (oneCCL), else nothing. Yields False if the turn did not come within
        ``timeout``."""
        ts = self.turnstile
        return ts.hold(timeout, what) if ts is not None else contextlib.nullcontext(True)

    def lib(self):
        return self.binding.lib()

    def check_device(self, device: torch.device) -> None:
        if device.type not in _DEVICES_FOR_BACKEND[self.name]:
            raise ValueError(
                f"backend {self.name!r} does not run on device {device}; it supports "
                f"{', '.join(_DEVICES_FOR_BACKEND[self.name])} (cpu and xpu: 'oneccl'; cuda: 'nccl')"
            )

    def emulated(self, device_type: str) -> frozenset:
        return _EMULATED_OPS.get((self.name, device_type), frozenset())

    def func(self, collective: str) -> Optional[str]:
        return self.funcs.get(collective)

    def widened(self, device_type: str, on: Optional[bool] = None) -> Dict[torch.dtype, torch.dtype]:
        """dtype -> the dtype its reductions are computed in on ``device_type``
        (see ``_WIDENED``); empty where ``on`` is False (a communicator
        passes the value agreed by every rank, :data:`streamcoll.startup.env_defaults.OWN`;
        None: this process's ``STREAMCOLL_WIDEN_BF16``, ``0`` for off)."""
        if on is None:
            on = os.environ.get("STREAMCOLL_WIDEN_BF16", "1").strip().lower() not in ("0", "false", "no", "off")
        if not on:
            return {}
        return dict(_WIDENED.get((self.name, device_type), {}))

    # ---- communicator life cycle (not on the hot path) -------------------
    def unique_id(self) -> bytes:
        ffi = self.ffi
        uid = ffi.new(self.uid_type + " *")
        with self.serial():
            rc = getattr(self.lib(), self.funcs["get_unique_id"])(uid)
        if rc:
            raise self.binding.error(self.funcs["get_unique_id"], rc)
        return bytes(ffi.buffer(uid))

    def init_rank(self, nranks: int, uid: bytes, rank: int, blocking: Optional[bool] = None,
                  timeout: Optional[float] = None, what: Optional[str] = None):
        ffi = self.ffi
        expected = ffi.sizeof(self.uid_type)
        if len(uid) != expected:
            raise ValueError(f"unique id: expected {expected} bytes for {self.name}, got {len(uid)}")
        cid = ffi.new(self.uid_type + " *")
        ffi.memmove(cid, uid, expected)
        comm = ffi.new(self.comm_type + " *")
        lib = self.lib()
        if blocking is not None and self.name == "nccl":
            cfg = self.default_config()
            cfg.blocking = 1 if blocking else 0
            fname = self.funcs["init_rank_config"]
            rc = getattr(lib, fname)(comm, nranks, cid[0], rank, cfg)
        else:
            fname = self.funcs["init_rank"]
            # A rendezvous inside the library: a call of another communicator waits. Two
            # communicators created at once from two threads are ordered here by the process's
            # issue order; ranks that order them differently hang: the rule is that
            # communicators are created like collectives, in one order on every rank. ``what``
            # names this init while it waits for the turn (the init guard reports it as such).
            with self.serial(what=what or f"init of a communicator (rank {rank} of {nranks})"):
                rc = getattr(lib, fname)(comm, nranks, cid[0], rank)
        if rc and blocking is False and self.name == "nccl" and rc == self.binding.const("ncclInProgress"):
            # Non-blocking init: poll until ready, an error, or the timeout (then aborted).
            nccl_wait_ready(self, comm[0], timeout, "init", rank, nranks)
            return comm[0]
        if rc:
            raise self.binding.error(fname, rc)
        return comm[0]

    def default_config(self):
        """A config struct filled as the header's *_CONFIG_INITIALIZER does."""
        ffi = self.ffi
        cfg = ffi.new(self.config_type + " *")
        undef = -(2 ** 31)
        t = ffi.typeof(self.config_type)
        for fname, field in t.fields:
            if field.type.kind == "primitive" and field.type.cname == "int":
                setattr(cfg, fname, undef)
        cfg.size = ffi.sizeof(self.config_type)
        cfg.magic = 0xCAFEBEEF
        if self.name == "nccl":
            cfg.version = 23203
            cfg.netName = ffi.NULL
            cfg.commName = ffi.NULL
        else:
            cfg.version = 20220200
            cfg.netName = ffi.NULL
            cfg.plugin = self.binding.const("onecclPluginAny")
        return cfg

    def split(self, comm, color: int, key: int, in_progress_ok: bool = False):
        """``ncclCommSplit``/``onecclCommSplit``; ``in_progress_ok``: a
        non-blocking parent's child may still be initialising (the caller polls)."""
        ffi = self.ffi
        new = ffi.new(self.comm_type + " *")
        fname = self.funcs["split"]
        with self.serial(what=f"split of a communicator (color {color})"):
            rc = getattr(self.lib(), fname)(comm, color, key, new, ffi.NULL)
        if rc and in_progress_ok and self.name == "nccl" and rc == self.binding.const("ncclInProgress"):
            return new[0]
        if rc:
            raise self.binding.error(fname, rc, comm)
        return new[0]

    def query(self, comm, what: str) -> int:
        v = self.ffi.new("int *")
        fname = self.funcs[what]
        with self.serial():
            rc = getattr(self.lib(), fname)(comm, v)
        if rc:
            raise self.binding.error(fname, rc, comm)
        return v[0]

    def destroy(self, comm, finalize: bool = True) -> None:
        """Free ``comm`` (after ``finalize`` where asked). The caller holds
        :meth:`serial` (a bounded wait: :meth:`Communicator.destroy`)."""
        lib = self.lib()
        if finalize:
            rc = getattr(lib, self.funcs["finalize"])(comm)
            if rc:
                raise self.binding.error(self.funcs["finalize"], rc, comm)
        rc = getattr(lib, self.funcs["destroy"])(comm)
        if rc:
            raise self.binding.error(self.funcs["destroy"], rc, comm)

    def abort(self, comm) -> bool:
        """Abort ``comm`` if the library can (NCCL); False where it cannot
        (oneCCL 2022.2 declares onecclCommAbort not implemented)."""
        fname = self.funcs.get("abort")
        if fname is None:
            return False
        rc = getattr(self.lib(), fname)(comm)
        if rc:
            raise self.binding.error(fname, rc, comm)
        return True


BACKENDS: Dict[str, Backend] = {}


def _after_fork_in_child() -> None:
    # a parent thread may have held the turn at fork: the child's own communicators start with a fresh turnstile
    for b in BACKENDS.values():
        if b.turnstile is not None:
            b.turnstile = Turnstile()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def get_backend(name: str) -> Backend:
    """The Backend named ``name`` ("nccl" or "oneccl"); does not load the library."""
    b = BACKENDS.get(name)
    if b is not None:
        return b
    binding: Binding
    if name == "nccl":
        from .._ffi.nccl import NCCL
        binding, prefix = NCCL, "nccl"
    elif name in ("oneccl", "ccl", "xccl"):
        from .._ffi.oneccl import ONECCL
        binding, prefix, name = ONECCL, "oneccl", "oneccl"
    else:
        raise ValueError(f"backend: expected 'nccl' or 'oneccl', got {name!r}")
    b = BACKENDS[name] = Backend(name, binding, prefix)
    return b


def resolve(backend: Optional[str], device: torch.device) -> Tuple[Backend, torch.device]:
    """The Backend for an explicit ``backend`` or, if None, for ``device``."""
    if backend is None:
        if device.type not in BACKEND_FOR_DEVICE:
            raise ValueError(f"device: expected a cpu, cuda or xpu device, got {device}")
        backend = BACKEND_FOR_DEVICE[device.type]
    b = get_backend(backend)
    b.check_device(device)
    return b, device


# ------------------------------------------------------- non-blocking NCCL
# NCCL communicators can be created non-blocking (STREAMCOLL_NCCL_NONBLOCKING=1:
# config blocking=0, as TORCH_NCCL_USE_COMM_NONBLOCKING does): init returns
# ncclInProgress and is polled with ncclCommGetAsyncError (nccl_wait_ready), so
# an init whose peers never come raises CollectiveTimeout after the timeout (the
# communicator is aborted) instead of ending the process; every later call on
# such a communicator that returns ncclInProgress is polled the same way
# (make_nonblocking), as NCCL requires before the next call. NCCL's protocol,
# so here with NCCL's other code, not in the watchdog.
def nccl_nonblocking_requested() -> bool:
    return os.environ.get("STREAMCOLL_NCCL_NONBLOCKING", "0").strip().lower() not in ("", "0", "false", "no", "off")


def nccl_wait_ready(backend: Any, handle: Any, timeout: Optional[float], what: str,
                    rank: int = -1, size: int = -1,
                    abort: Optional[Callable[[BaseException], Any]] = None) -> None:
    """Poll ``ncclCommGetAsyncError`` until a non-blocking NCCL communicator
    left ``ncclInProgress``. An error state raises the library error; past
    ``timeout`` seconds :class:`CollectiveTimeout` is raised. Either way the
    native communicator is aborted first: by ``abort(error)`` where a
    :class:`~streamcoll.Communicator` owns the handle (its own abort path
    marks it failed before ``ncclCommAbort`` frees the handle, so no launch,
    watchdog query or ``destroy()`` uses the freed pointer), else
    (``abort`` None: an init or split whose handle nobody else holds yet)
    with ``ncclCommAbort`` directly."""
    lib, ffi, binding = backend.lib(), backend.ffi, backend.binding

    def _abort_with(err: BaseException) -> None:
        try:
            if abort is not None:
                abort(err)
            else:
                lib.ncclCommAbort(handle)
        except Exception:
            pass

    in_progress = binding.const("ncclInProgress")
    state = ffi.new("ncclResult_t *")
    deadline = None if timeout is None else time.monotonic() + timeout
    pause = 1e-4
    while True:
        rc = lib.ncclCommGetAsyncError(handle, state)
        if rc:
            raise binding.error("ncclCommGetAsyncError", rc, handle)
        s = int(state[0])
        if s == 0:
            return
        if s != in_progress:
            err: BaseException = binding.error(f"{what} (asynchronous error)", s, handle)
            _abort_with(err)
            raise err
        if deadline is not None and time.monotonic() > deadline:
            err = CollectiveTimeout(what, 0, float(timeout or 0.0), [], rank, size,
                                    "the non-blocking NCCL communicator stayed ncclInProgress; it was aborted "
                                    "(ncclCommAbort). Check that every rank started and can reach the others")
            _abort_with(err)
            raise err
        time.sleep(pause)
        pause = min(pause * 2, 0.01)


def make_nonblocking(comm: Any) -> None:
    """Poll ``ncclInProgress`` of ``comm``'s calls to completion (or its
    error, or the communicator's timeout) before the call returns, as a
    non-blocking communicator requires: an rc hook, so the launch path (and
    its fast paths) are the same as for a blocking communicator."""
    backend = comm._backend
    in_progress = backend.binding.const("ncclInProgress")

    def fail(err: BaseException) -> None:
        comm.mark_failed(err)  # every launcher refuses from here on
        comm.abort()  # ncclCommAbort once, then the handle, fast paths and events are dropped

    def poll(cname: str, rc: int) -> bool:
        if rc != in_progress:
            return False
        nccl_wait_ready(backend, comm._handle, comm.timeout, cname, comm.rank, comm.size, abort=fail)
        return True

    comm.register_rc_hook(poll)
    comm.nonblocking = True


__all__ += ["resolve", "CommunicatorError", "nccl_nonblocking_requested", "nccl_wait_ready", "make_nonblocking"]
