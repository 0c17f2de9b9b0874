"""Which ranks meet (issue 33): the rendezvous namespace every member agrees
on, on real processes and a real TCPStore.

- one store, communicators of different sizes: rank 0 alone makes a 1-rank
  communicator, then both ranks a 2-rank one (before: rank 0 in namespace 1,
  rank 1 in 2, both timing out, each blaming the other); the store part
  only: a process whose first oneCCL communicator had 1 rank does not
  finish a 2-rank one's native init (seen here, the watchdog's exit 86
  after the ranks had met), whatever the namespace;
- one 4-rank job, two disjoint 2-rank communicators on the job's store: the
  default name is refused at once on every rank (two groups reaching the
  store together took ranks from each other), named ones give gloo's sums;
- two processes claiming one rank of one namespace: the second raises at
  once, saying so;
- two SLURM jobs whose ports collide, on one store: the second job's rank
  never joins the first's rendezvous (the job and step lead every
  namespace).
"""
from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
import threading
import time
from typing import Dict, List, Optional

import pytest

from conftest import ROOT, needs_oneccl
from world import TORCHRUN_ENV


def _server():
    import torch.distributed as dist
    return dist.TCPStore("127.0.0.1", 0, 1, True, datetime.timedelta(seconds=120), wait_for_workers=False,
                         multi_tenant=True)


def _spawn(code: str, envs: List[Dict[str, str]], tmp_path, timeout: float = 240,
           base: Optional[Dict[str, str]] = None) -> List[dict]:
    """Run ``code`` once per env (started together, over ``base``, default
    this process's); each prints one ``OUT <json>`` line: the list of
    those, in order."""
    procs = []
    for e in envs:
        env = dict(os.environ if base is None else base, **TORCHRUN_ENV, **e)
        env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
        procs.append(subprocess.Popen([sys.executable, "-c", code], env=env, cwd=str(tmp_path),
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outs = []
    try:
        for p in procs:
            o, err = p.communicate(timeout=timeout)
            lines = [x for x in o.splitlines() if x.startswith("OUT ")]
            assert p.returncode == 0 and lines, f"exit {p.returncode}\n{o[-3000:]}\n{err[-5000:]}"
            outs.append(json.loads(lines[-1][4:]))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return outs


_SIZES = r"""
import datetime, json, os, time, torch.distributed as dist
from streamcoll.startup import bootstrap
from streamcoll._ffi.errors import RendezvousError
rank = int(os.environ["RANK"])
tcp = dist.TCPStore("127.0.0.1", int(os.environ["STORE_PORT"]), 1, False, datetime.timedelta(seconds=60))
out = {}
if rank == 0:  # alone, on the shared store (the README's store=)
    out["alone"] = bootstrap.rendezvous(tcp, 0, 1, timeout=10, make_uid=lambda t, n: b"alone").uid.decode()
    tcp.set("alone-done", "1")
tcp.wait(["alone-done"])
t0 = time.monotonic()
try:
    m = bootstrap.rendezvous(tcp, rank, 2, timeout=10, make_uid=lambda t, n: b"pair")
    out["both"] = [m.uid.decode(), m.name, m.topology.world_size]
except RendezvousError as e:
    out["both"] = f"RendezvousError after {time.monotonic() - t0:.1f} s: {e}"
print("OUT " + json.dumps(out), flush=True)
"""


def test_communicators_of_another_size_on_the_shared_store_shift_nobody(tmp_path):
    """Rank 0 alone makes a 1-rank communicator on the shared store, then
    both ranks a 2-rank one: they meet (the store part, real processes and
    TCPStore; the native init after it is not this test's). Before: rank 0
    landed in namespace 1 and rank 1 in 2 (the counter divided by the world
    size counted rank 0's 1-rank communicator as half a 2-rank one); both
    timed out after 10 s, each naming the other."""
    server = _server()
    envs = [dict(RANK=str(r), WORLD_SIZE="2", LOCAL_RANK=str(r), LOCAL_WORLD_SIZE="2",
                 STORE_PORT=str(server.port)) for r in range(2)]
    outs = _spawn(_SIZES, envs, tmp_path)
    assert outs[0].get("alone") == "alone", outs
    assert [o["both"] for o in outs] == [["pair", "default", 2]] * 2, outs


_PAIRS = r"""
import datetime, json, os, time, torch, torch.distributed as dist, streamcoll
rank = int(os.environ["RANK"])
tcp = dist.TCPStore("127.0.0.1", int(os.environ["STORE_PORT"]), 1, False, datetime.timedelta(seconds=60))
dist.init_process_group("gloo", store=dist.PrefixStore("gloo/", tcp), rank=rank, world_size=4)
out = {}
t0 = time.monotonic()
try:  # the default name: refused on every rank, before any store request
    c = streamcoll.new_communicator(backend="oneccl", device="cpu", store=tcp, rank=rank % 2, world_size=2,
                                    timeout=10)
    t = torch.full((2,), float(rank + 1))
    c.all_reduce(t)  # (before: whichever ranks reached the store together)
    out["default"] = t.tolist()
    c.destroy()
except (ValueError, streamcoll.CollectiveError) as e:
    out["default"] = f"{type(e).__name__} after {time.monotonic() - t0:.1f} s: {e}"
dist.barrier()
c = streamcoll.new_communicator(backend="oneccl", device="cpu", store=tcp, rank=rank % 2, world_size=2,
                                name=f"pair{rank // 2}", timeout=60)
groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
t = torch.arange(4, dtype=torch.float32) * (rank + 1)
g = t.clone()
c.all_reduce(t)
dist.all_reduce(g, group=groups[rank // 2])
out["named"], out["gloo"] = t.tolist(), g.tolist()
c.destroy()
dist.destroy_process_group()
print("OUT " + json.dumps(out), flush=True)
"""


@needs_oneccl
@pytest.mark.world
def test_disjoint_pairs_of_a_four_rank_job(tmp_path):
    """Two 2-rank communicators on a 4-rank job's store. With the default
    name (before: the four processes numbered themselves into namespaces by
    arrival, so process 0 could meet process 3 and sum the wrong tensors,
    or two rank 0s share a namespace and time out): a ValueError naming
    ``name`` on every rank, at once. With a name per pair: gloo's sums."""
    server = _server()
    envs = [dict(RANK=str(r), WORLD_SIZE="4", LOCAL_RANK=str(r), LOCAL_WORLD_SIZE="4",
                 STORE_PORT=str(server.port)) for r in range(4)]
    outs = _spawn(_PAIRS, envs, tmp_path, timeout=300)
    for r, o in enumerate(outs):
        d = o["default"]
        assert isinstance(d, str) and d.startswith("ValueError") and "name: a communicator over 2 of the job's 4" \
            in d, (r, d)
        assert float(d.split(" after ")[1].split(" s")[0]) < 5.0, d  # (the 10 s timeout never started)
        assert o["named"] == o["gloo"], (r, o)
    assert outs[0]["named"] == [0.0, 3.0, 6.0, 9.0] and outs[3]["named"] == [0.0, 7.0, 14.0, 21.0], outs


def test_two_processes_claiming_one_rank_the_second_raises_at_once():
    """Two rank 0s in one namespace (two groups sharing a name, reaching the
    store together): before, both waited for rank 1 and both published a
    unique id. Now the second raises a RendezvousError at once naming the
    process that holds the rank, and the first one's timeout says why."""
    import torch.distributed as dist
    from dataclasses import replace
    from streamcoll.startup import bootstrap, topology
    from streamcoll._ffi.errors import RendezvousError
    store = dist.HashStore()
    me = topology.local_facts(0)
    facts = [replace(me, pid=40001), replace(me, pid=40002)]
    out: Dict[int, object] = {}

    def run(i: int, timeout: float) -> None:
        try:
            out[i] = bootstrap.rendezvous(store, 0, 2, timeout=timeout, facts=facts[i], make_uid=lambda t, n: b"u")
        except Exception as e:
            out[i] = e
    first = threading.Thread(target=run, args=(0, 3.0))
    first.start()
    while not dist.PrefixStore("streamcoll/comm/2/1/", store).check([topology.exchange_key(0)]):
        time.sleep(0.01)
    t0 = time.monotonic()
    run(1, 20.0)
    took = time.monotonic() - t0
    first.join(30)
    second = out[1]
    assert isinstance(second, RendezvousError) and took < 2, (second, took)
    assert "held by pid 40001" in str(second) and "this is pid 40002" in str(second), second
    assert "give each its own name=" in str(second), second
    assert isinstance(out[0], RendezvousError) and "rank 1 never joined" in str(out[0]), out[0]
    assert "Meanwhile: rendezvous of communicator 'default' failed on rank 0: rank 0" in str(out[0]), out[0]


_JOB = r"""
import json, os, sys, time, torch.distributed as dist, datetime
from streamcoll.startup import bootstrap, launchers
from streamcoll._ffi.errors import RendezvousError
launchers.adopt()  # srun's variables: RANK, WORLD_SIZE, ... (MASTER_ADDR/MASTER_PORT given: the colliding port)
rank, job = int(os.environ["RANK"]), os.environ["SLURM_JOB_ID"]
tcp = dist.TCPStore("127.0.0.1", int(os.environ["MASTER_PORT"]), 1, False, datetime.timedelta(seconds=60))
print("READY", flush=True)
out = {"scope": getattr(launchers, "job_scope", lambda: "?")()}
try:
    m = bootstrap.rendezvous(tcp, rank, 2, timeout=float(os.environ["JOB_TIMEOUT"]),
                             make_uid=lambda t, n: ("job" + job).encode())
    out["uid"] = m.uid.decode()
except RendezvousError as e:
    out["error"] = str(e)
print("OUT " + json.dumps(out), flush=True)
"""


def test_two_slurm_jobs_on_one_store_do_not_join_each_other(tmp_path):
    """Job 1001's step 0 got job 1000's port (a collision): its rank 0
    could not bind, its rank 1 reached job 1000's store first. Before, it
    took rank 1 of job 1000's first namespace and got job 1000's unique id
    (and job 1000's rank 1 waited in a second namespace). Now its keys are
    under ``slurm1001.0/``: it times out alone (15 s, long enough for job
    1000 to arrive); job 1000 meets as before."""
    server = _server()

    def srun(job: int, rank: int, timeout: float) -> Dict[str, str]:
        return {"SLURM_PROCID": str(rank), "SLURM_STEP_ID": "0", "SLURM_STEP_NUM_TASKS": "2", "SLURM_NTASKS": "2",
                "SLURM_LOCALID": str(rank), "SLURM_STEP_TASKS_PER_NODE": "2", "SLURM_NODEID": "0",
                "SLURM_JOB_ID": str(job), "SLURM_STEP_NODELIST": "localhost", "MASTER_PORT": str(server.port),
                "JOB_TIMEOUT": str(timeout)}
    base = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "RANK", "WORLD_SIZE", "LOCAL_",
                                                                       "TORCHELASTIC", "GROUP_RANK"))}
    procs = []
    for job, rank, timeout in ((1001, 1, 15), (1000, 0, 60), (1000, 1, 60)):
        env = dict(base, **TORCHRUN_ENV, **srun(job, rank, timeout))
        env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
        p = subprocess.Popen([sys.executable, "-c", _JOB], env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, cwd=str(tmp_path))
        procs.append(p)
        if job == 1001:  # in the store first
            assert p.stdout.readline().strip() == "READY", p.stderr.read()
            time.sleep(0.3)
    outs = []
    try:
        for p in procs:
            o, err = p.communicate(timeout=120)
            lines = [x for x in o.splitlines() if x.startswith("OUT ")]
            assert p.returncode == 0 and lines, f"exit {p.returncode}\n{o}\n{err[-4000:]}"
            outs.append(json.loads(lines[-1][4:]))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    intruder, lead, member = outs
    assert lead.get("uid") == member.get("uid") == "job1000", outs
    assert "uid" not in intruder and "rank 0 published nothing" in intruder["error"], outs
    assert [o["scope"] for o in outs] == ["slurm1001.0/", "slurm1000.0/", "slurm1000.0/"], outs


_PG_JOB = r"""
import datetime, json, os, torch, torch.distributed as dist
import streamcoll
from streamcoll.startup import launchers
rank = int(os.environ["SLURM_PROCID"])
tcp = dist.TCPStore("127.0.0.1", int(os.environ["STORE_PORT"]), None, False, datetime.timedelta(seconds=60))
out = {"scope": launchers.job_scope()}
try:
    dist.init_process_group("streamcoll", store=tcp, rank=rank, world_size=2, timeout=datetime.timedelta(seconds=6))
    t = torch.ones(2)
    dist.all_reduce(t)
    out["sum"] = t.tolist()
except Exception as e:
    out["error"] = f"{type(e).__name__}: {e}"[:600]
print("OUT " + json.dumps(out), flush=True)
"""


def test_a_process_group_over_a_slurm_steps_world_keeps_the_job_scope(tmp_path):
    """``init_process_group("streamcoll")`` over the whole step (2 tasks of
    2: the launcher's world, whose store is the launcher's rendezvous):
    the job and step still lead its communicator's keys, though the store
    reaches the communicator as a given one (new_communicator scopes only
    its own default store). Rank 0 of job 1000 and rank 1 of job 1001 (a
    port collision) on one store: neither joins the other (without the
    scope they met and summed [2.0, 2.0]); both time out (6 s)."""
    server = _server()
    envs = [{"SLURM_PROCID": str(rank), "SLURM_STEP_ID": "0", "SLURM_STEP_NUM_TASKS": "2", "SLURM_NTASKS": "2",
             "SLURM_LOCALID": str(rank), "SLURM_STEP_TASKS_PER_NODE": "2", "SLURM_NODEID": "0",
             "SLURM_JOB_ID": str(job), "SLURM_STEP_NODELIST": "localhost", "STORE_PORT": str(server.port)}
            for rank, job in ((0, 1000), (1, 1001))]
    keep = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "RANK", "WORLD_SIZE", "LOCAL_",
                                                                       "TORCHELASTIC", "GROUP_RANK", "MASTER_PORT"))}
    outs = _spawn(_PG_JOB, envs, tmp_path, timeout=120, base=keep)
    assert [o["scope"] for o in outs] == ["slurm1000.0/", "slurm1001.0/"], outs
    for o in outs:
        assert "sum" not in o and "did not complete within 6 s" in o.get("error", ""), outs
