"""Ctrl-C and SIGTERM after init, on real oneCCL ranks (issue 15).

The ranks are processes of their own (``python tests/diagnostics/test_signals.py
SCENARIO``), signalled by the test: oneCCL installs native SIGINT/SIGTERM
handlers at init (``SigCgt``), and the point is how the process ends.

- between calls: SIGINT raises KeyboardInterrupt (``finally`` and ``atexit``
  run, the exit status is Python's for an uncaught KeyboardInterrupt),
  SIGTERM ends with -15; oneCCL keeps its handlers for SIGSEGV and friends.
- inside a synchronous call stuck on a peer that never joins: the process
  ends within the grace period, killed by SIGINT (as Python's own exit on an
  uncaught KeyboardInterrupt), with a message naming the call; a second
  Ctrl-C ends it at once. (Until the watcher ended every stuck process by
  the signal itself, whatever call the main thread was in, this exit was
  ``os._exit(130)``: a parent saw an exit code here and a signal elsewhere.)
  Other places and signals: ``tests/diagnostics/test_terminating_signals.py``.
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
# file runs as a rank's script (python tests/diagnostics/test_signals.py ...)
TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if TESTS not in sys.path:
    sys.path.insert(0, TESTS)

from signal_ranks import record  # noqa: E402
from world import Processes  # noqa: E402



def _out(name: str, data: dict) -> None:
    record(data, name)


def _caught() -> List[str]:
    with open(f"/proc/{os.getpid()}/status") as f:
        for line in f:
            if line.startswith("SigCgt:"):
                m = int(line.split()[1], 16)
                return sorted(signal.Signals(i).name for i in range(1, 32)
                              if m >> (i - 1) & 1 and i in signal.valid_signals())
    return []


def _between() -> None:
    import atexit
    import torch
    import streamcoll
    rank = int(os.environ["RANK"])
    atexit.register(_out, f"rank{rank}.json", {"atexit": True})
    comm = streamcoll.init(backend="oneccl", device="cpu", timeout=60)
    t = torch.ones(4)
    comm.all_reduce(t)
    _out(f"rank{rank}.json", {"caught": _caught(), "sum": t[0].item(),
                              "term_handler": getattr(signal.getsignal(signal.SIGTERM), "__qualname__", None)})
    try:
        _out(f"rank{rank}.json", {"ready": time.time()})
        while True:
            time.sleep(0.01)
    except KeyboardInterrupt:
        _out(f"rank{rank}.json", {"keyboard_interrupt": True})
        raise
    finally:
        _out(f"rank{rank}.json", {"finally": True})


def _stuck() -> None:
    import torch
    import streamcoll
    rank = int(os.environ["RANK"])
    comm = streamcoll.init(backend="oneccl", device="cpu", timeout=120)
    comm.barrier()
    t = torch.ones(4)
    if rank == 0:
        _out("rank0.json", {"entering": time.time()})
        try:
            comm.all_reduce(t)  # rank 1 never joins
        finally:
            _out("rank0.json", {"finally": True})  # must not run: the call never returns
    else:
        _out("rank1.json", {"ready": time.time()})
        time.sleep(120)


def _late_peer() -> None:
    """Rank 0 has its own handler for SIGNALS_SIG and all-reduces while
    rank 1 arrives 3 s late."""
    import torch
    import streamcoll
    rank = int(os.environ["RANK"])
    signum = int(os.environ["SIGNALS_SIG"])
    ran: List[float] = []
    if rank == 0:
        signal.signal(signum, lambda s, f: ran.append(time.time()))
    comm = streamcoll.init(backend="oneccl", device="cpu", timeout=60)
    comm.barrier()
    t = torch.ones(4)
    if rank == 0:
        _out("rank0.json", {"entering": time.time()})
    else:
        time.sleep(3.0)
    comm.all_reduce(t)
    _out(f"rank{rank}.json", {"returned": time.time(), "sum": t[0].item(), "handler": ran})
    streamcoll.destroy()


SCENARIOS = {"between": _between, "stuck": _stuck, "late_peer": _late_peer}


if __name__ != "__main__":
    import pytest

    from conftest import needs_oneccl

    pytestmark = [needs_oneccl, pytest.mark.world]

    class Ranks(Processes):
        def __init__(self, scenario: str, size: int, tmp, env: Optional[dict] = None) -> None:
            super().__init__(str(tmp))
            self.start_ranks([sys.executable, __file__, scenario], size, dict(env or {}, SIGNALS_OUT=self.dir))


        def wait(self, r: int, timeout: float) -> Optional[float]:
            """Seconds until rank ``r`` ended (None: still running)."""
            t0 = time.monotonic()
            try:
                self.procs[r].wait(timeout)
            except subprocess.TimeoutExpired:
                return None
            return time.monotonic() - t0


    def test_ctrl_c_between_calls_raises_keyboard_interrupt(tmp_path):
        """After init, SIGINT raises KeyboardInterrupt with finally and atexit
        (before the fix oneCCL's handler ended the process with status 1 and
        nothing ran); SIGTERM ends with -15; oneCCL's crash handlers stay."""
        ranks = Ranks("between", 2, tmp_path)
        try:
            for r in (0, 1):
                ranks.until(r, "ready")
            os.kill(ranks.procs[0].pid, signal.SIGINT)
            os.kill(ranks.procs[1].pid, signal.SIGTERM)
            took = [ranks.wait(r, 30) for r in (0, 1)]
        finally:
            ranks.kill()
        info = ranks.describe()
        assert took[0] is not None and took[0] < 10, info
        assert ranks.procs[0].returncode == -signal.SIGINT, info  # Python's exit for an uncaught Ctrl-C
        res = ranks.result(0)
        assert res["sum"] == 2.0, res
        assert res.get("keyboard_interrupt") and res.get("finally") and res.get("atexit"), (res, info)
        assert "KeyboardInterrupt" in ranks.text("stderr0"), info
        assert ranks.procs[1].returncode == -signal.SIGTERM, info
        # oneCCL's handlers stay for the fatal signals (its crash report), Python's SIGINT handler is back.
        assert {"SIGSEGV", "SIGBUS", "SIGABRT", "SIGINT"} <= set(res["caught"]), res
        # SIGTERM's default (kill) becomes a Python handler that removes this process's /dev/shm regions,
        # then ends it by SIGTERM under the default again: the exit status above stays -15 (issue 26).
        from streamcoll.diagnostics import shm_regions
        assert "SIGTERM" in res["caught"] and res["term_handler"] == shm_regions._end_by_signal.__qualname__, res

    @pytest.mark.parametrize("twice", [False, True], ids=["once", "twice"])
    def test_ctrl_c_inside_a_stuck_call_ends_the_process(tmp_path, twice):
        """Rank 0 is inside a synchronous all_reduce that rank 1 never joins.
        One SIGINT: the process ends within the grace period (1 s) plus a
        margin, killed by SIGINT, a message naming the call. Two SIGINTs: at
        once. Before the fix the Ctrl-C was swallowed by oneCCL's handler
        (status 1, no message); with only Python's handler it would wait
        for the watchdog's timeout (120 s here)."""
        from streamcoll.diagnostics.signals import INTERRUPT_GRACE_S
        ranks = Ranks("stuck", 2, tmp_path)
        try:
            ranks.until(1, "ready")
            ranks.until(0, "entering")
            time.sleep(1.0)  # well inside the C call
            os.kill(ranks.procs[0].pid, signal.SIGINT)
            if twice:
                time.sleep(0.1)
                os.kill(ranks.procs[0].pid, signal.SIGINT)
            took = ranks.wait(0, 20)
        finally:
            ranks.kill()
        info = ranks.describe()
        assert took is not None, info
        assert ranks.procs[0].returncode == -signal.SIGINT, info
        err = ranks.text("stderr0")
        assert "streamcoll: SIGINT received" in err, info
        assert "all_reduce (sequence number 2, synchronous) on communicator 'default' (rank 0 of 2, oneccl" in err, info
        assert "ending it now, by SIGINT" in err, info
        assert not ranks.result(0).get("finally"), info
        if twice:
            assert "a second time" in err and took < INTERRUPT_GRACE_S, (took, info)
        else:
            assert f"did not return within {INTERRUPT_GRACE_S:g} s" in err, info
            assert INTERRUPT_GRACE_S <= took <= INTERRUPT_GRACE_S + 3.0, (took, info)

    @pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
    def test_users_handler_runs_while_a_collective_waits(tmp_path, signum):
        """Rank 0 installed its own handler (a checkpoint-on-preemption
        SIGTERM handler) and gets the signal while its all_reduce waits 3 s
        for rank 1: the handler runs when the call returns, the sum is right
        and both ranks end normally (before: exit 143 after 1 s, the handler
        never ran, and the peer crashed in destroy)."""
        ranks = Ranks("late_peer", 2, tmp_path, env={"SIGNALS_SIG": str(int(signum))})
        try:
            ranks.until(0, "entering")
            time.sleep(1.0)  # inside the C call, waiting for rank 1
            os.kill(ranks.procs[0].pid, signum)
            ended = [ranks.wait(r, 60) for r in (0, 1)]
        finally:
            ranks.kill()
        info = ranks.describe()
        assert ended[0] is not None and ended[1] is not None, info
        assert [p.returncode for p in ranks.procs] == [0, 0], info
        res = ranks.result(0)
        assert res["sum"] == 2.0 and len(res["handler"]) == 1, (res, info)
        assert abs(res["handler"][0] - res["returned"]) < 0.5, res  # run by Python once the call returned
        assert "your handler runs when the call returns" in ranks.text("stderr0"), info

else:
    SCENARIOS[sys.argv[1]]()
