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

The review of the signal watcher (the second part of this file; branch
``signals``): the attacks that found a defect, on real oneCCL ranks. Fixed on ``sigreview``: two SIGINTs at once
taken for a stuck call; a signal during a rank's first native init (oneCCL's
handler: exit 1); a full stderr pipe keeping a SIGTERMed rank alive. Open
(these tests fail): a caught KeyboardInterrupt in a native call that returns
after the 1 s grace is killed; a wakeup fd released by an event loop after
init leaves SIGTERM's stand-in unwatched.

Its ranks too are processes of their own (``python
tests/diagnostics/test_signals.py SCENARIO``), each in its own session,
SIGKILLed with it in a ``finally``; its tests have 120 s each.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from typing import List, Optional

# tests/ (world, rank_scripts, conftest): on the path also when this file runs as a rank's script
TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if TESTS not in sys.path:
    sys.path.insert(0, TESTS)

from rank_scripts import own_regions, record  # noqa: E402
from world import Processes, free_port, rank_env  # noqa: E402



def _out(name: str, data: dict) -> None:
    record("SIGNALS_OUT", data, name)


def _rank_out(data: dict) -> None:
    record("SIGNALS_OUT", data)


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


# ======================================================== the watcher's attacks
# (the review of the signal watcher: the module docstring's second part)
BOUND_S = 2.0


_regions = own_regions


def _long_op_seconds(target: float):
    """A single torch op (the GIL released throughout) of about ``target``
    seconds here: a matrix product, sized by timing it."""
    import torch
    n = 256
    while True:
        a = torch.randn(n, n)
        t0 = time.perf_counter()
        torch.mm(a, a)
        took = time.perf_counter() - t0
        if took >= target / 2:
            return lambda: torch.mm(a, a)
        n = int(n * min(2.0, max(1.1, (target / max(took, 1e-4)) ** (1 / 3))))


# ------------------------------------------------------------ rank programs
def _rank(where: str) -> None:
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    rank = int(os.environ["RANK"])
    late = float(os.environ.get("SIGNALS_PEER_LATE", "0"))
    use_streamcoll = os.environ.get("SIGNALS_NO_STREAMCOLL") != "1"
    waiter = int(os.environ.get("SIGNALS_WAITER", "0"))  # init_wait: the rank that waits in the native init
    if where == "init_wait" and rank != waiter:  # the other rank comes to the native init 30 s late
        from streamcoll.core import backends
        real = backends.Backend.init_rank

        def slow(self, *a, **k):
            time.sleep(30)
            return real(self, *a, **k)
        backends.Backend.init_rank = slow
    if where == "init_wait" and rank == waiter:
        from streamcoll.core import backends
        real0 = backends.Backend.init_rank

        def mark(self, *a, **k):
            _rank_out({"entering": time.time(), "pid": os.getpid()})
            return real0(self, *a, **k)
        backends.Backend.init_rank = mark
    comm = None
    if use_streamcoll:
        import streamcoll
        comm = streamcoll.init(backend="oneccl", device="cpu", timeout=120)
        t = torch.ones(1024)
        comm.all_reduce(t)
    store = dist.TCPStore("127.0.0.1", int(os.environ["SIGNALS_GLOO_PORT"]), 2, is_master=rank == 0,
                          timeout=timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=timedelta(seconds=120))
    if where == "wakeup_taken":  # an event loop with a signal handler, run and closed after init
        import asyncio

        async def main() -> None:
            asyncio.get_running_loop().add_signal_handler(signal.SIGUSR1, lambda: None)
            await asyncio.sleep(0.01)
        asyncio.run(main())
    op = _long_op_seconds(float(os.environ.get("SIGNALS_OP_S", "3"))) if where == "kbd_torch" else None
    _rank_out({"pid": os.getpid(), "regions": _regions() if use_streamcoll else [],
          "threads": [th.name for th in threading.enumerate()]})
    if rank == 1:
        if late:
            time.sleep(late)
            dist.barrier()
        time.sleep(300)
        return
    _rank_out({"entering": time.time()})
    caught = 0
    if where in ("kbd_gloo", "kbd_torch"):
        t0 = time.time()
        try:
            if where == "kbd_gloo":
                dist.barrier()  # rank 1 joins SIGNALS_PEER_LATE s later
            else:
                op()
        except KeyboardInterrupt:
            caught += 1
        _rank_out({"op_s": time.time() - t0, "op_end": time.time()})
    elif where == "kbd_busy":  # Python code that catches every KeyboardInterrupt, for a while
        deadline = time.monotonic() + float(os.environ.get("SIGNALS_LOOP_S", "4"))
        while time.monotonic() < deadline:
            try:
                sum(range(1000))
            except KeyboardInterrupt:
                caught += 1
    elif where in ("stderr_full", "stderr_full_sleep"):  # stderr: a pipe its reader does not drain (yet), full
        import fcntl
        import logging
        if where == "stderr_full_sleep":  # the program logs streamcoll's INFO lines to stderr
            logging.basicConfig(level=logging.INFO)
        fl = fcntl.fcntl(2, fcntl.F_GETFL)
        fcntl.fcntl(2, fcntl.F_SETFL, fl | os.O_NONBLOCK)
        try:
            while True:
                os.write(2, b"x" * 4096)
        except BlockingIOError:
            pass
        fcntl.fcntl(2, fcntl.F_SETFL, fl)
        _rank_out({"stderr_full": time.time()})
        if where == "stderr_full":
            dist.barrier()  # rank 1 never comes
        else:
            time.sleep(60)
    elif where == "wakeup_taken":
        dist.barrier()  # rank 1 never comes
    _rank_out({"returned": time.time(), "caught": caught})


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

    # ==================================================== the watcher's attacks
    # (each test 120 s at most: its pytest.mark.timeout)
    class WatcherRanks(Processes):
        def __init__(self, where: str, tmp, env: Optional[dict] = None, stderr0_pipe: bool = False) -> None:
            super().__init__(str(tmp))
            env = dict(env or {}, SIGNALS_OUT=self.dir, SIGNALS_GLOO_PORT=str(free_port()))
            self.pipe_r = None
            if not stderr0_pipe:
                self.start_ranks([sys.executable, __file__, where], 2, env)
                return
            port = free_port()
            for r in range(2):
                e = dict(os.environ)
                e.update(rank_env(r, 2, port))
                e.update(env)
                if r == 0:  # stderr: a pipe nobody reads
                    self.pipe_r, w = os.pipe()
                    out = open(os.path.join(self.dir, "stdout0"), "w")
                    try:
                        self.procs.append(subprocess.Popen([sys.executable, __file__, where], env=e, stdout=out,
                                                           stderr=w, start_new_session=True))
                    finally:
                        os.close(w)
                        out.close()
                    open(os.path.join(self.dir, "stderr0"), "w").close()
                else:
                    self.start([sys.executable, __file__, where], e, f"stdout{r}", f"stderr{r}")

        def kill(self) -> None:
            super().kill()
            if self.pipe_r is not None:
                os.close(self.pipe_r)
                self.pipe_r = None



    def _signal(ranks: "WatcherRanks", r: int, signum: int, times: int = 1, gap: float = 0.0,
                timeout: float = 10) -> Optional[float]:
        """Send ``signum`` ``times`` times (``gap`` s apart) to rank ``r``;
        seconds until it ended (None: alive after ``timeout``)."""
        t0 = time.monotonic()
        for i in range(times):
            if i:
                time.sleep(gap)
            os.kill(ranks.procs[r].pid, signum)
        try:
            ranks.procs[r].wait(timeout)
        except subprocess.TimeoutExpired:
            return None
        return time.monotonic() - t0

    @pytest.mark.timeout(120)
    @pytest.mark.parametrize("where,env", [("kbd_gloo", {"SIGNALS_PEER_LATE": "4"}),
                                           ("kbd_torch", {"SIGNALS_OP_S": "6"})], ids=["gloo", "torch_op"])
    def test_a_caught_keyboard_interrupt_in_a_native_call_that_returns_later_does_not_kill(tmp_path, where, env):
        """Rank 0 wraps a native call that returns after a few seconds (a
        gloo barrier rank 1 joins 4 s late; one torch matrix product of
        about 3-6 s, the GIL released) in ``try/except KeyboardInterrupt``
        and goes on; a Ctrl-C 0.5 s into it. Without streamcoll (and on
        1d00d51) the call returns, KeyboardInterrupt is raised and caught,
        exit 0. On ``signals`` the watcher ends the process by SIGINT 1 s
        after the Ctrl-C: a Ctrl-C in a REPL or notebook during any native
        call longer than 1 s kills the interpreter."""
        for attempt in range(3):
            (tmp_path / str(attempt)).mkdir()
            ranks = WatcherRanks(where, tmp_path / str(attempt), env)
            try:
                ranks.until(1, "pid")
                ranks.until(0, "entering")
                time.sleep(0.5)
                sent = time.time()
                took = _signal(ranks, 0, signal.SIGINT, timeout=30)
            finally:
                ranks.kill()
            info = ranks.describe()
            assert took is not None, info
            res = ranks.result(0)
            if res.get("op_end", 0) - sent > 1.2:
                break  # the Ctrl-C came well inside a call that outlasted the watcher's grace
            # the call ended too soon after the Ctrl-C (sized on a quieter moment): a longer one
            env = dict(env, SIGNALS_OP_S=str(2 * float(env.get("SIGNALS_OP_S", "3"))))
        else:
            raise AssertionError(f"the native call never outlasted the Ctrl-C by the grace: {res}")
        assert ranks.procs[0].returncode == 0 and res.get("caught") == 1, (res, info)

    @pytest.mark.timeout(120)
    def test_two_sigints_at_once_to_a_main_thread_in_python_are_two_keyboard_interrupts(tmp_path):
        """Rank 0 runs Python (a loop that catches every KeyboardInterrupt);
        pairs of SIGINTs 0-5 ms apart (a terminal's Ctrl-C reaches the whole
        process group, then torchrun forwards its own), six pairs. On
        ``signals`` the watcher read the second one before the main thread
        had the GIL back, took it for "a second SIGINT while stuck in a
        native call" and ended the process by SIGINT (no finally/atexit),
        naming a Python line as the native call: about two pairs in three.
        Expected: Python's own outcome (KeyboardInterrupts raised in the
        program's code), nothing from the watcher."""
        ranks = WatcherRanks("kbd_busy", tmp_path, {"SIGNALS_LOOP_S": "6"})
        try:
            ranks.until(1, "pid")
            t0 = ranks.until(0, "entering")
            for gap in (0.0, 0.002, 0.005, 0.0, 0.002, 0.005):
                time.sleep(0.4)
                if ranks.procs[0].poll() is not None or time.time() > t0 + 5:
                    break
                os.kill(ranks.procs[0].pid, signal.SIGINT)
                time.sleep(gap)
                os.kill(ranks.procs[0].pid, signal.SIGINT)
            ranks.procs[0].wait(30)
        finally:
            ranks.kill()
        info = ranks.describe()
        err = ranks.text("stderr0")
        assert "streamcoll:" not in err, info  # the watcher did not end it
        # Python's own handling: each KeyboardInterrupt caught, or one raised where the loop has no
        # try (its condition, right after a handler: the second of a pair), as without streamcoll
        assert ranks.procs[0].returncode == 0 or (ranks.procs[0].returncode == -signal.SIGINT
                                                  and "KeyboardInterrupt" in err), info

    @pytest.mark.timeout(120)
    @pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
    def test_a_signal_during_a_ranks_first_native_init_ends_it_by_the_signal(tmp_path, signum):
        """Rank 1's first native call is oneCCL's init, which waits for rank 0
        (30 s late here: a peer that died or hangs between the rendezvous and
        the native init). oneCCL installs its SIGINT/SIGTERM handlers when
        the library is loaded, inside that call, and native_entry puts
        Python's back only after it: on ``signals`` the signal ends rank 1
        with exit status 1 and no message (oneCCL's handler), the case the
        module says a launcher cannot tell from a crash. Expected: killed by
        the signal within 2 s, as after init."""
        ranks = WatcherRanks("init_wait", tmp_path, {"SIGNALS_WAITER": "1"})
        try:
            ranks.until(1, "entering")
            time.sleep(1.5)  # well inside the native init
            took = _signal(ranks, 1, signum)
        finally:
            ranks.kill()
        info = ranks.describe()
        assert took is not None and took < BOUND_S, (took, info)
        assert ranks.procs[1].returncode == -signum, info

    @pytest.mark.timeout(120)
    @pytest.mark.parametrize("where", ["stderr_full", "stderr_full_sleep"], ids=["gloo", "stand_in_logs"])
    def test_sigterm_ends_the_rank_when_its_stderr_pipe_is_full(tmp_path, where):
        """Rank 0's stderr is a pipe its reader does not drain (a stopped
        supervisor, a terminal paused with Ctrl-S): full. ``gloo``: the main
        thread in a gloo barrier; the watcher's message blocks on the write,
        before the regions are removed and before the end, so SIGTERM does
        nothing (without streamcoll: killed at once). ``stand_in_logs``: the
        program logs INFO to stderr, the main thread sleeps; the stand-in's
        "removed this process's region" line blocks the main thread, and the
        watcher, seeing the stand-in started, leaves the end to it. Expected:
        killed by SIGTERM within 2 s, the regions gone."""
        ranks = WatcherRanks(where, tmp_path, stderr0_pipe=True)
        try:
            ranks.until(1, "pid")
            ranks.until(0, "stderr_full")
            time.sleep(1.0)
            res = ranks.result(0)
            took = _signal(ranks, 0, signal.SIGTERM)
        finally:
            ranks.kill()
        info = ranks.describe()
        assert took is not None and took < BOUND_S, (took, info)
        assert ranks.procs[0].returncode == -signal.SIGTERM, info
        assert res["regions"] and not [p for p in res["regions"] if os.path.exists(p)], res

    @pytest.mark.timeout(120)
    @pytest.mark.xfail(strict=True, reason="known limit (streamcoll/diagnostics/signals.py): an event loop closed after "
                       "init leaves the wakeup fd at -1 and the watcher blind; Python offers no way to see it")
    def test_sigterm_ends_the_rank_after_an_event_loop_released_the_wakeup_fd(tmp_path):
        """After init the program runs an asyncio loop with a signal handler
        (``asyncio.run``, ``add_signal_handler(SIGUSR1)``); closing the loop
        sets the wakeup fd to -1. The watcher then sees no signal for good,
        while SIGTERM keeps the stand-in: rank 0 in a gloo barrier survives
        SIGTERM until the barrier returns (without streamcoll: killed at
        once; the docs say such a program "handles its signals through the
        loop anyway", but its loop is gone and never handled SIGTERM)."""
        ranks = WatcherRanks("wakeup_taken", tmp_path)
        try:
            ranks.until(1, "pid")
            ranks.until(0, "entering")
            time.sleep(1.0)
            took = _signal(ranks, 0, signal.SIGTERM)
        finally:
            ranks.kill()
        info = ranks.describe()
        assert took is not None and took < BOUND_S, (took, info)
        assert ranks.procs[0].returncode == -signal.SIGTERM, info

else:
    if sys.argv[1] in SCENARIOS:
        SCENARIOS[sys.argv[1]]()
    else:  # the watcher's attacks
        _rank(sys.argv[1])
