"""Adversarial review of issue 45 ("beyond one job"): ``store="host:port"``
(:func:`streamcoll.startup.rendezvous.store_at`) and the first-communicator
rule. Each test runs real processes over real oneCCL on loopback, every one
with a timeout, killed (by session) at the end.
"""
from __future__ import annotations

import json
import sys
import time
from typing import Dict, List, Optional, Tuple

import pytest

from conftest import needs_oneccl
from world import Processes, bare_env, free_port

pytestmark = [needs_oneccl]

_MEMBER = r"""
import json, os, sys, time
import torch
import streamcoll
addr, rank, ws, names, tmo = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4].split(","), float(sys.argv[5])
gate = sys.argv[6] if len(sys.argv) > 6 else ""
how = os.environ.get("MEMBER_STORE", "address")  # or "object": a TCPStore at addr (rank 0 hosts it); "pg": that
store = addr                                     # store given to init_process_group("streamcoll")
if how != "address":
    from datetime import timedelta
    import torch.distributed as dist
    host, port = addr.rsplit(":", 1)
    store = dist.TCPStore(host, int(port), None, rank == 0, timedelta(seconds=60), wait_for_workers=False)
for i, name in enumerate(names):
    if i and gate:  # the second communicator: once the test says so
        while not os.path.exists(gate):
            time.sleep(0.05)
    t0 = time.monotonic()
    res = {"name": name}
    try:
        t = torch.ones(4) * (rank + 1)
        if how == "pg":
            dist.init_process_group("streamcoll", store=store, rank=rank, world_size=ws, timeout=timedelta(seconds=tmo))
            dist.all_reduce(t)
        else:
            c = streamcoll.new_communicator(backend="oneccl", device="cpu", store=store, rank=rank, world_size=ws,
                                            name=name, timeout=tmo)
            c.all_reduce(t)
        res["sum"] = t.tolist()
    except Exception as e:
        res["error"] = f"{type(e).__name__}: {e}"[:800]
    res["took"] = round(time.monotonic() - t0, 2)
    print("RESULT " + json.dumps(res), flush=True)
"""


def _env(extra: Optional[Dict[str, str]] = None) -> Dict[str, str]:
    e = bare_env()
    for k in list(e):
        if k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "GROUP_RANK",
                 "TORCHELASTIC_RUN_ID") or k.startswith(("SLURM_", "PMI_", "OMPI_", "PMIX_")):
            del e[k]
    e.update(extra or {})
    return e


def _results(ps: Processes, name: str) -> List[dict]:
    return [json.loads(line[len("RESULT "):]) for line in ps.text(name).splitlines() if line.startswith("RESULT ")]


def _member(tmp_path, ps: Processes, addr: str, rank: int, ws: int, names: str, timeout: float, out: str,
            extra: Optional[Dict[str, str]] = None, gate: str = ""):
    job = tmp_path / "member.py"
    if not job.exists():
        job.write_text(_MEMBER)
    argv = [sys.executable, str(job), addr, str(rank), str(ws), names, str(timeout)] + ([gate] if gate else [])
    return ps.start(argv, _env(extra), out)


# ------------------------------------------------------------- store="host:port"
SRUN_STEP = {"SLURM_PROCID": "0", "SLURM_STEP_ID": "0", "SLURM_NTASKS": "1", "SLURM_JOB_ID": "4242",
             "SLURM_LOCALID": "0", "SLURM_NODEID": "0", "SLURM_TASKS_PER_NODE": "1"}


@pytest.mark.parametrize("how", ["address", "object", "pg"])
def test_a_member_started_by_srun_meets_a_server_started_with_python(tmp_path, how):
    """The weight-sync shape under SLURM: the trainer's rank 0 is a task of
    an srun step (one task here: its variables), the server a plain
    ``python``; both pass ``store="127.0.0.1:port"``, rank= and world_size=
    (``address``), or a TCPStore there that rank 0 hosts (``object``), or
    that store to ``init_process_group("streamcoll", store=...)`` (``pg``).
    Their rendezvous must meet. Before, with a store object the srun task
    led its keys with its job's scope (``slurm4242.0/``), the server did
    not: both timed out."""
    got, logs = _task_and_server(tmp_path, how, SRUN_STEP, 60)
    for r, res in enumerate(got):
        assert res and "error" not in res[0] and res[0]["sum"] == [3.0] * 4, (r, res, logs)


def _task_and_server(tmp_path, how: str, step: Dict[str, str], wait: float) -> Tuple[List[List[dict]], str]:
    """An srun task (``step``: its fake SLURM variables) as rank 0 and a
    server started with python as rank 1 of a 2-process world meeting
    through ``how`` (``MEMBER_STORE``), timeout 8 s: each one's results and
    the tails of their logs."""
    addr = f"127.0.0.1:{free_port()}"
    tcp = dict(CCL_ATL_SHM="0", FI_PROVIDER="tcp", MEMBER_STORE=how)
    ps = Processes(str(tmp_path))
    try:
        _member(tmp_path, ps, addr, 0, 2, "weights", 8, "trainer.out", dict(step, **tcp))
        _member(tmp_path, ps, addr, 1, 2, "weights", 8, "server.out", tcp)
        ps.wait_all(wait)
        got = [_results(ps, "trainer.out"), _results(ps, "server.out")]
        return got, ps.text("trainer.out")[-1500:] + ps.text("server.out")[-1500:]
    finally:
        ps.kill()


def test_a_restarted_store_host_at_the_same_address_is_met_again(tmp_path):
    """Process B (rank 1) met a host A at the address, A exited, a new host
    C (rank 0) serves the address again: B's next ``new_communicator`` there
    must reach C, not fail on the connection to the A that is gone."""
    addr = f"127.0.0.1:{free_port()}"
    gate = str(tmp_path / "go")
    tcp = dict(CCL_ATL_SHM="0", FI_PROVIDER="tcp")
    ps = Processes(str(tmp_path))
    try:
        b = _member(tmp_path, ps, addr, 1, 2, "w1,w2", 10, "b.out", tcp, gate=gate)
        a = _member(tmp_path, ps, addr, 0, 2, "w1", 10, "a.out", tcp)
        a.wait(60)
        (tmp_path / "go").write_text("1")
        c = _member(tmp_path, ps, addr, 0, 2, "w2", 10, "c.out", tcp)
        c.wait(60)
        b.wait(30)
        res_b, res_c = _results(ps, "b.out"), _results(ps, "c.out")
        assert len(res_b) == 2 and res_b[0].get("sum") == [3.0] * 4, res_b
        assert "error" not in res_b[1] and res_b[1]["sum"] == [3.0] * 4, (res_b, res_c)
        assert res_c and res_c[0].get("sum") == [3.0] * 4, res_c
    finally:
        ps.kill()


_LISTENER = r"""
import socket, sys, time
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("127.0.0.1", int(sys.argv[1]))); s.listen(16)
print("LISTENING", flush=True)
conns = []
while True:
    c, _ = s.accept(); conns.append(c)  # accepts, never answers: not a store
"""


def test_a_port_held_by_a_process_that_is_no_store_fails_within_the_timeout(tmp_path):
    """Something else (not a torch store) listens at the address: rank 0
    cannot host there and connects as a client; it must fail within its
    ``timeout=`` (5 s) with a RendezvousError naming the address, not wait
    for as long as that process lives."""
    port = free_port()
    (tmp_path / "listen.py").write_text(_LISTENER)
    ps = Processes(str(tmp_path))
    try:
        ps.start([sys.executable, str(tmp_path / "listen.py"), str(port)], _env(), "listener.out")
        deadline = time.monotonic() + 30
        while "LISTENING" not in ps.text("listener.out") and time.monotonic() < deadline:
            time.sleep(0.05)
        t0 = time.monotonic()
        m = _member(tmp_path, ps, f"127.0.0.1:{port}", 0, 1, "w", 5, "member.out")
        while m.poll() is None and time.monotonic() - t0 < 40:
            time.sleep(0.1)
        took = time.monotonic() - t0
        res = _results(ps, "member.out")
        assert res and "RendezvousError" in res[0].get("error", "") and f"127.0.0.1:{port}" in res[0]["error"], (
            took, res, ps.text("member.out")[-1500:])
        assert res[0]["took"] < 12, res
    finally:
        ps.kill()


def test_a_store_that_is_neither_a_store_nor_an_address_is_a_value_error_naming_store():
    import streamcoll
    for bad in (29500, b"127.0.0.1:29500", object()):
        with pytest.raises(ValueError, match="store"):
            streamcoll.new_communicator(backend="oneccl", device="cpu", store=bad, rank=1, world_size=2, timeout=2)


# ------------------------------------------------------------- mpi4py's finalize under mpiexec
_MPI_USER = r"""
import atexit, json, sys
from mpi4py import MPI  # a program that uses MPI loads it before streamcoll (docs/failures.md, "one libfabric")


def goodbye():  # the program's own exit handler, registered first: MPI is still the program's at exit
    from mpi4py import MPI
    MPI.COMM_WORLD.barrier()
    print("GOODBYE BARRIER", MPI.COMM_WORLD.Get_rank(), flush=True)


atexit.register(goodbye)
import torch, streamcoll
c = streamcoll.init()
t = torch.ones(4) * (c.rank + 1)
c.all_reduce(t)
print(json.dumps({"rank": c.rank, "sum": t.tolist()}), flush=True)
"""


@pytest.mark.launchers
def test_a_programs_own_exit_handler_may_still_use_mpi_under_mpiexec(tmp_path):
    """mpi4py finalises MPI after every atexit handler (Py_AtExit): an exit
    handler the program registered before ``streamcoll.init()`` may use
    MPI (measured: with MPI4PY_RC_FINALIZE=true, streamcoll's deferral off,
    both ranks print GOODBYE BARRIER and mpiexec exits 0). The program
    imports mpi4py first: streamcoll loads no MPI under hydra (its PMI finds
    rank 0), and MPI imported after oneCCL loaded the system's libfabric
    does not load (the mpich wheel's libmpi needs FABRIC_1.9)."""
    from launching import VENV, job_env, venv_why_not
    why = venv_why_not()
    if why:
        pytest.skip(why)
    prog = tmp_path / "user.py"
    prog.write_text(_MPI_USER)
    ps = Processes(str(tmp_path))
    try:
        p = ps.start([str(VENV / "bin" / "mpiexec"), "-n", "2", str(VENV / "bin" / "python"), str(prog)],
                     job_env(VENV / "bin"), "mpiexec.out")
        ps.wait_all(180)
        out = ps.text("mpiexec.out")
        assert p.returncode == 0, (p.returncode, out[-3000:])
        assert out.count("GOODBYE BARRIER") == 2 and "after finalizing" not in out, out[-3000:]
    finally:
        ps.kill()


# ------------------------------------------------------------- the first-communicator rule
_DISAGREE = r"""
import json, os, sys, time
import torch
import streamcoll
rank = int(os.environ["RANK"])
w = streamcoll.init(backend="oneccl", device="cpu", timeout=30)
t = torch.ones(2)
w.all_reduce(t)
res = {"world": t.tolist()}
if rank == 1:
    streamcoll.destroy()  # rank 1 destroyed all its oneCCL communicators, rank 0 keeps the world's
t0 = time.monotonic()
if rank in (0, 1):
    try:
        c = streamcoll.new_communicator(backend="oneccl", device="cpu", store=sys.argv[1], rank=rank, world_size=2,
                                        name="pair", timeout=8)
        u = torch.ones(2)
        c.all_reduce(u)
        res["pair"] = u.tolist()
    except Exception as e:
        res["error"] = f"{type(e).__name__}: {e}"[:400]
res["took"] = round(time.monotonic() - t0, 2)
print("RESULT " + json.dumps(res), flush=True)
"""


def test_a_rank_that_destroyed_its_communicators_is_refused_on_every_member(tmp_path):
    """3 ranks (torchrun's variables), the world's communicator first;
    rank 1 destroys it, rank 0 does not; ranks 0 and 1 then make a pair
    (a sub-world communicator, shared memory in effect). streamcoll refuses
    it on rank 1 (oneCCL remakes rank 1's transport from the pair): every
    member must refuse at once, not rank 0 enter the native init alone."""
    prog = tmp_path / "disagree.py"
    prog.write_text(_DISAGREE)
    master, port = free_port(), free_port()
    ps = Processes(str(tmp_path))
    try:
        for r in range(3):
            e = _env(dict(RANK=str(r), WORLD_SIZE="3", LOCAL_RANK=str(r), LOCAL_WORLD_SIZE="3",
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(master)))
            ps.start([sys.executable, str(prog), f"127.0.0.1:{port}"], e, f"rank{r}.out")
        ps.wait_all(90)
        res = [_results(ps, f"rank{r}.out") for r in range(2)]
        logs = "\n".join(ps.text(f"rank{r}.out")[-1500:] for r in range(2))
        for r in (0, 1):
            assert res[r] and "CommunicatorError" in res[r][0].get("error", ""), (r, res, logs)
            assert res[r][0]["took"] < 4, (r, res)
    finally:
        ps.kill()


_MESH = r"""
import json, os, sys
from datetime import timedelta
import torch, torch.distributed as dist
import streamcoll
from streamcoll.startup import env_defaults as env
r = int(os.environ["RANK"])
dist.init_process_group("streamcoll", timeout=timedelta(seconds=20))
g02, g13 = dist.new_group([0, 2]), dist.new_group([1, 3])
g01, g23 = dist.new_group([0, 1]), dist.new_group([2, 3])
res = {}
try:
    t = torch.ones(2) * (r + 1)
    dist.all_reduce(t, group=g02 if r in (0, 2) else g13)
    res["dim0"] = t.tolist()
    res["in_effect"] = [env.in_effect().get("CCL_ATL_SHM"), env.in_effect().get("FI_PROVIDER")]
    u = torch.ones(2) * (r + 1)
    dist.all_reduce(u, group=g01 if r in (0, 1) else g23)
    res["dim1"] = u.tolist()
except Exception as e:
    res["error"] = f"{type(e).__name__}: {e}"[:400]
print("RESULT " + json.dumps(res), flush=True)
dist.barrier(group=dist.new_group(backend="gloo"))
"""


def test_a_mesh_over_two_hosts_with_lazy_init_forms_its_second_dimension(tmp_path):
    """4 ranks on 2 (simulated: GROUP_RANK) hosts, ``STREAMCOLL_EAGER_INIT=0``:
    the first communicators are the dimension [0,2]/[1,3], which streamcoll
    runs over TCP across hosts (its own default there: CCL_ATL_SHM=0,
    FI_PROVIDER unset, design.md); the second dimension [0,1]/[2,3] must
    form, not be refused as 'shared memory' (with the rule bypassed it
    forms and sums right)."""
    prog = tmp_path / "mesh.py"
    prog.write_text(_MESH)
    master = free_port()
    ps = Processes(str(tmp_path))
    try:
        for r in range(4):
            e = _env(dict(RANK=str(r), WORLD_SIZE="4", LOCAL_RANK=str(r % 2), LOCAL_WORLD_SIZE="2",
                          GROUP_RANK=str(r // 2), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(master),
                          STREAMCOLL_EAGER_INIT="0"))
            ps.start([sys.executable, str(prog)], e, f"rank{r}.out")
        ps.wait_all(120)
        res = [_results(ps, f"rank{r}.out") for r in range(4)]
        for r in range(4):
            assert res[r] and res[r][0].get("in_effect") == ["0", None], (r, res[r])
            assert "error" not in res[r][0], (r, res[r])
            assert res[r][0]["dim1"] == [3.0, 3.0] if r < 2 else [7.0, 7.0], (r, res[r])
    finally:
        ps.kill()


_NODES = r"""
import json, os, sys
import torch
import streamcoll
addr, role = sys.argv[1], sys.argv[2]
res = {}
if role == "trainer":
    rank = int(os.environ["RANK"])
    w = streamcoll.init(backend="oneccl", device="cpu", timeout=30)
    t = torch.ones(2)
    w.all_reduce(t)
    res["world_hosts"] = [list(h.ranks) for h in w.topology.layout.hosts]
else:
    rank = 2
try:
    c = streamcoll.new_communicator(backend="oneccl", device="cpu", store=addr, rank=rank, world_size=3,
                                    name="weights", timeout=10)
    u = torch.ones(2) * (rank + 1)
    c.all_reduce(u)
    res["weights"] = u.tolist()
    res["hosts"] = [list(h.ranks) for h in c.topology.layout.hosts]
except Exception as e:
    res["error"] = f"{type(e).__name__}: {e}"[:400]
print("RESULT " + json.dumps(res), flush=True)
"""


def test_a_trainer_over_two_hosts_and_a_server_beside_it_meet_with_the_defaults(tmp_path):
    """The trainer's world: 2 ranks on 2 (simulated: GROUP_RANK) hosts, one
    each, so oneCCL runs without shared memory (CCL_ATL_SHM, FI_PROVIDER
    unset); a server (plain python, same identity) joins a 3-rank
    communicator with them: one host (several jobs), and it forms (with
    the rule bypassed it did: [6.0, 6.0] on every member)."""
    prog = tmp_path / "nodes.py"
    prog.write_text(_NODES)
    master, port = free_port(), free_port()
    addr = f"127.0.0.1:{port}"
    ps = Processes(str(tmp_path))
    try:
        for r in range(2):
            e = _env(dict(RANK=str(r), WORLD_SIZE="2", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", GROUP_RANK=str(r),
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(master)))
            ps.start([sys.executable, str(prog), addr, "trainer"], e, f"rank{r}.out")
        ps.start([sys.executable, str(prog), addr, "server"], _env(), "rank2.out")
        ps.wait_all(90)
        res = [_results(ps, f"rank{r}.out") for r in range(3)]
        for r in range(3):
            assert res[r] and "error" not in res[r][0] and res[r][0]["weights"] == [6.0, 6.0], (r, res[r])
            assert res[r][0]["hosts"] == [[0, 1, 2]], (r, res[r])
        assert res[0][0]["world_hosts"] == [[0], [1]], res[0]
    finally:
        ps.kill()


# ------------------------------------------------- the job scope (review 45)
def _step_task_and_server(tmp_path) -> List[dict]:
    """A 2-task srun step's task 0 (fake SLURM variables) and a server
    started with python form a 2-process world through
    ``init_process_group(store=TCPStore)``, timeout 8 s: each one's result."""
    got, logs = _task_and_server(tmp_path, "pg", dict(SRUN_STEP, SLURM_NTASKS="2", SLURM_TASKS_PER_NODE="2"), 90)
    assert all(got), logs
    return [g[0] for g in got]


def test_a_world_of_the_steps_size_with_an_outside_member_ends_within_its_timeout(tmp_path):
    """Known limitation, measured: the world's size equals the step's, so the
    task leads its keys with ``slurm4242.0/``; the server (no SLURM
    variable) does not: they never meet. Every member must still end within
    its timeout (measured: both at 7.7-8.3 s, CollectiveTimeout, or on the
    server a RendezvousError when the store's host, the task, ended first)."""
    for r, res in enumerate(_step_task_and_server(tmp_path)):
        assert res["took"] < 30, (r, res)
        assert ("error" not in res and res["sum"] == [3.0] * 4) or res["error"].startswith(("CollectiveTimeout", "RendezvousError")), (r, res)


@pytest.mark.xfail(strict=True, reason="the members disagree about the job scope (the task's world has the step's "
                   "size, the server has no SLURM variable); the timeout names the missing rank and MASTER_ADDR/"
                   "MASTER_PORT, never the scope (slurm4242.0/) nor job_scoped=False: the user cannot tell why")
def test_a_world_of_the_steps_size_with_an_outside_member_names_the_scope(tmp_path):
    for r, res in enumerate(_step_task_and_server(tmp_path)):
        assert ("error" not in res and res["sum"] == [3.0] * 4) or "slurm4242.0" in res["error"], (r, res)


_STEP_MEMBER = r"""
import json, os, sys, time
import torch, streamcoll
addr, rank, step = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
res = {"step": step, "rank": rank}
try:
    c = streamcoll.new_communicator(backend="oneccl", device="cpu", store=addr, rank=rank, world_size=2, timeout=15)
    t = torch.tensor([float(10 * step + rank + 1)])
    c.all_reduce(t)
    res["sum"] = t.item()
except Exception as e:
    res["error"] = f"{type(e).__name__}: {e}"[:600]
print("RESULT " + json.dumps(res), flush=True)
"""


@pytest.mark.xfail(strict=True, reason="a store given is shared by whoever passed it (no job scope): two srun steps "
                   "whose ports collide and that both pass the launcher's store address to new_communicator pair "
                   "their ranks by arrival order in streamcoll/comm/2/made, across steps")
def test_two_colliding_steps_passing_one_store_never_mix(tmp_path):
    """Two 2-task srun steps (jobs 4242 and 4343, fake SLURM variables)
    whose rendezvous ports collide: all four pass that address as
    ``store=`` to ``new_communicator`` (rank, world_size=2). Arriving in the
    order A0, B1, A1, B0, each step's sum must be its own (3 and 23), or
    every member fail naming the other job; never a sum across steps."""
    addr = f"127.0.0.1:{free_port()}"
    job = tmp_path / "step_member.py"
    job.write_text(_STEP_MEMBER)
    ps = Processes(str(tmp_path))
    outs = []
    try:
        for step, rank in ((0, 0), (1, 1), (0, 1), (1, 0)):
            env = dict(SRUN_STEP, SLURM_JOB_ID=str(4242 + 101 * step), SLURM_PROCID=str(rank), SLURM_NTASKS="2",
                       SLURM_TASKS_PER_NODE="2", SLURM_LOCALID=str(rank), CCL_ATL_SHM="0", FI_PROVIDER="tcp")
            out = f"s{step}r{rank}.out"
            outs.append(out)
            ps.start([sys.executable, str(job), addr, str(rank), str(step)], _env(env), out)
            time.sleep(4)  # import and reach the rendezvous before the next one starts
        ps.wait_all(90)
        res = [(_results(ps, o) or [{}])[0] for o in outs]
        for r in res:
            assert r and ("error" in r or r["sum"] == 3.0 + 20 * r["step"]), res
    finally:
        ps.kill()
