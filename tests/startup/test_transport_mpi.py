"""oneCCL over its MPI transport (``CCL_ATL_TRANSPORT=mpi``, issue 35): two
ranks started by an MPI runtime's own ``mpiexec``, ``streamcoll.all_reduce``
against gloo's result for the same inputs, in the same processes, and proof
that the transport really was MPI: ``libmpi.so.12`` is mapped in a process
that never imported mpi4py, and oneCCL's own log (``CCL_LOG_LEVEL=info``)
says ``CCL_ATL_TRANSPORT: mpi``. oneCCL 2022.2 falls back to OFI without a
word above its warning level when it cannot ``dlopen`` libmpi, so a passing
sum alone proves nothing about the transport.

The runtimes are the benchmark venvs (docs/benchmarks.md, "oneCCL's
transport: OFI against MPI"): MPICH from ``benchmarks/setup_mpi.sh``
(``$STREAMCOLL_MPI_VENV``, default ``.venv-mpi``) and Intel MPI, the same
with ``impi-rt`` (``$STREAMCOLL_IMPI_VENV``, default ``.venv-impi``); each
case skips with the reason where its venv is absent. One world per runtime,
about 6-8 s each."""
from __future__ import annotations

import os
import subprocess

import pytest

from conftest import ROOT, needs_oneccl
from world import free_port

VENVS = {
    "mpich": os.environ.get("STREAMCOLL_MPI_VENV") or os.path.join(ROOT, ".venv-mpi"),
    "intel": os.environ.get("STREAMCOLL_IMPI_VENV") or os.path.join(ROOT, ".venv-impi"),
}

WORKER = r"""
import os, sys
import torch, torch.distributed as td
import streamcoll
rank, size = int(os.environ["PMI_RANK"]), int(os.environ["PMI_SIZE"])
td.init_process_group("gloo", init_method="tcp://127.0.0.1:" + os.environ["GLOO_PORT"], rank=rank,
                      world_size=size)
streamcoll.init()
g = torch.Generator().manual_seed(1234 + rank)
for n in (1, 1000, 1 << 18):
    x = torch.randn(n, generator=g)
    a, b = x.clone(), x.clone()
    streamcoll.all_reduce(a)
    td.all_reduce(b)
    if not torch.equal(a, b):
        print(f"MISMATCH n={n} max diff {(a - b).abs().max().item()}", flush=True)
        sys.exit(3)
maps = open("/proc/self/maps").read()
# a file per rank: hydra forwards the ranks' output interleaved, lines may join
with open(f"rank{rank}.txt", "w") as f:
    f.write(f"libmpi mapped={'libmpi.so' in maps} mpi4py={'mpi4py' in sys.modules} OK")
streamcoll.destroy()
td.destroy_process_group()
"""


def _why_not(venv: str) -> str:
    for f in ("bin/mpiexec", "bin/python", "lib/libmpi.so.12"):
        if not os.path.exists(os.path.join(venv, f)):
            return (f"no {f} in {venv} (bash benchmarks/setup_mpi.sh makes the MPICH venv; Intel MPI: "
                    "the same venv recipe with pip install impi-rt, docs/benchmarks.md)")
    return ""


@needs_oneccl
@pytest.mark.timeout(120)
@pytest.mark.parametrize("runtime", sorted(VENVS))
def test_oneccl_over_mpi_matches_gloo(runtime, tmp_path):
    venv = VENVS[runtime]
    why = _why_not(venv)
    if why:
        pytest.skip(why)
    worker = tmp_path / "worker.py"
    worker.write_text(WORKER)
    drop = ("CCL_", "FI_", "I_MPI_", "MASTER_", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
            "TORCHELASTIC", "PMI_", "STREAMCOLL_")
    env = {k: v for k, v in os.environ.items() if not k.startswith(drop)}
    env.update({"PYTHONPATH": os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p),
                "CCL_ATL_TRANSPORT": "mpi", "CCL_MPI_LIBRARY_PATH": os.path.join(venv, "lib", "libmpi.so.12"),
                "CCL_LOG_LEVEL": "info", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
                "GLOO_PORT": str(free_port()), "CCL_KVS_IFACE": "lo", "GLOO_SOCKET_IFNAME": "lo",
                "I_MPI_PIN": "off", "OMP_NUM_THREADS": "1"})
    cmd = [os.path.join(venv, "bin", "mpiexec"), "-n", "2", "-bind-to", "none", os.path.join(venv, "bin", "python"),
           str(worker)]
    try:
        p = subprocess.run(cmd, env=env, cwd=str(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           text=True, timeout=90)
    except subprocess.TimeoutExpired as e:  # pragma: no cover - a hang is the failure being guarded
        out = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        pytest.fail(f"2 ranks under {runtime}'s mpiexec did not finish in 90 s:\n{out[-3000:]}")
    tail = p.stdout[-3000:]
    assert p.returncode == 0, f"exit {p.returncode}:\n{tail}"
    for r in range(2):
        f = tmp_path / f"rank{r}.txt"
        assert f.exists(), f"rank {r} did not finish:\n{tail}"
        assert f.read_text() == "libmpi mapped=True mpi4py=False OK", (r, f.read_text())
    assert "CCL_ATL_TRANSPORT: mpi" in p.stdout, f"oneCCL did not report the MPI transport:\n{tail}"
    assert "fallback to OFI" not in p.stdout, tail


# each rank: refused by streamcoll.init() (exit 0, saying so and after how long) or not (exit 4);
# its rank from the MPI launcher's variable (mpiexec) or torchrun's
REFUSED = r"""
import os, sys, time
import streamcoll
rank = os.environ.get("PMI_RANK", os.environ.get("RANK"))
t0 = time.monotonic()
try:
    streamcoll.init()
except streamcoll.CommunicatorError as e:
    print(f"rank {rank} refused after {time.monotonic() - t0:.1f} s: {e}", flush=True)
    sys.exit(0)
print(f"rank {rank} was not refused", flush=True)
sys.exit(4)
"""


@needs_oneccl
@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", ["torchrun-style launch", "no libmpi"])
def test_the_mpi_transport_is_refused_where_it_cannot_run(case, tmp_path):
    """``CCL_ATL_TRANSPORT=mpi`` where it cannot work raises on every rank
    before oneCCL's init, naming why: ranks not started by an MPI's mpiexec
    (before: with MPICH's libmpi loadable, each rank an MPI world of one, the
    init hung until the watchdog's timeout; Intel MPI's aborted both ranks)
    and a libmpi that does not load (oneCCL falls back to OFI quietly)."""
    venv = VENVS["mpich"]
    lib = os.path.join(venv, "lib", "libmpi.so.12")
    if case == "torchrun-style launch" and _why_not(venv):
        pytest.skip(_why_not(venv))
    worker = tmp_path / "worker.py"
    worker.write_text(REFUSED)
    drop = ("CCL_", "FI_", "I_MPI_", "MASTER_", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
            "TORCHELASTIC", "PMI_", "OMPI_", "PMIX_", "STREAMCOLL_")
    base = {k: v for k, v in os.environ.items() if not k.startswith(drop)}
    base.update({"PYTHONPATH": os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p),
                 "CCL_ATL_TRANSPORT": "mpi", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
                 "WORLD_SIZE": "2", "STREAMCOLL_TIMEOUT": "60"})
    if case == "torchrun-style launch":
        base["CCL_MPI_LIBRARY_PATH"] = lib
        want = "needs the ranks started by that MPI's own mpiexec"
    else:  # started as mpiexec would (its variables), a library path that does not exist
        base.update({"PMI_SIZE": "2", "CCL_MPI_LIBRARY_PATH": str(tmp_path / "libmpi.so.12")})
        want = "does not load"
    procs = []
    for r in range(2):
        env = dict(base, RANK=str(r), LOCAL_RANK=str(r), **({"PMI_RANK": str(r)} if "PMI_SIZE" in base else {}))
        procs.append(subprocess.Popen([os.environ.get("PYTHON", "python3"), str(worker)], env=env, cwd=str(tmp_path),
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=60)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for r, (p, out) in enumerate(zip(procs, outs)):
        assert p.returncode == 0 and f"rank {r} refused" in out and want in out, (r, p.returncode, out[-2000:])


@needs_oneccl
@pytest.mark.timeout(120)
def test_a_libmpi_missing_on_one_rank_only_is_refused_on_every_rank_at_once(tmp_path):
    """Two ranks under MPICH's mpiexec (MPMD), the library loading on rank
    0 and not on rank 1 (a host without it: the case the load check is for).
    Rank 0's check passes inside the rendezvous, rank 1's fails after it:
    before, rank 1 raised and rank 0 went into oneCCL's init and waited for
    it until the watchdog's timeout (exit 86, blaming the network)."""
    venv = VENVS["mpich"]
    if _why_not(venv):
        pytest.skip(_why_not(venv))
    worker = tmp_path / "worker.py"
    worker.write_text(REFUSED)
    drop = ("CCL_", "FI_", "I_MPI_", "MASTER_", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
            "TORCHELASTIC", "PMI_", "STREAMCOLL_")
    env = {k: v for k, v in os.environ.items() if not k.startswith(drop)}
    env.update({"PYTHONPATH": os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p),
                "CCL_ATL_TRANSPORT": "mpi", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
                "CCL_KVS_IFACE": "lo", "STREAMCOLL_TIMEOUT": "60", "OMP_NUM_THREADS": "1"})
    py, mpiexec = os.path.join(venv, "bin", "python"), os.path.join(venv, "bin", "mpiexec")
    cmd = [mpiexec, "-n", "1", "-env", "CCL_MPI_LIBRARY_PATH", os.path.join(venv, "lib", "libmpi.so.12"), py,
           str(worker), ":", "-n", "1", "-env", "CCL_MPI_LIBRARY_PATH", str(tmp_path / "libmpi.so.12"), py, str(worker)]
    try:
        p = subprocess.run(cmd, env=env, cwd=str(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           text=True, timeout=40)
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        pytest.fail(f"not refused on every rank within 40 s (a rank waits in oneCCL's init for the refused one):\n"
                    f"{out[-3000:]}")
    out = p.stdout
    assert p.returncode == 0, f"exit {p.returncode}:\n{out[-3000:]}"
    for r in range(2):
        assert f"rank {r} refused" in out, out[-3000:]
    assert "rank 1" in out.split("rank 0 refused", 1)[1].split("\n", 1)[0], out[-3000:]  # rank 0 names rank 1
    assert out.count("does not load") >= 2, out[-3000:]
