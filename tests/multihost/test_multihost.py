"""Several hosts, simulated (issues 13, 25): network namespaces, two joined
by a veth pair, four by a bridge in a switch namespace, the interface named
``mn0`` on each host (it sorts after ``lo``, which oneCCL's own NIC choice
takes first), each host with its own hostname, IPC, PID namespace and
``/dev/shm`` (``tests/netns.py``). The ranks get a clean environment: no
oneCCL, NCCL, libfabric or interface variable (the suite's own loopback
settings are removed), only what torchrun would set (RANK, WORLD_SIZE,
LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR, MASTER_PORT).

Scenarios: 2 hosts x 1 rank and 2 hosts x 2 ranks, with equal and with
distinct hostnames (2 x 2 with equal hostnames under torchrun ``--nnodes 2``,
the others started directly by a per-host launcher in this file). Each
world runs every collective and checks the values, then one rank SIGKILLs
itself in a run of all_reduces and the survivors must end within the
timeout plus 2 s, the flight records naming the dead rank. Plus: an
interface variable that cannot work across hosts (``CCL_KVS_IFACE=lo``)
fails at once on every rank, saying why. And 4 hosts x 1 rank on the
switch, gloo and streamcoll in the same processes, values compared.

Skips with the reason where namespaces cannot be created (not root, no
``ip``/``unshare``). ``python tests/multihost/test_multihost.py host|rank ...`` is the
rank side.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from typing import Dict, List, Optional

# tests/ (conftest, world and the other helpers) on the path, also when this
# file runs as a rank's script (python tests/multihost/test_multihost.py ...)
TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROOT = os.path.dirname(TESTS)
if TESTS not in sys.path:
    sys.path.insert(0, TESTS)

KILL_AT = 20          # all_reduce iteration at which the victim kills itself
DEATH_TIMEOUT = 5.0   # the communicator's timeout during the peer-death phase


# ===================================================================== ranks
def _out(name: str, data: dict) -> None:
    path = os.path.join(os.environ["MULTIHOST_OUT"], name)
    with open(path + ".tmp", "w") as f:
        json.dump(data, f)
    os.replace(path + ".tmp", path)


def _check_collectives(comm) -> List[str]:
    """Every collective once, values checked; returns the names checked."""
    import torch
    import streamcoll
    r, n = comm.rank, comm.size
    done = []

    def ok(name, got, want):
        if not torch.equal(got, want):
            raise AssertionError(f"rank {r}: {name}: got {got.tolist()}, expected {want.tolist()}")
        done.append(name)

    t = torch.full((5,), float(r + 1))
    streamcoll.all_reduce(t)
    ok("all_reduce", t, torch.full((5,), n * (n + 1) / 2))
    t = torch.full((3,), float(r))
    streamcoll.all_reduce(t, op=streamcoll.ReduceOp.MAX)
    ok("all_reduce MAX", t, torch.full((3,), float(n - 1)))
    t = torch.full((3,), float(2 * r))
    streamcoll.all_reduce(t, op=streamcoll.ReduceOp.AVG)
    ok("all_reduce AVG", t, torch.full((3,), float(n - 1)))
    big = torch.full((1 << 20,), float(r))  # 4 MB: the large-message path between hosts
    streamcoll.all_reduce(big)
    ok("all_reduce 4 MB", big, torch.full((1 << 20,), n * (n - 1) / 2))
    w = streamcoll.all_reduce(t := torch.ones(4), async_op=True)
    w.wait()
    ok("all_reduce async", t, torch.full((4,), float(n)))
    t = torch.full((4,), float(r))
    streamcoll.broadcast(t, src=n - 1)
    ok("broadcast", t, torch.full((4,), float(n - 1)))
    t = torch.full((2,), float(r + 1))
    streamcoll.reduce(t, dst=0)
    if r == 0:
        ok("reduce", t, torch.full((2,), n * (n + 1) / 2))
    out = torch.empty(2 * n)
    streamcoll.all_gather_into_tensor(out, torch.full((2,), float(r)))
    ok("all_gather_into_tensor", out, torch.arange(n, dtype=torch.float32).repeat_interleave(2))
    lst = [torch.empty(2) for _ in range(n)]
    streamcoll.all_gather(lst, torch.full((2,), float(r)))
    ok("all_gather", torch.stack(lst), torch.arange(n, dtype=torch.float32)[:, None].expand(n, 2))
    o = torch.empty(2)
    streamcoll.reduce_scatter_tensor(o, torch.arange(2 * n, dtype=torch.float32))
    ok("reduce_scatter_tensor", o, torch.tensor([2.0 * r, 2.0 * r + 1]) * n)
    o = torch.empty(1)
    streamcoll.reduce_scatter(o, [torch.full((1,), float(j)) for j in range(n)])
    ok("reduce_scatter", o, torch.full((1,), float(n * r)))
    o = torch.empty(n)
    streamcoll.all_to_all_single(o, torch.arange(n, dtype=torch.float32) + 10 * r)
    ok("all_to_all_single", o, torch.arange(n, dtype=torch.float32) * 10 + r)
    ins = [j + 1 for j in range(n)]
    o = torch.empty((r + 1) * n)
    streamcoll.all_to_all_single(o, torch.full((sum(ins),), float(r)), [r + 1] * n, ins)
    ok("all_to_all_single uneven", o, torch.arange(n, dtype=torch.float32).repeat_interleave(r + 1))
    outs = [torch.empty(1) for _ in range(n)]
    streamcoll.all_to_all(outs, [torch.full((1,), float(10 * r + j)) for j in range(n)])
    ok("all_to_all", torch.cat(outs), torch.arange(n, dtype=torch.float32) * 10 + r)
    g = [torch.empty(2) for _ in range(n)] if r == 0 else None
    streamcoll.gather(torch.full((2,), float(r)), g, dst=0)
    if r == 0:
        ok("gather", torch.stack(g), torch.arange(n, dtype=torch.float32)[:, None].expand(n, 2))
    o = torch.empty(2)
    streamcoll.scatter(o, [torch.full((2,), float(j)) for j in range(n)] if r == 0 else None, src=0)
    ok("scatter", o, torch.full((2,), float(r)))
    # A ring: every rank sends to the next and receives from the previous (crosses hosts).
    recv = torch.empty(3)
    works = streamcoll.batch_isend_irecv([streamcoll.P2POp(streamcoll.isend, torch.full((3,), float(r)), (r + 1) % n),
                                          streamcoll.P2POp(streamcoll.irecv, recv, (r - 1) % n)])
    for w in works:
        w.wait()
    ok("batch_isend_irecv ring", recv, torch.full((3,), float((r - 1) % n)))
    if r in (0, n - 1):  # plain send/recv between the first and the last rank (other hosts)
        t = torch.full((2,), 7.0) if r == 0 else torch.empty(2)
        (streamcoll.send(t, n - 1) if r == 0 else streamcoll.recv(t, 0))
        ok("send/recv", t, torch.full((2,), 7.0))
    streamcoll.barrier()
    done.append("barrier")
    return done


def _world() -> None:
    import streamcoll
    from streamcoll.startup import env_defaults as env
    rank = int(os.environ["RANK"])
    t0 = time.monotonic()
    comm = streamcoll.init(timeout=float(os.environ.get("MULTIHOST_INIT_TIMEOUT", "60")))  # no arguments but the timeout: what torchrun gives
    res: Dict[str, object] = {"init_s": time.monotonic() - t0, "hostname": os.uname().nodename,
                              "applied": dict(env.APPLIED), "hosts": comm.topology.hosts,
                              "local": [comm.topology.local_rank, comm.topology.local_size]}
    res["checked"] = _check_collectives(comm)
    _out(f"rank{rank}.json", res)
    if os.environ.get("MULTIHOST_DEATH") != "1":
        streamcoll.destroy()
        return
    # Peer death: the last rank SIGKILLs itself; the others stay blocked inside
    # oneCCL until the watchdog ends them (exit 86).
    import torch
    comm.timeout = DEATH_TIMEOUT
    victim = comm.size - 1
    t = torch.zeros(16)
    for i in range(1, 1 << 30):
        if rank == victim and i == KILL_AT:
            res.update(killed_at=time.time(), seq=comm.seq)
            _out(f"rank{rank}.json", res)
            os.kill(os.getpid(), signal.SIGKILL)
        t.fill_(1.0)
        comm.all_reduce(t)
        if t[0].item() != comm.size:
            raise AssertionError(f"iteration {i}: {t[0].item()}")


def _fail_fast() -> None:
    """With ``CCL_KVS_IFACE=lo`` set by the user on two hosts: every rank
    raises at once, naming the cause."""
    import streamcoll
    rank = int(os.environ["RANK"])
    t0 = time.monotonic()
    try:
        streamcoll.init(timeout=60)
        res = {"raised": None}
    except streamcoll.CollectiveError as e:
        res = {"raised": type(e).__name__, "message": str(e)}
    res["elapsed"] = time.monotonic() - t0
    _out(f"rank{rank}.json", res)


def _against_gloo() -> None:
    """gloo and streamcoll in the same process (streamcoll reuses the
    process group's store): the same inputs through both, every result
    compared, integer-valued where the order of a sum would matter."""
    import datetime
    import torch
    import torch.distributed as dist
    import streamcoll
    from streamcoll.startup import env_defaults as env
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    comm = streamcoll.init(timeout=60)
    r, n = comm.rank, comm.size
    gen = torch.Generator().manual_seed(1000 + r)
    res: Dict[str, object] = {"applied": dict(env.APPLIED), "hosts": comm.topology.hosts, "compared": []}

    def both(name, fn, *tensors, exact=True):
        mine = [t.clone() for t in tensors]
        ref = [t.clone() for t in tensors]
        fn(streamcoll, *mine)
        fn(dist, *ref)
        for a, b in zip(mine, ref):
            if not (torch.equal(a, b) if exact else torch.allclose(a, b, rtol=1e-5, atol=1e-5)):
                raise AssertionError(f"rank {r}: {name}: streamcoll {a[:4].tolist()}... gloo {b[:4].tolist()}... "
                                     f"(max |diff| {(a - b).abs().max().item()})")
        res["compared"].append(name)  # type: ignore[union-attr]

    ints = lambda *shape: torch.randint(-1000, 1000, shape, generator=gen).float()  # noqa: E731
    both("all_reduce SUM", lambda m, t: m.all_reduce(t), ints(1000))
    both("all_reduce SUM 4 MB", lambda m, t: m.all_reduce(t), ints(1 << 20))
    both("all_reduce SUM 4 MB random", lambda m, t: m.all_reduce(t), torch.randn(1 << 20, generator=gen),
         exact=False)
    both("all_reduce MAX", lambda m, t: m.all_reduce(t, op=m.ReduceOp.MAX), ints(1000))
    both("all_reduce MIN 4 MB", lambda m, t: m.all_reduce(t, op=m.ReduceOp.MIN), ints(1 << 20))
    both("broadcast", lambda m, t: m.broadcast(t, src=n - 1), ints(1 << 18))
    both("all_gather_into_tensor", lambda m, o, i: m.all_gather_into_tensor(o, i), torch.empty(4 * n), ints(4))
    both("reduce_scatter_tensor", lambda m, o, i: m.reduce_scatter_tensor(o, i), torch.empty(1 << 16),
         ints(n << 16))
    both("all_to_all_single", lambda m, o, i: m.all_to_all_single(o, i), torch.empty(8 * n), ints(8 * n))
    streamcoll.destroy()
    dist.destroy_process_group()
    _out(f"rank{rank}.json", res)


SCENARIOS = {"world": _world, "fail_fast": _fail_fast, "against_gloo": _against_gloo}


def _host(layout: List[int], group: int, scenario: str) -> None:
    """One host's launcher (as torchrun's agent, without its torch import):
    starts this host's ranks (``layout``: ranks per host), records when each
    ends, exits when all did."""
    out = os.environ["MULTIHOST_OUT"]
    procs = []
    local_size = layout[group]
    for lr in range(local_size):
        rank = sum(layout[:group]) + lr
        e = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(lr), LOCAL_WORLD_SIZE=str(local_size),
                 GROUP_RANK=str(group), WORLD_SIZE=str(sum(layout)))
        with open(os.path.join(out, f"stderr{rank}"), "w") as err:
            procs.append((rank, subprocess.Popen([sys.executable, __file__, "rank", scenario], env=e,
                                                 stdout=err, stderr=subprocess.STDOUT)))
    ended: Dict[int, list] = {}
    while len(ended) < len(procs):
        for rank, p in procs:
            if rank not in ended and p.poll() is not None:
                ended[rank] = [time.time(), p.returncode]
        time.sleep(0.02)
    with open(os.path.join(out, f"ended{group}.json"), "w") as f:
        json.dump(ended, f)


# ==================================================================== tests
if __name__ != "__main__":
    import pytest

    import netns
    from conftest import needs_oneccl
    from world import Processes

    _WHY = netns.unavailable()
    pytestmark = [needs_oneccl, pytest.mark.multihost, pytest.mark.world,
                  pytest.mark.skipif(_WHY is not None, reason=f"simulated hosts unavailable: {_WHY}")]

    class Run(Processes):
        """One world on simulated hosts, watched until every host ends.
        ``per_host``: ranks on each host (an int: the same on every one)."""

        def __init__(self, tmp, hosts: "netns.Hosts", per_host, scenario: str, torchrun: bool = False,
                     env: Optional[Dict[str, str]] = None) -> None:
            super().__init__(str(tmp))
            nhosts = len(hosts.names)
            self.layout = [per_host] * nhosts if isinstance(per_host, int) else list(per_host)
            if len(self.layout) != nhosts:
                raise ValueError(f"per_host: one size per host ({nhosts}), got {self.layout}")
            self.host_of = [h for h, n in enumerate(self.layout) for _ in range(n)]
            self.flight_dir = os.path.join(self.dir, "flight")
            os.makedirs(self.flight_dir)
            port = 29400 + os.getpid() % 20000  # inside private namespaces: no clash with anything outside
            base = {"MASTER_ADDR": hosts.addr(0), "MASTER_PORT": str(port), "MULTIHOST_OUT": self.dir,
                    "STREAMCOLL_FLIGHT_DIR": self.flight_dir, "PYTHONPATH": os.pathsep.join(
                        p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)}
            base.update(env or {})
            for g in range(nhosts):
                if torchrun:
                    argv = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nhosts), "--node-rank", str(g),
                            "--nproc-per-node", str(per_host), "--master-addr", hosts.addr(0), "--master-port",
                            str(port), "--monitor-interval", "0.1", __file__, "rank", scenario]
                else:
                    argv = [sys.executable, __file__, "host", ",".join(map(str, self.layout)), str(g), scenario]
                self.start(hosts.command(g, argv), netns.clean_env(base), f"host{g}.log")
            self.torchrun = torchrun

        wait = Processes.wait_all

        def rank_end(self, r: int) -> Optional[list]:
            """(time, exit status) of rank ``r`` from its host's launcher."""
            path = os.path.join(self.dir, f"ended{self.host_of[r]}.json")
            if not os.path.exists(path):
                return None
            with open(path) as f:
                return json.load(f).get(str(r))

        def log(self, r: int) -> str:
            path = os.path.join(self.dir, f"stderr{r}")
            if not os.path.exists(path):
                path = os.path.join(self.dir, f"host{self.host_of[r]}.log")
            with open(path) as f:
                return f.read()

        def describe(self) -> str:
            parts = []
            for g in range(len(self.layout)):
                with open(os.path.join(self.dir, f"host{g}.log")) as f:
                    parts.append(f"--- host {g}: exit {self.procs[g].returncode}\n{f.read()[-4000:]}")
            for r in range(len(self.host_of)):
                p = os.path.join(self.dir, f"stderr{r}")
                if os.path.exists(p):
                    with open(p) as f:
                        parts.append(f"--- rank {r}\n{f.read()[-3000:]}")
            return "\n".join(parts)

    SCENARIO_PARAMS = [
        pytest.param(1, ("node", "node"), False, id="2x1-same-hostname"),
        pytest.param(1, ("node-a", "node-b"), False, id="2x1-distinct-hostnames"),
        pytest.param(2, ("node", "node"), True, id="2x2-same-hostname-torchrun"),
        pytest.param(2, ("node-a", "node-b"), False, id="2x2-distinct-hostnames"),
    ]

    @pytest.mark.parametrize("per_host,hostnames,torchrun", SCENARIO_PARAMS)
    def test_two_hosts_collectives_and_peer_death(tmp_path, per_host, hostnames, torchrun):
        """No variables: every collective is right across the hosts; then
        (not under torchrun, whose agent ends a failed rank's peers itself)
        the last rank dies and the survivors end within the timeout plus
        2 s and the hang report's wait for the dead rank (2 s), with exit
        code 86 and a report naming it, and their flight records name it."""
        from streamcoll.diagnostics import flight
        n = 2 * per_host
        # Fresh PID namespaces started alike give equal pids; oneCCL cannot
        # tell such ranks apart when their hostnames are equal too (see the
        # next test), which real hosts rarely share: shift host 1's pids.
        with netns.Hosts(hostnames, pid_shift=(0, 5)) as hosts:
            # Under torchrun the agent ends a failed rank's peers itself: peer death is watched without it.
            run = Run(tmp_path, hosts, per_host, "world", torchrun, {"MULTIHOST_DEATH": "0" if torchrun else "1"})
            try:
                run.wait(120)
            finally:
                run.kill()
        info = run.describe()
        victim = n - 1
        for r in range(n):
            res = run.result(r)
            assert res.get("checked"), f"rank {r} did not finish its collectives\n{info}"
            assert "barrier" in res["checked"] and len(res["checked"]) >= 16, res["checked"]
            assert res["hostname"] == hostnames[r // per_host]
            assert res["hosts"] == [list(range(per_host)), list(range(per_host, n))], res
            assert res["local"] == [r % per_host, per_host], res
            applied = res["applied"]
            # The interface that reaches MASTER_ADDR (mn0), never oneCCL's own choice (lo).
            assert applied.get("CCL_KVS_IFACE") == "mn0" and applied.get("CCL_MNIC_NAME") == "mn0", applied
            assert "FI_PROVIDER" not in applied, applied  # no shm-only transport across hosts
            # shm inside a host, where oneCCL can tell the hosts apart (it groups shm peers by hostname).
            shm = per_host > 1 and hostnames[0] != hostnames[1]
            assert applied.get("CCL_ATL_SHM") == ("1" if shm else None), applied
        if torchrun:
            assert [p.returncode for p in run.procs] == [0, 0], info
            return
        killed_at = run.result(victim)["killed_at"]
        for r in range(n - 1):
            end = run.rank_end(r)
            assert end is not None, info
            took = end[0] - killed_at
            assert end[1] == 86, f"rank {r} exit {end[1]}\n{info}"
            # + the hang report's wait for the dead rank's answer (STREAMCOLL_HANG_REPORT_S, 2 s)
            assert DEATH_TIMEOUT <= took <= DEATH_TIMEOUT + 2.0 + 2.0, f"rank {r} ended {took:.2f} s after the kill\n{info}"
            # rank 0 hosts the store and exits once its report is done: a slower rank's report may
            # then find the store gone (and says so) instead of naming the dead rank itself
            log = run.log(r)
            assert f"rank {victim} did not answer within 2 s" in log or (
                r != 0 and "could not ask: the store" in log), info
            err = run.log(r)
            assert f"on rank {r} of {n}" in err and f"(timeout {DEATH_TIMEOUT:g} s)" in err, info
        stuck = [f for f in flight.analyze([run.flight_dir]) if f.kind != "missing_dump"]
        assert stuck and stuck[0].ranks == [victim], [f.message for f in stuck]

    def test_uneven_hosts_two_plus_one(tmp_path):
        """2 + 1 ranks on two hosts, no variables (issue 20): every rank gets
        the same CCL_ATL_SHM and the other settings that must agree, and every
        collective is right (before: the host with one rank got no
        CCL_ATL_SHM, its init failed with 'pmrt_kvs_get: decode failed' and
        the others hung until the watchdog)."""
        with netns.Hosts(("node-a", "node-b"), pid_shift=(0, 5)) as hosts:
            run = Run(tmp_path, hosts, (2, 1), "world", env={"MULTIHOST_DEATH": "0"})
            try:
                run.wait(150)
            finally:
                run.kill()
        info = run.describe()
        keys = ("CCL_ALLREDUCE", "CCL_WORKER_OFFLOAD", "CCL_YIELD", "CCL_ATL_SHM", "FI_PROVIDER")
        agreed = []
        for r in range(3):
            res = run.result(r)
            assert res.get("checked") and "barrier" in res["checked"], f"rank {r} did not finish\n{info}"
            assert res["hosts"] == [[0, 1], [2]] and res["local"] == [[0, 2], [1, 2], [0, 1]][r], res
            assert res["applied"].get("CCL_KVS_IFACE") == "mn0", res
            agreed.append(tuple(res["applied"].get(k) for k in keys))
        assert len(set(agreed)) == 1 and agreed[0][3] == "1" and agreed[0][4] is None, agreed

    def test_switch_is_cleaned_up_after_a_failure_and_a_crash():
        """Four hosts on a switch: a set-up step that fails deletes every
        namespace made so far (the switch's too), and the namespaces of a
        creator that was SIGKILLed are swept by the next ``Hosts``."""
        def ours(prefix):
            return sorted(n for n in os.listdir(netns.NETNS_DIR) if n.startswith(prefix))
        bad = netns.Hosts(("a", "b", "c", "d"), subnet="10.77.999")  # an address ip refuses, after the switch exists
        with pytest.raises(subprocess.CalledProcessError):
            bad.__enter__()
        assert ours(f"{netns.PREFIX}{os.getpid()}-") == [], "a failed set-up left namespaces"
        code = ("import sys, time; sys.path.insert(0, %r); import netns\n"
                "netns.Hosts(('a', 'b', 'c', 'd')).__enter__(); print('up', flush=True); time.sleep(60)" % TESTS)
        p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
        try:
            assert p.stdout.readline().strip() == "up"
            left = ours(f"{netns.PREFIX}{p.pid}-")
        finally:
            p.kill()
            p.wait(10)
        assert len(left) == 5 and left[-1].endswith("-sw"), left
        with netns.Hosts(("a", "b")):
            assert ours(f"{netns.PREFIX}{p.pid}-") == []

    def test_four_hosts_against_gloo(tmp_path):
        """4 hosts x 1 rank on one switch (a bridge), no variables (issue
        25): the same collectives on gloo and streamcoll in the same
        processes give the same values; every rank finds four hosts, the
        routed interface, and the transport defaults for 4 ranks on this
        machine's cores (streamcoll.startup.env_defaults)."""
        names = ("node-a", "node-b", "node-c", "node-d")
        with netns.Hosts(names, pid_shift=(0, 5, 10, 15)) as hosts:
            assert hosts.switch
            run = Run(tmp_path, hosts, 1, "against_gloo")
            try:
                run.wait(150)
            finally:
                run.kill()
        info = run.describe()
        over = len(os.sched_getaffinity(0)) < 4  # all four hosts share this machine's cores
        from streamcoll.startup.env_defaults import POW2_ALLREDUCE as env_pow2
        for r in range(4):
            res = run.result(r)
            assert len(res.get("compared", ())) == 9, f"rank {r} did not finish\n{info}"
            assert res["hosts"] == [[0], [1], [2], [3]], res
            applied = res["applied"]
            assert applied.get("CCL_KVS_IFACE") == "mn0" and applied.get("CCL_MNIC_NAME") == "mn0", applied
            assert "FI_PROVIDER" not in applied and "CCL_ATL_SHM" not in applied, applied
            assert applied.get("CCL_WORKER_OFFLOAD") == ("1" if over else "0"), applied
            assert applied.get("CCL_YIELD") == ("sleep" if over else None), applied  # not sched_yield (issue 25)
            assert applied.get("CCL_ALLREDUCE") == ("nreduce" if over else env_pow2), applied

    def test_same_hostname_and_pid_fails_at_once(tmp_path):
        """Equal hostnames and equal process ids on the two hosts (containers
        started alike): oneCCL's key-value store would fail and hang; every
        rank raises within seconds instead, naming the ranks and the cause."""
        with netns.Hosts(("node", "node")) as hosts:
            run = Run(tmp_path, hosts, 1, "fail_fast")
            try:
                run.wait(90)
            finally:
                run.kill()
        info = run.describe()
        for r in range(2):
            res = run.result(r)
            assert res.get("raised") == "CommunicatorError", info
            msg = res["message"]
            assert "ranks 0 and 1 (hostname 'node', pid " in msg, msg
            assert "same hostname and process id on different hosts" in msg, msg
            assert res["elapsed"] < 30, res

    def test_loopback_interface_across_hosts_fails_at_once(tmp_path):
        """``CCL_KVS_IFACE=lo`` set on two hosts (as a single-host setup
        would): rank 0's bootstrap address is 127.0.0.1, which the other host
        cannot reach; every rank raises within seconds, saying so, instead of
        hanging until the watchdog."""
        with netns.Hosts(("node", "node"), pid_shift=(0, 5)) as hosts:
            run = Run(tmp_path, hosts, 1, "fail_fast", env={"CCL_KVS_IFACE": "lo"})
            try:
                run.wait(90)
            finally:
                run.kill()
        info = run.describe()
        for r in range(2):
            res = run.result(r)
            assert res.get("raised") == "CommunicatorError", info
            msg = res["message"]
            assert "advertises its bootstrap address 127.0.0.1, a loopback address" in msg, msg
            assert "but rank 1 is on another host" in msg, msg
            assert "Set MASTER_ADDR" in msg, msg
            assert res["elapsed"] < 30, res

else:
    if sys.argv[1] == "host":
        _host([int(n) for n in sys.argv[2].split(",")], int(sys.argv[3]), sys.argv[4])
    else:
        SCENARIOS[sys.argv[2]]()
