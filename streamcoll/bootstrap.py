"""Creating communicators: rank and world from torchrun's variables, the
unique id exchanged through a torch.distributed store, and the default
communicator the module-level functions use.

Rendezvous is torch.distributed's (``env://``: TCPStore at MASTER_ADDR,
MASTER_PORT, or the agent's store under torchrun); after it, NCCL's or
oneCCL's own bootstrap and networking take over. Nothing home-made.
"""
from __future__ import annotations

import contextlib
import os
import socket
import threading
from datetime import timedelta
from typing import Any, Iterator, Optional, Union

import torch

from .backends import resolve
from .communicator import Communicator, _seconds
from .env import apply_nccl_defaults, apply_oneccl_defaults
from .errors import CommunicatorError

__all__ = ["init", "new_communicator", "is_initialized", "get_rank", "get_world_size",
           "destroy", "default_communicator", "is_available"]

_DEFAULT: Optional[Communicator] = None
_STORE: Any = None
_COUNTER = 0
_LOCK = threading.Lock()


def is_available(backend: str = "oneccl") -> bool:
    """Whether ``backend``'s native library loads here. Never raises."""
    try:
        from .backends import get_backend
        return get_backend(backend).binding.is_available()
    except Exception:
        return False


def _env_int(name: str, default: Optional[int] = None) -> Optional[int]:
    v = os.environ.get(name)
    if v is None or v == "":
        return default
    try:
        return int(v)
    except ValueError:
        raise ValueError(f"environment variable {name}: expected an integer, got {v!r}") from None


def _default_device(backend: Optional[str], local_rank: int) -> torch.device:
    if backend == "nccl" or (backend is None and torch.cuda.is_available()):
        return torch.device("cuda", local_rank % max(torch.cuda.device_count(), 1))
    if backend in ("oneccl",) and hasattr(torch, "xpu") and torch.xpu.is_available() and os.environ.get("STREAMCOLL_DEVICE") == "xpu":
        return torch.device("xpu", local_rank)
    return torch.device("cpu")


@contextlib.contextmanager
def _native_entry(backend: str) -> Iterator[None]:
    """Around the calls that may be the process's first into the library:
    oneCCL sets itself up there, printing a line on stdout (kept off it, see
    :mod:`streamcoll.logs`) and installing signal handlers (Python's are put
    back for SIGINT/SIGTERM, see :mod:`streamcoll.signals`)."""
    from .logs import quiet_oneccl_startup
    from .signals import native_entry
    if backend != "oneccl":
        yield
        return
    with native_entry(), quiet_oneccl_startup():
        yield


def _get_store(rank: int, world_size: int, timeout: float):
    """The default store: torch.distributed's if it is initialised, else the
    ``env://`` rendezvous (created once per process and reused)."""
    global _STORE
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized():
        return dist.distributed_c10d._get_default_store()
    if _STORE is None:
        for var in ("MASTER_ADDR", "MASTER_PORT"):
            if var not in os.environ:
                raise ValueError(
                    f"{var} is not set: launch with torchrun, set MASTER_ADDR/MASTER_PORT, or pass store="
                )
        store, _, _ = next(dist.rendezvous("env://", rank, world_size, timeout=timedelta(seconds=timeout)))
        _STORE = store
    return _STORE


def new_communicator(
    backend: Optional[str] = None,
    device: Union[None, str, torch.device] = None,
    timeout: Union[None, float, timedelta] = None,
    store: Any = None,
    rank: Optional[int] = None,
    world_size: Optional[int] = None,
    record_stream: Optional[bool] = None,
    name: Optional[str] = None,
) -> Communicator:
    """Create a Communicator over ``world_size`` ranks (collective: every
    rank calls it with the same arguments in the same order).

    ``rank``/``world_size`` default to RANK/WORLD_SIZE (torchrun sets them);
    ``device`` defaults to ``cuda:LOCAL_RANK`` where CUDA is available, else
    cpu; ``backend`` defaults by device (cpu, xpu: oneccl; cuda: nccl).
    ``store`` is any torch.distributed Store; by default the one
    torch.distributed was initialised with, else the env:// rendezvous.
    """
    global _COUNTER
    t = _seconds(timeout)
    if rank is None:
        rank = _env_int("RANK", 0)
    if world_size is None:
        world_size = _env_int("WORLD_SIZE", 1)
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size: expected a positive int, got {world_size!r}")
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ValueError(f"rank: expected an int in [0, {world_size}), got {rank!r}")
    if backend is not None and not isinstance(backend, str):
        raise TypeError(f"backend: expected 'nccl', 'oneccl' or None, got {backend!r}")
    local_rank = _env_int("LOCAL_RANK", rank)
    local_size = _env_int("LOCAL_WORLD_SIZE", world_size)
    if device is None:
        device = _default_device(backend.lower() if backend else None, local_rank)
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"device: expected a torch device or string like 'cpu' or 'cuda:0', got {device!r}") from e
    b, device = resolve(backend.lower() if backend else None, device)
    if device.type in ("cuda", "xpu") and device.index is None:
        device = torch.device(device.type, local_rank)

    if store is None:
        store = _get_store(rank, world_size, t)
    with _LOCK:
        _COUNTER += 1
        n = _COUNTER
    import torch.distributed as dist
    prefix = f"streamcoll/{name or 'comm'}/{n}/"
    pstore = dist.PrefixStore(prefix, store)
    pstore.set_timeout(timedelta(seconds=t))

    # Are all ranks on this host? Decides the single-host defaults.
    host = socket.gethostname()
    pstore.set(f"host/{rank}", host)
    hosts = {pstore.get(f"host/{r}").decode() for r in range(world_size)}
    single = hosts == {host}
    if b.name == "oneccl":
        apply_oneccl_defaults(single, local_rank, local_size)
    else:
        apply_nccl_defaults(single)
    if device.type == "cuda":
        torch.cuda.set_device(device)

    if rank == 0:
        with _native_entry(b.name):
            uid = b.unique_id()
        pstore.set("uid", uid)
    else:
        uid = pstore.get("uid")
    cname = name or ("default" if n == 1 else f"comm{n}")
    from . import watchdog
    nonblocking = b.name == "nccl" and watchdog.nccl_nonblocking_requested()
    if nonblocking:  # polled with ncclCommGetAsyncError: times out with CollectiveTimeout
        handle = b.init_rank(world_size, bytes(uid), rank, blocking=False, timeout=t)
    else:  # a blocking init whose peers never come must not hang silently
        with watchdog.guard(f"init of communicator {cname!r} (rank {rank} of {world_size}, {b.name} on {device})", t):
            with _native_entry(b.name):
                handle = b.init_rank(world_size, bytes(uid), rank)
    comm = Communicator(b, device, handle, rank, world_size, t, record_stream, pstore, name=cname)
    if nonblocking:
        watchdog.make_nonblocking(comm)
    return comm


def init(
    backend: Optional[str] = None,
    device: Union[None, str, torch.device] = None,
    timeout: Union[None, float, timedelta] = None,
    store: Any = None,
    rank: Optional[int] = None,
    world_size: Optional[int] = None,
    record_stream: Optional[bool] = None,
) -> Communicator:
    """Create the default communicator used by the module-level collectives
    (``streamcoll.all_reduce(...)``) and return it. See :func:`new_communicator`."""
    global _DEFAULT
    if _DEFAULT is not None and not _DEFAULT._destroyed:
        raise RuntimeError("streamcoll.init() was already called; call streamcoll.destroy() first")
    _DEFAULT = new_communicator(backend, device, timeout, store, rank, world_size, record_stream, name="default")
    return _DEFAULT


def is_initialized() -> bool:
    return _DEFAULT is not None and not _DEFAULT._destroyed


def default_communicator() -> Communicator:
    c = _DEFAULT
    if c is None or c._destroyed:
        raise CommunicatorError("streamcoll is not initialised: call streamcoll.init() first (or pass group=)")
    return c


def get_rank(group: Optional[Communicator] = None) -> int:
    return (group or default_communicator()).rank


def get_world_size(group: Optional[Communicator] = None) -> int:
    return (group or default_communicator()).size


def destroy(group: Optional[Communicator] = None) -> None:
    """Destroy ``group`` (default: the default communicator). Idempotent."""
    global _DEFAULT
    if group is None:
        c, _DEFAULT = _DEFAULT, None
        if c is not None:
            c.destroy()
    else:
        group.destroy()


destroy_process_group = destroy
