"""The README's "Launching" command lines and the launchers venv, shared by
the launchers tier (startup/test_launchers.py), the hang report under the
launchers (diagnostics/test_hang_report_launchers.py) and the two-node tier
(multihost/test_two_nodes.py): a user's environment for a job, the torchrun
line with a free port, the one-node SLURM."""
from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
from pathlib import Path
from typing import Dict, List, Optional

import pytest

from conftest import ROOT
from world import free_port

VENV = Path(os.environ.get("STREAMCOLL_LAUNCHERS_VENV") or os.path.join(ROOT, ".venv-launchers"))
VPY = VENV / "bin" / "python"
SLURM_LOCAL = os.path.join(ROOT, "scripts", "slurm_local.sh")

_LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK", "MASTER_ADDR",
                  "MASTER_PORT", "TORCHELASTIC_RUN_ID")


def job_env(path_first: Optional[object] = None, **extra: str) -> Dict[str, str]:
    """The environment of a user's shell: no launcher variables (the
    conftest's MASTER_ADDR included), the checkout first on PYTHONPATH."""
    env = {k: v for k, v in os.environ.items()
           if k not in _LAUNCHER_VARS and not k.startswith(("SLURM_", "PMI_", "OMPI_", "PMIX_", "MPI_LOCAL"))}
    env.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    if path_first is not None:
        env["PATH"] = f"{path_first}:{env.get('PATH', '')}"
    env.update(extra)
    return env


def torchrun(cmd: str, python: str) -> str:
    """A README torchrun line as ``python -m torch.distributed.run`` with a
    free port (the test's world may not take a fixed one)."""
    return cmd.replace("torchrun ", f"{shlex.quote(python)} -m torch.distributed.run --master-addr 127.0.0.1 "
                                    f"--master-port {free_port()} ", 1)


def slurm_start() -> str:
    """The one-node SLURM (scripts/slurm_local.sh start): its SLURM_CONF, or
    a skip saying why it cannot be set up here."""
    if shutil.which("bash") is None:
        pytest.skip("no bash")
    p = subprocess.run(["bash", SLURM_LOCAL, "start"], capture_output=True, text=True, timeout=300)
    if p.returncode != 0:
        pytest.skip(f"no one-node SLURM here (scripts/slurm_local.sh start: exit {p.returncode}: "
                    f"{p.stderr.strip()[-500:]})")
    return p.stdout.strip().splitlines()[-1]


def slurm_stop() -> None:
    subprocess.run(["bash", SLURM_LOCAL, "stop"], capture_output=True, timeout=60)


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
