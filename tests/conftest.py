"""Shared fixtures: library gates and pools of real rank processes.

Tiers: plain unit tests; library-gated tests (``needs_oneccl``/``needs_nccl``
skip with the reason where a library does not load); multi-process tests
(``world2``/``world3``/``world`` fixtures: real oneCCL across spawned ranks,
kept per session and replaced after a failure); GPU tests (``cuda`` marker,
skipped without a CUDA device).

No sweep of ``/dev/shm`` here: the regions SIGKILLed ranks leave are the
library's to remove (:mod:`streamcoll.diagnostics.shm_regions`: every process sweeps
before its first init, by the kernel's open count); a sweep by pid would
remove a live region of another PID namespace.
"""
from __future__ import annotations

import os
import sys

import pytest

# tests/ holds the test files in a folder per concern (binding, core,
# diagnostics, startup, integrations, repo, multihost) and, at its top, the
# helpers they import (world, workloads, netns, rank_scripts): on the path for
# every test file, whatever its folder (pytest puts only the file's own folder
# there). ROOT is the repository's root, for the tests that read or run its
# files (``from conftest import ROOT``); a test file run as a rank's script
# (``python tests/<folder>/test_x.py SCENARIO``) finds tests/ itself.
TESTS = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(TESTS)
if TESTS not in sys.path:
    sys.path.insert(0, TESTS)

# No environment is set here: tests run with the user's environment, and a
# rank gets what torchrun would give it (world.TORCHRUN_ENV, world.rank_env);
# a test about a variable sets it itself (monkeypatch, or a child's env).
from world import World  # noqa: E402


@pytest.fixture(autouse=True)
def _users_environment():
    """Every test starts from the environment the session started with (the
    user's): what a test sets, or what an in-process ``streamcoll.init``
    applies as its defaults (``streamcoll.startup.env_defaults``), is undone after it, so no
    test runs with another test's variables."""
    saved = dict(os.environ)
    yield
    if os.environ != saved:
        os.environ.clear()
        os.environ.update(saved)


def _loads(name: str):
    from streamcoll.core.backends import get_backend
    b = get_backend(name).binding
    try:
        b.lib()
        return True, ""
    except Exception as e:  # LibraryNotFoundError: its message lists the places tried
        return False, str(e)


_ONECCL_OK, _ONECCL_WHY = _loads("oneccl")
_NCCL_OK, _NCCL_WHY = _loads("nccl")

needs_oneccl = pytest.mark.skipif(not _ONECCL_OK, reason=f"oneCCL not loadable: {_ONECCL_WHY}")
needs_nccl = pytest.mark.skipif(not _NCCL_OK, reason=f"NCCL not loadable: {_NCCL_WHY}")


def _has_cuda() -> bool:
    try:
        import torch
        return torch.cuda.is_available()
    except Exception:
        return False


def pytest_collection_modifyitems(config, items):
    # A module may leave some of its tests out of the run (test_torch_dist_suite:
    # PyTorch's tests outside the CI subset): deselected, so that the summary's
    # skips are only tests that cannot run here.
    left_out = [i for i in items if getattr(getattr(i, "module", None), "deselected", lambda _: False)(i)]
    if left_out:
        config.hook.pytest_deselected(items=left_out)
        out = set(map(id, left_out))
        items[:] = [i for i in items if id(i) not in out]
    skip_cuda = pytest.mark.skip(reason="needs a CUDA GPU (none here)")
    has_cuda = _has_cuda()
    for item in items:
        if "cuda" in item.keywords and not has_cuda:
            item.add_marker(skip_cuda)
        fixtures = getattr(item, "fixturenames", ())
        if any(f in fixtures for f in ("world", "world2", "world3")) or "world" in item.keywords:
            # Meant: all multi-process tests on one xdist worker, one at a time.
            # Not in effect: xdist reads the groups (and names them into the
            # node ids) before this hook adds the mark, so only explicit marks
            # group tests (test_launchers/test_two_nodes: "slurm",
            # test_fresh_world): the worlds run on both workers.
            item.add_marker(pytest.mark.xdist_group("world"))
            item.add_marker(pytest.mark.world)


_WORLDS = {}


def get_world(size: int, **kwargs) -> World:
    """A live world of ``size`` ranks, reused across tests (replaced if a
    previous test killed it)."""
    key = (size, tuple(sorted((kwargs.get("env") or {}).items())))
    w = _WORLDS.get(key)
    if w is None or not w.alive or not w.conns:
        if not _ONECCL_OK:
            pytest.skip(f"oneCCL not loadable: {_ONECCL_WHY}")
        w = _WORLDS[key] = World(size, **kwargs)
    return w


@pytest.fixture
def world2():
    return get_world(2)


@pytest.fixture
def world3():
    return get_world(3)


@pytest.fixture(params=[2, 3], ids=["w2", "w3"])
def world(request):
    return get_world(request.param)


def pytest_sessionfinish(session, exitstatus):
    for w in _WORLDS.values():
        try:
            w.close()
        except Exception:
            pass
    _WORLDS.clear()
