"""Adversarial review of hydra's PMI client (streamcoll/startup/pmi.py and
launchers._pmi_rendezvous): real ``mpiexec`` (MPICH 5.0.2's hydra from the
launchers venv), real ranks, each run bounded by a timeout; mpiexec runs in
its own session and the whole group is killed at the end."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from typing import Dict, Tuple

import pytest

from conftest import ROOT, needs_oneccl
from launching import VENV, job_env, venv_why_not

pytestmark = [needs_oneccl, pytest.mark.launchers, pytest.mark.slow]


@pytest.fixture(scope="module")
def venv_bin():
    why = venv_why_not()
    if why:
        pytest.skip(why)
    return VENV / "bin"


def mpiexec(venv_bin, n: int, script: str, *args: str, timeout: float = 120,
            env: Dict[str, str] = None) -> Tuple[int, str, float]:
    """``mpiexec -n n python -c script args`` (the venv's python: mpi4py
    importable but not imported, so streamcoll takes hydra's PMI); its
    exit status, its output, seconds taken. Killed as a group at the end."""
    e = job_env(venv_bin, **(env or {}))
    t0 = time.monotonic()
    p = subprocess.Popen([str(venv_bin / "mpiexec"), "-n", str(n), str(venv_bin / "python"), "-c", script, *args],
                         cwd=str(ROOT), env=e, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         start_new_session=True)
    try:
        out, _ = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, _ = p.communicate()
        return -999, out, time.monotonic() - t0
    finally:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return p.returncode, out, time.monotonic() - t0


_EXITS_APART = r"""
import os, sys, time, torch, streamcoll
c = streamcoll.init(timeout=60)
t = torch.ones(1); c.all_reduce(t)
time.sleep(1.5 * c.rank)   # rank 0 ends first, the others still work (a checkpoint's write)
print(f"rank {c.rank} done {t.item()}", flush=True)
"""


@pytest.mark.parametrize("n", [2, 3])
def test_a_rank_that_ends_first_does_not_kill_the_others(venv_bin, n):
    # Without PMI's finalize hydra takes a process's exit after PMI init as an
    # abort: it SIGKILLs the rest of the job (measured: 1 of 2 and 1 of 4
    # ranks printed, mpiexec exit 0 at 2 ranks and 9 at 4).
    rc, out, _ = mpiexec(venv_bin, n, _EXITS_APART)
    done = sorted(int(line.split()[1]) for line in out.splitlines() if line.startswith("rank ") and " done " in line)
    assert done == list(range(n)) and rc == 0, (rc, out[-3000:])


_RAISES = r"""
import time, torch, streamcoll
c = streamcoll.init(timeout=60)
t = torch.ones(1); c.all_reduce(t)
if c.rank == 0:
    raise RuntimeError("rank 0 fails")
time.sleep(60)
print(f"rank {c.rank} slept on", flush=True)
"""


def test_a_rank_that_fails_still_ends_the_job(venv_bin):
    # The finalize at exit must not keep a failed job alive: after an uncaught
    # exception (or a stuck native call) no finalize, so hydra ends the others
    # (a finalised rank's non-zero exit ends nothing: the hang-report mpiexec
    # 'fail' test ran past its 30 s with the first fix).
    rc, out, took = mpiexec(venv_bin, 2, _RAISES, timeout=120)
    assert rc != 0 and took < 40 and "slept on" not in out, (rc, took, out[-3000:])


_ADOPT_THEN_MPI = r"""
import streamcoll.launchers
streamcoll.launchers.adopt()   # hydra's PMI: rank 0's address and a port
from mpi4py import MPI         # then the program's own MPI, on the same PMI_FD
print(f"rank {MPI.COMM_WORLD.Get_rank()} mpi {MPI.COMM_WORLD.allreduce(1)}", flush=True)
"""


def test_mpi_initialises_after_the_pmi_rendezvous(venv_bin):
    # The PMI client's socket timeout set O_NONBLOCK on the file description
    # that its dup shares with PMI_FD: MPICH's PMI_Init read EAGAIN and
    # aborted ("PMI_Init returned -1"), although pmi.py says MPI_Init after
    # it works.
    rc, out, _ = mpiexec(venv_bin, 2, _ADOPT_THEN_MPI)
    assert rc == 0 and out.count(" mpi 2") == 2, (rc, out[-3000:])


_STAGGERED = r"""
import os, sys, time
r = int(os.environ["PMI_RANK"])
time.sleep(2.0 * r)                      # ranks starting seconds apart
import torch, streamcoll, torch.distributed as dist
c = streamcoll.init(timeout=60)          # hydra's PMI: rank 0's address and a port
t = torch.ones(1); c.all_reduce(t)
c2 = streamcoll.new_communicator(timeout=60)   # a second communicator on the launcher's store
t2 = torch.ones(1); c2.all_reduce(t2)
dist.init_process_group("streamcoll")    # torch's world after streamcoll.init: no second PMI exchange
t3 = torch.ones(1); dist.all_reduce(t3)
sub = dist.new_group([0, 1])
if r < 2:
    t4 = torch.ones(1); dist.all_reduce(t4, group=sub)
dist.barrier()
dist.destroy_process_group()
print(f"rank {r} ok {t.item()} {t2.item()} {t3.item()}", flush=True)
"""


def test_three_ranks_apart_make_every_kind_of_world(venv_bin):
    # Measured before the finalize: every rank printed ok, mpiexec exited 9.
    rc, out, _ = mpiexec(venv_bin, 3, _STAGGERED, timeout=180)
    assert rc == 0 and sum(f"rank {r} ok 3.0 3.0 3.0" in out for r in range(3)) == 3, (rc, out[-3000:])


_LATE = r"""
import os, sys, time
r = int(os.environ["PMI_RANK"])
if r == 1:
    time.sleep(float(sys.argv[1]))
import torch, streamcoll
t0 = time.monotonic()
try:
    streamcoll.init(timeout=float(sys.argv[2]))
    print(f"rank {r} init ok", flush=True)
except Exception as e:
    print(f"rank {r} failed after {time.monotonic() - t0:.1f}s: {type(e).__name__}: {str(e)[:400]}", flush=True)
    sys.exit(3)
"""


def test_init_timeout_bounds_the_pmi_rendezvous(venv_bin):
    # rank 1 starts 60 s late; init(timeout=8) on rank 0 should end near 8 s
    # naming the rendezvous (as the store rendezvous does under torchrun), not
    # wait for PMI's fixed 300 s.
    rc, out, took = mpiexec(venv_bin, 2, _LATE, "60", "8", timeout=120)
    assert took < 45, (rc, took, out[-3000:])  # the late rank ends with the job
    line = next((x for x in out.splitlines() if x.startswith("rank 0 failed after ")), "")
    assert line, (rc, took, out[-3000:])
    assert float(line.split()[4].rstrip("s:")) < 20 and "PMI" in line, line


_FAKE_FD = r"""
import os, socket, sys, time, subprocess
kind = sys.argv[1]
a, b = socket.socketpair()
fd = a.fileno()
if kind == "pipe":
    fd = os.pipe()[0]
elif kind == "closed":
    fd = 1000
elif kind == "garbage":
    b.sendall(b"hello world\n")
elif kind == "eof":
    b.close()
if kind != "closed":
    os.set_inheritable(fd, True)
env = dict(os.environ, PMI_FD=str(fd), PMI_RANK="0", PMI_SIZE="2")
t0 = time.monotonic()
p = subprocess.run([sys.executable, "-c", "import streamcoll; streamcoll.init(timeout=3)"], env=env,
                   pass_fds=() if kind == "closed" else (fd,), capture_output=True, text=True, timeout=60)
print(f"rc={p.returncode} took={time.monotonic() - t0:.1f}")
print(p.stderr.strip().splitlines()[-1])
"""


@pytest.mark.parametrize("kind,says", [
    ("silent", "TimeoutError: PMI_FD: no answer from the launcher in 3 s"),
    ("pipe", "not an open socket"),
    ("closed", "not an open socket"),
    ("garbage", "answered 'hello world'"),
    ("eof", "PMI_FD"),
])
def test_a_pmi_fd_that_is_not_hydra_fails_bounded_and_named(kind, says):
    # No mpiexec: PMI_FD names a socket nobody answers on, a pipe, a closed
    # descriptor, one that answers garbage or is closed at the far end.
    e = job_env()
    p = subprocess.run([sys.executable, "-c", _FAKE_FD, kind], cwd=str(ROOT), env=e, capture_output=True,
                       text=True, timeout=90)
    rc_line, last = (p.stdout.strip().splitlines() + ["", ""])[:2]
    assert rc_line.startswith("rc=1 ") and float(rc_line.split("took=")[1]) < 30, (p.stdout, p.stderr[-2000:])
    assert "rank 0's address through hydra's PMI (PMI_FD) failed" in last and says in last, last


_WAITS = r"""
import os, sys, time
r = int(os.environ["PMI_RANK"])
if r == 1:
    time.sleep(100)
print(f"pid {os.getpid()}", flush=True)
import streamcoll
streamcoll.init(timeout=90)
"""


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_ends_a_rank_waiting_on_pmi(venv_bin, sig):
    # rank 0 waits in the PMI barrier for rank 1 (100 s late); a signal to
    # rank 0 ends it, and hydra then ends the job.
    p = subprocess.Popen([str(venv_bin / "mpiexec"), "-n", "2", str(venv_bin / "python"), "-c", _WAITS],
                         cwd=str(ROOT), env=job_env(venv_bin), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         text=True, start_new_session=True)
    try:
        line = p.stdout.readline()
        assert line.startswith("pid "), line
        time.sleep(3)  # inside streamcoll.init: the PMI barrier
        t0 = time.monotonic()
        os.kill(int(line.split()[1]), sig)
        try:
            p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pytest.fail(f"mpiexec still running 30 s after {sig.name} to rank 0")
        took = time.monotonic() - t0
        assert took < 15 and p.returncode != 0, (took, p.returncode)
    finally:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        p.wait()


# ------------------------------------------------------- the libfabric diagnostic
_TWO_FABRICS = r"""
import ctypes, sys
from streamcoll._ffi.oneccl import mapped_libfabric
print("none:", repr(mapped_libfabric()))
ctypes.CDLL("libfabric.so.1")      # the system's, by name: what oneCCL's by-name open gets
ctypes.CDLL(sys.argv[1])           # a second copy, by path (the mpich wheel's 2.5)
by_name = ctypes.CDLL("libfabric.so.1").fi_version
by_name.restype = ctypes.c_uint32
n = by_name()
print("by name:", f"{n >> 16}.{n & 0xFFFF}")
print("reported:", mapped_libfabric())
"""


def test_with_two_libfabrics_mapped_the_report_names_the_one_oneccl_gets(venv_bin):
    # mapped_libfabric took the lowest mapping in /proc/self/maps: the copy
    # mapped last (2.5), while a by-name open (oneCCL's) gets the first (1.17).
    wheel = venv_bin.parent / "lib" / "mpich" / "libfabric.so.1"
    if not wheel.exists():
        pytest.skip(f"no {wheel}")
    p = subprocess.run([sys.executable, "-c", _TWO_FABRICS, str(wheel)], cwd=str(ROOT), env=job_env(),
                       capture_output=True, text=True, timeout=60)
    lines = dict(line.split(": ", 1) for line in p.stdout.splitlines() if ": " in line)
    assert lines.get("none") == "''", (p.stdout, p.stderr[-2000:])
    assert lines["reported"].split()[0] == lines["by name"] != "2.5", p.stdout
    assert f"also mapped: {wheel}" in lines["reported"], p.stdout


def _topo(hosts):
    from streamcoll.startup import topology
    facts = [topology.RankFacts(r, h, "M", "N", f"host{h}", 100 + r, None, (0, 1), None) for r, h in enumerate(hosts)]
    return topology.Topology.from_facts(facts, 0)


def test_the_libfabric_cause_only_where_versions_differ_on_one_host():
    from streamcoll.startup.bootstrap import _fabric_cause
    one = _topo(["A", "A"])
    same = {0: "1.17 /usr/lib/libfabric.so.1.20.0", 1: "1.17 /opt/other/libfabric.so.1 (also mapped: /x/libfabric.so.1)"}
    assert _fabric_cause(one, same) == ""  # same version, other paths: not blamed
    assert _fabric_cause(one, {0: "1.17 /a/libfabric.so.1"}) == ""  # a rank that never said
    assert _fabric_cause(one, {0: "1.17 /a/libfabric.so.1", 1: "? /b/libfabric.so.1"}) == ""  # no fi_version
    assert _fabric_cause(one, {0: "", 1: "1.17 /a/libfabric.so.1"}) == ""  # none mapped on rank 0
    assert _fabric_cause(_topo(["A", "B"]), {0: "1.17 /a/libfabric.so.1", 1: "2.5 /b/libfabric.so.1"}) == ""
    why = _fabric_cause(one, {0: "1.17 /a/libfabric.so.1", 1: "2.5 /b/libfabric.so.1"})
    assert "rank(s) 0: libfabric 1.17 (/a/libfabric.so.1)" in why and "rank(s) 1: libfabric 2.5" in why, why


def test_the_report_waits_at_most_its_bound_for_a_rank_that_never_says():
    import torch.distributed as dist
    from streamcoll.startup import bootstrap
    store = dist.HashStore()
    store.set("fabric/1", "1.17 /a/libfabric.so.1")
    t0 = time.monotonic()
    got = bootstrap._fabrics(store, _topo(["A", "A", "A"]), [0, 1, 2])  # rank 2 began, never publishes
    took = time.monotonic() - t0
    assert set(got) == {0, 1} and bootstrap.FABRIC_WAIT <= took < bootstrap.FABRIC_WAIT + 1.5, (got, took)
