"""Communicator creation's store part at scale (issue 24): a constant
number of store requests per rank, the same topology the all-pairs exchange
computed, and the failures named. Simulated ranks (threads over a few
processes, each rank its own TCPStore client under a counting store) run
the real ``streamcoll.startup.bootstrap.rendezvous``; no native library."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field, replace
from typing import Dict, List, Optional, Tuple

import pytest

from streamcoll.startup import bootstrap, topology
from streamcoll.bench.rendezvous import CountingStore, Server, simulate, synthetic_facts
from streamcoll._ffi.errors import CommunicatorError, RendezvousError
from streamcoll.startup.topology import RankFacts, Route

from world import free_port


# ------------------------------------------------------------ the reference
@dataclass
class AllPairs:
    """What every rank computed before issue 24, from every rank's facts
    (streamcoll/startup/topology.py's Topology at de39bfe, verbatim but for names):
    the reference the published layout must reproduce on every rank."""

    facts: List[RankFacts]
    rank: int
    hosts: List[List[int]] = field(init=False)

    def __post_init__(self) -> None:
        groups: Dict[Tuple[str, Optional[int]], List[int]] = {}
        for f in self.facts:
            groups.setdefault((f.identity, f.node), []).append(f.rank)
        self.hosts = sorted(groups.values(), key=lambda rs: rs[0])

    @property
    def me(self) -> RankFacts:
        return self.facts[self.rank]

    @property
    def host_index(self) -> int:
        return next(i for i, h in enumerate(self.hosts) if self.rank in h)

    @property
    def local_rank(self) -> int:
        return self.hosts[self.host_index].index(self.rank)

    @property
    def local_size(self) -> int:
        return len(self.hosts[self.host_index])

    @property
    def single_host(self) -> bool:
        return len(self.hosts) == 1

    @property
    def one_network(self) -> bool:
        return len({f.network for f in self.facts}) == 1

    @property
    def machine_ranks(self) -> List[int]:
        return [f.rank for f in self.facts if f.machine == self.me.machine]

    @property
    def machine_cores(self) -> int:
        cpus: set = set()
        for r in self.machine_ranks:
            cpus.update(self.facts[r].cpus)
        return max(len(cpus), 1)

    @property
    def oversubscribed(self) -> bool:
        return len(self.machine_ranks) > self.machine_cores

    @property
    def hostnames_tell_hosts_apart(self) -> bool:
        owner: Dict[str, int] = {}
        for i, h in enumerate(self.hosts):
            for r in h:
                if owner.setdefault(self.facts[r].hostname, i) != i:
                    return False
        return True

    def name_clashes(self) -> List[Tuple[int, int]]:
        host = {r: i for i, h in enumerate(self.hosts) for r in h}
        seen: Dict[Tuple[str, int], int] = {}
        out = []
        for f in self.facts:
            first = seen.setdefault((f.hostname, f.pid), f.rank)
            if first != f.rank and host[first] != host[f.rank]:
                out.append((first, f.rank))
        return out

    def loopback_problem(self, advertised: Optional[str]) -> Optional[str]:
        if advertised is None or self.one_network or advertised != "127.0.0.1":
            return None
        others = [r for r in range(len(self.facts)) if r not in self.hosts[0]]
        which = f"rank {others[0]} is" if len(others) == 1 else f"ranks {', '.join(map(str, others))} are"
        return (f"rank 0 advertises its bootstrap address {advertised}, a loopback address, but {which} on "
                f"another host: each host would reach only its own {advertised}")


_VIEW = ("hosts", "host_index", "local_rank", "local_size", "single_host", "one_network", "machine_ranks",
         "machine_cores", "oversubscribed", "hostnames_tell_hosts_apart")


def view(t) -> dict:
    d = {k: getattr(t, k) for k in _VIEW}
    d["clashes"] = t.name_clashes()
    d["loopback"] = t.loopback_problem("127.0.0.1")
    d["me"] = t.me
    return d


def varied_facts(rank: int) -> RankFacts:
    """24 ranks: machine M0 holds hosts 0-5 (one namespace, hostname a) and
    6-11 (another namespace, hostname a too: not told apart); 12-17 and
    18-23 are torchrun nodes 2 and 3 of machine M1 (one namespace, hostnames
    b and c, rank 20 hostname b2); ranks 3 and 21 share a hostname and pid
    across hosts; uneven CPU sets."""
    if rank < 12:
        machine, ns, node, name = "M0", "n0" if rank < 6 else "n1", None, "a"
    else:
        machine, ns, node, name = "M1", "n2", 2 if rank < 18 else 3, "b" if rank < 18 else "c"
    if rank == 20:
        name = "b2"
    pid = 777 if rank in (3, 21) else 100 + rank
    if rank == 21:
        name = "a"
    ident = f"boot={machine} net={ns} ipc=1 pid=1 shm=1"
    cpus = tuple(range(rank % 4)) or (0,)
    route = Route("10.0.0.1", "10.0.0.1", f"10.0.{ns[1]}.1", f"eth{ns[1]}")
    return RankFacts(rank, ident, machine, f"boot={machine} net={ns}", name, pid, node, cpus, route)


# ------------------------------------------------------------------ tests
def test_1024_ranks_in_a_constant_number_of_requests():
    """Before: 1,033 requests per rank and 328 MB through the server at 1024
    ranks (87 s); ``bootstrap.rendezvous`` did not exist."""
    n = 1024
    res = simulate(n, procs=4, timeout=120, keep_topology=True)
    ranks = res["ranks"]
    assert sorted(ranks) == list(range(n))
    errors = [r for r in ranks.values() if "error" in r]
    assert not errors, errors[:3]
    requests = [r["requests"] for r in ranks.values()]
    assert max(requests) <= 8, max(requests)
    # every rank holds rank 0's layout, and that layout gives each rank the all-pairs answer
    facts = [synthetic_facts(r) for r in range(n)]
    expected = topology.to_plain(topology.compute(facts))
    assert all(r["topology"] == expected for r in ranks.values())
    layout = topology.from_plain(topology.Layout, expected)
    for r in (0, 1, 7, 8, 500, 1023):
        assert view(topology.Topology(layout, r, facts[r])) == view(AllPairs(facts, r)), r
    # what each rank receives grows with hosts, not with ranks times CPU lists
    received = max(r["bytes_in"] for r in ranks.values() if r["rank"] != 0)
    assert received < 20_000, received


def test_every_rank_gets_the_all_pairs_topology():
    """Several hosts per machine, torchrun nodes, several hostnames per host,
    a hostname+pid clash: each rank's view equals the all-pairs computation."""
    n = 24
    res = simulate(n, procs=2, timeout=60, keep_topology=True, facts=varied_facts)
    facts = [varied_facts(r) for r in range(n)]
    for r, out in sorted(res["ranks"].items()):
        assert "error" not in out, out
        assert out["requests"] <= 8
        layout = topology.from_plain(topology.Layout, out["topology"])
        mine = RankFacts.from_json(out["me"])
        assert view(topology.Topology(layout, r, mine)) == view(AllPairs(facts, r)), r
    ref = AllPairs(facts, 0)
    assert ref.name_clashes() == [(3, 21)] and not ref.hostnames_tell_hosts_apart and len(ref.hosts) == 4


def test_a_rank_that_never_arrives_is_named_on_every_rank():
    res = simulate(8, procs=2, timeout=3, absent=[5])
    assert res["wall_s"] < 3 + 5, res["wall_s"]
    for r, out in res["ranks"].items():
        assert out.get("error") == "RendezvousError", out
        assert out["missing"] == [5], out
        assert "rank 5" in out["message"], out["message"]
    assert "rank 5 never joined within 3 s" in res["ranks"][0]["message"]
    progress = [line for line in res["logs"] if "waiting for rank 5 to join communicator" in line]
    assert any(line.startswith("streamcoll: rank 0 ") for line in progress), res["logs"]
    assert any("rank 0 says" in line for line in progress), res["logs"]  # the others name it too


def test_rank_0_that_never_comes_leaves_a_clear_error_within_the_timeout():
    res = simulate(6, procs=2, timeout=3, absent=[0])
    assert res["wall_s"] < 3 + 5, res["wall_s"]
    for out in res["ranks"].values():
        assert out.get("error") == "RendezvousError" and out["missing"] == [0], out
        assert "rank 0 published nothing within 3 s" in out["message"], out["message"]


_RANK0 = r"""
import sys, time, datetime, torch.distributed as dist
from streamcoll.startup import bootstrap
from streamcoll.bench.rendezvous import synthetic_facts
port = int(sys.argv[1])
store = dist.TCPStore("127.0.0.1", port, 1, True, datetime.timedelta(seconds=60), wait_for_workers=False)
print("SERVING", flush=True)
bootstrap.rendezvous(store, 0, 3, timeout=30, facts=synthetic_facts(0), make_uid=lambda t, n: b"u")
"""

_RANK1 = r"""
import sys, time, datetime, torch.distributed as dist
from streamcoll import RendezvousError
from streamcoll.startup import bootstrap
from streamcoll.bench.rendezvous import synthetic_facts
store = dist.TCPStore("127.0.0.1", int(sys.argv[1]), 1, False, datetime.timedelta(seconds=60))
print("JOINED", flush=True)
t0 = time.monotonic()
try:
    bootstrap.rendezvous(store, 1, 3, timeout=30, facts=synthetic_facts(1), make_uid=lambda t, n: b"u")
except RendezvousError as e:
    print(f"RAISED {time.monotonic() - t0:.1f} {e.missing} {e}", flush=True)
"""


def test_rank_0_that_dies_hosting_the_store_gives_a_clear_error_at_once(tmp_path):
    """env:// without torchrun: rank 0 hosts the store; SIGKILLed while it
    waits for rank 2, rank 1 raises a RendezvousError naming rank 0 long
    before its 30 s timeout."""
    port = free_port()
    env = dict(os.environ, RES_OPTIONS="use-vc")
    r0 = subprocess.Popen([sys.executable, "-c", _RANK0, str(port)], env=env, stdout=subprocess.PIPE, text=True)
    r1 = None
    try:
        assert r0.stdout.readline().strip() == "SERVING"
        r1 = subprocess.Popen([sys.executable, "-c", _RANK1, str(port)], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
        assert r1.stdout.readline().strip() == "JOINED"
        time.sleep(1.0)
        r0.send_signal(signal.SIGKILL)
        out, err = r1.communicate(timeout=60)
    finally:
        for p in (r0, r1):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait()
    line = [x for x in out.splitlines() if x.startswith("RAISED")]
    assert line, out + err
    took = float(line[0].split()[1])
    assert took < 10, line
    assert "[0]" in line[0] and "the store stopped answering" in line[0] and "rank 0" in line[0], line


def _threads(n: int, target) -> List[object]:
    out: List[object] = [None] * n
    def run(r: int) -> None:
        try:
            out[r] = target(r)
        except Exception as e:  # noqa: BLE001 - the result under test
            out[r] = e
    ts = [threading.Thread(target=run, args=(r,)) for r in range(n)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(60)
    return out


def test_rank_0s_error_reaches_every_rank():
    """An error raised on rank 0 after the facts met (the computation,
    ``make_uid``: e.g. the hostname/pid clash refusal) is published: the
    others raise it at once instead of timing out."""
    import torch.distributed as dist
    with Server(30) as server:
        def rank(r: int):
            s = CountingStore(dist.TCPStore("127.0.0.1", server.port, 1, False))

            def make_uid(topo, name):
                raise CommunicatorError(f"init of communicator {name!r}: no can do")
            t0 = time.monotonic()
            try:
                bootstrap.rendezvous(s, r, 3, timeout=20, facts=synthetic_facts(r), make_uid=make_uid)
            finally:
                s.took = time.monotonic() - t0
        out = _threads(3, rank)
    for r, e in enumerate(out):
        assert isinstance(e, CommunicatorError) and "init of communicator 'default': no can do" in str(e), (r, e)
    assert "reported by rank 0" in str(out[1])


def test_store_requests_of_a_derived_subgroup():
    """``known`` (a subgroup's topology derived from its parent's): rank 0
    reads no facts, every rank still gets the layout, requests stay constant."""
    import torch.distributed as dist
    facts = [varied_facts(r) for r in range(24)]
    parent = topology.Topology.from_facts(facts, 0)
    members = [0, 5, 12, 20]
    with Server(30) as server:
        stores = [CountingStore(dist.TCPStore("127.0.0.1", server.port, 1, False)) for _ in members]

        def rank(i: int):
            known = parent.subgroup(members, 0) if i == 0 else None
            mine = topology.Topology.from_facts(facts, members[i]).subgroup(members, i).me
            return bootstrap.rendezvous(stores[i], i, len(members), timeout=20, facts=mine, known=known,
                                        make_uid=lambda t, n: b"u")
        out = _threads(len(members), rank)
    sub = [replace(facts[m], rank=i) for i, m in enumerate(members)]  # what an exchange among them would see
    for i, m in enumerate(out):
        assert isinstance(m, bootstrap.Meeting), m
        ref, got = AllPairs(sub, i), m.topology
        assert got.hosts == ref.hosts == [[0, 1], [2], [3]] and got.rank == i
        for k in ("local_rank", "local_size", "single_host", "one_network", "machine_ranks"):
            assert getattr(got, k) == getattr(ref, k), k
        # hosts keep their parent's hostnames: never "apart" where an exchange would say not
        assert got.hostnames_tell_hosts_apart <= ref.hostnames_tell_hosts_apart
        assert got.name_clashes() == ref.name_clashes() == []
    # rank 0: add, compare_set (its slot: issue 33), wait, set; others: add, compare_set, wait, get
    assert [s.requests for s in stores] == [4, 4, 4, 4]
    own = len(topology.Topology.from_facts(facts, members[0]).subgroup(members, 0).me.to_json())
    assert stores[0].bytes_in < 100 + own  # rank 0 read nobody's facts (its slot's compare_set returns its own)
