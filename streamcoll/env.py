"""Environment defaults for the native libraries, applied before the first
communicator is created (both libraries read their variables then).

Only variables the user has not set are touched, and every value applied is
recorded in :data:`APPLIED` (``python -m streamcoll info`` prints them).

oneCCL, all ranks on one host (measured, 2 ranks, 2-core machine, raw C
calls): with oneCCL's defaults a 1-element allreduce took 4.3 ms and a 4 MB one
14-27 ms; with the values below 9 us and 0.42 ms.

- ``CCL_WORKER_OFFLOAD=0``: run collectives on the calling thread instead of
  handing them to oneCCL's worker thread (the hand-off dominates small calls).
  That thread then spins until the peers arrive, which is right only while
  every local rank has a core of its own.
- More local ranks than usable cores (``os.sched_getaffinity``):
  ``CCL_WORKER_OFFLOAD=1`` and ``CCL_YIELD=sched_yield`` instead, so a waiting
  rank gives its core to the rank it waits for. Measured, 3 ranks on 2 cores
  (streamcoll, all_reduce): 4 B 4.8 ms -> 0.18 ms, 1 MB busbw 0.17 -> 1.2
  GB/s; spinning inline, gloo was 5x faster than oneCCL there. With 2 ranks on
  2 cores the inline spin stays far ahead (4 B 13 us vs 80 us).
- ``CCL_ATL_SHM=1`` and ``FI_PROVIDER=shm``: shared memory transport; only
  valid when every rank is on this host, so applied only then.
- ``CCL_KVS_IFACE=lo``: the key-value store of the unique id listens on
  loopback (single host only).
- ``CCL_LOCAL_RANK``/``CCL_LOCAL_SIZE`` from torchrun's LOCAL_RANK and
  LOCAL_WORLD_SIZE (oneCCL warns and probes without them).
- ``CCL_ALLREDUCE``, chosen per message size (oneCCL's ``algo:lo-hi;...``
  ranges, bytes): ``recursive_doubling:0-16384;nreduce:16385-max`` when the
  local ranks are a power of two with a core each, else ``nreduce``.
  nreduce was the fastest of oneCCL's CPU algorithms at every size on one
  2-rank machine (4 B 6.5 us, 1 MB 130 us, 64 MB 8.5 GB/s busbw vs 10.1 us,
  167 us, 4.7 GB/s for oneCCL's own choice) and the best or level at 1 MB and
  up on another (64 MB: nreduce 20.0 ms, oneCCL's choice 24.8, ring 24.2;
  medians of 5 interleaved rounds); on that second machine recursive doubling
  beat it from 16 B to 16 KB by 3-5 us (16 B 13.7 vs 18.5 us, 16 KB 23.9 vs
  27.1; 8 rounds) and tied at 4 B. With 3 ranks on 2 cores (yielding, see
  above) timings swing by a third from round to round; nreduce led below
  1 KB, ring by up to 20% above, recursive doubling trailed: nreduce stays
  (``benchmarks/algorithms.py``; ``benchmarks/README.md`` has the tables).
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
    "STREAMCOLL_RECORD_STREAM", "STREAMCOLL_NO_ENV_DEFAULTS", "STREAMCOLL_DEBUG_CHECKS", "STREAMCOLL_WIDEN_BF16",
    "CCL_BF16",
    "CCL_ROOT", "CCL_WORKER_OFFLOAD", "CCL_YIELD", "CCL_ATL_SHM", "CCL_ATL_TRANSPORT", "FI_PROVIDER", "CCL_KVS_IFACE",
    "CCL_ALLREDUCE", "CCL_LOCAL_RANK", "CCL_LOCAL_SIZE", "CCL_LOG_LEVEL",
    "NCCL_SOCKET_IFNAME", "NCCL_DEBUG", "NCCL_HOME", "CUDA_HOME",
    "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LD_LIBRARY_PATH",
)


def _default(name: str, value: str) -> None:
    if name not in os.environ:
        os.environ[name] = value
        APPLIED[name] = value


def _usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _enabled() -> bool:
    return os.environ.get("STREAMCOLL_NO_ENV_DEFAULTS", "0") in ("", "0")


def apply_oneccl_defaults(single_host: bool, local_rank: int, local_size: int) -> None:
    if not _enabled():
        return
    _default("CCL_LOCAL_RANK", str(local_rank))
    _default("CCL_LOCAL_SIZE", str(local_size))
    _default("CCL_LOG_LEVEL", "error")
    if single_host:
        oversubscribed = local_size > _usable_cores()
        if oversubscribed:
            _default("CCL_WORKER_OFFLOAD", "1")
            _default("CCL_YIELD", "sched_yield")
        else:
            _default("CCL_WORKER_OFFLOAD", "0")
        _default("CCL_ATL_SHM", "1")
        _default("FI_PROVIDER", "shm")
        _default("CCL_KVS_IFACE", "lo")
        if oversubscribed or local_size & (local_size - 1):
            _default("CCL_ALLREDUCE", "nreduce")
        else:
            _default("CCL_ALLREDUCE", "recursive_doubling:0-16384;nreduce:16385-max")


def apply_nccl_defaults(single_host: bool) -> None:
    if not _enabled():
        return
    if single_host:
        _default("NCCL_SOCKET_IFNAME", "lo")
