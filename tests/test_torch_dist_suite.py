"""PyTorch's own distributed test suite (``_DistTestBase``, shipped in the
torch wheel) against the "streamcoll" backend at 2 CPU ranks.

The runner is the one of ``test/distributed/test_distributed_spawn.py``:
environment ``BACKEND``, ``WORLD_SIZE``, ``TEMP_DIR``, one spawned world per
test, and a third-party backend admitted through
``DistTestCases.backend_feature["plugin"]``. Every test of the class is
collected; those not in :data:`SUBSET` are skipped unless
``STREAMCOLL_DIST_SUITE=all`` (the whole class: every test spawns its
own world, 10-35 s each here), so that CI runs the chosen subset in about
3 minutes. Each test is bounded by
pytest-timeout (:data:`PER_TEST_TIMEOUT`).
"""
from __future__ import annotations

import os
import sys
import tempfile
from typing import Any, Optional

import pytest

# Read by distributed_test at import, in this process and in the spawned ranks.
os.environ.setdefault("BACKEND", "streamcoll")
os.environ.setdefault("WORLD_SIZE", "2")
os.environ.setdefault("TEMP_DIR", tempfile.mkdtemp(prefix="streamcoll-dist-suite-"))
os.environ.setdefault("CCL_KVS_IFACE", "lo")
os.environ.setdefault("OMP_NUM_THREADS", "1")

expecttest = pytest.importorskip("expecttest", reason="torch.testing._internal needs expecttest (scripts/setup.sh)")

import torch.distributed as dist  # noqa: E402

import streamcoll  # noqa: E402,F401  (registers the backend, here and in every rank)

from conftest import needs_oneccl  # noqa: E402

from torch.testing._internal.common_distributed import DistTestCases  # noqa: E402

# What the backend declares to the suite, the way nccl, gloo and ucc are
# declared in common_distributed.DistTestCases: read by the decorators when
# distributed_test is imported below, so it must come first. streamcoll runs
# DDP, new_group subgroups and object collectives, on cpu (oneCCL) and cuda
# (NCCL); like nccl and xccl it cannot receive from any source (neither
# library has a wildcard receive; recv(src=None) raises ValueError).
_B = os.environ["BACKEND"]
DistTestCases.backend_feature["plugin"].add(_B)
if _B == "streamcoll":
    for _feature in ("ddp", "subgroup", "gpu", "cuda"):
        DistTestCases.backend_feature[_feature].add(_B)
    DistTestCases.skip_collective["sendrecv anysource"].add(_B)

from torch.testing._internal.distributed.distributed_test import (  # noqa: E402
    DistributedTest,
    TestDistBackend,
)

PER_TEST_TIMEOUT = 90  # seconds; a spawned 2-rank world plus the test

# The CI subset, chosen by measured time (pytest --durations, 2026-12-01, on
# this 2-core machine at load average ~14: seconds per test in brackets):
# one test per feature, cheapest first, about 200 s together (a run of
# the subset with test_all_gather_group in place of test_all_gather: 229 s
# wall; tests outside the subset are skipped before spawning).
SUBSET: frozenset = frozenset({
    "test_all_gather_complex",          # 9.0
    "test_all_reduce_sum",              # 10.8
    "test_all_reduce_max",              # 11.5
    "test_all_reduce_product",          # 12.2
    "test_all_reduce_sum_async",        # 13.6
    "test_all_gather_coalesced_simple",  # 15.8
    "test_irecv",                       # 16.2
    "test_barrier",                     # 17.3
    "test_all_reduce_sum_complex",      # 19.3
    "test_all_gather",                  # 19.4
    "test_send_recv",                   # 24.5
    "test_DistributedDataParallelCPU",  # 28.3
})
# (test_all_gather_group skips itself at 2 ranks: "small world size".)
# Also measured passing, left out for time:
# test_all_gather_coalesced_with_empty (20.5), test_barrier_group (20.8),
# test_gather (21.5), test_all_reduce_group_sum (21.9), test_scatter (22.3),
# test_gather_checks (23.3), test_destroy_group (26.4), test_isend (27.8),
# test_reduce_sum (28.3), test_broadcast (33.4).
# Measured failing: test_send_recv_any_source (recv_anysource: neither
# library can receive from any source; the suite marks nccl as lacking it
# too) and test_scatter_checks (onecclCommInitRank "Plugin could not
# initialize communicator" at the group's first collective, once, under load;
# not investigated).

_ALL = os.environ.get("STREAMCOLL_DIST_SUITE", "") == "all"

pytestmark = [needs_oneccl, pytest.mark.world, pytest.mark.slow, pytest.mark.timeout(PER_TEST_TIMEOUT)]


def _child_skip(fn: Any) -> Optional[str]:
    """The reason the spawned ranks would skip ``fn`` at once, or None.

    common_distributed's runtime skips (``skip_if_no_gpu``,
    ``skip_if_lt_x_gpu``, ``skip_if_small_worldsize``,
    ``skip_if_odd_worldsize``) exit the child with a skip code, after a
    world was spawned (about 10 s here, a third of a full run). Their
    conditions depend only on the machine and ``WORLD_SIZE``, so they are
    evaluated here on the decorator chain (``__wrapped__``, each wrapper
    known by its code's qualified name) and the test skips with the same
    message without spawning. Anything else is left to the ranks."""
    import torch
    from torch.testing._internal import common_distributed as cd

    if (torch.cuda.is_available() and torch.cuda.device_count()) or cd.TEST_HPU or cd.TEST_XPU:
        accelerators = True
    else:
        accelerators = False
    ws = int(os.environ["WORLD_SIZE"])
    f = fn
    while f is not None:
        code = getattr(f, "__code__", None)
        q = code.co_qualname if code is not None else ""
        if q.startswith("skip_if_no_gpu.") and not accelerators:
            return cd.TEST_SKIPS["no_cuda"].message
        if q.startswith("skip_if_lt_x_gpu.") and not accelerators:
            cells = dict(zip(code.co_freevars, f.__closure__ or ()))
            if not (cells.get("allow_cpu") and cells["allow_cpu"].cell_contents):
                return cd.TEST_SKIPS[f"multi-gpu-{cells['x'].cell_contents}"].message
        if q.startswith("skip_if_small_worldsize.") and os.environ["BACKEND"] != "mpi" and ws < 8:
            return cd.TEST_SKIPS["small_worldsize"].message
        if q.startswith("skip_if_odd_worldsize.") and os.environ["BACKEND"] != "mpi" and ws % 2 == 1:
            return cd.TEST_SKIPS["odd_worldsize"].message
        f = getattr(f, "__wrapped__", None)
    return None


class TestStreamcollDistBackend(TestDistBackend, DistributedTest._DistTestBase):
    """``_DistTestBase`` with one spawned 2-rank world per test."""

    def setUp(self) -> None:
        name = self._testMethodName
        if not _ALL and name not in SUBSET:
            self.skipTest("not in the CI subset (STREAMCOLL_DIST_SUITE=all runs every test)")
        why = _child_skip(getattr(type(self), name))
        if why is not None:
            self.skipTest(f"{why} (decided before spawning)")
        super().setUp()
        self._spawn_processes()


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
