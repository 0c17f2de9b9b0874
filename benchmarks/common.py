"""What the per-call benchmarks (``paths.py``, ``inline_async.py``) share:
timing a callable, the launcher variables a single process runs with, and
writing ``--out PREFIX`` files. Plain Python, no streamcoll import: the
benchmarks that use it run against any checkout on PYTHONPATH."""
from __future__ import annotations

import json
import os
import time
from typing import Any, Callable


def per_call_us(f: Callable[[], object], calls: int) -> float:
    """Microseconds per call of ``f`` over ``calls`` back-to-back calls."""
    t0 = time.perf_counter()
    for _ in range(calls):
        f()
    return (time.perf_counter() - t0) / calls * 1e6


def single_process_defaults(port: int) -> None:
    """torchrun's variables for a world of one, where no launcher set them."""
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(port))


def write_out(prefix: str, text: str, doc: Any) -> None:
    """``PREFIX.txt`` (the printed table) and ``PREFIX.json`` (the figures)."""
    os.makedirs(os.path.dirname(prefix) or ".", exist_ok=True)
    with open(prefix + ".txt", "w") as f:
        f.write(text + "\n")
    with open(prefix + ".json", "w") as f:
        json.dump(doc, f, indent=1)
