"""When a collective hangs, say who and where (issue 46, the report): the
rank whose call times out asks every rank through the communicator's store;
each answers (its last completed sequence number, where its main thread
stands, the streamcoll calls it is inside) and dumps its flight record with
its threads' stacks; the report (the watchdog's message, a
CollectiveTimeout's) and ``python -m streamcoll.flight analyze`` name the
ranks that have not entered the stuck collective and where they are.

The scenarios launch their own rank processes (``python
tests/diagnostics/test_hang_report.py SCENARIO``, real oneCCL, as test_reliability.py
does): the hangs leave calls stuck inside oneCCL for good. Every process is
killed by id at the end of its test. Communicator timeout 4 s (the
watchdog's pass: 0.4 s).

- ``evaluate``: both ranks run three all_reduces; rank 1 then calls
  ``evaluate()`` (a long sleep) while rank 0 calls the fourth: rank 0's
  watchdog message names rank 1, ``evaluate``, its file and line, within
  the timeout + 2 s of the call; the analysis says the same.
- ``fail_async_reuse``: ``STREAMCOLL_WATCHDOG=fail``, the fourth call async:
  ``Work.wait()`` raises a CollectiveTimeout naming ``evaluate``; the
  process goes on; a second communicator of the same name on the same store
  (keys of its own) hangs in ``evaluate_again`` and is reported as such.
- ``process_group``: the same through ``dist.all_reduce`` on
  ``backend="streamcoll"`` (``fail``: the process keeps running).
- ``gloo``: rank 1 waits in a gloo barrier (a gloo group beside the
  streamcoll communicator).
- ``two_comms``: each rank inside a collective of another communicator (a
  split), both timing out at once: each report names the other rank inside
  the other communicator with its sequence number.
- ``dead_and_late``: 3 ranks; rank 1 SIGKILLed (named as not answering),
  rank 2 holding the GIL in C code past the wait (named as not answering by
  the report; its answer, which comes later, is in its dump and the
  analysis says it came late).
- ``two_culprits``: 3 ranks; ranks 1 and 2 in two different functions:
  both named.
- ``store_gone``: the rank hosting the store died: the report says it could
  not ask, at once.
- the hot path: no frame and no store request more per call with the
  watchdog and its polling running (pooled world); a fork.
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
# file runs as a rank's script (python tests/diagnostics/test_hang_report.py ...)
TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if TESTS not in sys.path:
    sys.path.insert(0, TESTS)

from rank_scripts import all_started, marker_line, record  # noqa: E402
from world import Processes  # noqa: E402

TIMEOUT = 4.0
EXIT_CODE = 86


# ===================================================================== ranks
def _out(name: str, data: dict) -> None:
    record("HANG_OUT", data, name)


def _all_started() -> None:
    """Every rank's process up (its imports done) before the short timeouts start."""
    all_started("HANG_OUT")


def evaluate(seconds: float) -> None:
    time.sleep(seconds)  # HANG-EVALUATE


def evaluate_again(seconds: float) -> None:
    time.sleep(seconds)  # HANG-EVALUATE-AGAIN


def save_checkpoint(seconds: float) -> None:
    time.sleep(seconds)  # HANG-CHECKPOINT


def hold_the_gil(seconds: float) -> None:
    import ctypes
    ctypes.PyDLL(None).sleep(int(seconds))  # HANG-GIL: a C call that keeps the GIL


def wait_for_the_others(dist) -> None:
    dist.barrier()  # HANG-GLOO


def exchange(side, t) -> None:
    side.all_reduce(t)  # HANG-SIDE


def _three(comm, t) -> None:
    for _ in range(3):
        comm.all_reduce(t)


def _evaluate() -> None:
    import torch
    import streamcoll
    rank = int(os.environ["RANK"])
    _all_started()
    comm = streamcoll.init(backend="oneccl", device="cpu", timeout=TIMEOUT)
    t = torch.ones(4)
    _three(comm, t)
    if rank == 1:
        _out("rank1.json", {"evaluating": time.time()})
        evaluate(60)
    elif rank == 2:
        save_checkpoint(60)
    else:
        _out("rank0.json", {"call": time.time(), "seq": comm.seq})
        comm.all_reduce(t)


def _fail_async_reuse() -> None:
    import torch
    import streamcoll
    rank = int(os.environ["RANK"])
    _all_started()
    res: Dict[str, object] = {}
    for n, culprit in ((1, evaluate), (2, evaluate_again)):
        comm = streamcoll.new_communicator(backend="oneccl", device="cpu", name="job", timeout=TIMEOUT)
        t = torch.ones(4)
        _three(comm, t)
        if n == 2:
            time.sleep(1.5)  # several watchdog passes: the first communicator's alarm is not this one's
            from streamcoll.diagnostics import hang_report
            st = hang_report._STATES.get(comm)
            res["second_polled"] = st is not None  # its alarm key was checked...
            res["second_answered_early"] = st is not None and (st.answered or st.alarm is not None)  # ...not found
        if rank == 1:
            culprit(TIMEOUT + 4)
            comm.all_reduce(t)  # late: it completes rank 0's stuck call
        else:
            t0 = time.monotonic()
            w = comm.all_reduce(t, async_op=True)
            try:
                w.wait()
                res[f"raised{n}"] = None
            except streamcoll.CollectiveTimeout as e:
                res[f"raised{n}"] = type(e).__name__
                res[f"message{n}"] = str(e)
            res[f"elapsed{n}"] = time.monotonic() - t0
            # the call completes once rank 1 arrives; this rank's communicator stays failed
            deadline = time.monotonic() + 30
            while comm._in_library() and time.monotonic() < deadline:
                time.sleep(0.05)
        res[f"store_prefix_{n}"] = repr(comm.store)
        _out(f"rank{rank}.json", res)
    _out(f"rank{rank}.json", {"done": True})


def _process_group() -> None:
    from datetime import timedelta
    import torch
    import torch.distributed as dist
    import streamcoll  # noqa: F401  (registers the backend)
    rank = int(os.environ["RANK"])
    _all_started()
    dist.init_process_group("streamcoll", timeout=timedelta(seconds=TIMEOUT))
    t = torch.ones(4)
    for _ in range(3):
        dist.all_reduce(t)
    if rank == 1:
        evaluate(60)
    else:
        _out("rank0.json", {"call": time.time()})
        dist.all_reduce(t)  # fail mode: stays inside oneCCL, the process goes on
        _out("rank0.json", {"returned": time.time()})


def _gloo() -> None:
    import torch
    import torch.distributed as dist
    import streamcoll
    rank = int(os.environ["RANK"])
    _all_started()
    dist.init_process_group("gloo")
    comm = streamcoll.init(backend="oneccl", device="cpu", timeout=TIMEOUT)
    t = torch.ones(4)
    _three(comm, t)
    if rank == 1:
        wait_for_the_others(dist)
    else:
        _out("rank0.json", {"call": time.time()})
        comm.all_reduce(t)


def _two_comms() -> None:
    import torch
    import streamcoll
    rank = int(os.environ["RANK"])
    _all_started()
    comm = streamcoll.init(backend="oneccl", device="cpu", timeout=TIMEOUT)
    side = comm.split(0)
    t = torch.ones(4)
    _three(comm, t)
    side.all_reduce(t)  # its signature checked once, together: the next call goes straight in
    _out(f"rank{rank}.json", {"main_seq": comm.seq, "side_seq": side.seq, "side": side.name})
    if rank == 1:
        exchange(side, t)  # waits for rank 0 on the side communicator
    else:
        comm.all_reduce(t)  # waits for rank 1 on the main one


def _dead_and_late() -> None:
    import torch
    import streamcoll
    rank = int(os.environ["RANK"])
    _all_started()
    comm = streamcoll.init(backend="oneccl", device="cpu", timeout=TIMEOUT)
    t = torch.ones(4)
    _three(comm, t)
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    elif rank == 2:
        hold_the_gil(TIMEOUT + 4)
        evaluate(60)
    else:
        _out("rank0.json", {"call": time.time()})
        comm.all_reduce(t)


def _store_gone() -> None:
    """Rank 0, which hosts the store, dies once rank 1's hang report has its
    connection and while rank 1 does not poll (reports off meanwhile, the
    setting being read at each use): a server dying under a clone or a
    request is another case (the clone waits the store's timeout; the
    request fails, "Connection reset by peer", torch logging its trace);
    rank 1's call then times out."""
    import torch
    import streamcoll
    from streamcoll.diagnostics import hang_report as hr
    rank = int(os.environ["RANK"])
    _all_started()
    comm = streamcoll.init(backend="oneccl", device="cpu", timeout=TIMEOUT)
    t = torch.ones(4)
    _three(comm, t)
    flag = os.path.join(os.environ["HANG_OUT"], "connected.1")
    end = time.monotonic() + 30
    if rank == 0:
        while not os.path.exists(flag) and time.monotonic() < end:
            time.sleep(0.01)
        os.kill(os.getpid(), signal.SIGKILL)
    while not hr._SERVERS and time.monotonic() < end:
        time.sleep(0.01)
    os.environ["STREAMCOLL_HANG_REPORT_S"] = "0"
    time.sleep(0.6)  # a round in flight is over
    open(flag, "w").close()
    time.sleep(1.0)  # rank 0 is gone
    os.environ.pop("STREAMCOLL_HANG_REPORT_S", None)
    time.sleep(1.0)
    _out("rank1.json", {"call": time.time()})
    comm.all_reduce(t)


SCENARIOS = {
    "store_gone": _store_gone,
    "evaluate": _evaluate,
    "fail_async_reuse": _fail_async_reuse,
    "process_group": _process_group,
    "gloo": _gloo,
    "two_comms": _two_comms,
    "dead_and_late": _dead_and_late,
}


def _line(marker: str) -> int:
    return marker_line(os.path.abspath(__file__), marker)


# ==================================================================== tests
if __name__ != "__main__":
    import pytest

    from streamcoll.diagnostics import flight, hang_answer, hang_report

    from conftest import ROOT, needs_oneccl

    ME = os.path.abspath(__file__)

    class Ranks(Processes):
        """Rank processes of one scenario."""

        def __init__(self, scenario: str, size: int, tmp, env: Optional[dict] = None) -> None:
            super().__init__(str(tmp))
            self.flight_dir = os.path.join(self.dir, "flight")
            os.makedirs(self.flight_dir)
            self.start_ranks([sys.executable, ME, scenario], size,
                             dict({"HANG_OUT": self.dir, "STREAMCOLL_FLIGHT_DIR": self.flight_dir,
                                   # this checkout's streamcoll, not an installed one (a script's
                                   # sys.path has its own folder, not the repository's root)
                                   "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
                                   "TORCH_FR_DUMP_TEMP_FILE": os.path.join(self.dir, "fr", "trace_")},
                                  **(env or {})))
            os.makedirs(os.path.join(self.dir, "fr"))

        def until_file(self, name: str, timeout: float = 20) -> str:
            path = os.path.join(self.flight_dir, name)
            deadline = time.monotonic() + timeout
            while not os.path.exists(path) and time.monotonic() < deadline:
                time.sleep(0.05)
            assert os.path.exists(path), f"{name} never written\n{self.describe()}"
            return path

        def analyze(self) -> str:
            p = subprocess.run([sys.executable, "-m", "streamcoll.flight", "analyze", self.flight_dir],
                               capture_output=True, text=True, timeout=60)
            assert p.returncode == 1, p.stdout + p.stderr
            return p.stdout

    def _evaluating(r: int, line: int, func: str = "evaluate") -> str:
        return f"its main thread is at {ME}:{line} in {func}"

    # ------------------------------------------------------------- scenarios
    @needs_oneccl
    @pytest.mark.world
    @pytest.mark.timeout(120)
    def test_evaluate_named_by_the_watchdog_and_the_analysis(tmp_path):
        ranks = Ranks("evaluate", 2, tmp_path)
        try:
            ranks.until_ended(0, 90)
            info = ranks.describe()
            assert ranks.rc(0) == EXIT_CODE, info
            err = ranks.stderr(0)
            line = _line("HANG-EVALUATE")
            want = (f"rank 1 has not entered all_reduce #4: last completed #3 (all_reduce); "
                    f"{_evaluating(1, line)}, called from {ME}:")
            assert want in err, info
            assert "not inside a streamcoll call" in err, info
            assert "Who and where (rank 0 asked every rank of communicator 'default'" in err, info
            took = ranks.ended[0] - ranks.result(0)["call"]
            assert TIMEOUT <= took <= TIMEOUT + 2.0, f"reported {took:.2f} s after the call\n{info}"
            # rank 1 answered and dumped its record with its threads' stacks
            d1 = json.load(open(ranks.until_file("default.rank1.json")))
            hang = d1["hang"]
            assert hang["alarm"]["rank"] == 0 and hang["alarm"]["seq"] == 4, hang["alarm"]
            assert hang["answer"]["last_completed"] == 3 and hang["answer"]["calls"] == [], hang["answer"]
            main = [t for t in hang["threads"] if t["main"]]
            assert len(main) == 1 and any(f"line {line}, in evaluate" in s for s in main[0]["stack"]), main
            assert any(t["name"] == "streamcoll-watchdog" for t in hang["threads"])
            d0 = json.load(open(os.path.join(ranks.flight_dir, "default.rank0.json")))
            assert d0["hang"]["report"]["answers"]["1"]["main"]["where"] == f"{ME}:{line} in evaluate"
            out = ranks.analyze()
            assert "rank 1 never arrived" in out, out
            assert want in out, out
            # torch's reader still reads the dumps; the stuck entry carries the stack of its call
            fr = subprocess.run([sys.executable, "-m", "torch.distributed.flight_recorder.fr_trace",
                                 os.path.join(ranks.dir, "fr")],
                                capture_output=True, text=True, timeout=120)
            text = fr.stdout + fr.stderr
            assert "Traceback" not in text and "Not all ranks joining collective" in text, text
            from streamcoll.diagnostics import fr_torch
            t0 = fr_torch.load(os.path.join(ranks.dir, "fr", "trace_0"))
            stuck = [e for e in t0["entries"] if e["state"] != "completed"]
            assert stuck and any(f["name"] == "_evaluate" and f["filename"] == ME for f in stuck[-1]["frames"]), stuck
            assert all(e["frames"] == [] for e in t0["entries"] if e["state"] == "completed")
        finally:
            ranks.kill()

    @needs_oneccl
    @pytest.mark.world
    @pytest.mark.timeout(150)
    def test_fail_mode_async_wait_and_a_second_communicator_on_the_same_store(tmp_path):
        ranks = Ranks("fail_async_reuse", 2, tmp_path, {"STREAMCOLL_WATCHDOG": "fail",
                                                        "STREAMCOLL_INLINE_ASYNC_BYTES": "0"})
        try:
            ranks.wait_all(120)
            info = ranks.describe()
            assert ranks.rc(0) == 0 and ranks.rc(1) == 0, info
            res = ranks.result(0)
            assert res.get("done"), info
            for n, (func, marker) in ((1, ("evaluate", "HANG-EVALUATE")), (2, ("evaluate_again", "HANG-EVALUATE-AGAIN"))):
                msg = res[f"message{n}"]
                assert res[f"raised{n}"] == "CollectiveTimeout", res
                assert "all_reduce (sequence number 4) did not complete within 4 s" in msg, msg
                assert ("rank 1 has not entered all_reduce #4: last completed #3 (all_reduce); "
                        f"{_evaluating(1, _line(marker), func)}") in msg, msg
                assert TIMEOUT <= res[f"elapsed{n}"] <= TIMEOUT + 2.0, res
            assert "evaluate_again" not in res["message1"] and " in evaluate," not in res["message2"], res
            assert res["second_polled"] is True and res["second_answered_early"] is False, res  # not the first one's
            # rank 1 answered each communicator once
            assert ranks.stderr(1).count("reports all_reduce (sequence number 4) on communicator 'job' stuck") == 2, \
                ranks.stderr(1)
        finally:
            ranks.kill()

    @needs_oneccl
    @pytest.mark.world
    @pytest.mark.timeout(120)
    def test_process_group_path_in_fail_mode(tmp_path):
        ranks = Ranks("process_group", 2, tmp_path, {"STREAMCOLL_WATCHDOG": "fail"})
        try:
            err = ranks.until_said(0, "Who and where", 90)
            took = time.time() - ranks.result(0)["call"]
            line = _line("HANG-EVALUATE")
            assert f"rank 1 has not entered all_reduce #4: last completed #3 (all_reduce); " \
                   f"{_evaluating(1, line)}" in err, err
            assert "The communicator is marked failed" in err, err
            assert took <= TIMEOUT + 3.0, took
            time.sleep(1.0)
            assert ranks.procs[0].poll() is None, ranks.describe()  # fail: the process goes on
            assert "returned" not in ranks.result(0)  # its call stays inside oneCCL
        finally:
            ranks.kill()

    @needs_oneccl
    @pytest.mark.world
    @pytest.mark.timeout(120)
    def test_rank_in_a_gloo_barrier(tmp_path):
        ranks = Ranks("gloo", 2, tmp_path)
        try:
            ranks.until_ended(0, 90)
            info = ranks.describe()
            assert ranks.rc(0) == EXIT_CODE, info
            err = ranks.stderr(0)
            line = _line("HANG-GLOO")
            assert (f"rank 1 has not entered all_reduce #4: last completed #3 (all_reduce); "
                    f"{_evaluating(1, line, 'wait_for_the_others')}") in err, info
            assert "distributed_c10d.py:" in err and " in barrier)" in err, info  # what it is inside
            assert "not inside a streamcoll call" in err, info
        finally:
            ranks.kill()

    @needs_oneccl
    @pytest.mark.world
    @pytest.mark.timeout(120)
    def test_two_communicators_timing_out_at_once_name_each_other(tmp_path):
        ranks = Ranks("two_comms", 2, tmp_path, {"STREAMCOLL_WATCHDOG": "fail"})
        try:
            err0 = ranks.until_said(0, "Who and where", 90)
            err1 = ranks.until_said(1, "Who and where", 30)
            r0, r1 = ranks.result(0), ranks.result(1)
            side = r1["side"]
            main_seq, side_seq = r0["main_seq"] + 1, r1["side_seq"] + 1
            assert (f"rank 1 has not entered all_reduce #{main_seq}: last completed #{main_seq - 1} (all_reduce); "
                    f"{_evaluating(1, _line('HANG-SIDE'), 'exchange')}") in err0, err0
            assert (f"inside all_reduce (sequence number {side_seq}, synchronous) on communicator {side!r}"
                    in err0), err0
            assert (f"rank 0 has not entered all_reduce #{side_seq}: last completed #{side_seq - 1} (all_reduce)"
                    in err1), err1
            assert (f"inside all_reduce (sequence number {main_seq}, synchronous) on communicator 'default'"
                    in err1), err1
        finally:
            ranks.kill()

    @needs_oneccl
    @pytest.mark.world
    @pytest.mark.timeout(150)
    def test_dead_rank_and_a_rank_holding_the_gil(tmp_path):
        ranks = Ranks("dead_and_late", 3, tmp_path, {"STREAMCOLL_WATCHDOG": "fail", "STREAMCOLL_HANG_REPORT_S": "1"})
        try:
            err = ranks.until_said(0, "Who and where", 90)
            took = time.time() - ranks.result(0)["call"]
            assert "ranks 1, 2 did not answer within 1 s: dead (or exited), or holding the GIL in C code" in err, err
            assert took <= TIMEOUT + 3.0, took
            assert ranks.procs[1].poll() == -signal.SIGKILL
            # rank 2 answers once it lets the GIL go: in its dump, and the analysis says it came late
            ranks.until_file("default.rank2.json", 30)
            time.sleep(0.5)
            out = ranks.analyze()
            assert "no dump from rank 1" in out, out
            assert "rank 1 did not answer within 1 s" in out, out
            assert "rank 2 has not entered all_reduce #4 (answered " in out, out
            assert "after the report, which had named it as not answering): last completed #3" in out, out
            # where it is when it answers: past the C call, in what it does next
            assert f"{_evaluating(2, _line('HANG-EVALUATE'))}" in out, out
        finally:
            ranks.kill()

    @needs_oneccl
    @pytest.mark.world
    @pytest.mark.timeout(120)
    def test_three_ranks_two_culprits(tmp_path):
        ranks = Ranks("evaluate", 3, tmp_path)
        try:
            ranks.until_ended(0, 90)
            info = ranks.describe()
            assert ranks.rc(0) == EXIT_CODE, info
            err = ranks.stderr(0)
            assert f"rank 1 has not entered all_reduce #4: last completed #3 (all_reduce); " \
                   f"{_evaluating(1, _line('HANG-EVALUATE'))}" in err, info
            assert f"rank 2 has not entered all_reduce #4: last completed #3 (all_reduce); " \
                   f"{_evaluating(2, _line('HANG-CHECKPOINT'), 'save_checkpoint')}" in err, info
            assert "Likely cause: ranks 1, 2 have not reached this collective (who and where: below)." in err, info
            for r in (1, 2):
                ranks.until_file(f"default.rank{r}.json")
            out = ranks.analyze()
            assert "ranks 1, 2 never arrived" in out, out
            assert "in save_checkpoint" in out and "in evaluate" in out, out
        finally:
            ranks.kill()

    @needs_oneccl
    @pytest.mark.world
    @pytest.mark.timeout(120)
    def test_a_store_that_is_gone(tmp_path):
        """The rank hosting the store died: the others' polls fail (quietly),
        and a report says it could not ask, without waiting for answers."""
        ranks = Ranks("store_gone", 2, tmp_path)
        try:
            ranks.until_ended(1, 90)
            info = ranks.describe()
            assert ranks.rc(1) == EXIT_CODE, info
            err = ranks.stderr(1)
            assert "Who and where (rank 1 asked every rank of communicator 'default'" in err, info
            assert "could not ask: the store closed the connection (its host process ended)" in err, info
            assert "recvValue failed" not in err, info  # no request went out: torch logs none of its C++ traces
            took = ranks.ended[1] - ranks.result(1)["call"]
            assert took <= TIMEOUT + 1.5, f"{took:.2f} s\n{info}"  # no wait for answers that cannot come
        finally:
            ranks.kill()

    # ------------------------------------------------------------- the hot path
    def _hot_path(comm, calls):
        """With the watchdog (and the hang report's polling) running: each
        synchronous call runs one Python frame and no store request on the
        calling thread; the polls follow the watchdog's passes, not the
        calls. A store request is counted where Python calls a method of
        ``dist.Store`` (every store method lives there; the control, one
        ``check`` on the calling thread, is seen)."""
        import threading
        import torch
        import torch.distributed as dist
        from streamcoll.diagnostics import hang_report as hr
        from streamcoll.diagnostics.watchdog import WATCHDOG, mode
        assert mode() == "exit" and WATCHDOG._thread is not None and WATCHDOG._thread.is_alive()
        t = torch.ones(4)
        for _ in range(20):
            comm.all_reduce(t)  # warm: the signature is checked
        time.sleep(1.2)  # a few passes: the hang report's thread runs and has its connection
        me = threading.get_ident()
        requests = []  # (thread, method)
        names = ("check", "get", "set", "add", "wait", "compare_set", "append", "multi_get", "multi_set",
                 "delete_key", "num_keys")
        orig = {n: dist.Store.__dict__[n] for n in names}

        def counting(n, f):
            def method(self, *a, **k):
                requests.append((threading.get_ident(), n))
                return f(self, *a, **k)
            return method

        frames = [0]
        others: dict = {}  # frames other than the fast path's, by (file, function)

        def prof(frame, event, arg):
            if event == "call":
                frames[0] += 1
                code = frame.f_code
                if code.co_name != "all_reduce" or not code.co_filename.startswith("<streamcoll"):
                    key = (code.co_filename.rsplit("/", 1)[-1], code.co_name)
                    others[key] = others.get(key, 0) + 1

        for n, f in orig.items():
            setattr(dist.Store, n, counting(n, f))
        try:
            p0, r0 = WATCHDOG.passes, hr.requests_made()
            t0 = time.monotonic()
            f = comm.all_reduce
            sys.setprofile(prof)
            try:
                for _ in range(calls):
                    f(t)
            finally:
                sys.setprofile(None)
            loop = time.monotonic() - t0
            mine = [n for th, n in requests if th == me]
            st = comm.store
            st.check(["hang-report-test-control"])  # the control: a request on this thread is counted
            control = [n for th, n in requests if th == me][len(mine):]
            time.sleep(1.2)  # polls go on while no call runs: they follow the passes
            polls = [n for th, n in requests if th != me]
            res = {"frames": frames[0], "others": sorted(others.items()), "store_calls": mine,
                   "polled_comms": len(hr._POLLED), "control": control, "passes": WATCHDOG.passes - p0,
                   "polls": len(polls), "poll_methods": sorted(set(polls)), "requests_made": hr.requests_made() - r0,
                   "loop_s": loop}
        finally:
            for n, f in orig.items():
                setattr(dist.Store, n, f)
        return res

    @needs_oneccl
    def test_hot_path_unchanged_with_polling(world2):
        res = world2.run(_hot_path, 3000)
        for r, x in enumerate(res):
            # one frame per call: the generated fast path; on a world earlier tests used, a sync call
            # landing on a flight ring slot an async entry held makes an entry of its own (as in
            # test_signatures' steady state): FlightEntry.__init__, and nothing else
            others = dict(x["others"])
            assert x["frames"] == 3000 + sum(others.values()), (r, x)
            assert set(others) <= {("recorder.py", "__init__")} and others.get(("recorder.py", "__init__"), 0) <= 3000, (r, x)
            assert x["store_calls"] == [] and x["control"] == ["check"], (r, x)  # none on the calling thread
            assert x["passes"] >= 2, (r, x)
            # one check per pass and polled communicator (a shared world may hold more than this one),
            # whatever the number of calls
            n = max(1, x["polled_comms"])
            assert 1 <= x["polls"] <= (x["passes"] + 1) * n and x["poll_methods"] == ["check"], (r, x)
            assert x["requests_made"] == x["polls"], (r, x)

    def _fork(comm):
        """A forked child forgets the parent's hang-report thread and
        connections without closing them; the parent's polls go on."""
        import torch
        from streamcoll.diagnostics import hang_report as hr
        comm.all_reduce(torch.ones(4))
        time.sleep(1.2)  # the parent's thread has polled: it has its connection
        before = len(hr._CONNS) + len(hr._SERVERS)
        pid = os.fork()
        if pid == 0:
            os._exit(0 if (not hr._CONNS and not hr._SERVERS and hr._THREAD is None and not hr._STATES) else 3)
        _, status = os.waitpid(pid, 0)
        r0 = hr.requests_made()
        time.sleep(1.2)
        return {"child": os.waitstatus_to_exitcode(status), "before": before, "polls_after": hr.requests_made() - r0,
                "broken": [c.broken for c in list(hr._CONNS.values()) + list(hr._SERVERS.values())]}

    @needs_oneccl
    def test_fork(world2):
        for r, x in enumerate(world2.run(_fork)):
            assert x["child"] == 0 and x["before"] >= 1, (r, x)
            assert x["polls_after"] >= 1 and x["broken"] and not any(x["broken"]), (r, x)

    # ------------------------------------------------------------- units
    def test_locate_skips_library_frames_where_a_program_frame_exists():
        import threading
        ev = threading.Event()
        started = threading.Event()

        def program_waits():
            started.set()
            ev.wait(30)  # WAIT-HERE

        th = threading.Thread(target=program_waits)
        th.start()
        try:
            started.wait(10)
            time.sleep(0.1)
            where = hang_answer.locate(sys._current_frames()[th.ident])
        finally:
            ev.set()
            th.join()
        line = _line("WAIT-HERE")
        assert where["where"] == f"{ME}:{line} in program_waits", where
        assert where["inside"].startswith(threading.__file__) and where["inside"].endswith(" in wait"), where
        assert where["in_streamcoll"] is False
        assert hang_answer.locate(None)["where"] is None

    def test_locate_a_thread_with_no_program_frame_is_placed_at_its_innermost_frame():
        import threading
        ev = threading.Event()
        th = threading.Thread(target=ev.wait, args=(30,))  # only threading.py's frames
        th.start()
        try:
            time.sleep(0.1)
            where = hang_answer.locate(sys._current_frames()[th.ident])
        finally:
            ev.set()
            th.join()
        assert where["where"].startswith(threading.__file__) and where["where"].endswith(" in wait"), where
        assert where["inside"] is None

    def _answer(rank, issued=3, calls=(), where="/x/train.py:10 in step", p2p=0):
        return {"rank": rank, "communicator": "c", "size": 3, "alarm": "A", "issued": issued,
                "collectives_issued": issued - p2p, "last_completed": issued, "last_completed_op": "all_reduce",
                "calls": list(calls), "calls_text": [], "answered_at": 100.0,
                "main": {"where": where, "from": [], "inside": None, "in_streamcoll": bool(calls)}}

    def test_report_lines():
        alarm = {"id": "A", "rank": 0, "communicator": "c", "size": 4, "op": "all_reduce", "seq": 4,
                 "collective_seq": 4}
        inside_other = {"communicator": "c/split0", "size": 2, "op": "broadcast", "seq": 7, "how": "synchronous"}
        inside_this = {"communicator": "c", "size": 4, "op": "all_reduce", "seq": 4, "how": "synchronous"}
        lines = hang_answer.report_lines(alarm, {0: _answer(0, 4, [inside_this]), 1: _answer(1, 3, [inside_other]),
                                                 2: None, 3: _answer(3, 4, [inside_this])}, 4, 2.0)
        text = "\n".join(lines)
        assert ("rank 1 has not entered all_reduce #4: last completed #3 (all_reduce); its main thread is at "
                "/x/train.py:10 in step; inside broadcast (sequence number 7, synchronous) on communicator "
                "'c/split0'") in text, text
        assert "rank 2 did not answer within 2 s: dead (or exited), or holding the GIL in C code" in text
        assert "rank 3 is inside all_reduce #4 too" in text and "rank 0" not in text.split("\n", 1)[1], text
        # ranks with the same line share it, as ranges
        many = {r: _answer(r, 4, [inside_this]) for r in range(3, 4096)}
        many.update({1: None, 2: None})
        assert hang_answer.report_lines(alarm, many, 4096, 2.0)[1:] == [
            "  ranks 1, 2 did not answer within 2 s: dead (or exited), or holding the GIL in C code",
            "  ranks 3-4095 are inside all_reduce #4 too"]
        passed = hang_answer.report_lines(alarm, {1: _answer(1, 6)}, 2, 2.0)
        assert "rank 1 has passed all_reduce #4 (issued #6" in passed[1], passed
        err = hang_answer.report_lines(alarm, {}, 2, 2.0, error="the store did not answer (x)")
        assert err[1:] == ["  could not ask: the store did not answer (x)"], err
        # the watchdog's "Likely cause" line
        rep = hang_report.Report(alarm, {0: _answer(0, 4, [inside_this]), 1: _answer(1, 3, [inside_other]), 2: None,
                                         3: _answer(3, 6)}, 4, 2.0, 2.0, None)
        assert rep.cause() == ("rank 1 has not reached this collective; rank 3 went past it (another order of "
                               "collectives); rank 2 did not answer (dead, or holding the GIL) (who and where: below)")
        assert hang_report.Report(alarm, {1: None}, 2, 2.0, 2.0, "x").cause() is None

    def test_from_dumps_takes_each_ranks_own_answer_and_says_it_was_late():
        alarm = {"id": "A", "rank": 0, "communicator": "c", "size": 3, "op": "all_reduce", "seq": 4,
                 "collective_seq": 4}
        rep = {"alarm": alarm, "answers": {"0": _answer(0, 4), "1": None, "2": None}, "size": 3, "budget_s": 1.0,
               "waited_s": 1.0, "error": None, "ended_at": 98.0}
        d0 = {"rank": 0, "size": 3, "hang": {"alarm": alarm, "answer": _answer(0, 4), "report": rep}}
        d2 = {"rank": 2, "size": 3, "hang": {"alarm": alarm, "answer": _answer(2, where="/x/a.py:3 in slow")}}
        other = {"rank": 1, "size": 3, "hang": {"alarm": dict(alarm, id="B"), "answer": dict(_answer(1), alarm="B")}}
        got, lines = hang_answer.from_dumps([d0, d2, other])
        text = "\n".join(lines)
        assert got["id"] == "A"
        assert "rank 1 did not answer within 1 s" in text, text  # an answer to another alarm does not count
        assert "rank 2 has not entered all_reduce #4 (answered 2.0 s after the report, which had named it as " \
               "not answering): last completed #3" in text and "/x/a.py:3 in slow" in text, text
        assert hang_answer.from_dumps([{"rank": 0, "size": 2}]) is None

    def _one_connection_per_server(comm):
        import torch
        import streamcoll
        from streamcoll.diagnostics import hang_report as hr
        made = [streamcoll.new_communicator() for _ in range(3)]
        made.append(made[0].split(0))
        every = [comm] + made
        try:
            for c in every:
                c.all_reduce(torch.ones(4))
            time.sleep(1.5)  # a few watchdog passes: every communicator polled
            return {"servers": len(hr._SERVERS), "per_store": len(hr._CONNS),
                    "routes": len({hr._route(c)[0] for c in every}), "scopes": [c.scope for c in every],
                    "alarm_keys": len({hr.keys(c)["alarm"] for c in every}), "polled": hr.requests_made() > 0}
        finally:
            for c in made:
                c.destroy()

    @needs_oneccl
    def test_communicators_on_one_store_server_share_one_connection(world2):
        """The hang report's thread keeps one connection per store server,
        not one per communicator (four more communicators, a split's child
        among them, add none; a TCPStore server holds one more socket per
        rank, whatever the number of groups); each communicator's keys stay
        its own (its scope: equal on every rank, distinct between them)."""
        res = world2.run(_one_connection_per_server)
        for r, x in enumerate(res):
            assert x["servers"] == 1 and x["per_store"] == 0 and x["routes"] == 1 and x["polled"], (r, x)
            assert x["alarm_keys"] == 5 and len(set(x["scopes"])) == 5 and None not in x["scopes"], (r, x)
        assert res[0]["scopes"] == res[1]["scopes"], res

    @needs_oneccl
    def test_keys_are_per_communicator_on_a_reused_store(monkeypatch):
        """Two communicators of the same name made one after another on one
        store: the second has keys of its own (the rendezvous numbers each
        namespace through the store), so an alarm the first left is not the
        second's; a split's child has its own name."""
        import torch.distributed as dist
        import streamcoll
        monkeypatch.setenv("STREAMCOLL_WATCHDOG", "off")
        store = dist.HashStore()
        a = streamcoll.new_communicator(backend="oneccl", device="cpu", rank=0, world_size=1, store=store, name="x")
        try:
            k = hang_report.keys(a)["alarm"]
            a.store.set(k, json.dumps({"id": "old"}))
            a.destroy()
            b = streamcoll.new_communicator(backend="oneccl", device="cpu", rank=0, world_size=1, store=store,
                                            name="x")
            try:
                assert b.name == a.name and hang_report.keys(b)["alarm"] == k
                assert a.store.check([k]) and not b.store.check([k])
            finally:
                b.destroy()
        finally:
            a.destroy()

    @needs_oneccl
    def test_an_interrupt_while_waiting_for_the_answers_still_makes_the_exit_safe(monkeypatch):
        """A Ctrl-C in the report's wait (up to 2 s, on the thread whose
        wait timed out) leaves the communicator failed and its teardown
        made safe, as the timeout without a report did."""
        import torch.distributed as dist
        import streamcoll
        from streamcoll.diagnostics import failure
        monkeypatch.setenv("STREAMCOLL_WATCHDOG", "fail")  # not off: with it off, no report is gathered
        c = streamcoll.new_communicator(backend="oneccl", device="cpu", rank=0, world_size=1, store=dist.HashStore())
        torn = []

        def interrupted(*a, **k):
            raise KeyboardInterrupt

        monkeypatch.setattr(hang_report, "gather", interrupted)
        monkeypatch.setattr(failure, "after_failure", lambda comm: torn.append(comm))
        try:
            with pytest.raises(KeyboardInterrupt):
                failure.handle_timeout(c, "all_reduce", 1, 1.0, [])
            assert torn == [c] and isinstance(c.failure, streamcoll.CollectiveTimeout)
        finally:
            c.destroy()

    def test_budget_setting(monkeypatch):
        monkeypatch.delenv("STREAMCOLL_HANG_REPORT_S", raising=False)
        assert hang_report.budget_s() == 2.0
        monkeypatch.setenv("STREAMCOLL_HANG_REPORT_S", "0.5")
        assert hang_report.budget_s() == 0.5
        monkeypatch.setenv("STREAMCOLL_HANG_REPORT_S", "0")
        assert hang_report.budget_s() == 0.0
        for bad in ("soon", "-1", "inf", "nan"):
            monkeypatch.setenv("STREAMCOLL_HANG_REPORT_S", bad)
            assert hang_report.budget_s() == 2.0, bad

    @needs_oneccl
    def test_one_rank_communicator_is_neither_polled_nor_asked(monkeypatch):
        import torch.distributed as dist
        import streamcoll
        monkeypatch.setenv("STREAMCOLL_WATCHDOG", "off")
        c = streamcoll.new_communicator(backend="oneccl", device="cpu", rank=0, world_size=1, store=dist.HashStore())
        try:
            r0 = hang_report.requests_made()
            hang_report.after_pass([c])
            assert hang_report.gather(c, "all_reduce", 1) is None
            time.sleep(0.1)
            assert hang_report.requests_made() == r0
            assert "hang" not in flight.snapshot(c)
        finally:
            c.destroy()

    def test_torch_format_frames_only_for_a_call_in_flight():
        from streamcoll.diagnostics import fr_torch
        fr = [{"name": "step", "filename": "/x/train.py", "line": 3}]
        snap = {"communicator": "c", "backend": "oneccl", "size": 2, "timeout_s": 4.0,
                "hang": {"call_frames": {"2": fr}},
                "entries": [{"seq": 1, "collective_seq": 1, "op": "all_reduce", "shapes": None, "dtypes": None,
                             "state": "completed"},
                            {"seq": 2, "collective_seq": 2, "op": "all_reduce", "shapes": [[4]],
                             "dtypes": ["float32"], "state": "running"}]}
        t = fr_torch.to_torch([snap], 0)
        assert [e["frames"] for e in t["entries"]] == [[], fr]
        del snap["hang"]
        assert [e["frames"] for e in fr_torch.to_torch([snap], 0)["entries"]] == [[], []]

else:
    SCENARIOS[sys.argv[1]]()
