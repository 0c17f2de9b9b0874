"""What the subprocess harnesses' rank scripts share (test_signals,
test_terminating_signals, test_hang_report, test_hang_report_review,
test_reliability): each rank records what it saw in a JSON file the test
reads, replaced whole (a rank killed mid-write leaves the previous record),
waits until every rank's process is up, and lists its own libfabric
shared-memory regions; the test finds a marked line of a script."""
from __future__ import annotations

import json
import os
import time
from typing import List, Optional


def record(var: str, data: dict, name: Optional[str] = None) -> None:
    """Merge ``data`` into this rank's record in the folder ``$var`` (the
    file ``name``, default ``rank$RANK.json``), replacing the file atomically."""
    path = os.path.join(os.environ[var], name or f"rank{os.environ['RANK']}.json")
    old = {}
    if os.path.exists(path):
        with open(path) as f:
            old = json.load(f)
    old.update(data)
    with open(path + ".tmp", "w") as f:
        json.dump(old, f)
    os.replace(path + ".tmp", path)


def all_started(var: str, limit: float = 60.0) -> None:
    """Wait (bounded) until every rank's process is up, its imports done
    (a file per rank in ``$var``): scenarios with short communicator
    timeouts bound the rendezvous too, and on a loaded machine interpreters
    importing torch can start seconds apart (CI once: "ranks 1, 2 never
    joined within 2 s")."""
    d, rank, size = os.environ[var], int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    open(os.path.join(d, f"started.{rank}"), "w").close()
    end = time.monotonic() + limit
    while not all(os.path.exists(os.path.join(d, f"started.{r}")) for r in range(size)):
        if time.monotonic() > end:
            raise TimeoutError(f"rank {rank}: not every rank started within {limit:g} s")
        time.sleep(0.01)


def marker_line(path: str, marker: str) -> int:
    """The number of the line of ``path`` marked ``# marker`` (at its end, or
    ``# marker:`` followed by a comment)."""
    with open(path) as f:
        for i, text in enumerate(f, 1):
            if text.rstrip().endswith(f"# {marker}") or f"# {marker}:" in text:
                return i
    raise AssertionError(f"no line marked # {marker} in {path}")


def own_regions() -> List[str]:
    """This process's own libfabric regions, as /proc/self/maps shows them."""
    pid = os.getpid()
    with open("/proc/self/maps") as f:
        paths = {line.split(None, 5)[5].strip() for line in f if "/dev/shm/" in line}
    return sorted(p for p in paths if os.path.basename(p).startswith(f"{pid}:"))
