"""Types to the edge (issue 15): the stubs of the generated API are derived
from the table and up to date, and user code type-checks with the
``@overload``s on ``async_op`` (``Literal[True]`` -> Work, ``False`` -> None)."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from conftest import ROOT


def test_stubs_are_generated_from_the_table_and_up_to_date():
    from streamcoll import _stubgen
    from streamcoll.core import spec
    p = subprocess.run([sys.executable, "-m", "streamcoll._stubgen", "--check"], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    text = _stubgen.stubs()["collectives.pyi"]
    for name in spec.TABLE:
        assert f"def {name}(" in text


USER = '''
import torch
import streamcoll as dist

t = torch.ones(4)
dist.init()
work = dist.all_reduce(t, op=dist.ReduceOp.AVG, async_op=True)
work.wait()
none = dist.all_reduce(t)
c = dist.default_communicator()
w2 = c.all_gather_into_tensor(torch.empty(8), t, True)
w2.wait()
src: int = c.recv(t, 0)
ws = dist.batch_isend_irecv([dist.P2POp(dist.isend, t, 1)])
ws[0].wait()
reveal_type(none)
'''


def test_user_code_type_checks_with_the_overloads(tmp_path):
    pytest.importorskip("mypy")
    f = tmp_path / "user.py"
    f.write_text(textwrap.dedent(USER))
    p = subprocess.run([sys.executable, "-m", "mypy", "--strict", "--cache-dir", str(tmp_path / "cache"),
                        "--no-error-summary", str(f)], cwd=ROOT, capture_output=True, text=True, timeout=600)
    mine = [line for line in p.stdout.splitlines() if line.startswith(str(f))]
    assert mine == [f'{f}:16: note: Revealed type is "None"'], p.stdout[-3000:]


def test_the_package_type_checks(tmp_path):
    """``mypy streamcoll`` is clean (py.typed ships: users' checkers read this
    code), run as a newcomer runs it: no flags (the configuration is in
    setup.cfg; only the cache goes elsewhere, by environment)."""
    pytest.importorskip("mypy")
    env = dict(os.environ, MYPY_CACHE_DIR=str(tmp_path / "cache"))
    p = subprocess.run([sys.executable, "-m", "mypy", "streamcoll"], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=900)
    assert p.returncode == 0 and "Success: no issues found" in p.stdout, p.stdout[-5000:]


def test_abi_planner_takes_a_function_typedef():
    """mypy with types-cffi's stubs found ``except ffi.error`` in the ABI
    planner: cffi's FFI has no ``error`` attribute, so a typedef of a
    function type (``ffi.sizeof`` raises CDefError) raised AttributeError."""
    import cffi
    from streamcoll._ffi import abi
    ffi = cffi.FFI()
    ffi.cdef("typedef int fn_t(int); typedef int word_t;")
    p = abi._Planner(ffi)
    p.typedef("fn_t")
    p.typedef("word_t")
    assert any('"word_t"' in line for line in p.plan.lines), p.plan.lines
