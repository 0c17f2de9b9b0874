"""The checkout as a fresh clone holds it, copied, for the tests that build
or install from a copy of the source tree (repo/test_packaging.py,
startup/test_install.py, integrations/test_autoload.py)."""
from __future__ import annotations

import shutil
from pathlib import Path

from conftest import ROOT

REPO = Path(ROOT)


def copy_source_tree(dest: Path) -> Path:
    """The source tree without VCS data and build outputs (what a fresh
    clone holds); returns ``dest``."""
    shutil.copytree(REPO, dest, ignore=shutil.ignore_patterns(
        ".git", "build", "dist", "*.egg-info", "__pycache__", ".pytest_cache", ".hypothesis",
        "bench-results", "flight-records"))
    return dest
