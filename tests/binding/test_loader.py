"""Finding the native libraries: the documented search order, the error that
lists every place tried, import without either library, and
``python -m streamcoll info``.

What must not see an already-loaded library runs in a child interpreter
(``run_child``): the pytest process has oneCCL mapped (conftest loads it), and
a fresh binding would find it through /proc/self/maps. Nothing is mocked: the
children dlopen (or fail to dlopen) real files.
"""
from __future__ import annotations

import base64
import os
import pickle
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Dict, Optional

import pytest

import streamcoll
from streamcoll.startup import env_defaults as sc_env
from streamcoll._ffi import nccl as nccl_mod
from streamcoll._ffi import oneccl as oneccl_mod
from streamcoll._ffi.errors import LibraryNotFoundError

from conftest import ROOT, needs_nccl, needs_oneccl
from world import TORCHRUN_ENV

REPO = Path(ROOT)
PKG = Path(streamcoll.__file__).resolve().parent
_MARK = "@@streamcoll-child-result@@"

# Runs before the child's code when bare=True: torch cannot be imported, and
# the package ``streamcoll`` is an empty module whose __path__ is the real
# package folder, so ``import streamcoll._ffi.oneccl`` executes the real
# _ffi and errors modules without streamcoll/__init__.py (which imports torch).
_BARE_PRELUDE = f"""
import importlib.abc, sys, types
class _BlockTorch(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ImportError("torch is blocked in this child (import of " + name + ")")
        return None
sys.meta_path.insert(0, _BlockTorch())
_pkg = types.ModuleType("streamcoll")
_pkg.__path__ = [{str(PKG)!r}]
sys.modules["streamcoll"] = _pkg
"""


def child_env(extra: Optional[Dict[str, str]] = None, drop_prefixes=("CCL_", "FI_", "NCCL_", "STREAMCOLL_")) -> Dict[str, str]:
    """This process's environment without library settings other tests may
    have left, plus what torchrun gives a rank (world.TORCHRUN_ENV) and ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(drop_prefixes)}
    env.pop("LD_LIBRARY_PATH", None)
    env.update(TORCHRUN_ENV, PYTHONPATH=str(REPO))
    env.update(extra or {})
    return env


def run_child(code: str, env: Optional[Dict[str, str]] = None, bare: bool = True, timeout: float = 120.0):
    """Run ``code`` in a fresh interpreter; it leaves its answer in a
    variable ``result``, which comes back unpickled (exceptions included:
    they cross the process boundary as they would in a launcher)."""
    script = (_BARE_PRELUDE if bare else "") + code + (
        "\nimport base64 as _b, pickle as _p\n"
        f"print({_MARK!r} + _b.b64encode(_p.dumps(result)).decode())\n"
    )
    r = subprocess.run([sys.executable, "-c", script], env=env if env is not None else child_env(),
                       capture_output=True, text=True, timeout=timeout, cwd=str(REPO))
    for line in r.stdout.splitlines():
        if line.startswith(_MARK):
            return pickle.loads(base64.b64decode(line[len(_MARK):]))
    raise AssertionError(f"child failed (rc {r.returncode}):\nstdout:\n{r.stdout[-3000:]}\nstderr:\n{r.stderr[-6000:]}")


def _nowhere(tmp_path: Path) -> Dict[str, str]:
    """Environment in which no oneCCL can be found: explicit paths that do
    not exist, and HOME/STREAMCOLL_HOME (where set-up puts the runtime) empty."""
    home = tmp_path / "home"
    home.mkdir()
    return child_env({
        "STREAMCOLL_ONECCL_LIBRARY": "/nonexistent/libccl.so.2",
        "STREAMCOLL_NCCL_LIBRARY": "/nonexistent/libnccl.so.2",
        "HOME": str(home), "STREAMCOLL_HOME": str(home / "sc"), "XDG_CACHE_HOME": str(home / "cache"),
    })


# ---- the error when nothing is found --------------------------------------------
def test_missing_library_lists_every_place_tried_and_the_install_command(tmp_path):
    res = run_child("""
from streamcoll._ffi.oneccl import _Oneccl
from streamcoll._ffi.errors import LibraryNotFoundError
b = _Oneccl()
result = {"candidates": b.candidates()}
try:
    b.lib()
except LibraryNotFoundError as e:
    result["error"] = e
try:
    b.lib()
except LibraryNotFoundError as e:
    result["same_again"] = e is result["error"]
result["available"] = b.is_available()
result["maps"] = "libccl.so" in open("/proc/self/maps").read()
""", env=_nowhere(tmp_path))
    e = res["error"]
    assert isinstance(e, LibraryNotFoundError) and isinstance(e, streamcoll.CollectiveError)
    assert e.library == "oneccl"
    # One entry per candidate, in search order, each saying why it failed.
    cands = res["candidates"]
    assert len(e.tried) == len(cands) >= 6
    for (desc, path), line in zip(cands, e.tried):
        assert line.startswith(f"{desc}: "), (desc, line)
        if path:
            assert path in line
    assert e.tried[0] == "$STREAMCOLL_ONECCL_LIBRARY: /nonexistent/libccl.so.2: no such file"
    assert any(t.startswith("streamcoll runtime: ") and str(tmp_path) in t and t.endswith("no such file")
               for t in e.tried)
    assert e.tried[-1].startswith("system loader: libccl.so.2: ")
    assert "loaded" not in " ".join(e.tried)
    msg = str(e)
    assert "could not load the oneccl library; tried, in order:" in msg
    assert all(f"{i}. {t}" in msg for i, t in enumerate(e.tried, 1))
    assert "install it with: python -m streamcoll install-runtime" in msg and e.hint in msg
    assert "setup.sh" not in msg and "pip install" not in msg  # never a recipe for a broken runtime
    assert res["same_again"] is True  # cached: the search runs once
    assert res["available"] is False and res["maps"] is False


def test_import_streamcoll_without_either_library(tmp_path):
    """Import loads nothing; is_available says no; using oneCCL raises the
    listed-places error. (NCCL's wheel is in site-packages here, so NCCL can
    only be shown not loaded at import, not absent.)"""
    res = run_child("""
import streamcoll
from streamcoll._ffi.oneccl import ONECCL
from streamcoll._ffi.nccl import NCCL
maps = open("/proc/self/maps").read()
result = {"maps_ccl": "libccl.so" in maps, "maps_nccl": "libnccl.so" in maps,
          "loaded": (ONECCL._lib, NCCL._lib), "tried_before": list(ONECCL.tried)}
result["available"] = streamcoll.is_available("oneccl")
try:
    streamcoll.new_communicator(backend="oneccl", device="cpu", rank=0, world_size=1,
                                store=__import__("torch").distributed.HashStore())
except streamcoll.LibraryNotFoundError as e:
    result["error"] = e
""", env=_nowhere(tmp_path), bare=False)
    assert res["maps_ccl"] is False and res["maps_nccl"] is False
    assert res["loaded"] == (None, None) and res["tried_before"] == []
    assert res["available"] is False
    assert isinstance(res["error"], LibraryNotFoundError)
    assert res["error"].tried[0].startswith("$STREAMCOLL_ONECCL_LIBRARY: /nonexistent")


# ---- candidates that exist but are wrong, and the env var forms ------------------
@needs_nccl
@needs_oneccl
def test_a_wrong_file_is_passed_over_with_its_reason(monkeypatch):
    wrong = oneccl_mod.ONECCL.path  # a real shared library that is not NCCL
    monkeypatch.setenv("STREAMCOLL_NCCL_LIBRARY", wrong)
    b = nccl_mod._Nccl()
    b.lib()
    assert b.tried[0].startswith(f"$STREAMCOLL_NCCL_LIBRARY: {wrong}: ")
    assert "ncclGetVersion" in b.tried[0]
    assert b.tried[-1].endswith(": loaded") and b.path.endswith("libnccl.so.2")
    assert b.version() == 23203


@needs_nccl
@pytest.mark.parametrize("form", ["file", "folder"])
def test_env_var_takes_a_file_or_its_folder(monkeypatch, form):
    nccl_mod.NCCL.lib()
    real = Path(nccl_mod.NCCL.path)
    monkeypatch.setenv("STREAMCOLL_NCCL_LIBRARY", str(real if form == "file" else real.parent))
    b = nccl_mod._Nccl()
    b.lib()
    assert b.tried == [f"$STREAMCOLL_NCCL_LIBRARY: {real}: loaded"]
    assert b.path == os.path.realpath(real)


# ---- the documented order is the order searched -----------------------------------
# A phrase of each place as the module docstrings name it, and how candidates()
# describes it.
_PLACES = [
    ("env", r"\$STREAMCOLL_(NCCL|ONECCL)_LIBRARY", r"^\$STREAMCOLL_(NCCL|ONECCL)_LIBRARY$"),
    ("loaded", r"already mapped into this process", r"^already loaded in this process$"),
    ("wheel", r"Python wheels", r"^wheel "),
    ("NCCL_HOME", r"\$NCCL_HOME/lib", r"^\$NCCL_HOME/lib$"),
    ("CUDA_HOME", r"\$CUDA_HOME/lib64", r"^\$CUDA_HOME/lib64$"),
    ("CCL_ROOT", r"\$CCL_ROOT/lib", r"^\$CCL_ROOT/lib$"),
    ("oneapi", r"/opt/intel/oneapi/ccl/latest/lib", r"^oneAPI default$"),
    ("runtime", r"\$STREAMCOLL_HOME/oneccl/lib", r"^streamcoll runtime$"),
    ("system", r"system loader", r"^system loader$"),
]


def _documented_order(doc: str):
    lines = doc.splitlines()
    start = next((i for i, ln in enumerate(lines) if "search order" in ln.lower()), None)
    assert start is not None, "no 'search order' list in the module docstring"
    block = []
    for ln in lines[start + 1:]:
        if not ln.strip():
            if block:
                break
            continue
        block.append(ln)
    items = re.split(r"\n(?=\d+\. )", "\n".join(block))
    order = []
    for n, item in enumerate(items, 1):
        assert item.startswith(f"{n}. "), f"search order item {n} is numbered wrongly: {item[:40]!r}"
        hits = sorted((mm.start(), key) for key, doc_re, _ in _PLACES for mm in [re.search(doc_re, item)] if mm)
        assert hits, f"search order item {n} names no known place: {item!r}"
        order += [key for _, key in hits]
    return order


def _searched_order(binding):
    order = []
    for desc, _ in binding.candidates():
        keys = [key for key, _, c_re in _PLACES if re.search(c_re, desc)]
        assert len(keys) == 1, f"candidate {desc!r} matches {keys}"
        if not order or order[-1] != keys[0]:
            order.append(keys[0])
    return order


@pytest.mark.parametrize("mod", [nccl_mod, oneccl_mod], ids=["nccl", "oneccl"])
def test_documented_search_order_is_candidates_order(mod, monkeypatch, tmp_path):
    # Every conditional place present: the env vars set (to files that do
    # not exist; candidates() only lists) and the library mapped here.
    for var in ("STREAMCOLL_NCCL_LIBRARY", "STREAMCOLL_ONECCL_LIBRARY", "NCCL_HOME", "CUDA_HOME", "CCL_ROOT"):
        monkeypatch.setenv(var, str(tmp_path / var))
    binding = mod.binding
    if not binding.is_available():
        pytest.skip(f"{binding.name} not loadable: 'already loaded' cannot be listed")
    documented = _documented_order(mod.__doc__)
    searched = _searched_order(binding)
    assert searched == documented, f"docstring says {documented}, candidates() searches {searched}"


# ---- python -m streamcoll info ----------------------------------------------------
def _info(env: Dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "streamcoll", "info"], env=env, capture_output=True,
                          text=True, timeout=120, cwd=str(REPO))


def _info_here(capsys) -> str:
    """The report from this process (the libraries conftest loaded)."""
    from streamcoll.__main__ import main
    assert main(["info"]) == 0
    return capsys.readouterr().out


@needs_oneccl
@needs_nccl
def test_info_reports_paths_versions_places_and_environment(capsys, monkeypatch):
    for name in sc_env.RELEVANT:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("CCL_WORKER_OFFLOAD", "1")
    before = dict(os.environ)
    out = _info_here(capsys)
    assert dict(os.environ) == before  # computing the defaults left no trace
    one, nccl = out.split("\noneccl:\n", 1)[1].split("\nnccl:\n", 1)
    assert "status: loaded" in one and "version: 2022.2.0 (20220200)" in one
    assert f"path: {oneccl_mod.ONECCL.path}" in one
    assert "1. $STREAMCOLL_ONECCL_LIBRARY: not set" in one and ": loaded" in one
    assert "version: 2.32.3 (23203)" in nccl and f"path: {nccl_mod.NCCL.path}" in nccl
    assert "system loader" in nccl  # listed though not reached
    for name in sc_env.RELEVANT:
        assert re.search(rf"^  {name}(=| \(not set\))", out, re.M), name
    assert "  CCL_WORKER_OFFLOAD=1\n" in out  # the user's value, shown
    defaults = out.split("defaults streamcoll applies", 1)[1]
    assert "CCL_ATL_SHM=1" in defaults and "FI_PROVIDER=shm" in defaults
    assert "CCL_WORKER_OFFLOAD" not in defaults  # set by the user: not overridden


def test_info_with_defaults_off(capsys, monkeypatch):
    monkeypatch.setenv("STREAMCOLL_NO_ENV_DEFAULTS", "1")
    assert "defaults: off (STREAMCOLL_NO_ENV_DEFAULTS is set)" in _info_here(capsys)


def test_info_without_libraries_prints_the_error_and_exits_0(tmp_path):
    r = _info(_nowhere(tmp_path))
    assert r.returncode == 0, r.stderr
    assert "Traceback" not in r.stderr
    one = r.stdout.split("\noneccl:\n", 1)[1].split("\nnccl:\n", 1)[0]
    assert "status: NOT FOUND" in one
    assert "1. $STREAMCOLL_ONECCL_LIBRARY: /nonexistent/libccl.so.2: no such file" in one
    assert "install it with: python -m streamcoll install-runtime" in one


# ---- candidates that load but do not work: rejected with the reason -------------
# Real files, no mocks: copies of the working runtime's libraries with one
# part missing or replaced by a real shared library built here that fails the
# way the broken set-ups seen in the wild fail.
def _gcc_shared(out: Path, soname: str, needed=()) -> None:
    """Build a real (empty) shared library ``out`` with ``soname`` that
    NEEDs the given library files (by their sonames)."""
    cmd = ["gcc", "-shared", "-fPIC", "-o", str(out), f"-Wl,-soname,{soname}", "-Wl,--no-as-needed"]
    cmd += [str(n) for n in needed] + ["-x", "c", "-"]  # the source last: -x applies to what follows
    r = subprocess.run(cmd, input="int streamcoll_test_stub;\n", capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr


def _needs_gcc() -> None:
    if shutil.which("gcc") is None:
        pytest.skip("no gcc to build the broken stand-in libraries")


@pytest.fixture(scope="module")
def good_runtime(tmp_path_factory) -> Path:
    """A ``CCL_ROOT`` whose ``lib`` is the working runtime the suite uses."""
    if not oneccl_mod.ONECCL.is_available():
        pytest.skip("oneCCL not loadable: no working runtime to copy parts of")
    real = Path(oneccl_mod.ONECCL.path).parent
    for part in ("libccl.so.1", "libccl.so.2", "libccl_legacy_cpu.so"):
        if not (real / part).exists():
            pytest.skip(f"the loaded oneCCL ({real}) is not a CPU working set: no {part}")
    root = tmp_path_factory.mktemp("good")
    (root / "lib").symlink_to(real, target_is_directory=True)
    return root


def _broken(tmp_path: Path, good_runtime: Path, kind: str) -> Path:
    """A folder holding a libccl.so.2 that does not work, ``kind`` saying why."""
    real = good_runtime / "lib"
    d = tmp_path / f"broken-{kind}"
    d.mkdir()
    shutil.copy2(real / "libccl.so.2", d)
    if kind == "front-only":  # libccl.so.2 alone: no plugin to dispatch to
        return d
    shutil.copy2(real / "libccl_legacy_cpu.so", d)
    _needs_gcc()
    stub = tmp_path / "stub"
    stub.mkdir(exist_ok=True)
    if kind == "sycl":  # the oneccl wheel's libccl.so.1 needs Intel's libsycl.so.9
        _gcc_shared(stub / "libsycl.so.9", "libsycl.so.9")
        _gcc_shared(d / "libccl.so.1", "libccl.so.1", [stub / "libsycl.so.9"])
    elif kind == "libfabric":  # everything but a transport library that loads
        shutil.copy2(real / "libccl.so.1", d)
        _gcc_shared(stub / "libfi_gone.so.1", "libfi_gone.so.1")
        _gcc_shared(d / "libfabric.so.1", "libfabric.so.1", [stub / "libfi_gone.so.1"])
    else:
        raise ValueError(kind)
    shutil.rmtree(stub)  # what the stand-ins need is now missing
    return d


_INIT_ONE_RANK = """
import torch, streamcoll
from streamcoll._ffi.oneccl import ONECCL
result = {"available": streamcoll.is_available("oneccl"), "tried": list(ONECCL.tried), "path": ONECCL.path}
comm = streamcoll.new_communicator(backend="oneccl", device="cpu", rank=0, world_size=1,
                                   store=torch.distributed.HashStore())
t = torch.full((4,), 3.0)
comm.all_reduce(t)
result["sum"] = t.tolist()
comm.destroy()
"""

_REASONS = {
    "front-only": ["onecclGetVersion returned", "no oneCCL plugin loads", "no plugin (libccl_legacy_cpu.so) beside it",
                   "python -m streamcoll install-runtime"],
    "sycl": ["no oneCCL plugin loads", "libsycl.so.9: cannot open shared object file", "SYCL build",
             "python -m streamcoll install-runtime"],
    "libfabric": ["libfabric.so.1 does not load", "libfi_gone.so.1"],
}


@needs_oneccl
@pytest.mark.parametrize("kind", sorted(_REASONS))
def test_a_candidate_that_loads_but_cannot_work_is_rejected_and_the_search_goes_on(kind, tmp_path, good_runtime):
    bad = _broken(tmp_path, good_runtime, kind)
    env = _nowhere(tmp_path)
    env.update({"STREAMCOLL_ONECCL_LIBRARY": str(bad), "CCL_ROOT": str(good_runtime)})
    res = run_child(_INIT_ONE_RANK, env=env, bare=False)
    first = res["tried"][0]
    assert first.startswith(f"$STREAMCOLL_ONECCL_LIBRARY: {bad}/libccl.so.2: rejected: "), first
    for phrase in _REASONS[kind]:
        assert phrase in first, (phrase, first)
    # The next working place is taken, and is_available() agrees with init().
    assert res["tried"][-1] == f"$CCL_ROOT/lib: {good_runtime}/lib/libccl.so.2: loaded"
    assert res["available"] is True and res["sum"] == [3.0] * 4


@needs_oneccl
def test_only_broken_candidates_mean_not_available_and_init_raises_the_reasons(tmp_path, good_runtime):
    bad = _broken(tmp_path, good_runtime, "front-only")
    env = _nowhere(tmp_path)
    env["STREAMCOLL_ONECCL_LIBRARY"] = str(bad)
    res = run_child("""
import torch, streamcoll
result = {"available": streamcoll.is_available("oneccl")}
try:
    streamcoll.new_communicator(backend="oneccl", device="cpu", rank=0, world_size=1,
                                store=torch.distributed.HashStore())
except streamcoll.LibraryNotFoundError as e:
    result["error"] = e
""", env=env, bare=False)
    assert res["available"] is False
    e = res["error"]
    assert "rejected: onecclGetVersion returned" in e.tried[0]
    assert "install it with: python -m streamcoll install-runtime" in str(e)


@needs_oneccl
def test_info_shows_the_rejected_candidate_and_why_and_the_one_taken(tmp_path, good_runtime):
    bad = _broken(tmp_path, good_runtime, "front-only")
    env = _nowhere(tmp_path)
    env.update({"STREAMCOLL_ONECCL_LIBRARY": str(bad), "CCL_ROOT": str(good_runtime)})
    r = _info(env)
    assert r.returncode == 0, r.stderr[-3000:]
    one = r.stdout.split("\noneccl:\n", 1)[1].split("\nnccl:\n", 1)[0]
    assert "status: loaded" in one and "version: 2022.2.0 (20220200)" in one
    assert f"1. $STREAMCOLL_ONECCL_LIBRARY: {bad}/libccl.so.2: rejected: onecclGetVersion returned" in one
    assert f": {good_runtime}/lib/libccl.so.2: loaded" in one
    assert "not reached (after the one loaded):" in one and "system loader" in one.split("not reached", 1)[1]


def test_info_exits_0_when_the_declarations_are_missing(tmp_path):
    """A streamcoll installed without its package data (the bug of the first
    wheel): info reports it and still exits 0."""
    pkg = tmp_path / "site" / "streamcoll"
    shutil.copytree(PKG, pkg, ignore=shutil.ignore_patterns("_native", "__pycache__"))
    env = _nowhere(tmp_path)
    env["PYTHONPATH"] = str(tmp_path / "site")
    r = subprocess.run([sys.executable, "-m", "streamcoll", "info"], env=env, capture_output=True,
                       text=True, timeout=120, cwd=str(tmp_path))
    assert r.returncode == 0, r.stderr[-3000:]
    assert "Traceback" not in r.stderr
    assert str(pkg) in r.stdout
    for name in ("oneccl", "nccl"):
        assert (f"{name}:\n  status: ERROR (the binding does not import) FileNotFoundError: "
                f"streamcoll's C declarations {pkg}/_native/{name}.h are missing") in r.stdout


@needs_oneccl
def test_a_broken_venv_copy_does_not_shadow_the_working_runtime(tmp_path, good_runtime):
    """The reported set-up: ``pip install --no-deps oneccl oneccl-cpu`` into a
    venv leaves a libccl.so.2 whose plugin needs libsycl in ``<venv>/lib``,
    searched before streamcoll's runtime. It is rejected there and the
    runtime in ``$STREAMCOLL_HOME`` is taken."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", "--system-site-packages", str(venv)],
                   check=True, timeout=120)
    bad = _broken(tmp_path, good_runtime, "sycl")
    for f in bad.iterdir():
        shutil.copy2(f, venv / "lib" / f.name)
    home = tmp_path / "sc"
    (home / "oneccl").mkdir(parents=True)
    (home / "oneccl" / "lib").symlink_to(good_runtime / "lib", target_is_directory=True)
    env = _nowhere(tmp_path)
    env.pop("STREAMCOLL_ONECCL_LIBRARY")
    env["STREAMCOLL_HOME"] = str(home)
    script = _INIT_ONE_RANK + (
        "\nimport base64 as _b, pickle as _p\n"
        f"print({_MARK!r} + _b.b64encode(_p.dumps(result)).decode())\n")
    r = subprocess.run([str(venv / "bin" / "python"), "-c", script], env=env, capture_output=True, text=True,
                       timeout=120, cwd=str(tmp_path))
    line = next((ln for ln in r.stdout.splitlines() if ln.startswith(_MARK)), None)
    assert line is not None, r.stdout[-3000:] + r.stderr[-3000:]
    res = pickle.loads(base64.b64decode(line[len(_MARK):]))
    rejected = [t for t in res["tried"] if t.startswith(f"wheel prefix {venv}: ")]
    assert len(rejected) == 1 and ": rejected: " in rejected[0] and "SYCL build" in rejected[0], res["tried"]
    assert res["tried"][-1] == f"streamcoll runtime: {home}/oneccl/lib/libccl.so.2: loaded"
    assert res["available"] is True and res["sum"] == [3.0] * 4


# ---- info: which release against which declarations (issue 43) ------------------
class _Raw:
    """A dlopened library as cffi shows it: every declared name is listed;
    the functions the library does not export raise AttributeError."""

    def __init__(self, exported, missing):
        self._exported, self._missing = exported, missing

    def __dir__(self):
        return sorted(self._exported + self._missing)

    def __getattr__(self, name):
        if name in self.__dict__.get("_missing", ()):
            raise AttributeError(name)
        return 0


def _stub_binding(code: int, missing=()):
    class Stub(nccl_mod._Nccl):
        def version(self):
            return code
    b = Stub.__new__(Stub)
    b._raw = _Raw(["ncclAllReduce", "NCCL_ENCRYPTION_MODE_NONE"], list(missing))
    return b


def test_info_names_an_older_nccl_against_the_declarations_and_what_it_lacks():
    from streamcoll.__main__ import declarations_report
    # torch 2.11's own NCCL (2.28.9) under the 2.32.3 declarations
    lines = declarations_report(_stub_binding(22809, ["ncclAllReduceConfig", "ncclSetEncryption"]))
    assert lines[0] == ("against: nccl 2.28.9 loaded, declarations of 2.32.3 (streamcoll/_native/nccl.h): "
                        "older than the declarations")
    assert lines[1].startswith("WARNING: nccl 2.28.9 lacks 2 declared function(s); calling one raises "
                               "FunctionNotFoundError")
    assert "ncclAllReduceConfig (2.32), ncclSetEncryption (2.32)" in lines[1]
    # older, nothing missing: a note on the layout, no warning
    lines = declarations_report(_stub_binding(22805))
    assert "older than the declarations" in lines[0] and lines[1].startswith("note: every declared function")
    # the same release: one line
    assert declarations_report(_stub_binding(23203)) == [
        "against: nccl 2.32.3 loaded, declarations of 2.32.3 (streamcoll/_native/nccl.h): the same release"]
    assert "newer than the declarations" in declarations_report(_stub_binding(23301))[0]


@needs_nccl
def test_info_prints_the_declarations_line(capsys):
    out = _info_here(capsys)
    nccl = out.split("\nnccl:\n", 1)[1]
    v = nccl_mod.NCCL.version_string()
    assert f"  against: nccl {v} loaded, declarations of 2.32.3 (streamcoll/_native/nccl.h): " in nccl
