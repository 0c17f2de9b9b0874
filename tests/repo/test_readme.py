"""The Python snippets of the README and of ``docs/`` run as they are (issues
15 and 37): each block is extracted and run on 2 CPU ranks under torchrun,
from a folder outside the repository. A snippet that stops working fails
here."""
from __future__ import annotations

import glob
import os
import re
import subprocess
import sys

import pytest

from conftest import ROOT, needs_oneccl
from world import free_port


def _pages():
    """The README, then the pages of ``docs/`` (relative to the root)."""
    return ["README.md"] + sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "docs", "*.md")))


def _snippets_of(page):
    with open(os.path.join(ROOT, page)) as f:
        return re.findall(r"```python\n(.*?)```", f.read(), re.S)


def _snippets():
    """``(page, code)`` of every Python block, page by page."""
    return [(page, code) for page in _pages() for code in _snippets_of(page)]


def test_the_readme_has_its_snippets():
    assert len(_snippets_of("README.md")) >= 2  # the first job, direct and through torch.distributed
    s = [code for _, code in _snippets()]
    assert len(s) >= 4
    assert any("GradientSync" in b for b in s) and any("torch.compile" in b for b in s)


@needs_oneccl
@pytest.mark.world
@pytest.mark.slow
@pytest.mark.parametrize("index", range(len(_snippets())),
                         ids=[f"{page}-{i}" for i, (page, _) in enumerate(_snippets())])
def test_readme_snippet_runs_on_two_ranks(index, tmp_path):
    page, code = _snippets()[index]
    script = tmp_path / f"snippet{index}.py"
    script.write_text(code)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_SIZE", "LOCAL_", "MASTER_"))}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
           "--master-port", str(free_port()), str(script)]
    p = subprocess.run(cmd, cwd=str(tmp_path), env=env, capture_output=True, text=True, timeout=240)
    assert p.returncode == 0, f"{page}, snippet {index}:\n{code}\n--- stdout\n{p.stdout[-3000:]}\n--- stderr\n{p.stderr[-5000:]}"
