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
import time

import pytest

from streamcoll import env, topology
from streamcoll.errors import CommunicatorError
from streamcoll.topology import RankFacts, Route, Topology


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
    t = Topology([_facts(0, "A"), _facts(1, "A"), _facts(2, "B"), _facts(3, "B")], rank=3)
    assert t.hosts == [[0, 1], [2, 3]] and not t.single_host
    assert (t.host_index, t.local_rank, t.local_size) == (1, 1, 2)
    assert not t.hostnames_tell_hosts_apart  # oneCCL would mix them up: no CCL_ATL_SHM
    # One identity, but torchrun put the ranks on two nodes.
    t = Topology([_facts(0, node=0), _facts(1, node=1)], rank=0)
    assert t.hosts == [[0], [1]] and t.one_network
    # One identity, one node: one host.
    assert Topology([_facts(0), _facts(1)], rank=1).single_host


def test_oversubscription_counts_the_machine_not_the_host():
    fs = [_facts(r, "A" if r < 2 else "B", machine="M", cpus=(0, 1)) for r in range(4)]
    t = Topology(fs, rank=0)
    assert t.local_size == 2 and t.machine_ranks == [0, 1, 2, 3] and t.machine_cores == 2 and t.oversubscribed
    fs = [_facts(r, "A" if r < 2 else "B", machine="M" if r < 2 else "M2") for r in range(4)]
    assert not Topology(fs, rank=0).oversubscribed
    fs = [_facts(r, "A" if r < 2 else "B", cpus=(r,)) for r in range(4)]  # disjoint cpusets on one machine
    assert not Topology(fs, rank=0).oversubscribed


def test_name_clash_and_loopback_problem():
    fs = [_facts(0, "A", network="N1", hostname="node", pid=7), _facts(1, "B", network="N2", hostname="node", pid=7)]
    assert Topology([_facts(0, pid=7), _facts(1, pid=7)], rank=0).name_clashes() == []  # one host: no clash
    t = Topology(fs, rank=1)
    assert t.name_clashes() == [(0, 1)]
    msg = t.loopback_problem("127.0.0.1")
    assert "advertises its bootstrap address 127.0.0.1, a loopback address, but rank 1 is on another host" in msg
    assert t.loopback_problem("10.77.0.1") is None
    same_net = Topology([_facts(0, node=0), _facts(1, node=1)], rank=0)
    assert same_net.loopback_problem("127.0.0.1") is None  # two nodes, one network namespace: loopback works


def test_advertised_address_formats():
    uid = b"10.77.0.1_4096".ljust(256, b"\0")
    assert topology.advertised_address("oneccl", uid) == ("10.77.0.1", 4096)
    nccl = struct.pack("<Q", 123) + struct.pack("<H", socket.AF_INET) + struct.pack(">H", 5000) + \
        socket.inet_aton("192.0.2.7") + bytes(128 - 16)
    assert topology.advertised_address("nccl", nccl) == ("192.0.2.7", 5000)
    assert topology.advertised_address("oneccl", b"garbage".ljust(256, b"\0")) is None


def test_several_hosts_tables():
    assert env.several_hosts_oneccl(1, False, "mn0") == {
        "CCL_KVS_IFACE": "mn0", "CCL_MNIC_NAME": "mn0", "CCL_WORKER_OFFLOAD": "0",
        "CCL_ALLREDUCE": "recursive_doubling:0-16384;nreduce:16385-max"}
    assert env.several_hosts_oneccl(1, False, "mn0", world_size=3)["CCL_ALLREDUCE"] == "nreduce"
    d = env.several_hosts_oneccl(2, True, "mn0")
    assert d["CCL_ATL_SHM"] == "1" and d["CCL_WORKER_OFFLOAD"] == "1" and d["CCL_YIELD"] == "sched_yield"
    assert "CCL_ATL_SHM" not in env.several_hosts_oneccl(2, True, "mn0", shm=False)
    assert "FI_PROVIDER" not in d and "CCL_ALLREDUCE" not in d  # shm-only is for one host; oneCCL's choice
    assert "CCL_KVS_IFACE" not in env.several_hosts_oneccl(1, False, None)
    assert env.several_hosts_nccl("mn0") == {"NCCL_SOCKET_IFNAME": "=mn0"}  # exact name, not a prefix


def test_apply_several_hosts_keeps_user_values(monkeypatch):
    for k in ("CCL_KVS_IFACE", "CCL_MNIC_NAME", "CCL_WORKER_OFFLOAD", "CCL_LOCAL_RANK", "CCL_LOCAL_SIZE",
              "CCL_LOG_LEVEL", "CCL_ATL_SHM", "CCL_YIELD", "STREAMCOLL_NO_ENV_DEFAULTS"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("CCL_MNIC_NAME", "ib0")
    saved = dict(env.APPLIED)
    env.APPLIED.clear()
    try:
        env.apply_oneccl_defaults(False, 1, 2, env.several_hosts_oneccl(2, False, "mn0"))
        assert os.environ["CCL_MNIC_NAME"] == "ib0" and "CCL_MNIC_NAME" not in env.APPLIED
        assert env.APPLIED["CCL_KVS_IFACE"] == "mn0" and env.APPLIED["CCL_LOCAL_RANK"] == "1"
        assert "FI_PROVIDER" not in env.APPLIED
    finally:
        env.APPLIED.clear()
        env.APPLIED.update(saved)


def test_rendezvous_names_the_ranks_that_did_not_arrive():
    import torch.distributed as dist
    store = dist.PrefixStore("t/", dist.HashStore())
    t0 = time.monotonic()
    with pytest.raises(CommunicatorError) as ei:
        topology.exchange(store, 0, 3, timeout=1.0)
    took = time.monotonic() - t0
    msg = str(ei.value)
    assert "rank(s) 1, 2 of 3 did not arrive within 1 s" in msg, msg
    assert "this is rank 0 on" in msg and "Likely cause" in msg, msg
    assert took < 10, took


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
    for k in ("CCL_KVS_IFACE", "CCL_MNIC_NAME", "NCCL_SOCKET_IFNAME", "STREAMCOLL_NO_ENV_DEFAULTS"):
        monkeypatch.delenv(k, raising=False)
    out = io.StringIO()
    assert info(out) == 0
    text = out.getvalue()
    assert "route to the rendezvous: 127.0.0.1 on lo (to 127.0.0.1)" in text, text
    assert "defaults on several hosts, e.g. 2 hosts x 2 rank(s), a core each" in text, text
    assert "more ranks on this machine than cores" in text and "CCL_YIELD=sched_yield" in text, text
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
