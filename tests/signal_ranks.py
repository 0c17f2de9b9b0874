"""What the signal tests' rank scripts share (tests/diagnostics/test_signals.py,
tests/diagnostics/test_terminating_signals.py): each
rank records what it saw in a JSON file the test reads, replaced whole
(a rank killed mid-write leaves the previous record), and lists its own
libfabric shared-memory regions."""
from __future__ import annotations

import json
import os
from typing import List, Optional


def record(data: dict, name: Optional[str] = None) -> None:
    """Merge ``data`` into this rank's record in ``$SIGNALS_OUT`` (the file
    ``name``, default ``rank$RANK.json``), replacing the file atomically."""
    path = os.path.join(os.environ["SIGNALS_OUT"], name or f"rank{os.environ['RANK']}.json")
    old = {}
    if os.path.exists(path):
        with open(path) as f:
            old = json.load(f)
    old.update(data)
    with open(path + ".tmp", "w") as f:
        json.dump(old, f)
    os.replace(path + ".tmp", path)


def own_regions() -> List[str]:
    """This process's own libfabric regions, as /proc/self/maps shows them."""
    pid = os.getpid()
    with open("/proc/self/maps") as f:
        paths = {line.split(None, 5)[5].strip() for line in f if "/dev/shm/" in line}
    return sorted(p for p in paths if os.path.basename(p).startswith(f"{pid}:"))
