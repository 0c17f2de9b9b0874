"""The version matrix tier's script (issue 43), without making its venvs:
its pairs are the declared floors, the GPU machine's pair and the newest; a
venv that cannot be made fails the tier unless skipping is asked for, and
then it says NOT TESTED; the table reads pytest's results. The tier itself
(scripts/matrix.sh) runs in scripts/test.sh after the suite."""
from __future__ import annotations

import configparser
import os
import subprocess
import sys

from conftest import ROOT

SCRIPT = os.path.join(ROOT, "scripts", "matrix.sh")


def _pairs():
    env = {k: v for k, v in os.environ.items() if k != "STREAMCOLL_MATRIX_PAIRS"}
    p = subprocess.run(["bash", SCRIPT, "--list"], capture_output=True, text=True, timeout=30, env=env)
    assert p.returncode == 0, p.stderr
    return [line.split()[0] for line in p.stdout.splitlines()]


def test_the_pairs_are_the_floor_the_gpu_machines_and_the_newest():
    pairs = _pairs()
    cfg = configparser.ConfigParser()
    cfg.read(os.path.join(ROOT, "setup.cfg"))
    py_floor = cfg["options"]["python_requires"].strip().lstrip(">=")
    torch_floor = next(r for r in cfg["options"]["install_requires"].split() if r.startswith("torch>="))[7:]
    first_py, first_torch = pairs[0].split(":")
    assert first_py == py_floor and first_torch.startswith(torch_floor + ".")
    assert "3.12:2.11.0" in pairs  # scripts/gpu_check.sh's machine
    newest = max(pairs, key=lambda p: tuple(int(x) for x in p.split(":")[1].split(".")))
    assert newest == pairs[-1] and newest.split(":")[0] == max((p.split(":")[0] for p in pairs),
                                                               key=lambda v: tuple(map(int, v.split("."))))


def _make_without_an_index(tmp_path, **extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PIP_", "STREAMCOLL_"))}
    env.update(STREAMCOLL_HOME=str(tmp_path / "home"), STREAMCOLL_MATRIX_PAIRS=f"{sys.version_info[0]}."
               f"{sys.version_info[1]}:2.10.0", PIP_CONFIG_FILE=os.devnull, PIP_NO_INDEX="1", **extra)
    return subprocess.run(["bash", SCRIPT, "--make"], capture_output=True, text=True, timeout=300, env=env)


def test_a_venv_that_cannot_be_made_fails_the_tier_loudly(tmp_path):
    p = _make_without_an_index(tmp_path)
    assert p.returncode == 1, p.stdout + p.stderr
    assert "making the venv failed" in p.stdout and "FAILED" in p.stdout
    assert "STREAMCOLL_MATRIX_SKIP_UNAVAILABLE=1" in p.stdout
    # nothing half-made counts: no marker
    assert not list((tmp_path / "home" / "matrix").glob("*/.streamcoll-matrix-complete"))


def test_skipping_an_unavailable_venv_is_asked_for_and_said(tmp_path):
    p = _make_without_an_index(tmp_path, STREAMCOLL_MATRIX_SKIP_UNAVAILABLE="1")
    assert p.returncode == 0, p.stdout + p.stderr
    assert "SKIPPED" in p.stdout and "NOT TESTED" in p.stdout


def test_the_table_reads_junit_results(tmp_path):
    (tmp_path / "3.10:2.10.0.xml").write_text(
        '<testsuites><testsuite>'
        '<testcase classname="tests.integrations.test_compile" name="test_errors"/>'
        '<testcase classname="tests.integrations.test_compile" name="test_step">'
        '<skipped message="torch too old"/></testcase>'
        '<testcase classname="tests.integrations.test_process_group" name="test_ddp_matches_gloo"><failure/></testcase>'
        '</testsuite></testsuites>')
    (tmp_path / "3.10:2.10.0.info").write_text(
        "  python 3.10.13, cffi 2.1.1, torch 2.10.0+cu128\n"
        "  against: nccl 2.27.5 loaded, declarations of 2.32.3 (streamcoll/_native/nccl.h): older\n"
        "  WARNING: nccl 2.27.5 lacks 31 declared function(s); ...\n")
    p = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "matrix_table.py"), str(tmp_path),
                        "3.10:2.10.0"], capture_output=True, text=True, timeout=30)
    assert p.returncode == 0, p.stderr
    rows = {r.split(" | ")[0].lstrip("| "): r for r in p.stdout.splitlines() if r.startswith("|")}
    assert "Python 3.10.13 + torch 2.10.0+cu128" in rows["feature"]
    assert "NCCL 2.27.5 vs 2.32.3 declarations: WARNING, 31 functions missing" in p.stdout
    assert "pass (1), 1 skipped [1]" in rows["torch.compile (streamcoll and torch ReduceOp)"]
    assert "FAIL 1/1" in rows["DDP (vs gloo)"]
    assert rows["profiler"].endswith("| - |")
    assert "[1] torch too old" in p.stdout
