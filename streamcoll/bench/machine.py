"""What a figure was measured on: CPU, core count, load, library versions and
the environment variables that change collective performance. Saved beside
every result, because a number without its machine means little."""
from __future__ import annotations

import os
import platform
import time
from typing import Any, Dict, Optional

__all__ = ["describe", "loadavg", "summary_line", "cpu_snapshot", "cpu_usage"]

_ENV_PREFIXES = ("CCL_", "FI_", "NCCL_", "STREAMCOLL_", "OMP_NUM_THREADS", "MASTER_ADDR", "WORLD_SIZE")


def loadavg() -> Optional[list]:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def cpu_snapshot() -> Optional[list]:
    """The aggregate ``cpu`` line of /proc/stat (jiffies: user nice system
    idle iowait irq softirq steal ...)."""
    try:
        with open("/proc/stat") as f:
            return [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None


def cpu_usage(before: Optional[list], after: Optional[list]) -> Optional[Dict[str, float]]:
    """Percent of all cores' time between two snapshots that was busy, idle,
    and *stolen* (taken by the hypervisor for other guests: invisible in the
    load average, yet it slows every measurement)."""
    if not before or not after:
        return None
    d = [b - a for a, b in zip(before, after)]
    total = sum(d[:8]) or 1
    idle = d[3] + d[4]
    steal = d[7] if len(d) > 7 else 0
    return {"busy_pct": round(100.0 * (total - idle - steal) / total, 1),
            "idle_pct": round(100.0 * idle / total, 1),
            "steal_pct": round(100.0 * steal / total, 1)}


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _mem_gib() -> Optional[float]:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return round(int(line.split()[1]) / (1 << 20), 1)
    except OSError:
        pass
    return None


def memcpy_gbps(nbytes: int = 64 << 20, reps: int = 10) -> float:
    """One thread copying ``nbytes`` (torch ``copy_``), GB/s read, median of
    ``reps``: the yardstick for busbw on the CPU, where a collective's large
    messages are bound by memory copies."""
    import torch
    a = torch.ones(nbytes // 4)
    b = torch.empty_like(a)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        b.copy_(a)
        ts = []
        for _ in range(reps):
            t0 = time.perf_counter()
            b.copy_(a)
            ts.append(time.perf_counter() - t0)
    finally:
        torch.set_num_threads(threads)
    ts.sort()
    return round(nbytes / ts[len(ts) // 2] / 1e9, 2)


def describe(device: str = "cpu", memcpy: bool = False) -> Dict[str, Any]:
    """A JSON-able description of this machine and software (``memcpy``:
    also measure :func:`memcpy_gbps`, about a second)."""
    import torch
    import streamcoll
    from streamcoll.startup import env_defaults as scenv
    d: Dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "nproc": os.cpu_count(),
        "affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "cpu": _cpu_model(),
        "mem_gib": _mem_gib(),
        "loadavg": loadavg(),
        "os": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "streamcoll": getattr(streamcoll, "__version__", "?"),
    }
    try:
        from streamcoll._ffi.oneccl import ONECCL
        if ONECCL.is_available():
            d["oneccl"] = ONECCL.version_string()
            d["oneccl_path"] = ONECCL.path
    except Exception as e:  # pragma: no cover - reported, not fatal
        d["oneccl"] = f"unavailable: {e}"
    if device.startswith("cuda"):
        try:
            from streamcoll._ffi.nccl import NCCL
            d["nccl"] = NCCL.version_string()
            d["gpu"] = torch.cuda.get_device_name()
        except Exception as e:  # pragma: no cover
            d["nccl"] = f"unavailable: {e}"
    if memcpy:
        d["memcpy_64M_gbps"] = memcpy_gbps()
    d["env"] = {k: v for k, v in sorted(os.environ.items()) if k.startswith(_ENV_PREFIXES)}
    d["streamcoll_env_defaults"] = dict(scenv.APPLIED)
    return d


def summary_line(d: Dict[str, Any]) -> str:
    parts = [f"{d.get('cpu')}", f"{d.get('nproc')} cores", f"load {d.get('loadavg')}",
             f"torch {d.get('torch')}"]
    if d.get("cpu_usage"):
        u = d["cpu_usage"]
        parts.insert(3, f"during run: busy {u['busy_pct']}%, steal {u['steal_pct']}%")
    if d.get("memcpy_64M_gbps"):
        parts.insert(2, f"1-thread 64M memcpy {d['memcpy_64M_gbps']} GB/s")
    if "oneccl" in d:
        parts.append(f"oneCCL {d['oneccl']}")
    if "nccl" in d:
        parts.append(f"NCCL {d['nccl']} on {d.get('gpu')}")
    return ", ".join(parts)
