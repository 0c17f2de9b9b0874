"""A terminating signal ends a rank wherever its main thread stands.

After ``streamcoll.init()`` SIGTERM's default is streamcoll's stand-in (it
removes the process's ``/dev/shm`` regions, then dies of the signal), and a
Python-level handler runs only when the main thread is back in the
interpreter: a main thread inside any native call that retries on EINTR (a
gloo barrier, a TCPStore wait or connect, a oneCCL collective) kept the
process alive until the call returned (gloo's own timeout is 30 min). Here
rank 0 of two real ranks stands in one such place, gets SIGTERM (SIGINT,
SIGHUP), and must die of that signal within 2 s with its regions gone; a
handler of the program's own still runs when the call returns; a forked
child keeps no stand-in and no watcher; an asyncio loop that owns the
wakeup fd keeps it.

Ranks are processes of their own (``python tests/diagnostics/test_terminating_signals.py
SCENARIO``), each in its own session, killed with it on failure.
"""
from __future__ import annotations

import functools
import json
import os
import signal
import subprocess
import sys
import threading
import time
from typing import List, Optional

# tests/ (conftest, world and the other helpers) on the path, also when this
# file runs as a rank's script (python tests/diagnostics/test_terminating_signals.py ...)
TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if TESTS not in sys.path:
    sys.path.insert(0, TESTS)

from rank_scripts import own_regions, record  # noqa: E402
from world import Processes, free_port  # noqa: E402

BOUND_S = 2.0  # a launcher's SIGTERM ends the rank within this


_out = functools.partial(record, "SIGNALS_OUT")


_regions = own_regions


# ------------------------------------------------------------ rank programs
def _rank(where: str) -> None:
    """Rank 0 goes to ``where`` and stays there; rank 1 never joins it."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    import streamcoll
    rank = int(os.environ["RANK"])
    late = float(os.environ.get("SIGNALS_PEER_LATE", "0"))  # > 0: rank 1 joins the gloo barrier that late
    handled: List[float] = []
    if os.environ.get("SIGNALS_USER_HANDLER"):
        signal.signal(int(os.environ["SIGNALS_USER_HANDLER"]), lambda s, f: handled.append(time.time()))
    if where == "asyncio_owned":  # an event loop owns the wakeup fd before init
        import asyncio
        loop = asyncio.new_event_loop()
        loop.add_signal_handler(signal.SIGUSR1, lambda: None)
    comm = streamcoll.init(backend="oneccl", device="cpu", timeout=120)
    t = torch.ones(1024)
    comm.all_reduce(t)
    store = None
    if where == "gloo":
        store = dist.TCPStore("127.0.0.1", int(os.environ["SIGNALS_GLOO_PORT"]), 2, is_master=rank == 0,
                              timeout=timedelta(seconds=60))
        dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=timedelta(seconds=120))
    _out({"pid": os.getpid(), "regions": _regions(), "sum": t[0].item(),
          "threads": [th.name for th in threading.enumerate()]})
    if rank == 1:
        if late:
            time.sleep(late)
            dist.barrier()
        time.sleep(300)
        return
    _out({"entering": time.time()})
    if where == "gloo":
        dist.barrier()  # rank 1 never comes (or comes SIGNALS_PEER_LATE s later)
    elif where == "store_wait":
        s = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, timeout=timedelta(seconds=120))
        s.wait(["never set"])
    elif where in ("store_connect", "asyncio_owned"):
        dist.TCPStore("127.0.0.1", int(os.environ["SIGNALS_DEAD_PORT"]), is_master=False,
                      timeout=timedelta(seconds=120))
    elif where == "sleep":
        time.sleep(120)
    elif where == "oneccl":
        comm.all_reduce(t)  # rank 1 never joins
    elif where == "busy":
        n = 0
        while True:
            n += 1
    elif where == "fork":
        _fork_child()
    elif where == "asyncio_after":  # an event loop takes the wakeup fd after init and handles SIGTERM
        import asyncio

        async def main() -> None:
            got = asyncio.Event()
            asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, got.set)
            _out({"loop_ready": time.time()})
            await asyncio.wait_for(got.wait(), 60)
            _out({"handled_by_loop": time.time()})
        asyncio.run(main())
    _out({"returned": time.time(), "handled": handled})


def _fork_child() -> None:
    """A forked child (a DataLoader worker) stands in a TCPStore connect;
    the parent reports how and when it ended."""
    from datetime import timedelta

    import torch.distributed as dist
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        h = signal.getsignal(signal.SIGTERM)
        info = {"threads": [th.name for th in threading.enumerate()],
                "term": "SIG_DFL" if h is signal.SIG_DFL else getattr(h, "__qualname__", repr(h))}
        os.write(w, json.dumps(info).encode())
        os.close(w)
        try:
            dist.TCPStore("127.0.0.1", int(os.environ["SIGNALS_DEAD_PORT"]), is_master=False,
                          timeout=timedelta(seconds=60))
        finally:
            os._exit(3)
    os.close(w)
    with os.fdopen(r) as f:
        info = json.loads(f.read())
    _out({"child": pid, "child_info": info, "child_entering": time.time()})
    _, status = os.waitpid(pid, 0)
    _out({"child_ended": time.time(), "child_signal": os.WTERMSIG(status) if os.WIFSIGNALED(status) else None,
          "child_exit": os.WEXITSTATUS(status) if os.WIFEXITED(status) else None})
    time.sleep(300)


def _swallow() -> None:
    """No native init: the watcher alone, and a loop that catches each
    KeyboardInterrupt of its sleep (the main thread's frame stands still at
    the same instruction, but Python ran the handler)."""
    from streamcoll.diagnostics import signals
    print("watching", signals.watch_interrupts(), flush=True)
    caught = 0
    deadline = time.monotonic() + 4
    while time.monotonic() < deadline:
        try:
            time.sleep(0.05)
        except KeyboardInterrupt:
            caught += 1
            print("caught", caught, flush=True)
    print("done", caught, flush=True)


if __name__ != "__main__":
    import pytest

    from conftest import needs_oneccl

    pytestmark = [needs_oneccl, pytest.mark.world, pytest.mark.timeout(120)]

    class Ranks(Processes):
        def __init__(self, where: str, tmp, env: Optional[dict] = None) -> None:
            super().__init__(str(tmp))
            env = dict(env or {}, SIGNALS_OUT=self.dir, SIGNALS_GLOO_PORT=str(free_port()),
                       SIGNALS_DEAD_PORT=str(free_port()))
            self.start_ranks([sys.executable, __file__, where], 2, env)


        def signal_and_time(self, r: int, signum: int, timeout: float = 10) -> Optional[float]:
            """Send ``signum`` to rank ``r``; seconds until it ended (None: alive after ``timeout``)."""
            t0 = time.monotonic()
            os.kill(self.procs[r].pid, signum)
            try:
                self.procs[r].wait(timeout)
            except subprocess.TimeoutExpired:
                return None
            return time.monotonic() - t0


    def _enter(ranks: Ranks, settle: float = 1.0) -> dict:
        ranks.until(1, "pid")
        ranks.until(0, "entering")
        time.sleep(settle)  # well inside the call
        return ranks.result(0)

    CASES = [
        ("gloo", signal.SIGTERM), ("store_wait", signal.SIGTERM), ("store_connect", signal.SIGTERM),
        ("sleep", signal.SIGTERM), ("oneccl", signal.SIGTERM), ("busy", signal.SIGTERM),
        ("gloo", signal.SIGINT), ("store_connect", signal.SIGINT), ("gloo", signal.SIGHUP),
    ]

    @pytest.mark.parametrize("where,signum", CASES, ids=[f"{w}-{signal.Signals(s).name}" for w, s in CASES])
    def test_a_terminating_signal_ends_the_rank_wherever_its_main_thread_stands(tmp_path, where, signum):
        """Rank 0's main thread in ``where``, no handler of the program's:
        the signal ends it within 2 s, killed by that signal (as without
        streamcoll: a parent sees -15, not an exit code), its /dev/shm
        regions removed first."""
        ranks = Ranks(where, tmp_path)
        first_alive = None
        try:
            res = _enter(ranks)
            if signum == signal.SIGINT and where != "oneccl":
                # someone else's native call: one Ctrl-C warns (the call may return, and the program
                # may catch the KeyboardInterrupt), a second one ends it
                os.kill(ranks.procs[0].pid, signum)
                time.sleep(1.5)
                first_alive = ranks.procs[0].poll() is None
            took = ranks.signal_and_time(0, signum)
        finally:
            ranks.kill()
        info = ranks.describe()
        if first_alive is not None:
            assert first_alive, info
            assert "press Ctrl-C again" in ranks.text("stderr0"), info
        assert took is not None, f"alive 10 s after {signal.Signals(signum).name}\n{info}"
        assert took < BOUND_S, (took, info)
        assert ranks.procs[0].returncode == -signum, info
        assert res["regions"], res  # the shm transport is in use: something to remove
        left = [p for p in res["regions"] if os.path.exists(p)]
        assert not left, (left, info)
        err = ranks.text("stderr0")
        if where in ("gloo", "store_wait", "store_connect"):  # a native call that is not streamcoll's
            name = signal.Signals(signum).name
            assert f"streamcoll: {name} received while the main thread is inside a native call" in err, info
            assert "another rank died" not in err, info  # not streamcoll's call: no peer to blame
            assert os.path.basename(__file__) in err, info  # names where the program stands
        if where in ("sleep", "busy"):
            assert "streamcoll:" not in err, info  # Python ran the handler itself: nothing to say

    def test_a_users_handler_still_runs_when_the_call_returns(tmp_path):
        """Rank 0 installed its own SIGTERM handler and gets SIGTERM while in
        a gloo barrier that rank 1 joins 3 s later: not killed; the handler
        runs when the barrier returns; exit 0."""
        ranks = Ranks("gloo", tmp_path, env={"SIGNALS_USER_HANDLER": str(int(signal.SIGTERM)),
                                             "SIGNALS_PEER_LATE": "3"})
        try:
            _enter(ranks, settle=0.5)
            os.kill(ranks.procs[0].pid, signal.SIGTERM)
            ranks.procs[0].wait(60)
        finally:
            ranks.kill()
        info = ranks.describe()
        assert ranks.procs[0].returncode == 0, info
        res = ranks.result(0)
        assert len(res["handled"]) == 1 and abs(res["handled"][0] - res["returned"]) < 0.5, (res, info)

    def test_a_forked_child_keeps_no_stand_in_and_no_watcher(tmp_path):
        """A child forked after init (a DataLoader worker) in a TCPStore
        connect: it has no watcher thread and SIGTERM's plain default, so
        SIGTERM kills it at once (an inherited stand-in with no watcher
        would wait for the connect to give up); its parent is untouched."""
        ranks = Ranks("fork", tmp_path)
        try:
            ranks.until(1, "pid")
            ranks.until(0, "child_entering")
            time.sleep(1.0)
            res = ranks.result(0)
            t0 = time.monotonic()
            os.kill(res["child"], signal.SIGTERM)
            deadline = t0 + 10
            while time.monotonic() < deadline and ranks.result(0).get("child_ended") is None:
                time.sleep(0.02)
            took = time.monotonic() - t0
            res = ranks.result(0)
            alive = ranks.procs[0].poll() is None
        finally:
            ranks.kill()
        info = ranks.describe()
        assert res.get("child_ended") is not None and took < BOUND_S, (took, res, info)
        assert res["child_signal"] == signal.SIGTERM, res
        assert "streamcoll-signals" in res["threads"], res  # the parent has its watcher
        assert "streamcoll-signals" not in res["child_info"]["threads"], res
        assert res["child_info"]["term"] == "SIG_DFL", res
        assert alive, info

    def test_an_event_loop_owning_the_wakeup_fd_keeps_it_and_sigterm_still_kills(tmp_path):
        """An asyncio loop took the wakeup fd before init (add_signal_handler):
        the watcher stays off, so SIGTERM keeps its plain default (a stand-in
        nobody watches would wait for the main thread's native call): killed
        at once in a TCPStore connect; the regions are left for the next
        init's sweep."""
        ranks = Ranks("asyncio_owned", tmp_path)
        try:
            res = _enter(ranks)
            took = ranks.signal_and_time(0, signal.SIGTERM)
        finally:
            ranks.kill()
        info = ranks.describe()
        assert "streamcoll-signals" not in res["threads"], res
        assert took is not None and took < BOUND_S, (took, info)
        assert ranks.procs[0].returncode == -signal.SIGTERM, info

    def test_an_event_loop_taking_the_wakeup_fd_after_init_handles_sigterm(tmp_path):
        """asyncio after init: ``add_signal_handler(SIGTERM)`` takes the
        wakeup fd from the watcher and the signal from the stand-in; the
        loop's handler runs and the program ends normally."""
        ranks = Ranks("asyncio_after", tmp_path)
        try:
            ranks.until(1, "pid")
            ranks.until(0, "loop_ready")
            time.sleep(0.3)
            os.kill(ranks.procs[0].pid, signal.SIGTERM)
            ranks.procs[0].wait(30)
        finally:
            ranks.kill()
        info = ranks.describe()
        assert ranks.procs[0].returncode == 0, info
        assert ranks.result(0).get("handled_by_loop"), info
        assert "streamcoll:" not in ranks.text("stderr0"), info

    def test_a_keyboard_interrupt_the_program_catches_is_not_taken_for_a_stuck_call(tmp_path):
        """The main thread sleeps in a loop that catches KeyboardInterrupt:
        sampled, its frame stands at the same instruction as if it were stuck
        in a native call, but the pending-call probe runs (the main thread is
        back in the interpreter), so the watcher leaves it alone."""
        p = Processes(str(tmp_path))
        p.start([sys.executable, __file__, "swallow"], dict(os.environ), "out")
        try:
            deadline = time.monotonic() + 60
            while "watching" not in p.text("out") and time.monotonic() < deadline and p.procs[0].poll() is None:
                time.sleep(0.05)
            os.kill(p.procs[0].pid, signal.SIGINT)
            p.procs[0].wait(30)
        finally:
            p.kill()
        out = p.text("out")
        assert "watching True" in out, out
        assert p.procs[0].returncode == 0 and "done 1" in out, (p.procs[0].returncode, out)

else:
    _swallow() if sys.argv[1] == "swallow" else _rank(sys.argv[1])
