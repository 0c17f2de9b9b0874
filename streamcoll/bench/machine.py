"""What a figure was measured on: CPU, core count, load, library versions and
the environment variables that change collective performance. Saved beside
every result, because a number without its machine means little."""
from __future__ import annotations

import os
import platform
import time
from typing import Any, Dict, Optional

__all__ = ["describe", "loadavg", "summary_line"]

_ENV_PREFIXES = ("CCL_", "FI_", "NCCL_", "STREAMCOLL_", "OMP_NUM_THREADS", "MASTER_ADDR", "WORLD_SIZE")


def loadavg() -> Optional[list]:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


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


def describe(device: str = "cpu") -> Dict[str, Any]:
    """A JSON-able description of this machine and software."""
    import torch
    import streamcoll
    from streamcoll import env as scenv
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
    d["env"] = {k: v for k, v in sorted(os.environ.items()) if k.startswith(_ENV_PREFIXES)}
    d["streamcoll_env_defaults"] = dict(scenv.APPLIED)
    return d


def summary_line(d: Dict[str, Any]) -> str:
    parts = [f"{d.get('cpu')}", f"{d.get('nproc')} cores", f"load {d.get('loadavg')}",
             f"torch {d.get('torch')}"]
    if "oneccl" in d:
        parts.append(f"oneCCL {d['oneccl']}")
    if "nccl" in d:
        parts.append(f"NCCL {d['nccl']} on {d.get('gpu')}")
    return ", ".join(parts)
