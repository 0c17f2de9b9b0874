"""Tests run with the user's environment: no test module (nor conftest)
changes the process environment when it is imported (a module that sets
``WORLD_SIZE`` at import sets it for every later test of the session), and
none sets the variables the suite used to set for everyone."""
from __future__ import annotations

import json
import os
import subprocess
import sys

from conftest import ROOT, TESTS

_PROBE = r"""
import glob, importlib, json, os, sys
import torch, torch._dynamo  # torch's own: importing Dynamo sets TORCHINDUCTOR_CACHE_DIR (not a test module's doing)
sys.path.insert(0, sys.argv[1])
tests = sorted(glob.glob(os.path.join(sys.argv[1], "*", "test_*.py")))
for d in sorted({os.path.dirname(p) for p in tests}):  # each test file's folder, as pytest puts it there
    sys.path.insert(0, d)
changed = {}
for path in ["conftest.py"] + [os.path.basename(p) for p in tests]:
    name = path[:-3]
    before = dict(os.environ)
    try:
        importlib.import_module(name)
    except BaseException as e:  # an importorskip, a missing library: not this test's concern
        pass
    after = dict(os.environ)
    diff = sorted(k for k in set(before) | set(after) if before.get(k) != after.get(k))
    if diff:
        changed[name] = diff
        os.environ.clear(); os.environ.update(before)
print(json.dumps(changed))
"""


def test_no_module_changes_the_environment_at_import():
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    p = subprocess.run([sys.executable, "-c", _PROBE, TESTS], capture_output=True, text=True, timeout=240, env=env,
                       cwd=ROOT)
    assert p.returncode == 0, p.stderr[-3000:]
    changed = json.loads(p.stdout.strip().splitlines()[-1])
    assert changed == {}, f"modules that change os.environ when imported: {changed}"
