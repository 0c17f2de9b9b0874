"""Two nodes under the engines people run (issue 36): a two-node SLURM and
a two-node Ray cluster, each node a simulated host (its own network
namespace, hostname, IPC, PID namespace and ``/dev/shm``; tests/netns.py,
scripts/slurm_two_nodes.sh), the jobs started with no variable set by the
user, each compared with gloo under the same command.

SLURM (slurmctld and a slurmd on node01, a slurmd on node02; the README's
"Launching" job, examples/launch_job.py):

- ``srun -N 2 -n 2``: a streamcoll job and a gloo job at once (two jobs
  whose first node, the rendezvous host, is the same);
- ``srun -N 2 -n 4`` (2 per node), then the same on gloo;
- ``sbatch`` of a script calling ``srun`` twice: two steps of one job, on
  different ports, both right;
- a task of a 2 x 2 step killed on node02 (``kill -KILL`` there): the other
  ranks end within the communicator's timeout naming the cause, and
  neither node's ``/dev/shm`` keeps anything.

Skips with the reason where the cluster cannot be made (not root, no
namespaces, no apt for SLURM)."""
from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List

import pytest

import netns
from conftest import ROOT as REPO_ROOT, needs_oneccl
from launching import VENV, command, venv_why_not
from world import kill_sessions

ROOT = Path(REPO_ROOT)
SLURM2 = ROOT / "scripts" / "slurm_two_nodes.sh"
NODES = ("node01", "node02")
DEATH_TIMEOUT = 5.0

_WHY = netns.unavailable()
# xdist_group("slurm"): every SLURM test on one worker (see test_launchers.py's pytestmark)
pytestmark = [pytest.mark.two_nodes, pytest.mark.world, pytest.mark.slow, needs_oneccl,
              pytest.mark.skipif(_WHY is not None, reason=f"simulated hosts unavailable: {_WHY}"),
              pytest.mark.xdist_group("slurm")]


def rows_of(out: str) -> List[dict]:
    rows = []
    for line in out.splitlines():
        line = re.sub(r"^\s*\d+: ", "", line).strip()  # srun --label
        if line.startswith("{") and line.endswith("}"):
            rows.append(json.loads(line))
    return sorted(rows, key=lambda r: r["rank"])


def check_job(rows: List[dict], n: int, backend: str, what: str) -> None:
    """examples/launch_job.py on ``n`` ranks, block-distributed over the two
    nodes: every rank's values, its node and local rank."""
    per = n // 2
    assert [(r["rank"], r["world"], r["backend"]) for r in rows] == [(i, n, backend) for i in range(n)], (what, rows)
    assert all(r["values"] == [i * n * (n + 1) / 2 for i in range(4)] for r in rows), (what, rows)
    assert all(r["broadcast"] == [n - 1.0] * 2 for r in rows), (what, rows)
    assert [(r["host"], r["local_rank"]) for r in rows] == [(NODES[i // per], str(i % per)) for i in range(n)], \
        (what, rows)
    assert len({r["rendezvous"] for r in rows}) == 1 and rows[0]["rendezvous"].startswith("node01:"), (what, rows)


# ==================================================================== SLURM
class Slurm:
    """The cluster scripts/slurm_two_nodes.sh brought up; commands run on a
    node (node01 is also the login node: srun and sbatch run there)."""

    def __init__(self, d: str, conf: str) -> None:
        self.dir, self.conf = d, conf

    def env(self, **extra: str) -> Dict[str, str]:
        """A user's shell on the login node: no library, launcher or test
        variable; the checkout first on PYTHONPATH, this Python first on PATH."""
        env = {k: v for k, v in netns.clean_env().items() if not k.startswith(("SLURM_", "PMI_", "OMPI_"))}
        env.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", SLURM_CONF=self.conf,
                   STREAMCOLL_SLURM2_DIR=self.dir, PATH=f"{os.path.dirname(sys.executable)}:{os.environ['PATH']}")
        env.update(extra)
        return env

    def argv(self, node: int, cmd: str) -> List[str]:
        return ["bash", str(SLURM2), "exec", str(node), "bash", "-c", cmd]

    def run(self, cmd: str, node: int = 0, timeout: float = 180, **extra: str) -> subprocess.CompletedProcess:
        """``cmd`` on node ``node``; past ``timeout`` its whole session is
        killed (srun with it) and TimeoutExpired raised."""
        p = subprocess.Popen(self.argv(node, cmd), cwd=str(ROOT), env=self.env(**extra), stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, start_new_session=True)
        try:
            out, err = p.communicate(timeout=timeout)
        finally:
            kill_sessions([p])
        return subprocess.CompletedProcess(p.args, p.returncode, out, err)

    def popen(self, cmd: str, out: Path, node: int = 0, **extra: str) -> subprocess.Popen:
        with open(out, "w") as f:
            return subprocess.Popen(self.argv(node, cmd), cwd=str(ROOT), env=self.env(**extra), stdout=f,
                                    stderr=subprocess.STDOUT, text=True, start_new_session=True)

    def shm(self, node: int) -> List[str]:
        """What node ``node``'s own ``/dev/shm`` holds (seen through its
        init's root, from outside)."""
        p = subprocess.run(["bash", str(SLURM2), "pid", str(node)], env=self.env(), capture_output=True, text=True,
                           timeout=20)
        assert p.returncode == 0, p.stderr
        return sorted(os.listdir(f"/proc/{p.stdout.strip()}/root/dev/shm"))


def _done(p: subprocess.CompletedProcess, what: str) -> str:
    assert p.returncode == 0, f"{what}: exit {p.returncode}\n--- stdout\n{p.stdout[-3000:]}\n--- stderr\n" \
                              f"{p.stderr[-6000:]}"
    return p.stdout


@pytest.fixture(scope="module")
def slurm():
    # One directory per checkout: a later run from it ends what a crashed one left.
    d = f"/tmp/streamcoll-two-nodes-{hashlib.sha1(str(ROOT).encode()).hexdigest()[:8]}"
    env = dict(os.environ, STREAMCOLL_SLURM2_DIR=d)
    t0 = time.monotonic()
    p = subprocess.run(["bash", str(SLURM2), "start"], env=env, capture_output=True, text=True, timeout=300)
    try:
        if p.returncode in (3, 4, 6):
            pytest.skip(f"no two-node SLURM here (scripts/slurm_two_nodes.sh start: exit {p.returncode}: "
                        f"{p.stderr.strip()[-500:]})")
        assert p.returncode == 0, f"scripts/slurm_two_nodes.sh start: exit {p.returncode}\n{p.stderr[-4000:]}"
        print(f"two-node SLURM up in {time.monotonic() - t0:.1f} s")
        yield Slurm(d, p.stdout.strip().splitlines()[-1])
    finally:
        subprocess.run(["bash", str(SLURM2), "stop"], env=env, capture_output=True, timeout=120)


JOB = "python examples/launch_job.py"


def readme_srun() -> str:
    """The README's srun line with ``-N 2`` (and the rank count) given."""
    line = command(r"^srun -n 2 ")
    assert line.endswith(JOB), line
    return line


def test_two_nodes_srun_2_ranks_two_jobs_at_once(slurm):
    """``srun -N 2 -n 2``, a streamcoll and a gloo job at once: both jobs'
    first node is node01 (the rendezvous host of both), their ports differ
    (job ids), and the values agree."""
    base = readme_srun().replace("srun -n 2 ", "srun -N 2 -n 2 ", 1)
    d = Path(slurm.dir) / "log"
    procs = {b: slurm.popen(base + (" --backend gloo" if b == "gloo" else ""), d / f"srun2-{b}.out")
             for b in ("streamcoll", "gloo")}
    try:
        for p in procs.values():
            p.wait(240)
    finally:
        kill_sessions(list(procs.values()))
    rows = {}
    for b, p in procs.items():
        out = (d / f"srun2-{b}.out").read_text()
        assert p.returncode == 0, f"{b}: exit {p.returncode}\n{out[-6000:]}"
        rows[b] = rows_of(out)
        check_job(rows[b], 2, b, f"srun -N 2 -n 2 ({b})")
    assert [r["values"] for r in rows["streamcoll"]] == [r["values"] for r in rows["gloo"]]
    assert rows["streamcoll"][0]["rendezvous"] != rows["gloo"][0]["rendezvous"], rows


def test_two_nodes_srun_4_ranks(slurm):
    """``srun -N 2 -n 4``: two ranks per node, block order, local ranks 0
    and 1 on each node, gloo's values."""
    cmd = readme_srun().replace("srun -n 2 ", "srun -N 2 -n 4 ", 1)
    mine = rows_of(_done(slurm.run(cmd), "srun -N 2 -n 4"))
    check_job(mine, 4, "streamcoll", "srun -N 2 -n 4")
    gloo = rows_of(_done(slurm.run(cmd + " --backend gloo"), "srun -N 2 -n 4 (gloo)"))
    check_job(gloo, 4, "gloo", "srun -N 2 -n 4 (gloo)")
    assert [r["values"] for r in mine] == [r["values"] for r in gloo]


def test_two_nodes_sbatch_two_steps(slurm, tmp_path):
    """``sbatch`` of a script with two ``srun`` steps (streamcoll, then gloo):
    the steps meet on different ports (from the job and step id), both give
    the same values."""
    from streamcoll.startup.launchers import slurm_port
    script = tmp_path / "two_steps.sh"
    script.write_text(f"#!/bin/bash\nset -e\nsrun -N 2 -n 2 {JOB}\nsrun -N 2 -n 2 {JOB} --backend gloo\n")
    out = tmp_path / "job.out"
    p = slurm.run(f"sbatch --wait -N 2 -n 2 -o {out} {script}", timeout=300)
    text = out.read_text() if out.exists() else ""
    assert p.returncode == 0, f"sbatch: exit {p.returncode}\n{p.stdout}\n{p.stderr}\n--- job output\n{text[-6000:]}"
    job = int(re.search(r"Submitted batch job (\d+)", p.stdout).group(1))
    rows = rows_of(text)
    mine = [r for r in rows if r["backend"] == "streamcoll"]
    gloo = [r for r in rows if r["backend"] == "gloo"]
    check_job(mine, 2, "streamcoll", "sbatch step 0")
    check_job(gloo, 2, "gloo", "sbatch step 1")
    assert [r["values"] for r in mine] == [r["values"] for r in gloo]
    assert mine[0]["rendezvous"] == f"node01:{slurm_port(job, 0)}", mine
    assert gloo[0]["rendezvous"] == f"node01:{slurm_port(job, 1)}", gloo


def test_two_nodes_killed_task_ends_the_others(slurm, tmp_path):
    """``srun -N 2 -n 4``, then rank 3 is SIGKILLed on node02 in a run of
    all_reduces: ranks 0-2 (two of them on the other node) end within the
    communicator's timeout plus a margin, each saying it timed out, and
    neither node's /dev/shm keeps a region."""
    out = tmp_path / "srun.out"
    p = slurm.popen("srun --label -N 2 -n 4 python tests/two_nodes_job.py", out, TWO_NODES_OUT=str(tmp_path),
                    TWO_NODES_TIMEOUT=f"{DEATH_TIMEOUT:g}")
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and p.poll() is None and not all(
                (tmp_path / f"pid{r}").exists() for r in range(4)):
            time.sleep(0.1)
        assert p.poll() is None and (tmp_path / "pid3").exists(), out.read_text()[-6000:]
        pid, host = (tmp_path / "pid3").read_text().split()
        assert host == "node02", host
        k = slurm.run(f"kill -KILL {pid}", node=1, timeout=30)
        killed = time.monotonic()
        assert k.returncode == 0, k.stderr
        p.wait(DEATH_TIMEOUT + 60)
        took = time.monotonic() - killed
    finally:
        kill_sessions([p])
    text = out.read_text()
    assert p.returncode != 0, text[-6000:]
    assert took <= DEATH_TIMEOUT + 15, f"the step ended {took:.1f} s after the kill\n{text[-6000:]}"
    for r in range(3):
        mine = "\n".join(line for line in text.splitlines() if line.startswith((f"{r}: ", f" {r}: ")))
        assert f"on rank {r} of 4" in mine and f"(timeout {DEATH_TIMEOUT:g} s)" in mine, text[-6000:]
    print(f"killed task: the step ended {took:.1f} s after the kill")
    for node in (0, 1):
        left = slurm.shm(node)
        assert left == [], f"{NODES[node]}'s /dev/shm keeps {left}\n{text[-3000:]}"


# ====================================================================== Ray
RAY_PORT = 6379  # inside the hosts' namespaces: no clash with anything outside


@pytest.fixture(scope="module")
def ray_runs(tmp_path_factory):
    """One two-node Ray cluster for every Ray case (its start-up is most of
    the time): the head on node01 runs tests/two_nodes_ray.py once the head
    is up, node02 joins with ``ray start --address``. Returns
    {(backend, workers): rows by rank} and the cases' times."""
    from world import Processes
    why = venv_why_not()
    if why:
        pytest.skip(why)
    out = tmp_path_factory.mktemp("ray2")
    ray = str(VENV / "bin" / "ray")
    env = netns.clean_env({"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "RAY_TRAIN_V2_ENABLED": "1",
                           "RAY_USAGE_STATS_ENABLED": "0", "PYTHONUNBUFFERED": "1",
                           # Ray >= 2.59: `ray start --head` turns token auth on when ~/.ray/auth_token exists
                           # (a local ray.init() writes it: test_launchers' Ray Train case), and neither
                           # `ray start --address` nor ray.init(address=...) sends it: every join fails
                           # with InvalidAuthToken (seen in CI). The cluster is the test's own, in namespaces.
                           "RAY_AUTH_MODE": "disabled",
                           "PATH": f"{VENV / 'bin'}:{os.environ['PATH']}"})
    t0 = time.monotonic()
    with netns.Hosts(NODES) as hosts:
        tmp = [f"/tmp/scray{os.getpid()}n{i}" for i in range(2)]  # short: Ray's socket paths live under it
        common = "--num-cpus=2 --object-store-memory=100000000 --disable-usage-stats"
        head = (f"{ray} start --head --node-ip-address={hosts.addr(0)} --port={RAY_PORT} --include-dashboard=false "
                f"{common} --temp-dir={tmp[0]} && touch {out}/head-up && {VENV / 'bin' / 'python'} "
                f"{ROOT / 'tests' / 'two_nodes_ray.py'} {hosts.addr(0)}:{RAY_PORT} {out}")
        worker = (f"{ray} start --address={hosts.addr(0)}:{RAY_PORT} --node-ip-address={hosts.addr(1)} {common} "
                  f"--temp-dir={tmp[1]} --block")
        run = Processes(str(out))
        try:
            run.start(hosts.command(0, ["sh", "-c", head]), env, "head.log")
            deadline = time.monotonic() + 180
            while time.monotonic() < deadline and run.procs[0].poll() is None and not (out / "head-up").exists():
                time.sleep(0.2)
            assert (out / "head-up").exists(), f"the Ray head did not start\n{run.text('head.log')[-4000:]}"
            run.start(hosts.command(1, ["sh", "-c", worker]), env, "worker.log")
            run.procs[0].wait(540 - (time.monotonic() - t0))
        finally:
            run.kill()
            for d in tmp:
                subprocess.run(["rm", "-rf", d], timeout=60)
    info = f"--- head\n{run.text('head.log')[-6000:]}\n--- worker\n{run.text('worker.log')[-3000:]}"
    assert run.rc(0) == 0, f"the Ray driver failed: exit {run.rc(0)}\n{info}"
    cases = json.loads((out / "cases.json").read_text())
    rows = {}
    for c in cases:
        rows[(c["backend"], c["workers"])] = [json.loads((Path(c["dir"]) / f"rank{r}.json").read_text())
                                              for r in range(c["workers"])]
    print(f"two-node Ray: {time.monotonic() - t0:.0f} s in all; cases "
          + ", ".join(f"{c['backend']} x{c['workers']} {c['s']} s" for c in cases))
    return rows


def check_ray(rows: dict, n: int) -> None:
    import torch
    for backend in ("streamcoll", "gloo"):
        got = rows[(backend, n)]
        what = f"Ray Train, {n} workers, {backend}"
        assert [(r["rank"], r["world"], r["backend"]) for r in got] == [(i, n, backend) for i in range(n)], (what, got)
        assert all(r["rank_sum"] == n * (n + 1) / 2 and r["broadcast"] == [n - 1.0] * 2 for r in got), (what, got)
        nodes = {h: sorted(r["local_rank"] for r in got if r["node"] == h) for h in NODES}
        assert nodes == {h: list(range(n // 2)) for h in NODES}, (what, nodes)
        assert len({r["rendezvous"] for r in got}) == 1, (what, got)
    for mine, gloo in zip(rows[("streamcoll", n)], rows[("gloo", n)]):
        for a, b in zip(mine["params"], gloo["params"]):
            assert torch.allclose(torch.tensor(a), torch.tensor(b), atol=1e-6), (mine, gloo)


@pytest.mark.timeout(600)
def test_two_nodes_ray_train_2_workers_one_per_node(ray_runs):
    """TorchTrainer, TorchConfig(backend="streamcoll"), 2 workers of 2 CPUs
    on two nodes of 2: one per node; gloo's parameters."""
    check_ray(ray_runs, 2)


def test_two_nodes_ray_train_4_workers_two_per_node(ray_runs):
    """4 workers of 1 CPU: two per node, local ranks 0 and 1 on each;
    gloo's parameters."""
    check_ray(ray_runs, 4)
