"""The README's "Launching" command lines and the launchers venv, shared by
the launchers tier (startup/test_launchers.py) and the two-node tier
(multihost/test_two_nodes.py)."""
from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path
from typing import List

from conftest import ROOT

VENV = Path(os.environ.get("STREAMCOLL_LAUNCHERS_VENV") or os.path.join(ROOT, ".venv-launchers"))
VPY = VENV / "bin" / "python"


def readme_commands() -> List[str]:
    """The command lines of the README's "Launching" section (its ``sh``
    blocks, one command a line, comments dropped)."""
    text = Path(ROOT, "README.md").read_text()
    m = re.search(r"^## Launching\n(.*?)(?=^## )", text, re.S | re.M)
    assert m, "README.md has no 'Launching' section"
    out = []
    for block in re.findall(r"```sh\n(.*?)```", m.group(1), re.S):
        for line in block.splitlines():
            line = line.split(" #", 1)[0].strip()
            if line and not line.startswith("#"):
                out.append(line)
    return out


def command(pattern: str) -> str:
    hits = [c for c in readme_commands() if re.search(pattern, c)]
    assert len(hits) == 1, f"README 'Launching': expected one command matching {pattern!r}, got {hits}"
    return hits[0]


def venv_why_not() -> str:
    if not VPY.exists():
        return f"no launchers venv at {VENV} (bash scripts/setup_launchers.sh makes it)"
    r = subprocess.run([str(VPY), "-c", "import ray.train.torch, lightning, accelerate, mpi4py"], capture_output=True,
                       text=True, timeout=120)
    if r.returncode != 0:
        return f"the launchers venv lacks a framework ({r.stderr.strip().splitlines()[-1:]}): " \
               "bash scripts/setup_launchers.sh"
    return ""
