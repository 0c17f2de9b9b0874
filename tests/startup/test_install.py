"""``python -m streamcoll install-runtime`` and a user's install from the wheel.

Everything here is real: pip downloads the wheels from the package index
(into an empty HOME, so with an empty pip cache), the runtime is assembled into a temporary
``STREAMCOLL_HOME`` (never the shared ``~/.cache/streamcoll``), and it is
checked by loading it and reducing across real processes.

``test_a_user_installs_the_wheel_and_runs_a_job`` is the CI job the README's
test command runs: it builds the wheel, makes a venv without system site
packages outside the checkout, with an empty HOME and no PYTHONPATH, installs
torch 2.13.0 and the wheel, runs install-runtime and info, and a 2-rank
torchrun job (sync and async all_reduce) from a folder outside the repo.
Marked ``install`` (and ``slow``): ``-m "not install"`` leaves it out.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, Optional

import pytest

from checkout import REPO, copy_source_tree
from world import free_port

pytestmark = [pytest.mark.install, pytest.mark.slow, pytest.mark.xdist_group("world")]

# The variables a developer's shell or the suite may have set that would
# let the job see something a fresh user does not have.
_DROP = ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "LD_LIBRARY_PATH", "XDG_CACHE_HOME", "PYTHONSTARTUP")
_DROP_PREFIXES = ("STREAMCOLL_", "CCL_", "FI_", "NCCL_", "PYTEST_")


def clean_env(home: Path, extra: Optional[Dict[str, str]] = None, path_first: Optional[Path] = None) -> Dict[str, str]:
    """A user's environment: this one without library and Python settings,
    ``HOME`` = ``home`` (so pip's cache is empty too: the 130 MB of oneCCL
    wheels came from PyPI in 6 s here, measured with PIP_NO_CACHE_DIR=1)."""
    env = {k: v for k, v in os.environ.items()
           if k not in _DROP and k != "PIP_CACHE_DIR" and not k.startswith(_DROP_PREFIXES)}
    env["HOME"] = str(home)
    env["OMP_NUM_THREADS"] = "1"
    if path_first is not None:
        env["PATH"] = f"{path_first}{os.pathsep}{env.get('PATH', '')}"
    env.update(extra or {})
    return env


def sh(cmd, env: Dict[str, str], cwd: Path, timeout: float = 600) -> subprocess.CompletedProcess:
    """Run ``cmd``; fail the test with its output when it fails."""
    r = subprocess.run([str(c) for c in cmd], env=env, cwd=str(cwd), capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, f"$ {' '.join(map(str, cmd))}  (exit {r.returncode})\n{r.stdout[-4000:]}\n{r.stderr[-6000:]}"
    return r


def _system_libfabric() -> bool:
    import ctypes
    try:
        ctypes.CDLL("libfabric.so.1")
        return True
    except OSError:
        return False


def _install_runtime(home: Path, *args: str, python: str = sys.executable) -> subprocess.CompletedProcess:
    env = clean_env(home, {"STREAMCOLL_HOME": str(home / "sc"), "PYTHONPATH": str(REPO)})
    return subprocess.run([python, "-m", "streamcoll", "install-runtime", *args], env=env, cwd=str(home),
                          capture_output=True, text=True, timeout=900)


# ---- install-runtime on its own --------------------------------------------------
@pytest.mark.timeout(900)
def test_install_runtime_assembles_checks_is_idempotent_and_can_bundle_libfabric(tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    rt = home / "sc" / "oneccl"
    r = _install_runtime(home)
    assert r.returncode == 0, r.stdout + r.stderr
    lines = r.stdout.strip().splitlines()
    assert all(ln.startswith("[install-runtime] ") for ln in lines), lines
    for step in ("1/4", "2/4", "3/4", "4/4"):
        assert any(f"] {step} " in ln for ln in lines), (step, lines)
    assert any("downloading oneccl-cpu==2022.2.0, oneccl==2022.2.0, oneccl-cpu-devel==2022.2.0" in ln for ln in lines)
    last = lines[-1]
    assert last.startswith(f"[install-runtime] done: oneCCL 2022.2.0 CPU runtime in {rt}: ")
    assert "lib/libccl.so.1 (oneccl-cpu)" in last and "check it with: python -m streamcoll info" in last
    for rel in ("lib/libccl.so.1", "lib/libccl.so.2", "lib/libccl_legacy_cpu.so", "include/oneapi/ccl.h"):
        assert (rt / rel).is_file(), rel
    # The CPU libccl.so.1 (7 MB), not the oneccl wheel's SYCL one (231 MB).
    assert (rt / "lib/libccl.so.1").stat().st_size < 20 << 20
    assert f"ok: oneCCL 2022.2.0 from {rt}/lib/libccl.so.2" in r.stdout

    # Again: nothing downloaded, checked again.
    t0 = time.monotonic()
    again = _install_runtime(home)
    assert again.returncode == 0, again.stdout + again.stderr
    assert "already assembled: nothing to download" in again.stdout and "downloading" not in again.stdout
    assert "ok: oneCCL 2022.2.0" in again.stdout
    print(f"idempotent re-run: {time.monotonic() - t0:.1f} s")

    # A part gone (marker still there): rebuilt, not trusted.
    (rt / "lib/libccl_legacy_cpu.so").unlink()
    healed = _install_runtime(home)
    assert healed.returncode == 0, healed.stdout + healed.stderr
    assert "assembling the working set" in healed.stdout and (rt / "lib/libccl_legacy_cpu.so").is_file()

    # ``--libfabric pip``: the mpich wheel's libfabric.so.1 beside
    # libccl.so.1 is the one oneCCL maps (RUNPATH $ORIGIN beats the system's).
    r = _install_runtime(home, "--libfabric", "pip")
    assert r.returncode == 0, r.stdout + r.stderr
    bundled = home / "sc" / "oneccl" / "lib" / "libfabric.so.1"
    assert bundled.is_file()
    assert f"ok: oneCCL 2022.2.0 from {bundled.parent}/libccl.so.2, libfabric {bundled}\n" in r.stdout
    # Back to the system's: the copy goes.
    if not _system_libfabric():
        return
    back = _install_runtime(home, "--libfabric", "system")
    assert back.returncode == 0, back.stdout + back.stderr
    assert not bundled.exists() and "removed the bundled" in back.stdout


def test_install_runtime_without_an_index_fails_clearly_and_keeps_nothing_half_done(tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    env = clean_env(home, {"STREAMCOLL_HOME": str(home / "sc"), "PYTHONPATH": str(REPO),
                           "PIP_NO_INDEX": "1", "PIP_FIND_LINKS": str(tmp_path / "nothing"),
                           "PIP_CONFIG_FILE": os.devnull, "PIP_CACHE_DIR": str(tmp_path / "pipcache")})
    r = subprocess.run([sys.executable, "-m", "streamcoll", "install-runtime"], env=env, cwd=str(home),
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "[install-runtime] FAILED: pip download failed" in r.stdout
    assert "oneccl-cpu==2022.2.0" in r.stdout
    assert not (home / "sc" / "oneccl").exists()
    assert "Traceback" not in r.stderr


def test_install_runtime_rejects_a_bad_libfabric_choice(tmp_path):
    r = _install_runtime(tmp_path, "--libfabric", "maybe")
    assert r.returncode == 2 and "invalid choice: 'maybe'" in r.stderr


# ---- the user's install: the CI job ---------------------------------------------
_JOB = r"""
import os, torch, streamcoll
streamcoll.init()
rank, world = streamcoll.get_rank(), streamcoll.get_world_size()
t = torch.full((1000,), float(rank + 1))
streamcoll.all_reduce(t)
assert t.eq(world * (world + 1) / 2).all(), t[:4]
xs = [torch.ones(10), torch.full((3,), 2.0)]
works = [streamcoll.all_reduce(x, async_op=True) for x in xs]
for w in works:
    w.wait()
assert xs[0].eq(world).all() and xs[1].eq(2.0 * world).all(), xs
fabric = sorted({ln.split()[-1] for ln in open("/proc/self/maps") if "/libfabric.so" in ln})
with open(f"ok.rank{rank}", "w") as f:  # a file per rank: their stdout lines interleave
    f.write(f"{world} {os.path.dirname(streamcoll.__file__)} {','.join(fabric)}")
streamcoll.destroy()
"""


def _timed(label: str, times: Dict[str, float], fn):
    t0 = time.monotonic()
    out = fn()
    times[label] = time.monotonic() - t0
    return out


# About 2-3 minutes on an idle 2-core machine; 5+ when others load it (the
# pip install of torch dominates), so more than the suite's 300 s default.
@pytest.mark.timeout(1500)
def test_a_user_installs_the_wheel_and_runs_a_job(tmp_path):
    times: Dict[str, float] = {}
    home, work = tmp_path / "home", tmp_path / "work"
    home.mkdir()
    work.mkdir()
    assert REPO not in tmp_path.parents and tmp_path not in REPO.parents
    base = clean_env(home)

    # 1. The wheel, built from a copy of the source tree as pip builds it.
    src = copy_source_tree(tmp_path / "src")
    _timed("wheel", times, lambda: sh([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w",
                                       tmp_path / "dist", src], base, tmp_path))
    wheels = list((tmp_path / "dist").glob("streamcoll-*.whl"))
    assert len(wheels) == 1, wheels

    # 2. A clean venv (no system site packages), torch 2.13.0 and the wheel.
    venv = tmp_path / "venv"
    _timed("venv", times, lambda: sh([sys.executable, "-m", "venv", venv], base, tmp_path))
    py, bindir = venv / "bin" / "python", venv / "bin"
    env = clean_env(home, path_first=bindir)
    # --no-compile: byte-compiling torch's thousands of files is most of the
    # install's time on a loaded machine, and not what this job tests.
    _timed("pip install", times, lambda: sh([py, "-m", "pip", "install", "-q", "--no-compile", "torch==2.13.0",
                                             wheels[0]], env, work))
    where = sh([py, "-c", "import streamcoll, sys; print(streamcoll.__file__); print(sys.path)"], env, work).stdout
    assert where.startswith(str(venv)), where
    assert str(REPO) not in where and "/work/main" not in where, where

    # 3. The runtime into the empty HOME's cache, then info.
    r = _timed("install-runtime", times, lambda: sh([py, "-m", "streamcoll", "install-runtime"], env, work))
    cache = home / ".cache" / "streamcoll" / "oneccl"
    assert f"done: oneCCL 2022.2.0 CPU runtime in {cache}: " in r.stdout, r.stdout
    info = _timed("info", times, lambda: sh([py, "-m", "streamcoll", "info"], env, work))
    one = info.stdout.split("\noneccl:\n", 1)[1].split("\nnccl:\n", 1)[0]
    assert "status: loaded" in one and f"path: {cache}/lib/libccl.so.2" in one, info.stdout
    assert "streamcoll 0" in info.stdout and str(venv) in info.stdout.splitlines()[0]

    # 4. A 2-rank job from a folder outside the repo.
    (work / "job.py").write_text(_JOB)
    job_env = dict(env, MASTER_ADDR="127.0.0.1")

    def job(label: str) -> list:
        for old in work.glob("ok.rank*"):
            old.unlink()
        r = _timed(label, times, lambda: sh([bindir / "torchrun", "--nproc-per-node", "2", "--master-port",
                                             str(free_port()), "job.py"], job_env, work, timeout=300))
        fabrics = []
        for rank in (0, 1):
            ok = work / f"ok.rank{rank}"
            assert ok.is_file(), f"rank {rank} did not finish:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
            world, where, fabric = (ok.read_text().split(" ") + [""])[:3]
            assert world == "2" and where.startswith(str(venv)), (world, where)
            fabrics.append(fabric)
        return fabrics

    job("torchrun")
    # 5. The pip-only transport (no apt, no root): the mpich wheel's libfabric.
    _timed("install-runtime --libfabric pip", times,
           lambda: sh([py, "-m", "streamcoll", "install-runtime", "--libfabric", "pip"], env, work))
    assert job("torchrun (mpich libfabric)") == [str(cache / "lib" / "libfabric.so.1")] * 2
    print("user install job, seconds: " + ", ".join(f"{k} {v:.1f}" for k, v in times.items())
          + f", total {sum(times.values()):.1f}")
