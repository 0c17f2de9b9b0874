"""The mutation check on itself (scripts/mutation_check.py): every break of
the short list is caught by its tests, and every break of the full list
still applies to the tree (a refactor that moves a line makes its break
stale, which fails here rather than silently testing nothing).

The full list (table-derived breaks for every collective, the slow compile
and PyTorch-suite catchers) runs in the benchmark tier:
``python scripts/mutation_check.py``.
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from conftest import ROOT, needs_oneccl

sys.path.insert(0, os.path.join(ROOT, "scripts"))

import mutation_check  # noqa: E402


def test_every_break_applies_once_and_names_its_tests():
    ms = mutation_check.everything()
    names = [m.name for m in ms]
    assert len(set(names)) == len(names), "two breaks share a name"
    assert sum(m.ci for m in ms) >= 5
    derived = {m.name.split(":")[0] for m in mutation_check.derived()}
    from streamcoll.core import spec
    # one of each kind the planner allows, for the collectives with planners of their own
    assert {"all_reduce", "broadcast", "reduce", "gather", "scatter", "all_gather"} <= derived, derived
    for m in ms:
        assert m.tests, m.name
        for path, old, new in m.edits:
            with open(os.path.join(ROOT, path)) as f:
                n = f.read().count(old)
            assert n == 1, f"{m.name}: {path} holds the text to break {n} times"
            assert old != new, m.name
        for t in m.tests:
            assert os.path.exists(os.path.join(ROOT, t.split("::")[0])), (m.name, t)
    assert all(n in spec.TABLE for n in derived)


@needs_oneccl
@pytest.mark.world
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_ci_breaks_are_all_caught():
    """Each break of the short list in a temporary copy, its tests run one
    at a time (their worlds never overlap); every one must fail them."""
    p = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "mutation_check.py"), "--ci"],
                       capture_output=True, text=True, timeout=850, cwd=ROOT)
    assert p.returncode == 0, p.stdout[-6000:] + p.stderr[-3000:]
    assert "breaks caught" in p.stdout and "not caught" not in p.stdout, p.stdout
