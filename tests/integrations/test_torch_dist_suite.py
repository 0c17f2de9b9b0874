"""PyTorch's own distributed test suite (``_DistTestBase``, shipped in the
torch wheel) against the "streamcoll" backend at 2 CPU ranks.

The runner is the one of ``test/distributed/test_distributed_spawn.py``:
environment ``BACKEND``, ``WORLD_SIZE``, ``TEMP_DIR``, one spawned world per
test, and a third-party backend admitted through
``DistTestCases.backend_feature["plugin"]``. Every test of the class is
collected; those not in :data:`SUBSET` are deselected unless
``STREAMCOLL_DIST_SUITE=all`` (the whole class: every test that runs
spawns its own world, about 8 s each here), so that CI runs the chosen
subset in about 2 minutes. What streamcoll supports is declared to the suite
as nccl's and gloo's features are; tests gated on a backend's *name* for no
backend-specific reason run ungated (:data:`NAME_GATED`); what it refuses
on purpose is an expected failure (:data:`UNSUPPORTED`). Each test is
bounded by pytest-timeout (:data:`PER_TEST_TIMEOUT`).
"""
from __future__ import annotations

import contextlib
import os
import shutil
import sys
import tempfile
from typing import Any, Callable, Dict, Iterator, Optional

import pytest

# The runner's variables (test_distributed_spawn.py's): read by
# distributed_test at import (BACKEND, WORLD_SIZE in decorators) and while a
# test runs (TEMP_DIR, WORLD_SIZE), here and in the spawned ranks, which
# inherit them. Set only around that import and, by the module fixture
# below, while this module's tests run; the process environment is restored
# after both, so no other test sees them. A value already set wins
# (BACKEND=gloo runs the same file on gloo). OMP_NUM_THREADS=1 is what
# torchrun gives each rank of a multi-rank job (torch/distributed/run.py),
# and the suite's ranks stand for such ranks.
BACKEND = os.environ.get("BACKEND", "streamcoll")
RUNNER_ENV: Dict[str, str] = {"BACKEND": BACKEND, "WORLD_SIZE": os.environ.get("WORLD_SIZE", "2"),
                              "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}


@contextlib.contextmanager
def runner_env(temp_dir: Optional[str] = None) -> Iterator[None]:
    """The runner's variables set, then the environment as it was."""
    saved = dict(os.environ)
    os.environ.update(RUNNER_ENV)
    if temp_dir is not None:
        os.environ["TEMP_DIR"] = temp_dir
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


@pytest.fixture(scope="module", autouse=True)
def _runner_environment() -> Iterator[None]:
    """The runner's variables while this module's tests run (torch's own
    ``setUpClass`` also sets ``MASTER_ADDR``: undone with the rest)."""
    temp_dir = os.environ.get("TEMP_DIR") or tempfile.mkdtemp(prefix="streamcoll-dist-suite-")
    try:
        with runner_env(temp_dir):
            yield
    finally:
        if "TEMP_DIR" not in os.environ:
            shutil.rmtree(temp_dir, ignore_errors=True)


expecttest = pytest.importorskip("expecttest", reason="torch.testing._internal needs expecttest (scripts/setup.sh)")

import torch.distributed as dist  # noqa: E402

import streamcoll  # noqa: E402,F401  (registers the backend, here and in every rank)

# tests/ (conftest) on the path, also when this file runs as a script
# (python tests/integrations/test_torch_dist_suite.py: pytest.main on it)
TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if TESTS not in sys.path:
    sys.path.insert(0, TESTS)

from conftest import needs_oneccl  # noqa: E402

with runner_env():  # torch.testing._internal sets variables of its own at import (TORCHINDUCTOR_CACHE_DIR)
    from torch.testing._internal.common_distributed import DistTestCases  # noqa: E402

# What the backend declares to the suite, the way nccl, gloo and ucc are
# declared in common_distributed.DistTestCases: read by the decorators when
# distributed_test is imported below, so it must come first. streamcoll runs
# DDP, new_group subgroups and object collectives, on cpu (oneCCL) and cuda
# (NCCL); like nccl and xccl it cannot receive from any source (ncclRecv
# and onecclRecv take one peer, there is no wildcard; dist.recv(src=None)
# raises NotImplementedError naming recv_anysource).
DistTestCases.backend_feature["plugin"].add(BACKEND)
if BACKEND == "streamcoll":
    for _feature in ("ddp", "subgroup", "gpu", "cuda"):
        DistTestCases.backend_feature[_feature].add(BACKEND)
    DistTestCases.skip_collective["sendrecv anysource"].add(BACKEND)

with runner_env():
    from torch.testing._internal.distributed.distributed_test import (  # noqa: E402
        DistributedTest,
        TestDistBackend,
    )

PER_TEST_TIMEOUT = 90  # seconds; a spawned 2-rank world plus the test

# The CI subset, chosen by measured time: one test per feature, about 8 s
# each on this 2-core machine when otherwise idle (2026-12-01; 10-28 s at
# load average ~14). Seconds per test, full run of 2026-12-01, in brackets.
SUBSET: frozenset = frozenset({
    "test_all_gather_complex",          # 8.2
    # Value checks of the reductions. torch's test_all_reduce_sum, _async and
    # _complex are not here: their helper (_test_all_reduce_helper) takes the
    # expected value and never compares it (it checks profiler events only),
    # so they passed with every reduction turned into MAX. These compare:
    "test_reduce_sum",                  # reduce through ProcessGroup.reduce (_op(opts))
    "test_get_future",                  # an async allreduce's future value, chained (name-gated)
    "test_all_reduce_coalesced_sum",    # several dtypes in one coalesced all_reduce (name-gated)
    "test_all_gather_coalesced_simple",  # 9.8
    "test_all_gather",                  # 8.0
    "test_irecv",                       # 7.0
    "test_barrier",                     # 11.8
    "test_send_recv",                   # 8.0
    "test_DistributedDataParallelCPU",  # 8.2
    # name-gated tests run without the gate (NAME_GATED): coalesced all_reduce
    # with a non-SUM op, uneven CPU all_to_all_single, DDP no_sync with a
    # future-chained comm hook (body run in its CPU branch)
    "test_all_reduce_coalesced_product",  # 7.8
    "test_all_to_all_single_unequal_split",  # 8.0
    "test_accumulate_gradients_no_sync_allreduce_with_then_hook",  # 8.5
    # an expected failure (UNSUPPORTED): a non-zero tag is refused
    "test_send_recv_with_tag",          # 7.8
})
# Full runs (STREAMCOLL_DIST_SUITE=all, 2 CPU ranks, 285 tests, 2026-12-01,
# chunks of ~71 tests run one after the other, nothing else heavy running):
# - gloo (BACKEND=gloo, same file): 90 passed, 195 skipped, 0 failed;
#   1151 s of test time (the first chunk before runtime skips were decided
#   before spawning: 693 s; the other three after: 499 s).
# - streamcoll before its features were declared (only "plugin"): the
#   first chunk, 22 passed and 48 skipped where gloo passed 37.
# - streamcoll as declared here: 87 passed, 3 xfailed (UNSUPPORTED), 195
#   skipped, 0 failed; 914 s wall for the four chunks. Of gloo's 90 passes
#   it passes 78; it also passes the 9 CPU all_to_all tests gloo skips.
# Every test that passes on gloo passes on streamcoll except: the
# three test_send_recv_with_tag* (UNSUPPORTED, xfail), the three
# test_send_recv_any_source* (skipped: declared lacking, as nccl and xccl
# are), and the gloo-only or name-gated tests listed below as left gated
# (sparse all_reduce, tagged batch p2p, barrier timeouts, monitored_barrier),
# which skip.

# Tests the suite gates on backend *names* (``BACKEND != "gloo"``,
# ``require_backend_is_available({"gloo"})``, "only mpi, nccl and gloo")
# rather than on a feature set a backend can join, although what they test
# is no gloo feature: coalesced all_reduce (ProcessGroupNCCL has it too),
# futures of Works, DDP's no_sync, scatter_object_list, batched p2p on the
# CPU. On streamcoll these run unchanged, without the name gate. Those whose
# body branches on the name (``if BACKEND == "gloo" or BACKEND == "mpi"``:
# a CPU model and CPU tensors; ``== "nccl"``: GPUs) run their CPU branch:
# the value is the name the body sees, the process group stays streamcoll.
# Left gated (they test what streamcoll does not do): test_sparse_all_reduce_*
# (sparse tensors: TypeError), test_batch_isend_irecv_gloo_tags (non-zero
# tags: ValueError, neither library carries a tag), test_barrier_timeout_*
# (a barrier a peer never joins must raise in-process at the group's
# timeout; oneCCL cannot abandon a collective, so streamcoll's watchdog ends
# the process instead, as ProcessGroupNCCL's default error handling does.
# Only a group's first collective, still in the store rendezvous, raises in
# place: tried ungated, test_barrier_timeout_full_group got CollectiveTimeout
# "... timed out waiting for the other ranks" after 1 s and failed only on
# the test's case-sensitive " (Timed out|closed|timeout) "),
# test_monitored_barrier_* (gloo's own barrier).
NAME_GATED: Dict[str, Optional[str]] = {
    "test_all_reduce_coalesced_sum": None,
    "test_all_reduce_coalesced_product": None,
    "test_all_reduce_coalesced_min": None,
    "test_all_reduce_coalesced_max": None,
    "test_all_reduce_coalesced_full_group_sum": None,
    "test_all_reduce_coalesced_full_group_product": None,
    "test_all_reduce_coalesced_full_group_min": None,
    "test_all_reduce_coalesced_full_group_max": None,
    "test_get_future": None,
    "test_accumulate_gradients_no_sync": "gloo",
    "test_accumulate_gradients_no_sync_grad_is_view": "gloo",
    "test_accumulate_gradients_no_sync_allreduce_hook": "gloo",
    "test_accumulate_gradients_no_sync_allreduce_with_then_hook": "gloo",
    "test_grads_same_across_ranks_with_no_sync": None,
    "test_scatter_object_list": None,
    "test_batch_isend_irecv_gloo": None,
    # Gated "Only MPI supports CPU all_to_all(_single)": gloo skips them too;
    # streamcoll has CPU all_to_all (oneCCL AllToAll/AllToAllV, grouped Send/Recv).
    "test_all_to_all_single_equal_split": None,
    "test_all_to_all_single_equal_split_complex": None,
    "test_all_to_all_single_unequal_split": None,
    "test_all_to_all_single_unequal_split_complex": None,
    "test_all_to_all_single_equal_split_full_group": None,
    "test_all_to_all_single_unequal_split_full_group": None,
    "test_all_to_all": None,
    "test_all_to_all_complex": None,
    "test_all_to_all_full_group": None,
}

_ALL = os.environ.get("STREAMCOLL_DIST_SUITE", "") == "all"


def deselected(item: Any) -> bool:
    """Whether the collection leaves ``item`` out (``tests/conftest.py``
    asks every module that has this function): a suite test outside the CI
    subset, unless ``STREAMCOLL_DIST_SUITE=all``. Deselected, not skipped,
    so that a skip in the summary is a real one (a test that cannot run
    here)."""
    cls = getattr(item, "cls", None)
    return (not _ALL and cls is not None and issubclass(cls, DistributedTest._DistTestBase)
            and item.name not in SUBSET)

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
        if not _ALL and name not in SUBSET:  # run directly (unittest); pytest deselects these
            self.skipTest("not in the CI subset (STREAMCOLL_DIST_SUITE=all runs every test)")
        why = _child_skip(getattr(type(self), name))
        if why is not None:
            self.skipTest(f"{why} (decided before spawning)")
        super().setUp()
        self._spawn_processes()


def _ungated(name: str, body_backend: Optional[str]) -> Callable[[Any], Any]:
    """``name`` of ``_DistTestBase`` without its name gate (the skip mark the
    gate put on the function is read by unittest only; calling the function
    runs the test and its other decorators). ``body_backend``: the name the
    test body's ``BACKEND`` branches see while it runs, or None."""
    import torch.testing._internal.distributed.distributed_test as dt

    base = getattr(DistributedTest._DistTestBase, name)

    def test(self: Any) -> Any:
        if body_backend is None:
            return base(self)
        saved = dt.BACKEND
        dt.BACKEND = body_backend
        try:
            return base(self)
        finally:
            dt.BACKEND = saved

    test.__name__ = test.__qualname__ = name
    test.__doc__ = base.__doc__
    test.__wrapped__ = base  # type: ignore[attr-defined]  # _child_skip reads its decorators
    return test


# Tests that fail on streamcoll because they use what it refuses on purpose:
# expected failures (strict: one that starts passing fails the run).
UNSUPPORTED: Dict[str, str] = {
    name: "send/recv with a non-zero tag: streamcoll raises ValueError (NCCL and oneCCL carry no tag and "
          "match a pair's messages in issue order; ignoring the tag, as ProcessGroupNCCL does, lets "
          "recv(tag=2) take the message sent with tag=1)"
    for name in ("test_send_recv_with_tag", "test_send_recv_with_tag_autograd_profiler",
                 "test_send_recv_with_tag_torch_profiler")
}

if BACKEND == "streamcoll":
    for _name, _as in NAME_GATED.items():
        setattr(TestStreamcollDistBackend, _name, _ungated(_name, _as))
    for _name, _why in UNSUPPORTED.items():
        setattr(TestStreamcollDistBackend, _name,
                pytest.mark.xfail(strict=True, reason=_why)(_ungated(_name, None)))


def test_declarations_and_runtime_skips() -> None:
    """Without spawning: what streamcoll declares to the suite, the name
    gates lifted, and the runtime skips decided before spawning (the
    decorators' own conditions and messages)."""
    import torch
    from torch.testing._internal import common_distributed as cd

    C = TestStreamcollDistBackend
    if BACKEND == "streamcoll":
        for feature in ("plugin", "ddp", "subgroup", "gpu", "cuda"):
            assert "streamcoll" in DistTestCases.backend_feature[feature], feature
        assert "streamcoll" in DistTestCases.skip_collective["sendrecv anysource"]
        assert "streamcoll" not in DistTestCases.skip_collective["allgather_coalesced"]
        assert "streamcoll" not in DistTestCases.skip_collective["cpu barrier"]
        for name in (*NAME_GATED, *UNSUPPORTED):
            assert not getattr(getattr(C, name), "__unittest_skip__", False), name
        assert getattr(C.test_sparse_all_reduce_sum, "__unittest_skip__", False)
    assert _child_skip(C.test_all_reduce_sum) is None
    assert _child_skip(C.test_all_reduce_coalesced_sum) is None
    assert _child_skip(C.test_all_reduce_group_sum) == cd.TEST_SKIPS["small_worldsize"].message
    if not torch.cuda.is_available() and not cd.TEST_HPU and not cd.TEST_XPU:
        assert _child_skip(C.test_all_reduce_sum_cuda) == cd.TEST_SKIPS["no_cuda"].message
        assert _child_skip(C.test_ddp_device) == cd.TEST_SKIPS["multi-gpu-2"].message


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
