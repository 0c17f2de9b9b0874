"""Faults injected into real oneCCL ranks on the CPU, each test asserting the
error and the time it took (issue 7).

These tests launch their own rank processes (``python tests/diagnostics/test_reliability.py
SCENARIO`` with RANK/WORLD_SIZE/MASTER_PORT set), not the shared World pool:
the faults leave communicators stuck inside oneCCL for good (it has no
abort), and the point is to watch how the processes end (exit code, stderr,
time). Every process is killed by id at the end of its test.

- peer death, synchronous calls: one of 3 ranks SIGKILLs itself in the middle
  of a run of all_reduces; the two others are stuck inside the C call, and
  the watchdog ends each with its message and exit code 86 within the
  communicator's timeout plus a few seconds;
- peer death, asynchronous calls: the survivors' ``Work.wait()`` raises
  CollectiveTimeout; they then exit normally with their own exit status;
- a collective that one rank skips: ``Work.wait(timeout=)`` raises naming op,
  sequence number, shapes and ranks; later calls raise at once; ``destroy``
  with the pending work fails it explicitly; the processes exit cleanly; the
  flight-recorder analysis names the skipped collective and the rank;
- init that a peer never joins: the watchdog ends it with a message.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from typing import Dict, Optional

# tests/ (conftest, world and the other helpers) on the path, also when this
# file runs as a rank's script (python tests/diagnostics/test_reliability.py ...)
TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if TESTS not in sys.path:
    sys.path.insert(0, TESTS)

from rank_scripts import all_started  # noqa: E402
from world import Processes  # noqa: E402

EXIT_CODE = 86  # streamcoll.diagnostics.watchdog.EXIT_CODE (checked below)


# ===================================================================== ranks
def _out(name: str, data: dict) -> None:
    path = os.path.join(os.environ["RELIABILITY_OUT"], name)
    with open(path + ".tmp", "w") as f:
        json.dump(data, f)
    os.replace(path + ".tmp", path)


def _all_started() -> None:
    all_started("RELIABILITY_OUT")


def _peer_death(async_op: bool) -> None:
    import torch
    import streamcoll
    rank = int(os.environ["RANK"])
    size = int(os.environ["WORLD_SIZE"])
    timeout = float(os.environ["RELIABILITY_TIMEOUT"])
    victim, kill_at = size - 1, 40
    _all_started()
    comm = streamcoll.init(backend="oneccl", device="cpu", timeout=timeout)
    t = torch.zeros(16)
    i = 0
    try:
        while True:
            i += 1
            if rank == victim and i == kill_at:
                _out(f"rank{rank}.json", {"killed_at": time.time(), "iteration": i, "seq": comm.seq})
                os.kill(os.getpid(), signal.SIGKILL)
            t.fill_(1.0 + rank)
            started = time.time()
            if async_op:
                comm.all_reduce(t, async_op=True).wait()
            else:
                comm.all_reduce(t)
            expected = size * (size + 1) / 2
            if t[0].item() != expected:
                raise AssertionError(f"iteration {i}: got {t[0].item()}, expected {expected}")
    except streamcoll.CollectiveError as e:
        res = {"raised": type(e).__name__, "message": str(e), "raised_at": time.time(),
               "started": started, "iteration": i}
        t0 = time.monotonic()
        try:
            comm.all_reduce(t)
        except streamcoll.CollectiveError as e2:
            res["later"] = type(e2).__name__
        res["later_s"] = time.monotonic() - t0
        t0 = time.monotonic()
        comm.destroy()
        res["destroy_s"] = time.monotonic() - t0
        _out(f"rank{rank}.json", res)
        sys.exit(3)  # a normal exit with a status of its own, while a oneCCL call is still stuck


def _skip() -> None:
    """Ranks 0 and 1 issue collective #5; rank 2 skips it."""
    import torch
    import streamcoll
    rank = int(os.environ["RANK"])
    _all_started()
    comm = streamcoll.init(backend="oneccl", device="cpu", timeout=2.0)
    t = torch.ones(8)
    for _ in range(3):
        comm.all_reduce(t)  # seq 1-3
    comm.broadcast(t, 0)  # seq 4
    res: Dict[str, object] = {}
    if rank == 2:
        res["dump"] = comm.dump_flight_record(os.environ["STREAMCOLL_FLIGHT_DIR"])
        _out(f"rank{rank}.json", res)
        return  # exits normally
    w = comm.all_reduce(t, async_op=True)  # seq 5: never joined by rank 2
    if rank == 0:
        # shorter than the communicator's timeout: only slow, nothing failed (issue 15)
        try:
            w.wait(timeout=0.5)
        except streamcoll.CollectiveTimeout as e:
            res.update(short_wait_stuck=e.stuck, short_wait_failed=comm.failure is not None)
    t0 = time.monotonic()
    try:
        if rank == 0:
            w.wait()  # the communicator's timeout (2 s): declared stuck, failed
        else:
            comm.destroy(timeout=2.0)  # pending work: fails explicitly
        res["raised"] = None
    except streamcoll.CollectiveTimeout as e:
        res.update(raised=type(e).__name__, message=str(e), op=e.op, seq=e.seq, shapes=[list(s) for s in e.shapes],
                   rank=e.rank, size=e.size)
    res["elapsed"] = time.monotonic() - t0
    for what, call in (("later_call", lambda: comm.all_reduce(t)), ("wait_again", lambda: w.wait()),
                       ("later_async", lambda: comm.broadcast(t, 0, async_op=True))):
        t0 = time.monotonic()
        try:
            call()
            res[what] = None
        except streamcoll.CollectiveError as e:
            res[what] = type(e).__name__
        res[what + "_s"] = time.monotonic() - t0
    t0 = time.monotonic()
    comm.destroy()
    res["destroy_s"] = time.monotonic() - t0
    res["exiting_at"] = time.time()
    _out(f"rank{rank}.json", res)
    # falls off the end: a normal interpreter exit with the comm thread stuck in oneCCL


def _init_never_joined() -> None:
    """World of 2, rank 1 never comes: rank 0 blocks in onecclCommInitRank."""
    import torch.distributed as dist
    import streamcoll
    store = dist.HashStore()
    # Rank 1's part of the host exchange that precedes init, so that rank 0
    # reaches the native init call (the store's own waits time out by themselves).
    from streamcoll.startup import topology
    dist.PrefixStore("streamcoll/comm/2/1/", store).set(topology.exchange_key(1), topology.local_facts(1).to_json())
    _out("rank0.json", {"init_started": time.time()})
    streamcoll.new_communicator(backend="oneccl", device="cpu", rank=0, world_size=2, store=store,
                                timeout=float(os.environ["RELIABILITY_TIMEOUT"]))
    _out("rank0.json", {"unexpected": "init returned"})


SCENARIOS = {
    "peer_death_sync": lambda: _peer_death(False),
    "peer_death_async": lambda: _peer_death(True),
    "skip": _skip,
    "init_never_joined": _init_never_joined,
}


# ==================================================================== tests
if __name__ != "__main__":
    import pytest

    import streamcoll
    from streamcoll.diagnostics import flight, watchdog

    from conftest import needs_oneccl

    pytestmark = [needs_oneccl, pytest.mark.world]

    class Ranks(Processes):
        """Rank processes of one scenario, watched until they end."""

        def __init__(self, scenario: str, size: int, tmp, env: Optional[dict] = None) -> None:
            super().__init__(str(tmp))
            self.flight_dir = os.path.join(self.dir, "flight")
            os.makedirs(self.flight_dir)
            self.started = time.time()
            self.start_ranks([sys.executable, __file__, scenario], size,
                             dict({"RELIABILITY_OUT": self.dir, "STREAMCOLL_FLIGHT_DIR": self.flight_dir}, **(env or {})))

        wait = Processes.wait_all

        def describe(self) -> str:
            return "\n".join(f"--- rank {r}: exit {self.rc(r)}\n{self.stderr(r)[-3000:]}"
                             for r in range(len(self.procs)))

    def test_exit_code_constant():
        assert watchdog.EXIT_CODE == EXIT_CODE

    def test_peer_death_sync_watchdog_ends_survivors(tmp_path):
        """SIGKILL one of 3 ranks between synchronous all_reduces: the two
        others are stuck inside onecclAllReduce (no abort in oneCCL); the
        watchdog ends each with the message and exit code 86, within the
        timeout plus a few seconds of the death."""
        timeout = 5.0
        ranks = Ranks("peer_death_sync", 3, tmp_path, {"RELIABILITY_TIMEOUT": str(timeout)})
        try:
            ranks.wait(90)
        finally:
            ranks.kill()
        info = ranks.describe()
        assert ranks.rc(2) == -signal.SIGKILL, info
        killed_at = ranks.result(2)["killed_at"]
        for r in (0, 1):
            assert ranks.rc(r) == EXIT_CODE, info
            err = ranks.stderr(r)
            assert "streamcoll watchdog: all_reduce (sequence number" in err, info
            assert f"on rank {r} of 3" in err and "(timeout 5 s)" in err, info
            assert "tensor shapes [(16,)]" in err and "Flight record:" in err, info
            assert "oneCCL cannot abort" in err and f"exit code {EXIT_CODE}" in err, info
            took = ranks.ended[r] - killed_at
            # Not before the timeout, and no silent hang: timeout + grace + polling + exit.
            assert timeout <= took <= timeout + 6.0, f"rank {r} ended {took:.1f} s after the kill\n{info}"
        # Both survivors wrote their flight record; rank 2 (dead) none.
        files = sorted(os.listdir(ranks.flight_dir))
        assert files == ["default.rank0.json", "default.rank1.json"], files
        (f,) = [x for x in flight.analyze([ranks.flight_dir]) if x.kind != "missing_dump"]
        assert f.kind == "stuck" and f.ranks == [2], f.message
        assert f.seq == ranks.result(2)["seq"] + 1, f.message  # the first all_reduce rank 2 never joined

    def test_peer_death_async_wait_raises_then_clean_exit(tmp_path):
        """SIGKILL one of 3 ranks between async all_reduces: each survivor's
        Work.wait() raises CollectiveTimeout after the timeout; later calls
        raise at once; destroy returns; the process exits with its own status
        (3) although a oneCCL call is still running in it."""
        timeout = 5.0
        ranks = Ranks("peer_death_async", 3, tmp_path, {"RELIABILITY_TIMEOUT": str(timeout),
                                                        "STREAMCOLL_INLINE_ASYNC_BYTES": "0"})  # comm thread
        try:
            ranks.wait(90)
        finally:
            ranks.kill()
        info = ranks.describe()
        assert ranks.rc(2) == -signal.SIGKILL, info
        killed_at = ranks.result(2)["killed_at"]
        for r in (0, 1):
            assert ranks.rc(r) == 3, info  # its own exit status: no crash in oneCCL's teardown
            res = ranks.result(r)
            assert res["raised"] == "CollectiveTimeout", info
            msg = res["message"]
            assert msg.startswith("all_reduce (sequence number "), msg
            assert f"did not complete within 5 s on rank {r} of 3; tensor shapes [(16,)]" in msg, msg
            assert "oneCCL cannot abort" in msg and "flight record:" in msg, msg
            took = res["raised_at"] - killed_at
            assert timeout - 0.5 <= took <= timeout + 4.0, f"rank {r}: raised {took:.1f} s after the kill"
            assert res["later"] == "CommunicatorError" and res["later_s"] < 0.5, res
            assert res["destroy_s"] < 1.0, res
            assert ranks.ended[r] - res["raised_at"] < 5.0, info  # exits promptly after

    def test_skipped_collective_timeout_destroy_and_analysis(tmp_path):
        """Rank 2 skips collective #5 (communicator timeout 2 s). Rank 0: a
        ``Work.wait(timeout=0.5)`` raises a CollectiveTimeout that is not
        ``stuck`` and fails nothing; ``Work.wait()`` then raises
        CollectiveTimeout naming op, sequence number, shapes and ranks within
        the timeout plus a margin. Rank 1: ``destroy(timeout=2)`` with the
        pending work raises the same way. On both, later calls (and waiting
        again) raise at once, destroy returns, and the process exits 0. The
        flight-recorder analysis names sequence number 5 and rank 2."""
        ranks = Ranks("skip", 3, tmp_path, {"STREAMCOLL_WATCHDOG": "fail",  # the wait reports, not the watchdog
                                            "STREAMCOLL_INLINE_ASYNC_BYTES": "0"})  # pending async work: comm thread
        try:
            ranks.wait(90)
        finally:
            ranks.kill()
        info = ranks.describe()
        for r in range(3):
            assert ranks.rc(r) == 0, info
        for r in (0, 1):
            res = ranks.result(r)
            assert res["raised"] == "CollectiveTimeout", (r, res)
            assert (res["op"], res["seq"], res["shapes"], res["rank"], res["size"]) == ("all_reduce", 5, [[8]], r, 3)
            assert "all_reduce (sequence number 5) did not complete within 2 s" in res["message"]
            assert f"on rank {r} of 3; tensor shapes [(8,)]" in res["message"]
            # + the hang report's wait (STREAMCOLL_HANG_REPORT_S, 2 s) for rank 2, which has exited
            assert 2.0 <= res["elapsed"] <= 4.0 + 2.0, res
            assert "rank 2 did not answer within 2 s: dead (or exited)" in res["message"], res["message"]
            if r == 0:
                assert res["short_wait_stuck"] is False and res["short_wait_failed"] is False, res
            for what in ("later_call", "wait_again", "later_async"):
                assert res[what] == "CommunicatorError", (r, what, res)
                assert res[what + "_s"] < 0.2, (r, what, res)
            assert res["destroy_s"] < 0.5, res
            assert ranks.ended[r] - res["exiting_at"] < 5.0, info  # a clean, prompt exit
        assert "destroy: queued asynchronous work did not finish" in ranks.result(1)["message"]
        # One dump per rank: ranks 0 and 1 on the timeout, rank 2 on request.
        assert sorted(os.listdir(ranks.flight_dir)) == [f"default.rank{r}.json" for r in range(3)]
        (f,) = flight.analyze([ranks.flight_dir])
        assert (f.kind, f.seq, f.ranks) == ("never_arrived", 5, [2]), f.message
        cli = subprocess.run([sys.executable, "-m", "streamcoll.flight", "analyze", ranks.flight_dir],
                             capture_output=True, text=True, timeout=60)
        assert cli.returncode == 1, cli.stdout + cli.stderr
        assert "first problem at sequence number 5 (collective #5): rank 2 never arrived" in cli.stdout, cli.stdout
        assert "ranks 0, 1 called all_reduce(shapes [(8,)], float32; async)" in cli.stdout, cli.stdout
        assert "RuntimeWarning" not in cli.stderr, cli.stderr

    def test_init_that_a_peer_never_joins_is_ended(tmp_path):
        """World of 2 where rank 1 never calls init: rank 0 blocks inside
        onecclCommInitRank; the watchdog ends it with a message."""
        timeout = 3.0
        ranks = Ranks("init_never_joined", 1, tmp_path, {"RELIABILITY_TIMEOUT": str(timeout)})
        try:
            ranks.wait(60)
        finally:
            ranks.kill()
        info = ranks.describe()
        assert ranks.rc(0) == EXIT_CODE, info
        err = ranks.stderr(0)
        assert "streamcoll watchdog: init of communicator 'default' (rank 0 of 2, oneccl on cpu)" in err, info
        took = ranks.ended[0] - ranks.result(0)["init_started"]
        assert timeout <= took <= timeout + 6.0, f"{took:.1f} s\n{info}"


    # ------------------------------------------------ debug mode (shared world)
    def _dbg_call(comm, case):
        """One collective with debug checks on; rank 1 or 2 deviates per ``case``."""
        import torch
        from streamcoll.core import checks as debug
        debug.enable(comm)
        old_timeout = comm.timeout
        r = comm.rank
        res = {}
        try:
            t = torch.ones(5 if (case == "shape" and r == 1) else 4)
            seq0 = comm.seq
            t0 = time.monotonic()
            try:
                if case == "op" and r == 2:
                    comm.broadcast(t, 0)
                elif case == "skip":
                    comm.timeout = 2.0
                    if r != 2:
                        comm.all_reduce(t)
                elif case == "splits":
                    # Locally valid, inconsistent across ranks: rank 0 sends rank 1 two rows, rank 1 expects one.
                    n = comm.size
                    ins = [1] * n
                    outs = [1] * n
                    if r == 0:
                        ins = [2 if j == 1 else (0 if j == 0 else 1) for j in range(n)]
                    comm.all_to_all_single(torch.zeros(sum(outs)), torch.ones(sum(ins)), outs, ins)
                else:
                    comm.all_reduce(t)
                res["raised"] = None
            except streamcoll.CollectiveError as e:
                res.update(raised=type(e).__name__, message=str(e), ranks=getattr(e, "ranks", None))
            res["elapsed"] = time.monotonic() - t0
            res["seq_unchanged"] = comm.seq == seq0
        finally:
            comm.timeout = old_timeout
            debug.disable(comm)
        # The communicator is still usable: a real collective afterwards.
        x = torch.full((3,), float(r))
        comm.all_reduce(x)
        res["after"] = x.tolist()
        return res

    def _dbg_matching(comm):
        """Every checked collective with matching arguments passes the checks and computes."""
        import torch
        from streamcoll.core import checks as debug
        debug.enable(comm)
        try:
            r, n = comm.rank, comm.size
            t = torch.full((4,), float(r))
            comm.all_reduce(t)
            assert t.tolist() == [n * (n - 1) / 2] * 4
            comm.broadcast(t, src=n - 1)
            b = torch.full((2,), float(r))
            comm.reduce(b, dst=0, op=streamcoll.ReduceOp.MAX)
            out = torch.empty(2 * n)
            comm.all_gather_into_tensor(out, torch.full((2,), float(r)))
            assert out.tolist() == [float(i) for i in range(n) for _ in range(2)]
            g = [torch.empty(2) for _ in range(n)] if r == 0 else None
            comm.gather(torch.full((2,), float(r)), g, dst=0)
            # Uneven but consistent all-to-all: rank i sends j + 1 elements to rank j.
            ins = [j + 1 for j in range(n)]
            outs = [r + 1] * n
            o = torch.empty(sum(outs))
            comm.all_to_all_single(o, torch.full((sum(ins),), float(r)), outs, ins)
            assert o.tolist() == [float(i) for i in range(n) for _ in range(r + 1)]
            comm.barrier()
            w = comm.all_reduce(torch.ones(3), async_op=True)
            w.wait()
            sub = comm.split(0)
            sub.destroy()
            return comm._debug.n
        finally:
            debug.disable(comm)

    def test_debug_mismatched_shape_raises_on_every_rank(world3):
        res = world3.run(_dbg_call, "shape")
        for r, x in enumerate(res):
            assert x["raised"] == "MismatchError", (r, x)
            assert x["ranks"] == [1], x
            assert "ranks disagree: ranks 0, 2 called all_reduce(tensor=float32[4], op=SUM)" in x["message"]
            assert "rank 1 called all_reduce(tensor=float32[5], op=SUM): tensor float32[5] instead of float32[4]" \
                in x["message"]
            assert "No rank issued the collective" in x["message"]
            assert x["seq_unchanged"] and x["elapsed"] < 10, x
            assert x["after"] == [3.0] * 3  # usable afterwards
        assert len({x["message"].split(" (rank ")[1].split("):", 1)[1] for x in res}) == 1  # same text everywhere

    def test_debug_different_op_raises_on_every_rank(world3):
        res = world3.run(_dbg_call, "op")
        for r, x in enumerate(res):
            assert x["raised"] == "MismatchError", (r, x)
            assert x["ranks"] == [2], x
            assert "ranks 0, 1 called all_reduce(tensor=float32[4], op=SUM)" in x["message"]
            assert "rank 2 called broadcast(tensor=float32[4], src=0): a different collective " \
                "(broadcast instead of all_reduce)" in x["message"], x["message"]
            assert x["seq_unchanged"] and x["after"] == [3.0] * 3

    def test_debug_inconsistent_all_to_all_counts(world3):
        res = world3.run(_dbg_call, "splits")
        for r, x in enumerate(res):
            assert x["raised"] == "MismatchError", (r, x)
            assert "all_to_all_single counts disagree: " in x["message"], x["message"]
            assert "rank 0 sends 2 elements to rank 1, which expects 1" in x["message"], x["message"]
            assert x["seq_unchanged"] and x["after"] == [3.0] * 3

    def test_debug_rank_that_never_arrives(world3):
        res = world3.run(_dbg_call, "skip", timeout=60)
        assert res[2]["raised"] is None
        for r in (0, 1):
            x = res[r]
            assert x["raised"] == "CollectiveTimeout", x
            assert "rank 2 never reached this collective within the timeout" in x["message"], x["message"]
            assert 2.0 <= x["elapsed"] <= 6.0, x
            assert x["seq_unchanged"] and x["after"] == [3.0] * 3

    def test_debug_matching_calls_pass(world3):
        counts = world3.run(_dbg_matching)
        assert counts == [9, 9, 9]  # each of the 9 calls checked once (inner calls of barrier, split: not again)

    def test_debug_checks_from_environment(monkeypatch):
        import torch.distributed as dist
        from streamcoll.core import checks as debug
        monkeypatch.setenv("STREAMCOLL_DEBUG_CHECKS", "1")
        c = streamcoll.new_communicator(backend="oneccl", device="cpu", rank=0, world_size=1,
                                        store=dist.HashStore())
        try:
            assert debug.is_enabled(c) and not c.fast_path  # a pre-launch hook: the fast paths are off
            import torch
            t = torch.ones(2)
            c.all_reduce(t)
            streamcoll.all_reduce(t, group=c)  # the module-level function goes through the check too
            assert c._debug.n == 2 and t.tolist() == [1.0, 1.0]
        finally:
            c.destroy()
        monkeypatch.setenv("STREAMCOLL_DEBUG_CHECKS", "0")
        c = streamcoll.new_communicator(backend="oneccl", device="cpu", rank=0, world_size=1,
                                        store=dist.HashStore())
        try:
            assert not debug.is_enabled(c) and c.fast_path  # nothing on the launch path
        finally:
            c.destroy()


    # ------------------------------------------------------------ GPU (NCCL)
    def _nccl_comm(monkeypatch, world_size=1, store=None, timeout=None):
        import torch.distributed as dist
        monkeypatch.setenv("STREAMCOLL_NCCL_NONBLOCKING", "1")
        return streamcoll.new_communicator(backend="nccl", device="cuda:0", rank=0, world_size=world_size,
                                           store=store or dist.HashStore(), timeout=timeout)

    @pytest.mark.cuda
    def test_nccl_nonblocking_init_and_collectives(monkeypatch):
        import torch
        c = _nccl_comm(monkeypatch)
        try:
            assert c.nonblocking
            t = torch.ones(1024, device="cuda:0")
            c.all_reduce(t)
            w = c.all_reduce(t, async_op=True)
            w.wait()
            torch.cuda.synchronize()
            assert torch.all(t == 1).item()  # one rank: the sum is the tensor
        finally:
            c.destroy()

    @pytest.mark.cuda
    def test_nccl_nonblocking_init_times_out(monkeypatch):
        """A 2-rank NCCL init whose rank 1 never comes: polled, aborted, CollectiveTimeout."""
        import torch.distributed as dist
        store = dist.HashStore()
        from streamcoll.startup import topology
        # a fresh store: the first communicator named "comm" on it has namespace 1 (numbered through the store)
        dist.PrefixStore("streamcoll/comm/2/1/", store).set(
            topology.exchange_key(1), topology.local_facts(1).to_json())
        t0 = time.monotonic()
        with pytest.raises(streamcoll.CollectiveTimeout) as ei:
            _nccl_comm(monkeypatch, world_size=2, store=store, timeout=3.0)
        took = time.monotonic() - t0
        assert 3.0 <= took <= 15.0, took
        assert ei.value.op == "init" and "stayed ncclInProgress" in str(ei.value)

    def _cycles(seconds: float) -> int:
        """GPU clock cycles of ``seconds`` for torch.cuda._sleep (clock_rate in
        kHz; an H200's 1.98 GHz where the build reports 0: CUDA 13 dropped
        cudaDeviceProp::clockRate)."""
        import torch
        rate = getattr(torch.cuda.get_device_properties(0), "clock_rate", 0) or 1_980_000
        return int(rate * 1000 * seconds)

    def _comm_behind_a_spinning_kernel(monkeypatch):
        """A one-rank NCCL communicator with a 1 s timeout (watchdog ``fail``)
        whose current stream is held ~6 s by a spinning kernel, and a tensor."""
        import torch
        import torch.distributed as dist
        monkeypatch.setenv("STREAMCOLL_WATCHDOG", "fail")
        monkeypatch.delenv("STREAMCOLL_NCCL_NONBLOCKING", raising=False)
        monkeypatch.delenv("STREAMCOLL_SYNC_EVENTS", raising=False)
        c = streamcoll.new_communicator(backend="nccl", device="cuda:0", rank=0, world_size=1,
                                        store=dist.HashStore(), timeout=1.0)
        torch.cuda._sleep(_cycles(6.0))
        return c, torch.ones(16, device="cuda:0")

    def _until_the_watchdog_fires(c) -> None:
        """The watchdog declares the call stuck after the 1 s timeout (plus its grace), not later."""
        import torch
        t0 = time.monotonic()
        while c._failed is None and time.monotonic() - t0 < 10:
            time.sleep(0.05)
        took = time.monotonic() - t0
        torch.cuda.synchronize()
        assert isinstance(c._failed, streamcoll.CollectiveTimeout), c._failed
        assert 1.0 <= took <= 4.0, took

    @pytest.mark.cuda
    def test_gpu_watchdog_aborts_stuck_async_work(monkeypatch):
        """Async work whose completion event does not fire within the timeout
        (the stream is held by a spinning kernel): the watchdog marks the
        communicator failed and aborts it (ncclCommAbort)."""
        c, t = _comm_behind_a_spinning_kernel(monkeypatch)
        w = c.all_reduce(t, async_op=True)
        _until_the_watchdog_fires(c)
        assert c._destroyed  # aborted: ncclCommAbort succeeded
        with pytest.raises(streamcoll.CommunicatorError):
            w.wait()
        assert any("all_reduce (sequence number 1)" in m for m in watchdog.WATCHDOG.fired)

    @pytest.mark.cuda
    def test_gpu_watchdog_sees_a_stuck_sync_call(monkeypatch):
        """Issue 12 (6): a *synchronous* GPU collective whose kernel does not
        finish within the timeout (the stream is held by a spinning kernel)
        is reported through its completion event; before, its host call had
        returned and nothing watched it."""
        c, t = _comm_behind_a_spinning_kernel(monkeypatch)
        c.all_reduce(t)  # returns at once: enqueued behind the sleep
        seq = c.seq
        _until_the_watchdog_fires(c)
        assert any(f"all_reduce (sequence number {seq})" in m and "sync (inline)" in m
                   for m in watchdog.WATCHDOG.fired)

else:
    SCENARIOS[sys.argv[1]]()
