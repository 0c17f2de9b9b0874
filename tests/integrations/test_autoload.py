"""The ``torch.backends`` entry point (streamcoll_autoload.py, setup.cfg):
``backend="streamcoll"`` is known in a process that never imports
streamcoll; registering imports nothing of streamcoll and loads no native
library; a broken streamcoll package still lets ``import torch`` succeed (a
missing entry-point module does not: the stale install the README describes).

Entry points live in an install's metadata, so these tests build the wheel
from a copy of the checkout (as tests/repo/test_packaging.py does), install it
without dependencies into a venv that sees the system's torch, and run
fresh interpreters from it with no PYTHONPATH (the code that runs is the
wheel's)."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import venv
from pathlib import Path

import pytest

from conftest import needs_oneccl
from checkout import copy_source_tree
from world import free_port

pytestmark = [pytest.mark.slow]


@pytest.fixture(scope="module")
def autoload_python(tmp_path_factory):
    """A venv's python with the checkout's wheel installed (``--no-deps``)."""
    base = tmp_path_factory.mktemp("autoload")
    src = copy_source_tree(base / "src")
    r = subprocess.run([sys.executable, "-c", "import sys; from setuptools import build_meta as b; "
                        "print('@@' + b.build_wheel(sys.argv[1]))", str(base / "out")],
                       cwd=str(src), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-4000:]
    wheel = base / "out" / r.stdout.rsplit("@@", 1)[1].strip()
    env_dir = base / "venv"
    venv.create(env_dir, system_site_packages=True, with_pip=True)
    py = env_dir / "bin" / "python"
    # --force-reinstall: the system's streamcoll (an editable install) is visible through the system site and
    # has the same version; pip leaves it alone ("outside environment") and installs the wheel into the venv.
    r = subprocess.run([str(py), "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--force-reinstall",
                        str(wheel)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-4000:]
    return py


def _run(py: Path, code: str, **extra: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "TORCH_DEVICE_BACKEND_AUTOLOAD")}
    env.update(extra)
    return subprocess.run([str(py), "-c", textwrap.dedent(code)], cwd="/", env=env, capture_output=True,
                          text=True, timeout=240)


def _site(py: Path) -> Path:
    return next((py.parent.parent / "lib").glob("python*")) / "site-packages"


def test_import_torch_registers_the_name_and_imports_nothing_of_streamcoll(autoload_python):
    r = _run(autoload_python, """
        import sys, torch, torch.distributed as dist
        assert "STREAMCOLL" in dist.Backend._plugins, dist.Backend._plugins
        assert "streamcoll" in dist.Backend.backend_list
        assert not [m for m in sys.modules if m == "streamcoll" or m.startswith("streamcoll.")], sorted(sys.modules)
        assert "cffi" not in sys.modules
        maps = open("/proc/self/maps").read()
        assert "libccl" not in maps and "libnccl" not in maps and "libfabric" not in maps
        import streamcoll_autoload
        assert streamcoll_autoload.__file__.startswith(sys.prefix), streamcoll_autoload.__file__
        print("ok")
        """)
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr[-3000:]


def test_the_switch_torch_offers_turns_it_off(autoload_python):
    r = _run(autoload_python, """
        import torch, torch.distributed as dist
        print("STREAMCOLL" in dist.Backend._plugins)
        """, TORCH_DEVICE_BACKEND_AUTOLOAD="0")
    assert r.returncode == 0 and r.stdout.strip() == "False", r.stderr[-3000:]


@needs_oneccl
@pytest.mark.world
def test_init_process_group_streamcoll_in_a_process_that_never_imported_it(autoload_python):
    r = _run(autoload_python, f"""
        import sys, torch, torch.distributed as dist
        dist.init_process_group("streamcoll", init_method="tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
        t = torch.arange(4.0)
        dist.all_reduce(t)
        assert t.tolist() == [0.0, 1.0, 2.0, 3.0]
        assert dist.get_backend() == "streamcoll" and "streamcoll" in sys.modules
        dist.destroy_process_group()
        print("ok")
        """)
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr[-3000:]


def test_a_broken_streamcoll_install_still_lets_torch_import(autoload_python):
    init = _site(autoload_python) / "streamcoll" / "__init__.py"
    good = init.read_text()
    init.write_text("raise ImportError('streamcoll is broken on purpose (tests/integrations/test_autoload.py)')\n")
    try:
        r = _run(autoload_python, f"""
            import torch, torch.distributed as dist
            assert "STREAMCOLL" in dist.Backend._plugins
            try:
                dist.init_process_group("streamcoll", init_method="tcp://127.0.0.1:{free_port()}", rank=0,
                                        world_size=1)
            except Exception as e:
                print("raised at use:", type(e).__name__, e)
            """)
    finally:
        init.write_text(good)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "raised at use:" in r.stdout and "broken on purpose" in r.stdout, r.stdout + r.stderr[-3000:]


def test_register_never_raises(monkeypatch):
    import torch.distributed as dist
    import streamcoll_autoload

    def boom(*a, **k):
        raise RuntimeError("register_backend failed")

    monkeypatch.setattr(dist.Backend, "_plugins", {})
    monkeypatch.setattr(dist.Backend, "register_backend", boom)
    streamcoll_autoload.register()  # logged at debug level, not raised


def test_a_stale_install_fails_import_torch_and_the_way_out(tmp_path):
    """What the README says of a stale install (an editable install whose
    checkout moved or was deleted, a half-removed one): its metadata still
    names the entry point, whose module is gone, and torch turns that into a
    failed ``import torch`` for the whole environment; the module cannot
    guard its own absence. ``TORCH_DEVICE_BACKEND_AUTOLOAD=0`` gets torch
    back. (Mimicked by metadata alone, first on the path, naming a module
    that does not exist.)"""
    info = tmp_path / "streamcoll-0.1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: streamcoll\nVersion: 0.1.0\n")
    (info / "entry_points.txt").write_text("[torch.backends]\nstreamcoll = streamcoll_autoload_gone:register\n")
    env = {k: v for k, v in os.environ.items() if k != "TORCH_DEVICE_BACKEND_AUTOLOAD"}
    env["PYTHONPATH"] = str(tmp_path)
    r = subprocess.run([sys.executable, "-c", "import torch"], cwd="/", env=env, capture_output=True, text=True,
                       timeout=240)
    assert r.returncode != 0 and "Failed to load the backend extension: streamcoll" in r.stderr, r.stderr[-3000:]
    assert "TORCH_DEVICE_BACKEND_AUTOLOAD=0" in r.stderr, r.stderr[-3000:]
    r = subprocess.run([sys.executable, "-c", "import torch; print('ok')"], cwd="/",
                       env=dict(env, TORCH_DEVICE_BACKEND_AUTOLOAD="0"), capture_output=True, text=True, timeout=240)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-3000:]
