"""What a built wheel and sdist carry: the C declarations the binding parses
(``streamcoll/_native/*.h``) are package data, so an installed streamcoll can
load its libraries without the source tree.

Built with setuptools' PEP 517 backend (what ``pip wheel`` and ``python -m
build`` call) from a copy of the source tree, so the checkout gets no
``build/`` or ``*.egg-info``. Installing the wheel into a clean venv and
running a job from it is tests/startup/test_install.py.
"""
from __future__ import annotations

import subprocess
import sys
import tarfile
import zipfile

import pytest

from checkout import REPO, copy_source_tree

HEADERS = {"streamcoll/_native/nccl.h", "streamcoll/_native/oneccl.h", "streamcoll/_native/cudart.h"}


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    src = copy_source_tree(tmp_path_factory.mktemp("pkg") / "src")
    out = src.parent / "out"
    names = []
    for kind in ("sdist", "wheel"):  # one process each: setuptools keeps state between builds
        r = subprocess.run(
            [sys.executable, "-c",
             f"import sys; from setuptools import build_meta as b; print('@@' + b.build_{kind}(sys.argv[1]))",
             str(out)],
            cwd=str(src), capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr[-4000:]
        assert "Package would be ignored" not in r.stderr, r.stderr[-4000:]
        names.append(r.stdout.rsplit("@@", 1)[1].strip())
    return out / names[0], out / names[1]


def test_the_wheel_carries_the_declarations(built):
    _, wheel = built
    names = set(zipfile.ZipFile(wheel).namelist())
    assert HEADERS <= names, sorted(n for n in names if "native" in n)
    assert "streamcoll/py.typed" in names
    # The repo's copies are the ones shipped (one source of truth).
    with zipfile.ZipFile(wheel) as z:
        for h in HEADERS:
            assert z.read(h) == (REPO / h).read_bytes(), h


def test_the_sdist_carries_the_declarations_and_the_abi_check(built):
    sdist, _ = built
    with tarfile.open(sdist) as t:
        names = {n.split("/", 1)[1] for n in t.getnames() if "/" in n}
    assert HEADERS <= names
    assert "native/abi_check.c" in names and "tests/binding/test_abi.py" in names
    # the scripts the tests run (repo/test_mutation.py, repo/test_matrix_script.py)
    assert {"scripts/mutation_check.py", "scripts/matrix_table.py", "scripts/matrix.sh"} <= names


def _package_files():
    """Every file of the package in the source tree (what a fresh clone holds)."""
    pkg = REPO / "streamcoll"
    return {str(p.relative_to(REPO)) for p in pkg.rglob("*")
            if p.is_file() and "__pycache__" not in p.parts and (p.suffix in (".py", ".pyi", ".h") or p.name == "py.typed")}


def test_both_carry_every_file_of_every_subpackage(built):
    """The stubs (collectives.pyi, core/_methods.pyi: what a user's type
    checker reads), py.typed, the declarations and every module of each
    subpackage: a subpackage or a data pattern left out of setup.cfg would
    install a package that fails on import, or types as Any."""
    sdist, wheel = built
    want = _package_files()
    assert {"streamcoll/core/_methods.pyi", "streamcoll/collectives.pyi", "streamcoll/py.typed",
            "streamcoll/diagnostics/watchdog.py", "streamcoll/startup/launchers.py"} <= want
    in_wheel = set(zipfile.ZipFile(wheel).namelist())
    assert sorted(want - in_wheel) == []
    assert sorted(n for n in in_wheel if n.startswith("streamcoll/") and n not in want) == []
    with tarfile.open(sdist) as t:
        in_sdist = {n.split("/", 1)[1] for n in t.getnames() if "/" in n}
    assert sorted(want - in_sdist) == []
