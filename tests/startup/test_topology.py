"""Topology from facts (issue 13): host grouping, the route to the
rendezvous, the several-host defaults table, the rendezvous error that names
missing ranks, and what ``info`` and the debug log record. Pure CPU, no
second process (the simulated hosts are ``test_multihost.py``)."""
from __future__ import annotations

import dataclasses
import io
import logging
import os
import socket
import struct

import pytest

from streamcoll.startup import env_defaults as env, topology
from streamcoll.startup.topology import RankFacts, Route, Topology


def _facts(rank, ident="A", machine="M", network="N", hostname="h", pid=None, node=None, cpus=(0, 1), route=None):
    return RankFacts(rank, ident, machine, network, hostname, pid if pid is not None else 100 + rank, node,
                     tuple(cpus), route)


def test_route_to_loopback_and_unresolvable():
    r = topology.route_to("127.0.0.1")
    assert (r.local, r.iface, r.loopback, r.error) == ("127.0.0.1", "lo", True, "")
    bad = topology.route_to("no-such-host.invalid")
    assert bad.iface is None and "cannot resolve" in bad.error
    assert topology.interface_of("127.0.0.1") == "lo"
    assert topology.interface_of("not an address") is None


def test_rank_facts_round_trip_and_identity():
    f = topology.local_facts(3)
    assert RankFacts.from_json(f.to_json()) == f
    ident, machine, network = topology.host_identity()
    assert ident.startswith(network) and machine in network
    assert "net=" in network and "ipc=" in ident and "pid=" in ident and "shm=" in ident
    assert socket.gethostname() not in ident  # hostnames do not decide


def test_hosts_from_identity_and_launcher_node():
    # Same hostname everywhere; identities differ between the two pairs.
    t = Topology.from_facts([_facts(0, "A"), _facts(1, "A"), _facts(2, "B"), _facts(3, "B")], rank=3)
    assert t.hosts == [[0, 1], [2, 3]] and not t.single_host
    assert (t.host_index, t.local_rank, t.local_size) == (1, 1, 2)
    assert not t.hostnames_tell_hosts_apart  # oneCCL would mix them up: no CCL_ATL_SHM
    # One identity, but torchrun put the ranks on two nodes.
    t = Topology.from_facts([_facts(0, node=0), _facts(1, node=1)], rank=0)
    assert t.hosts == [[0], [1]] and t.one_network
    # One identity, one node: one host.
    assert Topology.from_facts([_facts(0), _facts(1)], rank=1).single_host


def test_oversubscription_counts_the_machine_not_the_host():
    fs = [_facts(r, "A" if r < 2 else "B", machine="M", cpus=(0, 1)) for r in range(4)]
    t = Topology.from_facts(fs, rank=0)
    assert t.local_size == 2 and t.machine_ranks == [0, 1, 2, 3] and t.machine_cores == 2 and t.oversubscribed
    fs = [_facts(r, "A" if r < 2 else "B", machine="M" if r < 2 else "M2") for r in range(4)]
    assert not Topology.from_facts(fs, rank=0).oversubscribed
    fs = [_facts(r, "A" if r < 2 else "B", cpus=(r,)) for r in range(4)]  # disjoint cpusets on one machine
    assert not Topology.from_facts(fs, rank=0).oversubscribed


def test_name_clash_and_loopback_problem():
    fs = [_facts(0, "A", network="N1", hostname="node", pid=7), _facts(1, "B", network="N2", hostname="node", pid=7)]
    assert Topology.from_facts([_facts(0, pid=7), _facts(1, pid=7)], rank=0).name_clashes() == []  # one host: no clash
    t = Topology.from_facts(fs, rank=1)
    assert t.name_clashes() == [(0, 1)]
    msg = t.loopback_problem("127.0.0.1")
    assert "advertises its bootstrap address 127.0.0.1, a loopback address, but rank 1 is on another host" in msg
    assert t.loopback_problem("10.77.0.1") is None
    same_net = Topology.from_facts([_facts(0, node=0), _facts(1, node=1)], rank=0)
    assert same_net.loopback_problem("127.0.0.1") is None  # two nodes, one network namespace: loopback works


def test_advertised_address_formats():
    uid = b"10.77.0.1_4096".ljust(256, b"\0")
    assert topology.advertised_address("oneccl", uid) == ("10.77.0.1", 4096)
    nccl = struct.pack("<Q", 123) + struct.pack("<H", socket.AF_INET) + struct.pack(">H", 5000) + \
        socket.inet_aton("192.0.2.7") + bytes(128 - 16)
    assert topology.advertised_address("nccl", nccl) == ("192.0.2.7", 5000)
    assert topology.advertised_address("oneccl", b"garbage".ljust(256, b"\0")) is None


def _route(iface="mn0"):
    return Route("10.77.0.1", "10.77.0.1", "10.77.0.2", iface)


def _hosts(layout, hostnames=None, cpus=(0, 1), machines=None, bound=None, defaults=None):
    """Facts for ``layout`` (ranks per host), host i on machine i unless ``machines`` says otherwise."""
    fs, r = [], 0
    for h, n in enumerate(layout):
        for _ in range(n):
            fs.append(RankFacts(r, f"H{h}", (machines or {}).get(h, f"M{h}"), f"N{h}",
                                (hostnames or {}).get(h, f"node{h}"), 100 + r, h, tuple(cpus), _route(),
                                tuple((bound or {}).get(r, ())), (defaults or {}).get(r, True)))
            r += 1
    return fs


def test_several_hosts_defaults():
    plan = env.plan(Topology.from_facts(_hosts([1, 1]), 1), "oneccl", environ={}, running={})
    assert plan == {"CCL_KVS_IFACE": "mn0", "CCL_MNIC_NAME": "mn0", "CCL_WORKER_OFFLOAD": "0",
                    "CCL_ALLREDUCE": "recursive_doubling:0-16384;nreduce:16385-max", "CCL_LOCAL_RANK": "0",
                    "CCL_LOCAL_SIZE": "1", "CCL_LOG_LEVEL": "error"}, plan
    assert env.agreed_defaults(Topology.from_facts(_hosts([2, 1]), 0))["CCL_ALLREDUCE"] == "nreduce"
    over = env.agreed_defaults(Topology.from_facts(_hosts([2, 2], machines={1: "M0"}), 0))  # 4 ranks, 2 cores
    assert over == {"CCL_WORKER_OFFLOAD": "1", "CCL_YIELD": "sleep", "CCL_ATL_SHM": "1", "CCL_ALLREDUCE": "nreduce"}, over


def test_oversubscribed_hosts_sleep_one_host_yields():
    """4 hosts x 1 rank on one 2-core machine (issue 25): the worker thread
    waits by sleeping (oneCCL's ``nanosleep(0)``), which leaves the cores to
    the kernel's TCP work, and the all-reduce is nreduce (measured, not
    oneCCL's own choice); on one host (shared memory, no kernel work) the
    measured ``sched_yield`` stays."""
    four = env.agreed_defaults(Topology.from_facts(_hosts([1, 1, 1, 1], machines={1: "M0", 2: "M0", 3: "M0"}), 2))
    assert four == {"CCL_WORKER_OFFLOAD": "1", "CCL_YIELD": "sleep", "CCL_ALLREDUCE": "nreduce"}, four
    one = env.agreed_defaults(Topology.from_facts(_hosts([3]), 0))  # 3 ranks, 2 cores, one host
    assert one["CCL_WORKER_OFFLOAD"] == "1" and one["CCL_YIELD"] == "sched_yield", one
    spare = env.agreed_defaults(Topology.from_facts(_hosts([1, 1, 1, 1], cpus=tuple(range(8)),
                                                             machines={1: "M0", 2: "M0", 3: "M0"}), 0))
    assert spare["CCL_WORKER_OFFLOAD"] == "0" and "CCL_YIELD" not in spare, spare  # a core each: spin
    same_name = Topology.from_facts(_hosts([2, 2], hostnames={1: "node0"}), 0)
    assert "CCL_ATL_SHM" not in env.agreed_defaults(same_name)  # oneCCL would mix the hosts up
    assert "CCL_KVS_IFACE" not in env.plan(Topology.from_facts([dataclasses.replace(f, route=None) for f in _hosts([1, 1])], 0), "oneccl", environ={}, running={})
    assert env.plan(Topology.from_facts(_hosts([1, 1]), 0), "nccl", environ={}, running={}) == {"NCCL_SOCKET_IFNAME": "=mn0"}


def test_uneven_hosts_agree_on_shm():
    """2 + 1 ranks: the host with one rank gets CCL_ATL_SHM=1 too (before:
    none there, and its init failed, 'pmrt_kvs_get: decode failed')."""
    fs = _hosts([2, 1])
    plans = [env.plan(Topology.from_facts(fs, r), "oneccl", environ={}, running={}) for r in range(3)]
    assert [p.get("CCL_ATL_SHM") for p in plans] == ["1", "1", "1"], plans
    assert [p["CCL_LOCAL_SIZE"] for p in plans] == ["2", "2", "1"]
    keys = ("CCL_ALLREDUCE", "CCL_WORKER_OFFLOAD", "CCL_YIELD", "CCL_ATL_SHM", "FI_PROVIDER")
    assert len({tuple(p.get(k) for k in keys) for p in plans}) == 1, plans


def test_user_values_are_kept_and_ccl_mnic_gets_no_mnic_name():
    """The user's CCL_MNIC (oneCCL's multi-NIC selection) gets no
    CCL_MNIC_NAME beside it, which would narrow it to one interface
    (before: CCL_MNIC_NAME set anyway); a user's CCL_MNIC_NAME is kept."""
    topo = Topology.from_facts(_hosts([2, 2]), 1)
    plan = env.plan(topo, "oneccl", environ={"CCL_MNIC": "global", "CCL_MNIC_COUNT": "4"}, running={})
    assert "CCL_MNIC_NAME" not in plan and plan["CCL_KVS_IFACE"] == "mn0", plan
    plan = env.plan(topo, "oneccl", environ={"CCL_MNIC_NAME": "ib0"}, running={})
    assert "CCL_MNIC_NAME" not in plan and plan["CCL_LOCAL_RANK"] == "1" and "FI_PROVIDER" not in plan, plan
    assert env.plan(topo, "oneccl", environ={"STREAMCOLL_NO_ENV_DEFAULTS": "1"}) == {}


def test_agreement_table_covers_every_native_variable():
    from streamcoll.core import env_vars
    native = {v.name for v in env_vars.TABLE if v.name.startswith(("CCL_", "FI_", "NCCL_"))}
    assert native == set(env.AGREEMENT), native ^ set(env.AGREEMENT)
    assert set(env.MUST_AGREE) == {"CCL_ALLREDUCE", "CCL_WORKER_OFFLOAD", "CCL_YIELD", "CCL_ATL_SHM",
                                   "FI_PROVIDER", "CCL_ATL_TRANSPORT"}


def test_conflicts_name_the_variable_ranks_and_values():
    user = (("CCL_ALLREDUCE", "ring", env.USER),)
    t = Topology.from_facts(_hosts([3], bound={2: user}), 0)
    assert t.agreed.conflicts_for("nccl") == []  # not NCCL's variable
    (msg,) = t.agreed.conflicts_for("oneccl")
    assert msg == ("CCL_ALLREDUCE: ranks 0, 1: 'nreduce' (streamcoll's default); rank 2: 'ring' (set by the user)"), msg
    # The same value everywhere is no conflict; neither is one rank's value equal to the default.
    assert not Topology.from_facts(_hosts([3], bound={r: user for r in range(3)}), 0).agreed.conflicts
    assert not Topology.from_facts(_hosts([3], bound={1: (("CCL_ALLREDUCE", "nreduce", env.USER),)}), 0).agreed.conflicts
    # Defaults off on one rank: its values are unset, the others' are not.
    off = Topology.from_facts(_hosts([2], defaults={1: False}), 0).agreed.conflicts
    assert "rank 1: unset (unset)" in off["CCL_WORKER_OFFLOAD"], off
    # A rank whose oneCCL already runs: the others take its values (it cannot change them) ...
    running = tuple((k, v, env.IN_EFFECT) for k, v in (("CCL_ALLREDUCE", "ring"), ("CCL_WORKER_OFFLOAD", "0"),
                                                       ("CCL_YIELD", None), ("CCL_ATL_SHM", "1"),
                                                       ("FI_PROVIDER", "shm"), ("CCL_ATL_TRANSPORT", None)))
    t = Topology.from_facts(_hosts([2], bound={0: running}), 1)
    assert not t.agreed.conflicts and t.agreed.values["CCL_ALLREDUCE"] == "ring"
    assert env.plan(t, "oneccl", environ={}, running={})["CCL_ALLREDUCE"] == "ring"
    # ... unless a user's value on another rank contradicts it.
    t = Topology.from_facts(_hosts([2], bound={0: running, 1: (("CCL_ALLREDUCE", "nreduce", env.USER),)}), 1)
    assert "rank 0: 'ring' (in effect since this process's first oneCCL init)" in t.agreed.conflicts["CCL_ALLREDUCE"]


def test_core_each_matches_ranks_to_cores():
    assert topology.core_each([(0,), (1,)]) and topology.core_each([(0, 1), (0,)])
    assert not topology.core_each([(0,), (0,)]) and not topology.core_each([(0,), (0,), (0, 1, 2)])
    assert topology.core_each([(0, 1), (0, 1)]) and not topology.core_each([(0, 1)] * 3)


def test_applied_values_do_not_stay_in_the_environment(monkeypatch):
    """Set around the native call, removed after; a user's value is left
    alone, and what streamcoll holds is not mistaken for the user's."""
    monkeypatch.delenv("CCL_YIELD", raising=False)
    monkeypatch.setenv("CCL_KVS_IFACE", "eth9")
    with env.applied({"CCL_YIELD": "sched_yield", "CCL_KVS_IFACE": "lo"}, "nccl"):
        assert os.environ["CCL_YIELD"] == "sched_yield" and os.environ["CCL_KVS_IFACE"] == "eth9"
        assert "CCL_YIELD" not in env._user_env() and env._user_env()["CCL_KVS_IFACE"] == "eth9"
    assert "CCL_YIELD" not in os.environ and os.environ["CCL_KVS_IFACE"] == "eth9"
    assert env.APPLIED["CCL_YIELD"] == "sched_yield"


def test_rendezvous_address_from_store(monkeypatch):
    import torch.distributed as dist
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    s = dist.TCPStore("127.0.0.1", 0, 1, True, wait_for_workers=False)
    assert topology.rendezvous_address(dist.PrefixStore("x/", s)) == "127.0.0.1"
    assert topology.rendezvous_address(dist.HashStore()) is None
    monkeypatch.setenv("MASTER_ADDR", "10.77.0.1")
    assert topology.rendezvous_address(s) == "10.77.0.1"


def test_info_reports_several_host_defaults_and_route(monkeypatch):
    from streamcoll.__main__ import info
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    for k in ("CCL_KVS_IFACE", "CCL_MNIC_NAME", "NCCL_SOCKET_IFNAME", "STREAMCOLL_NO_ENV_DEFAULTS", "CCL_YIELD"):
        monkeypatch.delenv(k, raising=False)
    # a fresh process's view: no oneCCL values bound by an earlier init in this one (an earlier
    # test's env.applied record made the oversubscribed case keep sched_yield, order-dependent)
    monkeypatch.setattr(env, "APPLIED", {})
    out = io.StringIO()
    assert info(out) == 0
    text = out.getvalue()
    assert "route to the rendezvous: 127.0.0.1 on lo (to 127.0.0.1)" in text, text
    assert "defaults on several hosts, e.g. 2 hosts x 2 rank(s), a core each" in text, text
    # several hosts with ranks sharing cores: waiting ranks sleep (issue 25's 4 x 1 / 2 x 2 measurements)
    assert "more ranks on this machine than cores" in text and "CCL_YIELD=sleep" in text, text
    assert "CCL_MNIC_NAME=lo" in text and "NCCL_SOCKET_IFNAME==lo" in text, text
    assert "host identity (ranks with the same one share a host): boot=" in text, text


def test_init_logs_topology_and_applied_defaults(caplog):
    import torch.distributed as dist
    import streamcoll
    saved = dict(env.APPLIED)
    caplog.set_level(logging.DEBUG, logger="streamcoll")
    c = streamcoll.new_communicator(backend="oneccl", device="cpu", rank=0, world_size=1, store=dist.HashStore())
    try:
        assert c.topology.single_host and c.topology.local_size == 1
        lines = [r.getMessage() for r in caplog.records if r.name == "streamcoll"]
        assert any("1 ranks on 1 host(s)" in m and "defaults applied:" in m for m in lines), lines
    finally:
        c.destroy()
        env.APPLIED.clear()
        env.APPLIED.update(saved)


def test_dataclasses_are_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        Route("a", None, None, None).iface = "x"  # type: ignore[misc]


def test_simulated_hosts_get_a_clean_environment(monkeypatch):
    """The multihost tier's ranks start without the suite's loopback settings
    (scripts/test.sh exports MASTER_ADDR=127.0.0.1 CCL_KVS_IFACE=lo ...)."""
    import netns
    for k, v in {"MASTER_ADDR": "127.0.0.1", "CCL_KVS_IFACE": "lo", "NCCL_SOCKET_IFNAME": "lo",
                 "FI_PROVIDER": "shm", "RANK": "3", "GLOO_SOCKET_IFNAME": "lo"}.items():
        monkeypatch.setenv(k, v)
    e = netns.clean_env({"MASTER_ADDR": "10.77.0.1"})
    assert e["MASTER_ADDR"] == "10.77.0.1" and "PATH" in e
    assert not {"CCL_KVS_IFACE", "NCCL_SOCKET_IFNAME", "FI_PROVIDER", "RANK", "GLOO_SOCKET_IFNAME"} & set(e)
    why = netns.unavailable()
    assert why is None or isinstance(why, str) and why  # a reason to skip with, or nothing


def test_facts_and_agreement_travel_as_json():
    """What a rank reports (its bound values, whether it applies defaults)
    and what the topology decides survive the store's JSON."""
    import json
    f = dataclasses.replace(topology.local_facts(0), defaults=False,
                            bound=(("CCL_ALLREDUCE", "ring", env.USER), ("CCL_YIELD", None, env.IN_EFFECT)))
    assert RankFacts.from_json(f.to_json()) == f
    a = Topology.from_facts(_hosts([2, 1], bound={1: (("CCL_ATL_SHM", "0", env.USER),)}), 0).agreed
    assert a.conflicts and env.Agreed.from_json(json.loads(json.dumps(a.to_json()))) == a


def test_fields_added_to_the_dataclasses_travel():
    """The layout and the facts cross the store generically (from the
    dataclasses' declarations): a field added to either (issue 20 adds some)
    comes back without changes to the exchange."""
    from dataclasses import make_dataclass
    from typing import Dict, Optional, Tuple
    Extra = make_dataclass("Extra", [("settings", Dict[str, str], dataclasses.field(default_factory=dict)),
                                     ("labels", Tuple[str, ...], ()),
                                     ("mixed", Optional[Tuple[int, str]], None)],
                           bases=(topology.Layout,), frozen=True)
    globals()["Extra"] = Extra  # get_type_hints resolves the bases' annotations in their modules
    base = topology.compute([_facts(0, "A"), _facts(1, "B", node=1)])
    x = Extra(**{f.name: getattr(base, f.name) for f in dataclasses.fields(base)},
              settings={"CCL_ATL_SHM": "1"}, labels=("a", "b"), mixed=(3, "x"))
    import json
    back = topology.from_plain(Extra, json.loads(json.dumps(topology.to_plain(x))))
    assert back == x
    old = topology.to_plain(base)  # a peer that does not know the new fields: their defaults
    assert topology.from_plain(topology.Layout, dict(old, unknown=1)) == base
    f = _facts(3, cpus=(0, 1, 2, 3, 8, 10, 11))
    assert '"cpus":"0..3,8,10..11"' in f.to_json() and RankFacts.from_json(f.to_json()) == f
    assert topology.parse_runs(topology.run_text((5, 6, 7, 1, -2, -1))) == (5, 6, 7, 1, -2, -1)




def test_namespace_probe_names_what_is_missing(monkeypatch):
    """The multihost tier's skip reason names the missing tool, then root."""
    import shutil

    import netns
    which = shutil.which
    monkeypatch.setattr(shutil, "which", lambda t: None if t == "unshare" else which(t) or f"/usr/bin/{t}")
    assert netns.unavailable() == "`unshare` is not installed"
    monkeypatch.setattr(shutil, "which", lambda t: which(t) or f"/usr/bin/{t}")
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert netns.unavailable() == "creating network namespaces needs root (ip netns add)"


def test_a_first_communicator_short_of_the_launchers_world_runs_over_tcp():
    """Issue 32: oneCCL's transport is made by a process's first
    communicator with a peer map of that communicator's size, and its shm
    path misroutes later peers from outside it. So a communicator whose
    ranks know the launcher's world is larger than it runs over TCP (where
    no rank's oneCCL runs yet: a value in effect wins, see
    test_agreement), on one host and across hosts; the whole world, or an
    unknown world size, keeps shared memory."""
    def with_job(fs, size):
        return [dataclasses.replace(f, job_size=size) for f in fs]

    part = Topology.from_facts(with_job(_hosts([2]), 4), 0)
    assert not part.spans_job
    d = env.agreed_defaults(part)
    assert (d["CCL_ATL_SHM"], d["FI_PROVIDER"]) == ("0", "tcp"), d
    whole = env.agreed_defaults(Topology.from_facts(with_job(_hosts([4]), 4), 0))
    assert (whole["CCL_ATL_SHM"], whole["FI_PROVIDER"]) == ("1", "shm"), whole
    unknown = env.agreed_defaults(Topology.from_facts(_hosts([2]), 0))
    assert unknown["FI_PROVIDER"] == "shm", unknown
    across = env.agreed_defaults(Topology.from_facts(with_job(_hosts([2, 2]), 8), 0))
    assert across["CCL_ATL_SHM"] == "0" and "FI_PROVIDER" not in across, across
    # a sub-group derived from the world keeps the world's decision (the world was first)
    world = Topology.from_facts(with_job(_hosts([4]), 4), 0)
    assert world.subgroup([0, 2], 0).agreed.values["FI_PROVIDER"] == "shm"


_OWN_DEFAULTS = (("STREAMCOLL_WIDEN_BF16", "1", env.DEFAULT), ("STREAMCOLL_SIGNATURE_CHECKS", "256", env.DEFAULT),
                 ("STREAMCOLL_DEBUG_CHECKS", "0", env.DEFAULT))


def _own(**changed):
    """streamcoll's own settings as a rank reports them, ``changed`` (name: (value, source)) replaced."""
    return tuple((k, *changed[k]) if k in changed else (k, v, s) for k, v, s in _OWN_DEFAULTS)


def test_streamcolls_own_settings_must_agree_like_oneccls():
    """Issue 42, finding 5: streamcoll's own variables that change which C
    call a rank makes (STREAMCOLL_WIDEN_BF16) or which checks it runs
    (STREAMCOLL_SIGNATURE_CHECKS and its bound, STREAMCOLL_DEBUG_CHECKS or
    TORCH_DISTRIBUTED_DEBUG=DETAIL) travel in every rank's facts and are
    agreed by the one function that agrees oneCCL's (before: only oneCCL's
    were compared; one rank with STREAMCOLL_WIDEN_BF16=0 hung both at
    100,000 elements)."""
    def topo(changes):
        fs = [dataclasses.replace(f, own=_own(**changes.get(f.rank, {}))) for f in _hosts([3])]
        return Topology.from_facts(fs, 0)

    t = topo({2: {"STREAMCOLL_WIDEN_BF16": ("0", env.USER)}})
    (msg,) = t.agreed.conflicts_for("oneccl")
    assert msg == "STREAMCOLL_WIDEN_BF16: ranks 0, 1: '1' (streamcoll's default); rank 2: '0' (set by the user)", msg
    assert t.agreed.conflicts_for("nccl") == []  # no dtype is widened on NCCL: it may differ there
    t = topo({0: {"STREAMCOLL_SIGNATURE_CHECKS": ("16", env.USER)}})
    for backend in ("oneccl", "nccl"):  # the checks' store protocol is every backend's
        (msg,) = t.agreed.conflicts_for(backend)
        assert msg == ("STREAMCOLL_SIGNATURE_CHECKS: rank 0: '16' (set by the user); ranks 1, 2: '256' "
                       "(streamcoll's default)"), msg
    t = topo({1: {"STREAMCOLL_DEBUG_CHECKS": ("1", "TORCH_DISTRIBUTED_DEBUG=DETAIL")}})
    (msg,) = t.agreed.conflicts_for("nccl")
    assert "rank 1: '1' (TORCH_DISTRIBUTED_DEBUG=DETAIL)" in msg and "ranks 0, 2: '0'" in msg, msg
    # One effective value reached by different spellings is no conflict; the agreed values are
    # the layout's, kept by sub-groups derived from it (their communicators run with them).
    t = topo({0: {"STREAMCOLL_DEBUG_CHECKS": ("1", env.USER)},
              1: {"STREAMCOLL_DEBUG_CHECKS": ("1", "TORCH_DISTRIBUTED_DEBUG=DETAIL")},
              2: {"STREAMCOLL_DEBUG_CHECKS": ("1", env.USER), "STREAMCOLL_WIDEN_BF16": ("1", env.USER)}})
    assert not t.agreed.conflicts, t.agreed.conflicts
    want = {"STREAMCOLL_WIDEN_BF16": "1", "STREAMCOLL_SIGNATURE_CHECKS": "256", "STREAMCOLL_DEBUG_CHECKS": "1"}
    assert t.agreed.own == want and t.subgroup([0, 2], 1).agreed.own == want
    import json
    assert env.Agreed.from_json(json.loads(json.dumps(t.agreed.to_json()))) == t.agreed


def test_own_settings_as_a_rank_reads_them(monkeypatch):
    """What a rank reports: the effective value (so `true` and `1`, or
    TORCH_DISTRIBUTED_DEBUG=DETAIL and STREAMCOLL_DEBUG_CHECKS=1, agree) and
    where it comes from; a malformed bound travels as it is (every rank
    then refuses together, before the native init) instead of raising on
    one rank only, which would leave the others waiting for it."""
    for k in ("STREAMCOLL_WIDEN_BF16", "STREAMCOLL_SIGNATURE_CHECKS", "STREAMCOLL_DEBUG_CHECKS",
              "TORCH_DISTRIBUTED_DEBUG"):
        monkeypatch.delenv(k, raising=False)
    assert env.own() == _OWN_DEFAULTS
    monkeypatch.setenv("STREAMCOLL_WIDEN_BF16", "off")
    monkeypatch.setenv("STREAMCOLL_SIGNATURE_CHECKS", " 064")
    monkeypatch.setenv("TORCH_DISTRIBUTED_DEBUG", "detail")
    assert env.own() == (("STREAMCOLL_WIDEN_BF16", "0", env.USER), ("STREAMCOLL_SIGNATURE_CHECKS", "64", env.USER),
                         ("STREAMCOLL_DEBUG_CHECKS", "1", "TORCH_DISTRIBUTED_DEBUG=DETAIL"))
    assert dict((k, v) for k, v, _ in topology.local_facts(0).own) == {
        "STREAMCOLL_WIDEN_BF16": "0", "STREAMCOLL_SIGNATURE_CHECKS": "64", "STREAMCOLL_DEBUG_CHECKS": "1"}
    monkeypatch.setenv("STREAMCOLL_SIGNATURE_CHECKS", "-1")
    (_, (name, value, source), _) = env.own()
    assert (name, value) == ("STREAMCOLL_SIGNATURE_CHECKS", "-1") and "expected an integer >= 0" in source
    with pytest.raises(ValueError, match="STREAMCOLL_SIGNATURE_CHECKS: expected an integer >= 0, got -1"):
        env.check_own({"STREAMCOLL_SIGNATURE_CHECKS": "-1"})
