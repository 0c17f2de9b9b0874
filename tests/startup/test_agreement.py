"""Every rank makes the same start-up decisions (issue 20), on real oneCCL
ranks of one host, each a process of its own (``python
tests/startup/test_agreement.py SCENARIO``) with no oneCCL variable set:

- ranks pinned to cores (``os.sched_setaffinity`` in the rank, as taskset,
  a cpuset cgroup or ``srun --cpu-bind`` do): the settings that must agree
  are the same on every rank, decided from every rank's CPU set, and the
  sums are right (before: rank 0 chose recursive doubling, rank 1 nreduce,
  and rank 0's sum was wrong by up to 1e28);
- a variable that must agree, set by the user on one rank only: every rank
  refuses before the native init, naming the variable, ranks and values;
- the defaults never pose as the user's: a process that made a one-rank
  communicator and then runs ``torchrun`` gives its children none of them,
  and they get their own.

The uneven layout on two simulated hosts (2 + 1) is in ``test_multihost.py``.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from typing import Dict, List, Optional

# tests/ (conftest, world and the other helpers) on the path, also when this
# file runs as a rank's script (python tests/startup/test_agreement.py ...)
TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROOT = os.path.dirname(TESTS)
if TESTS not in sys.path:
    sys.path.insert(0, TESTS)

from world import TORCHRUN_ENV, Processes, free_port, kill_sessions, rank_env  # noqa: E402

NATIVE_PREFIXES = ("CCL_", "FI_", "NCCL_")


# ===================================================================== ranks
def _out(data: dict) -> None:
    path = os.path.join(os.environ["AGREE_OUT"], f"rank{os.environ['RANK']}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(data, f)
    os.replace(path + ".tmp", path)


def _caught() -> List[str]:
    with open(f"/proc/{os.getpid()}/status") as f:
        for line in f:
            if line.startswith("SigCgt:"):
                m = int(line.split()[1], 16)
                return sorted(signal.Signals(i).name for i in range(1, 32)
                              if m >> (i - 1) & 1 and i in signal.valid_signals())
    return []


def _native_env() -> Dict[str, str]:
    return {k: v for k, v in os.environ.items() if k.startswith(NATIVE_PREFIXES)}


def _sums() -> None:
    """Pin this rank where AGREE_PIN says (``rank:cpu,cpu;...``), init with
    no variables, and check all-reduces of several sizes."""
    import torch
    rank = int(os.environ["RANK"])
    pins = dict(p.split(":") for p in os.environ.get("AGREE_PIN", "").split(";") if p)
    if str(rank) in pins:
        os.sched_setaffinity(0, {int(c) for c in pins[str(rank)].split(",")})
    import streamcoll
    from streamcoll.startup import env_defaults as env
    comm = streamcoll.init(backend="oneccl", device="cpu", timeout=30)
    n = comm.size
    errors = {}
    for count in (100, 5000, 1 << 18):
        t = torch.arange(count, dtype=torch.float32) + rank
        comm.all_reduce(t)
        want = n * torch.arange(count, dtype=torch.float32) + n * (n - 1) / 2
        errors[count] = (t - want).abs().max().item()
    _out({"errors": errors, "applied": dict(env.APPLIED), "env_after": _native_env(),
          "cpus": sorted(os.sched_getaffinity(0))})
    streamcoll.destroy()


def _refused() -> None:
    import streamcoll
    t0 = time.monotonic()
    try:
        streamcoll.init(backend="oneccl", device="cpu", timeout=30)
        res: Dict[str, object] = {"raised": None}
    except Exception as e:
        res = {"raised": type(e).__name__, "message": str(e)}
    res.update(elapsed=time.monotonic() - t0, caught=_caught())
    _out(res)


def _nested_parent() -> None:
    """A one-rank communicator, then torchrun with two ranks."""
    import torch
    import torch.distributed as dist
    import streamcoll
    from streamcoll.startup import env_defaults as env
    c = streamcoll.new_communicator(backend="oneccl", device="cpu", rank=0, world_size=1, store=dist.HashStore())
    t = torch.ones(3)
    c.all_reduce(t)
    parent = {"applied": dict(env.APPLIED), "env_after": _native_env()}
    port = free_port()
    child_env = dict(os.environ, AGREE_CHILD="1")
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr",
                        "127.0.0.1", "--master-port", str(port), "--monitor-interval", "0.1", __file__,
                        "nested_child"], env=child_env, capture_output=True, text=True, timeout=150)
    parent.update(torchrun_rc=r.returncode, torchrun_err=r.stderr[-3000:])
    c.destroy()
    with open(os.path.join(os.environ["AGREE_OUT"], "parent.json"), "w") as f:
        json.dump(parent, f)


def _nested_child() -> None:
    import torch
    import streamcoll
    from streamcoll.startup import env_defaults as env
    before = _native_env()
    comm = streamcoll.init(backend="oneccl", device="cpu", timeout=60)
    t = torch.ones(3)
    comm.all_reduce(t)
    _out({"env_before": before, "applied": dict(env.APPLIED), "sum": t.tolist()})
    streamcoll.destroy()


def _settings() -> None:
    """Init with this rank's variables (AGREE_* says none: the test gives
    them per rank); where no rank refuses, a bf16 all_reduce of 100,000
    elements (one rank in the pair form's all-gather and the other in
    oneCCL's bf16 all_reduce hang there) and what the communicator runs with."""
    import torch
    import streamcoll
    from streamcoll.core import checks as debug
    t0 = time.monotonic()
    try:
        comm = streamcoll.init(backend="oneccl", device="cpu", timeout=30)
    except Exception as e:
        _out({"raised": type(e).__name__, "message": str(e), "elapsed": time.monotonic() - t0, "caught": _caught()})
        return
    x = torch.ones(100_000, dtype=torch.bfloat16)
    comm.all_reduce(x)
    _out({"raised": None, "sum_ok": bool((x == comm.size).all()), "widened": bool(comm._cx.widened),
          "debug": debug.is_enabled(comm)})
    streamcoll.destroy()


def _sub_first() -> None:
    """``init_process_group("streamcoll")`` with the world made lazily
    (AGREE_EAGER), this rank's own one-rank group used first (AGREE_SUB_FIRST),
    then a world all_reduce: what oneCCL runs the world with, and what the
    world's own layout would have chosen."""
    import torch
    import torch.distributed as dist
    from streamcoll.startup import env_defaults as env
    rank = int(os.environ["RANK"])
    pins = dict(p.split(":") for p in os.environ.get("AGREE_PIN", "").split(";") if p)
    if str(rank) in pins:
        os.sched_setaffinity(0, {int(c) for c in pins[str(rank)].split(",")})
    dist.init_process_group("streamcoll")
    own = [dist.new_group([r]) for r in range(dist.get_world_size())]
    if os.environ.get("AGREE_SUB_FIRST") == "1":
        dist.all_reduce(torch.ones(2), group=own[rank])
    t = torch.ones(2)
    dist.all_reduce(t)
    comm = dist.distributed_c10d._get_default_group()._get_backend(torch.device("cpu"))._comms["cpu"]
    _out({"sum": t.tolist(), "in_effect": env.in_effect(), "world": env.agreed_defaults(comm.topology)})
    dist.destroy_process_group()


SCENARIOS = {"sums": _sums, "refused": _refused, "nested_parent": _nested_parent, "nested_child": _nested_child,
             "settings": _settings, "sub_first": _sub_first}


# ==================================================================== tests
if __name__ != "__main__":
    import pytest

    from conftest import needs_oneccl

    pytestmark = [needs_oneccl, pytest.mark.world]

    def _clean(extra: Optional[dict] = None) -> dict:
        """The test process's environment without any native library's
        variable (the suite sets CCL_KVS_IFACE=lo), plus ``extra``."""
        e = {k: v for k, v in os.environ.items() if not k.startswith(NATIVE_PREFIXES)}
        e.update({k: v for k, v in TORCHRUN_ENV.items() if not k.startswith(NATIVE_PREFIXES)})
        e.update(extra or {})
        return e

    class Ranks(Processes):
        """``size`` rank processes of one scenario, on this host (:class:`world.Processes`)."""

        def __init__(self, scenario: str, size: int, tmp, env: Optional[dict] = None,
                     per_rank: Optional[Dict[int, dict]] = None) -> None:
            super().__init__(str(tmp))
            port = free_port()
            for r in range(size):
                e = _clean({k: v for k, v in rank_env(r, size, port).items() if not k.startswith(NATIVE_PREFIXES)})
                e["AGREE_OUT"] = self.dir
                e.update(env or {})
                e.update((per_rank or {}).get(r, {}))
                self.start([sys.executable, __file__, scenario], e, f"log{r}")

        def finish(self, timeout: float) -> None:
            self.wait_all(timeout)
            self.kill()

        def describe(self) -> str:
            out = []
            for r, p in enumerate(self.procs):
                with open(os.path.join(self.dir, f"log{r}")) as f:
                    out.append(f"--- rank {r}: exit {p.returncode}\n{f.read()[-3000:]}")
            return "\n".join(out)

    MUST_AGREE = ("CCL_ALLREDUCE", "CCL_WORKER_OFFLOAD", "CCL_YIELD", "CCL_ATL_SHM", "FI_PROVIDER")

    @pytest.mark.parametrize("pins,offload", [
        pytest.param("1:0", "0", id="one-rank-pinned"),
        pytest.param("0:0;1:1", "0", id="separate-cores"),
        pytest.param("0:0;1:0", "1", id="one-core-for-both"),
    ])
    def test_pinned_ranks_agree_and_sum_right(tmp_path, pins, offload):
        """No variables; ranks pinned in the child. The settings that must
        agree are equal on both ranks, judged from both CPU sets (two ranks
        on separate cores have a core each: no worker offload; two on one
        core are oversubscribed: offload and yield), and every sum is right."""
        ranks = Ranks("sums", 2, tmp_path, env={"AGREE_PIN": pins})
        ranks.finish(120)
        info = ranks.describe()
        res = [ranks.result(r) for r in range(2)]
        assert all(res), info
        for r in range(2):
            assert all(e == 0 for e in res[r]["errors"].values()), (r, res[r]["errors"], info)
        agreed = [{k: x["applied"].get(k) for k in MUST_AGREE} for x in res]
        assert agreed[0] == agreed[1], (agreed, info)
        assert agreed[0]["CCL_WORKER_OFFLOAD"] == offload, agreed
        assert agreed[0]["CCL_YIELD"] == ("sched_yield" if offload == "1" else None), agreed
        assert agreed[0]["CCL_ALLREDUCE"] == ("nreduce" if offload == "1" else
                                              "recursive_doubling:0-16384;nreduce:16385-max"), agreed

    @pytest.mark.parametrize("mnic", [None, "global"], ids=["no-CCL_MNIC", "CCL_MNIC"])
    def test_ccl_mnic_gets_no_mnic_name(tmp_path, mnic):
        """Two torchrun nodes on this machine (two hosts to streamcoll, the
        interface reaching MASTER_ADDR is lo): CCL_MNIC_NAME=lo by default,
        none where the user set CCL_MNIC (oneCCL's multi-NIC selection, which
        one name would narrow to one interface); the sums are right."""
        env = {"CCL_MNIC": mnic} if mnic else {}
        per_rank = {r: {"GROUP_RANK": str(r), "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"} for r in range(2)}
        ranks = Ranks("sums", 2, tmp_path, env=env, per_rank=per_rank)
        ranks.finish(120)
        info = ranks.describe()
        for r in range(2):
            res = ranks.result(r)
            assert res and all(e == 0 for e in res["errors"].values()), info
            assert res["applied"].get("CCL_KVS_IFACE") == "lo" and res["applied"]["CCL_LOCAL_SIZE"] == "1", res
            assert res["applied"].get("CCL_MNIC_NAME") == (None if mnic else "lo"), res

    def test_a_must_agree_variable_on_one_rank_is_refused_everywhere(tmp_path):
        """CCL_ALLREDUCE=ring on rank 1 only: both ranks raise before the
        native init (oneCCL installs its signal handlers there: none are),
        naming the variable, the ranks and their values."""
        ranks = Ranks("refused", 2, tmp_path, per_rank={1: {"CCL_ALLREDUCE": "ring"}})
        ranks.finish(90)
        info = ranks.describe()
        for r in range(2):
            res = ranks.result(r)
            assert res.get("raised") == "CommunicatorError", info
            msg = res["message"]
            assert "CCL_ALLREDUCE" in msg and "rank 1: 'ring' (set by the user)" in msg, msg
            assert "rank 0: 'recursive_doubling:0-16384;nreduce:16385-max' (streamcoll's default)" in msg, msg
            assert "SIGSEGV" not in res["caught"], res  # oneCCL never initialised
            assert res["elapsed"] < 25, res

    def test_nested_torchrun_gets_its_own_defaults(tmp_path):
        """A process that made a one-rank communicator runs torchrun with two
        ranks: nothing streamcoll applied is left in its environment, its
        children inherit none of it (before: CCL_LOCAL_SIZE=1,
        FI_PROVIDER=shm ... and the children applied nothing), and they
        apply their own (CCL_LOCAL_SIZE=2)."""
        e = _clean({"AGREE_OUT": str(tmp_path), "RANK": "0"})
        with open(os.path.join(tmp_path, "log"), "w") as log:
            p = subprocess.Popen([sys.executable, __file__, "nested_parent"], env=e, stdout=log,
                                 stderr=subprocess.STDOUT, start_new_session=True)
        try:
            p.wait(200)
        except subprocess.TimeoutExpired:
            pass
        finally:
            kill_sessions([p])
        with open(os.path.join(tmp_path, "log")) as f:
            info = f.read()[-4000:]
        with open(os.path.join(tmp_path, "parent.json")) as f:
            parent = json.load(f)
        assert parent["applied"]["CCL_LOCAL_SIZE"] == "1", parent
        assert parent["env_after"] == {}, parent
        assert parent["torchrun_rc"] == 0, (parent["torchrun_err"], info)
        for r in range(2):
            with open(os.path.join(tmp_path, f"rank{r}.json")) as f:
                child = json.load(f)
            assert child["env_before"] == {}, child
            assert child["applied"]["CCL_LOCAL_SIZE"] == "2" and child["applied"]["CCL_LOCAL_RANK"] == str(r), child
            assert child["applied"]["FI_PROVIDER"] == "shm", child
            assert child["sum"] == [2.0] * 3, child

    @pytest.mark.parametrize("per_rank,shown", [
        pytest.param({1: {"STREAMCOLL_WIDEN_BF16": "0"}},
                     ("STREAMCOLL_WIDEN_BF16: rank 0: '1' (streamcoll's default); rank 1: '0' (set by the user)",),
                     id="widen-bf16"),
        pytest.param({1: {"STREAMCOLL_SIGNATURE_CHECKS": "0"}},
                     ("STREAMCOLL_SIGNATURE_CHECKS: rank 0: '256' (streamcoll's default); rank 1: '0' (set by the user)",),
                     id="signature-checks-off"),
        pytest.param({0: {"STREAMCOLL_SIGNATURE_CHECKS": "16"}},
                     ("STREAMCOLL_SIGNATURE_CHECKS: rank 0: '16' (set by the user); rank 1: '256' (streamcoll's default)",),
                     id="signature-bound"),
        pytest.param({0: {"TORCH_DISTRIBUTED_DEBUG": "DETAIL"}},
                     ("STREAMCOLL_DEBUG_CHECKS: rank 0: '1' (TORCH_DISTRIBUTED_DEBUG=DETAIL); "
                      "rank 1: '0' (streamcoll's default)",), id="debug-checks"),
    ])
    def test_streamcolls_own_settings_on_one_rank_are_refused_everywhere(tmp_path, per_rank, shown):
        """Issue 42, finding 5: a variable of streamcoll's own that changes
        which C call a rank makes, or which checks it runs, set on one rank
        only: both ranks raise before the native init, naming the variable,
        each rank's value and the way out. Before: STREAMCOLL_WIDEN_BF16=0 on
        one rank hung both in the 100,000-element bf16 all_reduce (one in the
        pair form's all-gather, one in oneCCL's bf16 all_reduce); checks on
        one rank only left it blaming the other for never reaching the call."""
        ranks = Ranks("settings", 2, tmp_path, per_rank=per_rank)
        ranks.finish(90)
        info = ranks.describe()
        for r in range(2):
            res = ranks.result(r)
            assert res.get("raised") == "CommunicatorError", info
            msg = res["message"]
            for text in shown:
                assert text in msg, msg
            assert "Set each on every rank alike, or on none" in msg, msg
            assert "SIGSEGV" not in res["caught"], res  # oneCCL never initialised
            assert res["elapsed"] < 25, res

    def test_own_settings_that_agree_or_may_differ_pass(tmp_path):
        """One effective value by different spellings (STREAMCOLL_DEBUG_CHECKS=1
        and TORCH_DISTRIBUTED_DEBUG=DETAIL; the default spelled out), and
        variables that change only what a rank does locally (when an async
        call starts, how tensors are kept alive): no refusal, and both ranks
        run with the checks on and bf16 widened."""
        per_rank = {0: {"STREAMCOLL_DEBUG_CHECKS": "1", "STREAMCOLL_WIDEN_BF16": "1",
                        "STREAMCOLL_SIGNATURE_CHECKS": "256"},
                    1: {"TORCH_DISTRIBUTED_DEBUG": "DETAIL", "STREAMCOLL_INLINE_ASYNC_BYTES": "0",
                        "STREAMCOLL_RECORD_STREAM": "1", "STREAMCOLL_FLIGHT_SIZE": "8"}}
        ranks = Ranks("settings", 2, tmp_path, per_rank=per_rank)
        ranks.finish(90)
        info = ranks.describe()
        for r in range(2):
            assert ranks.result(r) == {"raised": None, "sum_ok": True, "widened": True, "debug": True}, info

    def test_a_split_runs_with_its_parents_agreed_settings(monkeypatch):
        """A communicator's own settings are those agreed at its rendezvous,
        not what its process's environment says later: a split (no
        rendezvous) takes its parent's, so one rank's later change cannot
        make its children differ from its peers' (before: each child read
        the environment at its creation). A new communicator's rendezvous
        reads them afresh."""
        import torch
        import torch.distributed as dist
        import streamcoll
        from streamcoll.core import checks as debug
        for k in ("STREAMCOLL_WIDEN_BF16", "STREAMCOLL_SIGNATURE_CHECKS", "STREAMCOLL_DEBUG_CHECKS",
                  "TORCH_DISTRIBUTED_DEBUG"):
            monkeypatch.delenv(k, raising=False)
        c = streamcoll.new_communicator(backend="oneccl", device="cpu", rank=0, world_size=1, store=dist.HashStore())
        try:
            monkeypatch.setenv("STREAMCOLL_WIDEN_BF16", "0")
            monkeypatch.setenv("STREAMCOLL_DEBUG_CHECKS", "1")
            child = c.split(0)
            try:
                assert child._cx.widened == {torch.bfloat16: torch.float32} and not debug.is_enabled(child)
            finally:
                child.destroy()
            fresh = streamcoll.new_communicator(backend="oneccl", device="cpu", rank=0, world_size=1,
                                                store=dist.HashStore())
            try:
                assert fresh._cx.widened == {} and debug.is_enabled(fresh)
            finally:
                fresh.destroy()
        finally:
            c.destroy()

    def test_a_one_rank_group_first_imposes_its_settings_on_the_world(tmp_path):
        """Issue 42, finding 10 (confirmed): with the world made lazily
        (STREAMCOLL_EAGER_INIT=0, or auto on a CUDA host), a one-rank group
        used first is each process's first oneCCL communicator, and oneCCL
        reads its variables once: the world then runs with that group's
        choices, TCP and also its spin and algorithm (two ranks on one core:
        no worker offload, no yield, recursive doubling, where the world's
        own layout calls for offload, sched_yield and nreduce). The sums are
        right; every rank says so in a warning naming each variable, the
        value in effect and the world's (before: nothing said it), and the
        docs name them all (before: TCP only). The world made first keeps
        its own choices (the second run)."""
        lazy = {"STREAMCOLL_EAGER_INIT": "0", "AGREE_PIN": "0:0;1:0"}
        os.makedirs(tmp_path / "sub")
        ranks = Ranks("sub_first", 2, tmp_path / "sub", env=dict(lazy, AGREE_SUB_FIRST="1"))
        ranks.finish(120)
        info = ranks.describe()
        for r in range(2):
            res = ranks.result(r)
            assert res and res["sum"] == [2.0, 2.0], info
            world, running = res["world"], res["in_effect"]
            assert (world["CCL_WORKER_OFFLOAD"], world["CCL_YIELD"], world["CCL_ALLREDUCE"],
                    world["FI_PROVIDER"]) == ("1", "sched_yield", "nreduce", "shm"), res
            assert (running["CCL_WORKER_OFFLOAD"], running["CCL_YIELD"], running["CCL_ATL_SHM"],
                    running["FI_PROVIDER"]) == ("0", None, "0", "tcp"), res
            assert running["CCL_ALLREDUCE"].startswith("recursive_doubling"), res
            log = ranks.text(f"log{r}")
            assert "runs with settings in effect since this process's first oneCCL communicator" in log, info
            for text in ("CCL_WORKER_OFFLOAD='0' (this communicator's layout: '1')",
                         "CCL_YIELD=unset (this communicator's layout: 'sched_yield')",
                         "CCL_ALLREDUCE='recursive_doubling:0-16384;nreduce:16385-max' (this communicator's "
                         "layout: 'nreduce')", "FI_PROVIDER='tcp' (this communicator's layout: 'shm')",
                         "STREAMCOLL_EAGER_INIT=1"):
                assert text in log, (text, log)
        os.makedirs(tmp_path / "world")
        ranks = Ranks("sub_first", 2, tmp_path / "world", env=dict(lazy, AGREE_SUB_FIRST="0"))
        ranks.finish(120)
        info = ranks.describe()
        for r in range(2):
            res = ranks.result(r)
            assert res and res["sum"] == [2.0, 2.0], info
            assert {k: res["in_effect"].get(k) for k in res["world"]} == res["world"], res
            assert "first oneCCL communicator" not in ranks.text(f"log{r}"), info
        with open(os.path.join(ROOT, "docs", "design.md")) as f:
            design = f.read()
        assert "its spin and algorithm settings" in design

else:
    SCENARIOS[sys.argv[1]]()
