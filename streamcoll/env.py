"""Environment defaults for the native libraries, applied before the first
communicator is created (both libraries read their variables then).

Only variables the user has not set are touched, and every value applied is
recorded in :data:`APPLIED` (``python -m streamcoll info`` prints them).

oneCCL, all ranks on one host (measured, 2 ranks, 2-core machine, raw C
calls): with oneCCL's defaults a 1-element allreduce took 4.3 ms and a 4 MB one
14-27 ms; with the values below 9 us and 0.42 ms.

- ``CCL_WORKER_OFFLOAD=0``: run collectives on the calling thread instead of
  handing them to oneCCL's worker thread (the hand-off dominates small calls).
- ``CCL_ATL_SHM=1`` and ``FI_PROVIDER=shm``: shared memory transport; only
  valid when every rank is on this host, so applied only then.
- ``CCL_KVS_IFACE=lo``: the key-value store of the unique id listens on
  loopback (single host only).
- ``CCL_LOCAL_RANK``/``CCL_LOCAL_SIZE`` from torchrun's LOCAL_RANK and
  LOCAL_WORLD_SIZE (oneCCL warns and probes without them).
- ``CCL_ALLREDUCE=nreduce``: of oneCCL's CPU algorithms, nreduce was fastest at
  every size measured with 2 ranks (4 B 6.5 us, 1 MB 130 us, 64 MB 8.5 GB/s
  busbw vs 10.1 us, 167 us, 4.7 GB/s for oneCCL's own choice).
- ``CCL_LOG_LEVEL=error``: oneCCL's startup warnings are about the variables
  above.

On several hosts only the local-rank variables are set; transport and
interface are oneCCL's own choice (or the user's).
"""
from __future__ import annotations

import os
from typing import Dict

__all__ = ["APPLIED", "apply_oneccl_defaults", "apply_nccl_defaults", "RELEVANT"]

APPLIED: Dict[str, str] = {}

RELEVANT = (
    "STREAMCOLL_ONECCL_LIBRARY", "STREAMCOLL_NCCL_LIBRARY", "STREAMCOLL_HOME", "STREAMCOLL_TIMEOUT",
    "STREAMCOLL_RECORD_STREAM", "STREAMCOLL_NO_ENV_DEFAULTS", "STREAMCOLL_DEBUG_CHECKS",
    "CCL_ROOT", "CCL_WORKER_OFFLOAD", "CCL_ATL_SHM", "CCL_ATL_TRANSPORT", "FI_PROVIDER", "CCL_KVS_IFACE",
    "CCL_ALLREDUCE", "CCL_LOCAL_RANK", "CCL_LOCAL_SIZE", "CCL_LOG_LEVEL",
    "NCCL_SOCKET_IFNAME", "NCCL_DEBUG", "NCCL_HOME", "CUDA_HOME",
    "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LD_LIBRARY_PATH",
)


def _default(name: str, value: str) -> None:
    if name not in os.environ:
        os.environ[name] = value
        APPLIED[name] = value


def _enabled() -> bool:
    return os.environ.get("STREAMCOLL_NO_ENV_DEFAULTS", "0") in ("", "0")


def apply_oneccl_defaults(single_host: bool, local_rank: int, local_size: int) -> None:
    if not _enabled():
        return
    _default("CCL_LOCAL_RANK", str(local_rank))
    _default("CCL_LOCAL_SIZE", str(local_size))
    _default("CCL_LOG_LEVEL", "error")
    if single_host:
        _default("CCL_WORKER_OFFLOAD", "0")
        _default("CCL_ATL_SHM", "1")
        _default("FI_PROVIDER", "shm")
        _default("CCL_KVS_IFACE", "lo")
        _default("CCL_ALLREDUCE", "nreduce")


def apply_nccl_defaults(single_host: bool) -> None:
    if not _enabled():
        return
    if single_host:
        _default("NCCL_SOCKET_IFNAME", "lo")
