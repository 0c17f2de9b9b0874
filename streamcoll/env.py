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

Several hosts (:func:`several_hosts_oneccl`, :func:`several_hosts_nccl`;
which ranks share a host and which interface reaches the rendezvous address
come from :mod:`streamcoll.topology`), per host:

- ``CCL_KVS_IFACE``, ``CCL_MNIC_NAME`` and ``NCCL_SOCKET_IFNAME=<iface>``:
  the interface the kernel routes the rendezvous address through
  (:func:`interface_defaults`). oneCCL's own choice is the alphabetically
  first interface, loopback included, which hangs when the right one sorts
  after ``lo``.
- ``CCL_WORKER_OFFLOAD=0`` while the ranks of this machine have a core each,
  else ``CCL_WORKER_OFFLOAD=1 CCL_YIELD=sched_yield``, as on one host; the
  ranks counted are those on this *machine* (same boot id: simulated hosts or
  containers share its cores).
- ``CCL_ATL_SHM=1`` (shared memory between the ranks of one host, the network
  between hosts) when a host has several ranks and no two hosts share a
  hostname: oneCCL groups its shm peers by hostname, and with a hostname
  shared by two hosts init hangs (measured, 2 x 2). Never ``FI_PROVIDER=shm``
  (shm only) there.
"""
from __future__ import annotations

import logging
import os
from typing import Dict, Optional

__all__ = ["APPLIED", "apply_oneccl_defaults", "apply_nccl_defaults", "RELEVANT", "several_hosts_oneccl",
           "several_hosts_nccl", "interface_defaults"]

LOG = logging.getLogger("streamcoll")

APPLIED: Dict[str, str] = {}

# Every variable streamcoll reads or sets: the table in streamcoll/env_vars.py.
from .env_vars import names as _names  # noqa: E402

RELEVANT = tuple(_names())


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


def interface_defaults(iface: Optional[str]) -> Dict[str, str]:
    """The interface that reaches the rendezvous address, for oneCCL's
    key-value store (``CCL_KVS_IFACE``) and NIC (``CCL_MNIC_NAME``: without it
    oneCCL 2022.2 takes the alphabetically first interface, loopback included,
    and hangs when the right one sorts after ``lo``) and NCCL's sockets
    (``NCCL_SOCKET_IFNAME``; a leading ``=`` makes it an exact name, not a
    prefix). Nothing when the interface is unknown."""
    if not iface:
        return {}
    return {"CCL_KVS_IFACE": iface, "CCL_MNIC_NAME": iface, "NCCL_SOCKET_IFNAME": "=" + iface}


def several_hosts_oneccl(local_size: int, oversubscribed: bool, iface: Optional[str],
                         shm: bool = True, world_size: int = 2) -> Dict[str, str]:
    """oneCCL defaults for one host of several (the why and the figures are in
    the module docstring). ``local_size``: ranks on this host; ``oversubscribed``:
    more ranks on this machine than cores; ``iface``: see
    :func:`interface_defaults`; ``shm``: whether oneCCL can tell the hosts
    apart (it groups shm peers by hostname); ``world_size``: all ranks."""
    d = {k: v for k, v in interface_defaults(iface).items() if k.startswith("CCL_")}
    if oversubscribed:
        d["CCL_WORKER_OFFLOAD"] = "1"
        d["CCL_YIELD"] = "sched_yield"
    else:
        d["CCL_WORKER_OFFLOAD"] = "0"
        pow2 = world_size & (world_size - 1) == 0
        d["CCL_ALLREDUCE"] = "recursive_doubling:0-16384;nreduce:16385-max" if pow2 else "nreduce"
    if local_size > 1 and shm:
        d["CCL_ATL_SHM"] = "1"
    return d


def several_hosts_nccl(iface: Optional[str]) -> Dict[str, str]:
    """NCCL defaults for one host of several: its socket interface."""
    return {k: v for k, v in interface_defaults(iface).items() if k.startswith("NCCL_")}


def apply_oneccl_defaults(single_host: bool, local_rank: int, local_size: int,
                          several: Optional[Dict[str, str]] = None) -> None:
    """Apply the defaults; ``several`` is :func:`several_hosts_oneccl`'s table
    when the ranks are on several hosts."""
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
    else:
        for k, v in (several or {}).items():
            _default(k, v)


def apply_nccl_defaults(single_host: bool, several: Optional[Dict[str, str]] = None) -> None:
    if not _enabled():
        return
    if single_host:
        _default("NCCL_SOCKET_IFNAME", "lo")
    else:
        for k, v in (several or {}).items():
            _default(k, v)
