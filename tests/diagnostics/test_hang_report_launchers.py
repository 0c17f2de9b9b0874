"""The hang report (issue 46) under the real launchers: the ``evaluate``
hang of test_hang_report.py through ``dist.init_process_group("streamcoll")``
and ``dist.all_reduce``, started by torchrun, ``srun`` (the one-node SLURM
of scripts/slurm_local.sh) and ``mpiexec`` (MPICH's hydra with mpi4py, the
launchers venv; Intel MPI's where ``$STREAMCOLL_IMPI_VENV``, default
``.venv-impi``, has one), each as the README's "Launching" line runs it
(tests/launching.py), once per watchdog mode:

- ``exit`` (the default): rank 0's watchdog message, in the launcher's
  output, names rank 1, ``evaluate`` and the job file's line of its sleep;
  rank 0 ends with 86 and the launcher tears the job down itself (``srun``
  is given ``--kill-on-bad-exit=1``: SLURM's default lets the other task
  run on);
- ``fail``: ``Work.wait()`` of an async ``all_reduce`` raises the
  CollectiveTimeout, which the job prints with the same report; the
  process goes on (it prints after the error), then ends by ``sys.exit(3)``
  with its oneCCL call still stuck: the exit ends it with that status (under
  ``mpiexec`` it once hung in mpi4py's ``MPI_Finalize``, waiting for rank 1)
  and the launcher tears the job down.

Each: within the communicator's timeout (4 s, ``init_process_group``'s
``timeout=``) plus a few seconds of rank 0's call; rank 1's flight dump is
written and ``python -m streamcoll.flight analyze`` says the same. The job is
a file in the test's folder (:data:`JOB`); every rank writes its pid first
thing, and each test ends by SIGKILLing every rank still alive by that id
(torchrun starts each rank in a session of its own, slurmstepd starts
srun's), then the launcher's session, then ``scancel`` for a SLURM job left.
About 10-15 s a run here (2 cores)."""
from __future__ import annotations

import glob
import json
import os
import signal
import subprocess
import sys
import time
from typing import Dict, List, Optional

import pytest

from conftest import ROOT, needs_oneccl
from launching import VENV, command, job_env, slurm_start, slurm_stop, torchrun
from world import Processes, free_port


def launched(f):
    """The launcher tests' marks; one xdist worker with the other SLURM tests
    (test_launchers.py's pytestmark says why)."""
    for m in (pytest.mark.launchers, pytest.mark.world, pytest.mark.slow, needs_oneccl,
              pytest.mark.xdist_group("slurm")):
        f = m(f)
    return f


TIMEOUT = 4.0
SLACK = 4.0  # the report within TIMEOUT + SLACK of the call: the watchdog's pass, rank 1's answer, the launcher's relay
IMPI_VENV = os.environ.get("STREAMCOLL_IMPI_VENV") or os.path.join(ROOT, ".venv-impi")  # as test_transport_mpi

JOB = '''\
import json, os, sys, time
from datetime import timedelta

OUT = os.environ["HANG_OUT"]
with open(os.path.join(OUT, f"pid.{os.getpid()}"), "w") as f:  # first: the test kills every rank by its id
    f.write(os.environ.get("SLURM_JOB_ID", ""))


def evaluate(seconds):
    time.sleep(seconds)  # HANG-EVALUATE


def note(rank, **kv):
    path = os.path.join(OUT, f"rank{rank}.json")
    old = json.load(open(path)) if os.path.exists(path) else {}
    old.update(kv)
    with open(path + ".tmp", "w") as f:
        json.dump(old, f)
    os.replace(path + ".tmp", path)


def main():
    import torch
    import torch.distributed as dist
    import streamcoll
    streamcoll.launchers.adopt()  # the launcher's ranks as torchrun's variables (README, "Launching")
    rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    open(os.path.join(OUT, f"started.{rank}"), "w").close()
    end = time.monotonic() + 60  # every rank up before the short timeout starts
    while not all(os.path.exists(os.path.join(OUT, f"started.{r}")) for r in range(size)):
        if time.monotonic() > end:
            sys.exit(f"rank {rank}: not every rank started within 60 s")
        time.sleep(0.01)
    dist.init_process_group("streamcoll", timeout=timedelta(seconds=float(os.environ["HANG_TIMEOUT"])))
    t = torch.ones(4)
    for _ in range(3):
        dist.all_reduce(t)
    if rank == 1:
        evaluate(300)
    elif os.environ.get("STREAMCOLL_WATCHDOG") == "fail":
        note(rank, call=time.time())
        w = dist.all_reduce(t, async_op=True)
        try:
            w.wait()
            note(rank, raised=None)
        except streamcoll.CollectiveTimeout as e:
            note(rank, raised=time.time())
            print(f"JOB CAUGHT {type(e).__name__}: {e}", flush=True)
        for i in range(3):
            print(f"JOB STILL RUNNING {i}", flush=True)
            time.sleep(0.2)
        sys.exit(3)  # its oneCCL call still stuck: the exit keeps the status
    else:
        note(rank, call=time.time())
        dist.all_reduce(t)


main()
'''


def _line(marker: str) -> int:
    return next(i for i, text in enumerate(JOB.splitlines(), 1) if text.rstrip().endswith(f"# {marker}"))


class Job(Processes):
    """One launcher command (through bash, as a user types it) running
    :data:`JOB`, its output (both ranks', relayed by the launcher) in
    ``launcher.log``."""

    def __init__(self, tmp, cmd: str, env: Dict[str, str], mode: str) -> None:
        super().__init__(str(tmp))
        self.path = os.path.join(self.dir, "hang_job.py")
        with open(self.path, "w") as f:
            f.write(JOB)
        self.flight_dir = os.path.join(self.dir, "flight")
        self.cmd = cmd.replace("examples/launch_job.py", self.path)
        assert self.path in self.cmd, cmd
        extra = {"HANG_OUT": self.dir, "HANG_TIMEOUT": str(TIMEOUT), "STREAMCOLL_FLIGHT_DIR": self.flight_dir,
                 "STREAMCOLL_WATCHDOG": mode}
        if mode == "fail":
            extra["STREAMCOLL_INLINE_ASYNC_BYTES"] = "0"  # the async call on the comm thread: wait() raises
        self.env = dict(env, **extra)
        self.t0 = time.monotonic()
        self.launcher = self.start(["bash", "-c", self.cmd], self.env, "launcher.log")

    def log(self) -> str:
        return self.text("launcher.log")

    def describe(self) -> str:
        return f"--- {self.cmd}\n--- launcher exit {self.launcher.poll()}\n{self.log()[-6000:]}"

    def until_said(self, text: str, timeout: float) -> float:
        """When (time.time()) ``text`` appeared in the launcher's output."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if text in self.log():
                return time.time()
            if self.launcher.poll() is not None:
                if text in self.log():  # its last words
                    return time.time()
                break
            time.sleep(0.05)
        raise AssertionError(f"never said {text!r}\n{self.describe()}")

    def until_ended(self, timeout: float) -> Optional[int]:
        try:
            return self.launcher.wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    def rank_pids(self) -> Dict[int, str]:
        out = {}
        for p in glob.glob(os.path.join(self.dir, "pid.*")):
            with open(p) as f:
                out[int(p.rsplit(".", 1)[1])] = f.read().strip()
        return out

    def alive_ranks(self) -> List[int]:
        alive = []
        for pid in self.rank_pids():
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    if self.path.encode() in f.read():
                        alive.append(pid)
            except OSError:
                pass
        return alive

    def _kill_ranks(self) -> None:
        for pid in self.alive_ranks():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def kill(self) -> None:
        """Every rank still alive (by id); the launcher, asked to end the job
        (SIGTERM), then killed with its session; ranks that wrote their pid
        meanwhile; a SLURM job left."""
        self._kill_ranks()
        if self.until_ended(10) is None:  # the launcher sees its ranks gone
            try:
                os.killpg(self.launcher.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            if self.until_ended(10) is None:
                super().kill()
        self._kill_ranks()
        for job in sorted({j for j in self.rank_pids().values() if j}):
            subprocess.run(["scancel", job], env=self.env, capture_output=True, timeout=30)

    def analyze(self) -> subprocess.Popen:
        """``python -m streamcoll.flight analyze`` of the dumps, started (it
        runs while the launcher tears the job down)."""
        return subprocess.Popen([sys.executable, "-m", "streamcoll.flight", "analyze", self.flight_dir],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def check(job: Job, mode: str, what: str) -> None:
    """The report, its timing, rank 1's dump and the analysis, the process
    going on (``fail``), and the launcher's own teardown."""
    line = _line("HANG-EVALUATE")
    want = (f"rank 1 has not entered all_reduce #4: last completed #3 (all_reduce); "
            f"its main thread is at {job.path}:{line} in evaluate")
    head = "JOB CAUGHT CollectiveTimeout: all_reduce (sequence number 4) did not complete within 4 s on rank 0 of 2" \
        if mode == "fail" else "Who and where (rank 0 asked every rank of communicator"
    call = job.until(0, "call", 90)  # rank 0 is in its fourth all_reduce (rank0.json; procs[0]: the launcher)
    said = job.until_said(want, TIMEOUT + SLACK + 2)
    log = job.log()
    took = said - call
    assert head in log, job.describe()
    assert TIMEOUT <= took <= TIMEOUT + SLACK, f"{what}: reported {took:.2f} s after the call\n{job.describe()}"
    if mode == "fail":
        assert log.index(head) < log.index(want), job.describe()  # the report is the exception's text
        assert "Who and where (rank 0 asked every rank of communicator" in log.split(head, 1)[1], job.describe()
        raised = job.result(0)["raised"]
        assert raised is not None and TIMEOUT <= raised - call <= TIMEOUT + SLACK, (job.result(0), job.describe())
        job.until_said("JOB STILL RUNNING 2", 10)  # the process goes on after the error
        assert log.index(head) < job.log().index("JOB STILL RUNNING 0"), job.describe()
    else:
        assert "Ending this process now with exit code 86" in log, job.describe()
    # rank 1 answered and dumped its flight record with its threads' stacks
    deadline = time.monotonic() + 20
    while not glob.glob(os.path.join(job.flight_dir, "*.rank1.json")) and time.monotonic() < deadline:
        time.sleep(0.05)
    dumps = glob.glob(os.path.join(job.flight_dir, "*.rank1.json"))
    assert len(dumps) == 1, f"rank 1's dump: {dumps}\n{job.describe()}"
    with open(dumps[0]) as f:
        hang = json.load(f)["hang"]
    assert hang["alarm"]["rank"] == 0 and hang["alarm"]["seq"] == 4, hang["alarm"]
    assert hang["answer"]["last_completed"] == 3, hang["answer"]
    main = [t for t in hang["threads"] if t["main"]]
    assert len(main) == 1 and any(f"line {line}, in evaluate" in s for s in main[0]["stack"]), main
    analysis = job.analyze()
    try:
        # the launcher ends the job itself: rank 0's exit status, rank 1 torn down
        rc = job.until_ended(30)
        ended = time.monotonic() - job.t0
        out, err = analysis.communicate(timeout=60)
    finally:
        if analysis.poll() is None:
            analysis.kill()
            analysis.wait()
    assert analysis.returncode == 1 and "rank 1 never arrived" in out and want in out, out + err
    assert rc is not None, f"{what}: the launcher did not end the job within 30 s of the report\n{job.describe()}"
    assert rc != 0 and not job.alive_ranks(), job.describe()
    print(f"{what} [{mode}]: reported {took:.2f} s after the call (timeout {TIMEOUT:g} s); "
          f"the launcher ended {ended:.1f} s after its start, exit {rc}")


def run_check(tmp_path, cmd: str, env: Dict[str, str], mode: str, what: str, status: Optional[str]) -> None:
    """``status``: what the launcher says of rank 0's exit status ({code}: 86
    or 3); None: the launcher's own exit status is rank 0's."""
    job = Job(tmp_path, cmd, env, mode)
    try:
        check(job, mode, what)
        code = 3 if mode == "fail" else 86
        if status is None:
            assert job.launcher.returncode == code, job.describe()
        else:
            assert status.format(code=code) in job.log(), job.describe()
    finally:
        job.kill()


def _venv_why_not() -> str:
    """What this file needs of the launchers venv (test_launchers' check
    imports Ray and Lightning too: 10 s here): its python with mpi4py, and
    MPICH's mpiexec."""
    for f in ("bin/python", "bin/mpiexec"):
        if not (VENV / f).exists():
            return f"no {f} in the launchers venv {VENV} (bash scripts/setup_launchers.sh makes it)"
    r = subprocess.run([str(VENV / "bin" / "python"), "-c", "import mpi4py"], capture_output=True, text=True, timeout=60)
    return "" if r.returncode == 0 else f"the launchers venv {VENV} has no mpi4py: bash scripts/setup_launchers.sh"


@pytest.fixture(scope="module")
def venv():
    why = _venv_why_not()
    if why:
        pytest.skip(why)
    return VENV


MODES = pytest.mark.parametrize("mode", ["exit", "fail"])


@launched
@MODES
@pytest.mark.timeout(120)
def test_torchrun(tmp_path, mode):
    run_check(tmp_path, torchrun(command(r"^torchrun .*launch_job"), sys.executable), job_env(), mode, "torchrun",
              "exitcode  : {code} ")


@pytest.fixture(scope="module")
def slurm(venv):
    yield slurm_start()
    slurm_stop()


@launched
@MODES
@pytest.mark.timeout(420)  # the first start of the SLURM may install it (apt, up to 300 s)
def test_srun(tmp_path, mode, slurm, venv):
    cmd = command(r"^srun -n 2 ").replace("srun -n 2 ", "srun -n 2 --kill-on-bad-exit=1 ", 1)
    run_check(tmp_path, cmd, job_env(venv / "bin", SLURM_CONF=slurm), mode, "srun", "task 0: Exited with exit code {code}")


@launched
@MODES
@pytest.mark.timeout(120)
@pytest.mark.parametrize("runtime", ["mpich", "intel"])
def test_mpiexec(tmp_path, mode, runtime, request):
    if runtime == "mpich":
        request.getfixturevalue("venv")
        # with mpi4py: rank 0 broadcasts its address and a free port
        cmd, env = command(r"^mpiexec -n 2 "), job_env(VENV / "bin")
    else:
        for f in ("bin/mpiexec", "bin/python"):
            if not os.path.exists(os.path.join(IMPI_VENV, f)):
                pytest.skip(f"no Intel MPI: no {f} in {IMPI_VENV} (the MPICH venv recipe with pip install impi-rt, "
                            "docs/benchmarks.md)")
        cmd = command(r"^MASTER_ADDR=\S+ mpiexec -n 2 ")
        env = job_env(os.path.join(IMPI_VENV, "bin"), MASTER_PORT=str(free_port()), I_MPI_PIN="off")
    run_check(tmp_path, cmd, env, mode, f"mpiexec ({runtime})", None)


# ------------------------------------------------------------------ units
class _FakeMPI:
    def __init__(self) -> None:
        self.finalized = False

    def Is_initialized(self) -> bool:
        return True

    def Is_finalized(self) -> bool:
        return self.finalized

    def Finalize(self) -> None:
        self.finalized = True


@pytest.mark.parametrize("case", ["defaults", "finalize set", "initialize off", "MPI4PY_RC_FINALIZE"])
def test_mpi_finalize_is_deferred_only_where_the_program_left_mpi4py_its_defaults(case, monkeypatch):
    """streamcoll's rendezvous turns mpi4py's own MPI_Finalize off (and
    registers its own at exit) only where mpi4py's settings are the
    defaults."""
    import atexit
    import types
    from streamcoll.diagnostics import failure
    rc = types.SimpleNamespace(initialize=True, finalize=None)
    monkeypatch.setitem(sys.modules, "mpi4py", types.SimpleNamespace(rc=rc))
    monkeypatch.delenv("MPI4PY_RC_FINALIZE", raising=False)
    monkeypatch.delenv("MPI4PY_RC_INITIALIZE", raising=False)
    if case == "finalize set":
        rc.finalize = True
    elif case == "initialize off":
        rc.initialize = False
    elif case == "MPI4PY_RC_FINALIZE":
        monkeypatch.setenv("MPI4PY_RC_FINALIZE", "yes")
    registered = []
    monkeypatch.setattr(atexit, "register", registered.append)
    failure.defer_mpi_finalize()
    if case == "defaults":
        assert rc.finalize is False and registered == [failure.finalize_mpi_unless_stuck]
    else:
        assert rc.finalize is not False and registered == [], (rc, registered)


@pytest.mark.parametrize("stuck", [False, True])
def test_mpi_is_finalized_at_exit_unless_a_native_call_never_returns(stuck, monkeypatch):
    """After a hang (a oneCCL call that never returns: skip_native_teardown
    ran) MPI_Finalize, which waits for every rank, is skipped; else it runs."""
    from streamcoll.diagnostics import failure
    mpi = _FakeMPI()
    monkeypatch.setitem(sys.modules, "mpi4py.MPI", mpi)
    monkeypatch.setattr(failure, "_SKIP_REGISTERED", stuck)
    failure.finalize_mpi_unless_stuck()
    assert mpi.finalized is (not stuck)
