"""A communicator between processes of different jobs (issue 45, the
weight-sync shape): a trainer under real torchrun (2 ranks, its own
streamcoll world first) and a server started with plain ``python`` make one
3-rank communicator through a TCPStore the trainer's rank 0 hosts; rank 0
broadcasts the weights. Each process then does the same broadcast through
gloo (``ProcessGroupGloo`` on a PrefixStore of that store): the reference.

- With oneCCL's default shared-memory transport the trainer's ranks can
  reach only their first communicator's members (oneCCL made its transport
  for them): every member refuses at once, naming why and the way out, and
  the trainer's world goes on working. Before: all three hung until the
  timeout and blamed "a rank that cannot reach rank 0's bootstrap address"
  on "2 hosts".
- Every process started with ``CCL_ATL_SHM=0 FI_PROVIDER=tcp``: the weights
  arrive on all three, equal to gloo's, in both start orders; the members
  are one host.
- The shared communicator each process's first (the trainer skips its
  world): works with the defaults.

Plus the pure rules (:func:`streamcoll.startup.env_defaults.agree`,
:func:`streamcoll.startup.topology.compute`) on hand-made facts.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from typing import Dict, List, Optional

import pytest

from conftest import needs_oneccl
from world import Processes, bare_env, free_port
from streamcoll.startup import env_defaults as env, topology

_JOB = r"""
import json, os, socket, sys, time
from datetime import timedelta
import torch, torch.distributed as dist
import streamcoll
role, port, out, world_first = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4] == "1"
address = len(sys.argv) > 5 and sys.argv[5] == "address"  # store="127.0.0.1:port", else a TCPStore object
res = {}
if role == "trainer":
    streamcoll.launchers.adopt()  # torchrun's variables from mpiexec's or srun's (a no-op under torchrun)
    rank = int(os.environ["RANK"])
    if world_first:
        dist.init_process_group("streamcoll", timeout=timedelta(seconds=30))
        t = torch.ones(4); dist.all_reduce(t); res["world"] = t.tolist()
else:
    rank = 2
open(os.path.join(out, f"ready{rank}"), "w").close()  # about to meet the others (_run's after_ready)
if not address:  # the trainer's rank 0 hosts it
    end = time.monotonic() + 60
    while rank != 0 and time.monotonic() < end:  # torch's client backs off for seconds once refused: poll
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            time.sleep(0.05)
    store = dist.TCPStore("127.0.0.1", port, 3, rank == 0, timedelta(seconds=60), wait_for_workers=False)
def weights():
    return torch.arange(4096, dtype=torch.float32) * 0.5 + 1 if rank == 0 else torch.zeros(4096)
t0 = time.monotonic()
try:
    c = streamcoll.new_communicator(backend="oneccl", device="cpu", store=f"127.0.0.1:{port}" if address else store,
                                    rank=rank, world_size=3, name="weights",
                                    timeout=float(os.environ.get("JOB_TIMEOUT", "20")))
    w = weights()
    c.broadcast(w, src=0)
    res["weights"] = w.tolist()[:8] + [float(w.sum())]
    res["hosts"] = [list(h.ranks) for h in c.topology.layout.hosts]
except Exception as e:
    res["error"] = f"{type(e).__name__}: {e}"
res["took"] = time.monotonic() - t0
if address:  # the store the address names (rank 0 hosts it): the one new_communicator met through
    from streamcoll.startup.rendezvous import store_at
    store = store_at(f"127.0.0.1:{port}", rank, 3, 60)
g = dist.ProcessGroupGloo(dist.PrefixStore("gloo", store), rank, 3, timedelta(seconds=30))
w = weights()
g.broadcast([w]).wait()
res["gloo"] = w.tolist()[:8] + [float(w.sum())]
if world_first:
    t = torch.ones(4); dist.all_reduce(t); res["world_after"] = t.tolist()
maps = open("/proc/self/maps").read().split("\n")
res["libfabric"] = sorted({os.path.realpath(l.split()[-1]) for l in maps if "libfabric.so" in l})
res["libmpi"] = any("libmpi.so" in l for l in maps)
with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
    json.dump(res, f)
store.add("done", 1)  # the store's host (trainer rank 0) stays until every member wrote
end = time.monotonic() + 30
while int(store.add("done", 0)) < 3 and time.monotonic() < end:
    time.sleep(0.05)
"""

TCP = {"CCL_ATL_SHM": "0", "FI_PROVIDER": "tcp"}


def _run(tmp_path, first: str, world_first: bool, extra: Dict[str, str], delay: float = 2.0,
         launcher: str = "torchrun", store: str = "object", slurm_conf: str = "", after_ready: bool = False,
         trainer_extra: Optional[Dict[str, str]] = None, codes: Optional[List[int]] = None) -> List[dict]:
    """The trainer (2 ranks under ``launcher``: torchrun, mpiexec from the
    launchers venv, or srun on the one-node SLURM whose ``slurm_conf`` is
    given) and the server (python), ``first`` started ``delay`` s before the
    other (``after_ready``: ``delay`` s after the first is ready to meet,
    its world made: srun's start takes seconds), meeting through ``store``:
    a TCPStore ``object`` the trainer's rank 0 hosts, or an ``address``
    (``store="127.0.0.1:port"``); ``trainer_extra``: the trainer's
    environment only. Every member's result (``codes``: the exit codes
    expected instead, the trainer's launcher first; then no results)."""
    job = tmp_path / "job.py"
    job.write_text(_JOB)
    port, master = free_port(), free_port()
    e = bare_env()
    e.update(extra)
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "GROUP_RANK"):
        e.pop(k, None)
    ps = Processes(str(tmp_path))
    args = [str(job), "trainer", str(port), str(tmp_path), "1" if world_first else "0", store]
    slurm_job = f"streamcoll-cross-job-{port}"
    if launcher == "mpiexec":
        from launching import VENV, job_env
        te = job_env(VENV / "bin", **extra)
        trainer = [str(VENV / "bin" / "mpiexec"), "-n", "2", str(VENV / "bin" / "python")] + args
    elif launcher == "srun":  # the server's environment, srun's own SLURM_* only; 2 minutes at most
        te = {k: v for k, v in e.items() if not k.startswith(("SLURM_", "PMI_", "OMPI_", "PMIX_"))}
        te["SLURM_CONF"] = slurm_conf
        trainer = ["srun", "-n", "2", "--kill-on-bad-exit=1", "--time=2", f"--job-name={slurm_job}",
                   sys.executable] + args
    else:
        te = e
        trainer = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr",
                   "127.0.0.1", "--master-port", str(master)] + args
    te = {**te, **(trainer_extra or {})}
    server = [sys.executable, str(job), "server", str(port), str(tmp_path), "0", store]
    order = [(trainer, te, "trainer.out"), (server, e, "server.out")]
    if first == "server":
        order.reverse()
    try:
        ps.start(order[0][0], order[0][1], order[0][2])
        ready = [tmp_path / f"ready{r}" for r in ((0, 1) if first == "trainer" else (2,))]
        deadline = time.monotonic() + 60
        while after_ready and not all(p.exists() for p in ready) and time.monotonic() < deadline \
                and ps.procs[0].poll() is None:
            time.sleep(0.05)
        time.sleep(delay)
        ps.start(order[1][0], order[1][1], order[1][2])
        ps.wait_all(90)
        logs = "\n".join(f"--- {n}\n" + (tmp_path / n).read_text()[-3000:] for n in ("trainer.out", "server.out"))
        if codes is not None:
            got = [ps.procs[i].returncode for i in ((0, 1) if first == "trainer" else (1, 0))]
            assert got == codes, (got, logs)
            return []
        out = []
        for r in range(3):
            p = tmp_path / f"rank{r}.json"
            assert p.exists(), f"rank {r} wrote no result\n{logs}"
            out.append(json.loads(p.read_text()))
        assert all(p.returncode == 0 for p in ps.procs), logs
        return out
    finally:
        ps.kill()
        if launcher == "srun":  # srun's tasks are slurmstepd's children, outside srun's session
            subprocess.run(["scancel", f"--name={slurm_job}"], env=te, capture_output=True, timeout=30)


@needs_oneccl
def test_shared_memory_members_of_another_first_communicator_refuse_at_once(tmp_path):
    res = _run(tmp_path, "trainer", True, {})
    for r, x in enumerate(res):
        assert "error" in x, (r, x)
        assert "CommunicatorError" in x["error"] and "CCL_ATL_SHM=0 FI_PROVIDER=tcp" in x["error"], (r, x)
        assert "ranks 0, 1 run oneCCL with shared memory" in x["error"] and "rank 2 of this one" in x["error"], x
        assert x["took"] < (2.0 if r == 2 else 4.5), (r, x)  # the trainer's ranks waited up to 2 s for the server
        assert x["gloo"][-1] == sum(i * 0.5 + 1 for i in range(4096)), x
    for x in res[:2]:
        assert x["world"] == x["world_after"] == [2.0] * 4, x  # the trainer's own world keeps working


@needs_oneccl
@pytest.mark.parametrize("first", ["trainer", "server"])
def test_weights_over_tcp_in_both_start_orders_equal_to_gloo(tmp_path, first):
    res = _run(tmp_path, first, True, TCP)
    for r, x in enumerate(res):
        assert "error" not in x, (r, x)
        assert x["weights"] == x["gloo"], (r, x)
        assert x["hosts"] == [[0, 1, 2]], (r, x)  # one host: the node tells hosts apart inside one job only
    late = [2] if first == "trainer" else [0, 1]
    for r in late:
        assert res[r]["took"] < 5.0, (r, res[r])
    for x in res[:2]:
        assert x["world"] == x["world_after"] == [2.0] * 4, x


@needs_oneccl
def test_a_trainer_under_mpiexec_and_a_server(tmp_path):
    """The trainer under MPICH's mpiexec (rank 0 found through hydra's PMI),
    the server with python: the same weights as gloo's, one host. Before:
    mpi4py's MPI_Init mapped the mpich wheel's libfabric (2.5.1) into the
    trainer, oneCCL ran on it, the server's oneCCL on the system's (1.17),
    and every member stayed in the native init until its timeout."""
    from launching import venv_why_not
    why = venv_why_not()
    if why:
        pytest.skip(why)
    res = _run(tmp_path, "trainer", True, TCP, launcher="mpiexec")
    for r, x in enumerate(res):
        assert "error" not in x and x["weights"] == x["gloo"] and x["hosts"] == [[0, 1, 2]], (r, x)
    # one libfabric in all three: no MPI library (nor its libfabric) in the trainer's ranks
    assert all(x["libfabric"] == res[2]["libfabric"] and len(x["libfabric"]) == 1 for x in res), res
    assert not any(x["libmpi"] for x in res), res


@needs_oneccl
def test_ranks_on_different_libfabric_versions_never_meet_and_the_report_says_why(tmp_path):
    """The cause the mpiexec trainer hit, pinned under torchrun: the
    trainer's ranks run oneCCL on the mpich wheel's libfabric (2.5, on
    LD_LIBRARY_PATH, as mpi4py's MPI_Init mapped it), the server on the
    system's (1.17): the 3-rank init never finishes; at its timeout (5 s
    here) the report of rank 0 (which waits for the others') names both. The same with the
    server on the wheel's libfabric too: the weights arrive."""
    from launching import VENV
    wheel = VENV / "lib" / "mpich"
    if not (wheel / "libfabric.so.1").exists():
        pytest.skip(f"no mpich wheel libfabric at {wheel} (bash scripts/setup_launchers.sh)")
    from streamcoll._ffi.oneccl import mapped_libfabric
    import ctypes
    ctypes.CDLL("libfabric.so.1")  # the system's, as a plain process loads it (this test process is one)
    system = mapped_libfabric().split(" ", 1)[0]
    if system == "2.5" or not system:
        pytest.skip(f"the system's libfabric is {system or 'absent'}: no second version to meet")
    t0 = time.monotonic()
    _run(tmp_path, "trainer", True, dict(TCP, JOB_TIMEOUT="5"), trainer_extra={"LD_LIBRARY_PATH": str(wheel)},
         codes=[1, 86])  # the watchdog's exit code (torchrun: 1)
    assert time.monotonic() - t0 < 40
    # rank 0's report (it hosts the store: the others' may come after it is gone) waits for every rank's
    logs = (tmp_path / "trainer.out").read_text()
    cause = "the ranks run oneCCL on different libfabric versions ("
    assert cause in logs, logs[-6000:]
    assert f"rank(s) 0, 1: libfabric 2.5 ({wheel}/libfabric.so.1)" in logs, logs[-6000:]
    assert f"rank(s) 2: libfabric {system} (" in logs, logs[-6000:]
    (tmp_path / "same").mkdir()
    both = _run(tmp_path / "same", "trainer", True, dict(TCP, LD_LIBRARY_PATH=str(wheel)))
    for r, x in enumerate(both):
        assert "error" not in x and x["weights"] == x["gloo"], (r, x)


@pytest.fixture(scope="module")
def slurm():
    """The one-node SLURM (scripts/slurm_local.sh), stopped after the module."""
    from launching import slurm_start, slurm_stop
    yield slurm_start()
    slurm_stop()


def _check_srun(res: List[dict], first: str) -> None:
    print(f"{first} first: new_communicator + broadcast took " + ", ".join(f"rank {r} {x.get('took', -1):.2f} s"
                                                                        for r, x in enumerate(res)))
    for r, x in enumerate(res):
        assert "error" not in x, (r, x)
        assert x["weights"] == x["gloo"], (r, x)
        assert x["hosts"] == [[0, 1, 2]], (r, x)
    for r in ([2] if first == "trainer" else [0, 1]):
        assert res[r]["took"] < 5.0, (r, res[r])  # the late party
    for x in res[:2]:
        assert x["world"] == x["world_after"] == [2.0] * 4, x  # the trainer's own streamcoll world, before and after


def srun_test(f):
    """A test with the one-node SLURM: one xdist worker for every SLURM test
    (test_launchers' reason), 420 s (its first start may install it: apt,
    up to 300 s)."""
    for m in (needs_oneccl, pytest.mark.launchers, pytest.mark.slow, pytest.mark.xdist_group("slurm"),
              pytest.mark.timeout(420)):
        f = m(f)
    return f


@srun_test
@pytest.mark.parametrize("first", ["trainer", "server"])
def test_a_trainer_under_srun_meets_a_server_through_an_address(tmp_path, slurm, first):
    """The trainer: 2 tasks of ``srun -n 2`` (the one-node SLURM), its own
    streamcoll world first; the server: python; all three pass
    ``store="127.0.0.1:port"`` (the trainer's rank 0 hosts it): the weights
    equal gloo's on every member, one host, the late party within 5 s."""
    _check_srun(_run(tmp_path, first, True, TCP, delay=0.5, launcher="srun", store="address", slurm_conf=slurm,
                     after_ready=True), first)


@srun_test
@pytest.mark.parametrize("first", ["trainer", "server"])
def test_a_trainer_under_srun_meets_a_server_through_a_store_object(tmp_path, slurm, first):
    """The same through a TCPStore object the trainer's rank 0 hosts (every
    member makes its own client of it and passes it as ``store=``). Before,
    the srun tasks led their rendezvous keys with their job's scope
    (``slurm<job>.<step>/``) and the server did not: all timed out."""
    _check_srun(_run(tmp_path, first, True, TCP, delay=0.5, launcher="srun", store="object", slurm_conf=slurm,
                     after_ready=True), first)


@needs_oneccl
def test_the_shared_communicator_first_works_with_the_defaults(tmp_path):
    res = _run(tmp_path, "trainer", False, {}, delay=1.0)
    for r, x in enumerate(res):
        assert "error" not in x and x["weights"] == x["gloo"], (r, x)


# ------------------------------------------------------------------ the rules
def _facts(rank: int, first=None, shm="1", job="j", identity="H", node=0, provider="shm"):
    bound = ((("CCL_ATL_SHM", shm, env.IN_EFFECT), ("FI_PROVIDER", provider, env.IN_EFFECT))
             if first is not None else ())
    return topology.RankFacts(rank, identity, "M", "N", "h", 100 + rank, node, (0, 1), None, bound, True, None,
                              (), job, first)


def test_agree_refuses_a_member_outside_a_shared_memory_first_communicator():
    facts = [_facts(0, "A"), _facts(1, "A"), _facts(2, None, job="k", node=None)]
    layout = topology.compute(facts)
    why = layout.conflicts.get("CCL_ATL_SHM", "")
    assert "ranks 0, 1 run oneCCL with shared memory" in why and "rank 2 of this one" in why, why
    # a rank whose first communicator was another one: refused the same way
    why = topology.compute([_facts(0, "A"), _facts(1, "B")]).conflicts.get("CCL_ATL_SHM", "")
    assert "ranks 0, 1" in why and "ranks 0, 1 of this one" in why, why


def test_agree_accepts_a_subset_of_the_first_communicator_tcp_or_everyone_new():
    for facts in ([_facts(0, "A"), _facts(1, "A")],                      # members of one first communicator
                  [_facts(0), _facts(1, job="k", node=None)],            # everyone's first
                  [_facts(0, "A", shm="0", provider="tcp"), _facts(1, "B", shm="0", provider="tcp"),
                   _facts(2, None, job="k", node=None)]):                # TCP since their first
        assert "CCL_ATL_SHM" not in topology.compute(facts).conflicts, facts
    # CCL_ATL_SHM=0 alone is not enough (oneCCL's subgroups hung with it: facts.md)
    facts = [_facts(0, "A", shm="0", provider="shm"), _facts(1, None, job="k", node=None)]
    assert "CCL_ATL_SHM" in topology.compute(facts).conflicts


def test_ranks_of_several_jobs_on_one_identity_are_one_host():
    # one job, two nodes on one identity: two simulated hosts, as before
    two = topology.compute([_facts(0, node=0), _facts(1, node=1)])
    assert [h.ranks for h in two.hosts] == [(0,), (1,)]
    # a server of another job beside them: the node no longer tells them apart
    one = topology.compute([_facts(0, node=0), _facts(1, node=0), _facts(2, job="k", node=None)])
    assert [h.ranks for h in one.hosts] == [(0, 1, 2)] and one.jobs == 2
    # other identities stay other hosts
    apart = topology.compute([_facts(0, node=0), _facts(1, job="k", identity="G", node=None)])
    assert [h.ranks for h in apart.hosts] == [(0,), (1,)]


# ------------------------------------------------------------------ the example
def _example(tmp_path, backend: str) -> dict:
    """examples/weight_sync.py: the trainer under torchrun (2 ranks) and the
    server (asyncio) with ``python``; what each printed."""
    from conftest import ROOT
    ex = os.path.join(ROOT, "examples", "weight_sync.py")
    port, master = free_port(), free_port()
    e = bare_env()
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "GROUP_RANK"):
        e.pop(k, None)
    d = tmp_path / backend
    d.mkdir()
    ps = Processes(str(d))
    common = ["--store", f"127.0.0.1:{port}", "--backend", backend, "--steps", "6", "--every", "2", "--timeout", "30"]
    try:
        ps.start([sys.executable, ex, "server"] + common, e, "server.out", "server.err")
        ps.start([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr",
                  "127.0.0.1", "--master-port", str(master), ex, "trainer"] + common, e, "trainer.out", "trainer.err")
        ps.wait_all(120)
        text = {n: (d / n).read_text() for n in ("server.out", "server.err", "trainer.out", "trainer.err")}
        assert all(p.returncode == 0 for p in ps.procs), {k: v[-2000:] for k, v in text.items()}
        lines = [json.loads(x) for x in text["server.out"].splitlines() if x.startswith("{")]
        sent = [json.loads(x)["sent"] for x in text["trainer.out"].splitlines() if x.startswith('{"step"')]
        return {"server": lines[-1], "sent": sent}
    finally:
        ps.kill()


@needs_oneccl
def test_the_weight_sync_example_gives_gloos_values(tmp_path):
    """The server (started first, asyncio) gets the trainer's weights every
    2 steps and evaluates with them: the values gloo's run of the same
    program gives; its ticker ran while each broadcast was awaited."""
    ours = _example(tmp_path, "streamcoll")
    ref = _example(tmp_path, "gloo")
    assert ours["server"]["server"] == ref["server"]["server"], (ours, ref)
    assert [s["received"] for s in ours["server"]["server"]] == ours["sent"] and len(ours["sent"]) == 3, ours
    assert ours["server"]["ticks_while_awaiting"] > 0, ours  # the loop ran during the waits


def test_a_bad_store_address_names_store():
    import streamcoll
    for bad in ("127.0.0.1", "host:port", ":29500", "127.0.0.1:0", "127.0.0.1:70000"):
        with pytest.raises(ValueError, match="store: expected"):
            streamcoll.new_communicator(backend="oneccl", device="cpu", store=bad, rank=0, world_size=2)


_DEAD = r"""
import json, os, sys, time
from datetime import timedelta
import torch, torch.distributed as dist
import streamcoll
role, addr, out = sys.argv[1], sys.argv[2], sys.argv[3]
res = {}
if role == "trainer":
    dist.init_process_group("streamcoll", timeout=timedelta(seconds=30))
    rank = dist.get_rank()
    if rank == 0:
        c = streamcoll.new_communicator(backend="oneccl", device="cpu", store=addr, rank=0, world_size=2,
                                        name="weights", timeout=20)
        c.broadcast(torch.ones(8), src=0)
        dist.TCPStore(addr.split(":")[0], int(addr.split(":")[1]), None, False).wait(["server-gone"])
        t0 = time.monotonic()
        try:
            c.broadcast(torch.ones(1 << 16), src=0, timeout=3)
            res["second"] = ["returned", time.monotonic() - t0, ""]
        except Exception as e:
            res["second"] = [type(e).__name__, time.monotonic() - t0, str(e)]
        # the server restarted: a new communicator under a new name
        t0 = time.monotonic()
        d = streamcoll.new_communicator(backend="oneccl", device="cpu", store=addr, rank=0, world_size=2,
                                        name="weights2", timeout=20)
        w = torch.full((8,), 3.0)
        d.broadcast(w, src=0)
        res["restarted"] = [float(w.sum()), time.monotonic() - t0]
    t = torch.ones(4)
    t0 = time.monotonic()
    dist.all_reduce(t)  # the trainer's world after the weight-sync communicator failed
    res["world"] = [t.tolist(), time.monotonic() - t0]
    with open(os.path.join(out, f"trainer{rank}.json"), "w") as f:
        json.dump(res, f)
else:
    c = streamcoll.new_communicator(backend="oneccl", device="cpu", store=addr, rank=1, world_size=2,
                                    name=role, timeout=20)
    w = torch.zeros(8)
    c.broadcast(w, src=0)
    print("SERVER GOT", float(w.sum()), flush=True)
"""


@needs_oneccl
def test_a_dead_server_fails_the_weight_sync_call_only(tmp_path):
    """The server dies after the first sync: the trainer's next broadcast
    (its own timeout=3) raises CollectiveTimeout at 3 s; the report
    gathered after it, logged before the exit, names rank 1 as not
    answering; the server restarted joins a new communicator (a new name)
    and gets the next weights; the trainer's own world goes on."""
    job = tmp_path / "dead.py"
    job.write_text(_DEAD)
    port, master = free_port(), free_port()
    addr = f"127.0.0.1:{port}"
    e = bare_env()
    e.update(TCP, STREAMCOLL_WATCHDOG="fail")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "GROUP_RANK"):
        e.pop(k, None)
    ps = Processes(str(tmp_path))
    try:
        ps.start([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
                  "--master-port", str(master), str(job), "trainer", addr, str(tmp_path)], e, "trainer.out")
        server = ps.start([sys.executable, str(job), "weights", addr, str(tmp_path)], e, "server.out")
        server.wait(60)
        from torch.distributed import TCPStore
        TCPStore("127.0.0.1", port, None, False).set("server-gone", "1")  # the server process has ended
        ps.start([sys.executable, str(job), "weights2", addr, str(tmp_path)], e, "server2.out")  # restarted
        ps.wait_all(60)
        log = (tmp_path / "trainer.out").read_text()
        assert "SERVER GOT 8.0" in (tmp_path / "server.out").read_text()
        r0 = json.loads((tmp_path / "trainer0.json").read_text())
        r1 = json.loads((tmp_path / "trainer1.json").read_text())
        kind, took, msg = r0["second"]
        assert kind == "CollectiveTimeout" and 2.9 < took < 4.5 and "its own timeout (3 s" in msg, r0
        assert "who and where: the other ranks are being asked" in msg, msg
        assert r0["world"][0] == r1["world"][0] == [2.0] * 4, (r0, r1)
        assert r0["restarted"][0] == 24.0 and "SERVER GOT 24.0" in (tmp_path / "server2.out").read_text(), r0
        assert "rank 1 did not answer within 2 s" in log and "passed its own timeout=" in log, log[-3000:]
        assert ps.procs[0].returncode == 0, log[-3000:]
    finally:
        ps.kill()
