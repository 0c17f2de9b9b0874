"""A process's first communicators (issue 32): layouts whose first
collective goes through a sub-group, each in a fresh world.

oneCCL's shared-memory transport is set up by a process's first
communicator and serves later ones only among that first one's members:
before the fix a 2x2 mesh whose first collective went through one mesh
dimension hung in the other dimension's communicator creation. A pooled
world (``tests/world.py``'s ``World`` makes a communicator over every rank
at start) never meets that, so every test here spawns its own ranks with no
communicator (``World(fresh=True)``), runs the scenario on streamcoll first
(the process's first oneCCL communicators are the scenario's), then the same
scenario on gloo in the same processes, and compares the values.
"""
from __future__ import annotations

import os
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from conftest import needs_oneccl
from workloads import fsdp2_train
from world import World, free_port

pytestmark = [needs_oneccl, pytest.mark.world, pytest.mark.slow, pytest.mark.xdist_group("fresh_world")]

TIMEOUT = 120


def _init(backend: str, port: int) -> None:
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=int(os.environ["RANK"]),
                            world_size=int(os.environ["WORLD_SIZE"]), timeout=timedelta(seconds=60))


def _both(scenario, *args):
    """``scenario(rank, size, *args)`` on streamcoll (first), then on gloo."""
    import streamcoll  # noqa: F401  (registers the backend)
    out = {}
    for backend in ("streamcoll", "gloo"):
        _init(backend, free_port_of(backend))
        try:
            out[backend] = scenario(dist.get_rank(), dist.get_world_size(), *args)
            dist.barrier()
        finally:
            dist.destroy_process_group()
    return out


_PORTS: dict = {}


def free_port_of(backend: str) -> int:
    return _PORTS[backend]


def _run(size: int, scenario, *args, env=None, per_rank=None):
    """``scenario`` in a fresh world of ``size`` ranks (``per_rank``: rank ->
    variables of that rank alone); per-rank results ``{"streamcoll": ...,
    "gloo": ...}``, checked equal."""
    w = World(size, timeout=TIMEOUT, env=env, fresh=True)
    try:
        ports = {"streamcoll": free_port(), "gloo": free_port()}
        res = w.run(_with_ports, ports, per_rank or {}, scenario, *args, timeout=TIMEOUT)
    finally:
        w.close()
    for r, got in enumerate(res):
        sc, gl = got["streamcoll"], got["gloo"]
        assert sc.keys() == gl.keys(), (r, sc.keys(), gl.keys())
        for k in gl:
            assert _equal(sc[k], gl[k]), f"rank {r}, {k}: streamcoll {sc[k]!r} != gloo {gl[k]!r}"
    return res


def _with_ports(comm, ports, per_rank, scenario, *args):
    _PORTS.update(ports)
    os.environ.update(per_rank.get(comm.rank, {}))
    return _both(scenario, *args)


def _equal(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.shape == b.shape and torch.allclose(a, b, rtol=1e-5, atol=1e-6)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return a == b


# ------------------------------------------------------------------ scenarios
def _pairs(r, n, order):
    """A 2x2 mesh's sub-groups by hand: dim 0 = [0,2]/[1,3], dim 1 =
    [0,1]/[2,3]; the first collective on ``order[0]``'s dimension."""
    groups = {0: (dist.new_group([0, 2]), dist.new_group([1, 3])), 1: (dist.new_group([0, 1]), dist.new_group([2, 3]))}
    mine = {0: groups[0][0] if r in (0, 2) else groups[0][1], 1: groups[1][0] if r in (0, 1) else groups[1][1]}
    out = {}
    for i, d in enumerate(order):
        t = torch.arange(4, dtype=torch.float32) * (r + 1) + i
        dist.all_reduce(t, group=mine[d])
        out[f"step{i}_dim{d}"] = t
    b = torch.full((3,), float(r))
    dist.broadcast(b, src=2 if r in (0, 2) else 3, group=mine[0])
    out["broadcast"] = b
    return out


def _mesh_dim1_first(r, n):
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    out = {}
    t = torch.arange(6, dtype=torch.float32) + 10 * r
    dist.all_reduce(t, group=mesh.get_group("tp"))
    out["tp"] = t
    u = torch.arange(6, dtype=torch.float32) * (r + 1)
    dist.all_reduce(u, group=mesh.get_group("dp"))
    out["dp"] = u
    g = [torch.empty(2) for _ in range(2)]
    dist.all_gather(g, torch.full((2,), float(r)), group=mesh.get_group("tp"))
    out["tp_gather"] = g
    return out


def _dtensor(r, n):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    mesh = init_device_mesh("cpu", (2, 2))
    x = torch.arange(4 * 4 * 4, dtype=torch.float32).reshape(4, 4, 4) / 9
    d = distribute_tensor(x, mesh, [Shard(2), Shard(2)])
    out = {"local": d.to_local().clone()}
    e = d.redistribute(mesh, [Replicate(), Shard(0)])
    out["redistributed"] = e.to_local().clone()
    out["full"] = e.full_tensor().clone()
    out["sum"] = (d * 2).sum().full_tensor().clone()
    return out


def _hsdp(r, n):
    """FSDP2 over a 2-D mesh (replicate x shard): HSDP's reduce-scatter
    inside a shard group and all-reduce across the replicate dimension."""
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    return {"params": fsdp2_train(mesh, r, 2)}


def _orders_differ(r, n):
    """Every group made in the same order (torch requires it), but the
    ranks' first collectives go through different dimensions: ranks 0 and 1
    start on dim 1, ranks 2 and 3 on dim 0."""
    g02, g13 = dist.new_group([0, 2]), dist.new_group([1, 3])
    g01, g23 = dist.new_group([0, 1]), dist.new_group([2, 3])
    d0 = g02 if r in (0, 2) else g13
    d1 = g01 if r in (0, 1) else g23
    order = (d1, d0) if r in (0, 1) else (d0, d1)
    out = {}
    for i, g in enumerate(order):
        t = torch.full((5,), float(r + 1) * (i + 1))
        dist.all_reduce(t, group=g)
        out[f"step{i}"] = t
    return out


def _new_subgroups(r, n):
    cur, subs = dist.new_subgroups(group_size=2)
    t = torch.arange(3, dtype=torch.float32) + r
    dist.all_reduce(t, group=cur)
    w = torch.full((2,), float(r + 1))
    dist.all_reduce(w)
    return {"sub": t, "world": w, "sizes": [dist.get_world_size(g) for g in subs]}


def _three_ranks_pair_first(r, n):
    g = dist.new_group([0, 1])
    out = {}
    if r in (0, 1):
        t = torch.full((4,), float(r + 2))
        dist.all_reduce(t, group=g)
        out["pair"] = t
    w = torch.arange(4, dtype=torch.float32) * (r + 1)
    dist.all_reduce(w)
    out["world"] = w
    return out


# ---------------------------------------------------------------------- tests
@pytest.mark.parametrize("order", [(0, 1), (1, 0)], ids=["dim0_first", "dim1_first"])
def test_mesh_pairs_first_collective_on_a_sub_group(order):
    _run(4, _pairs, order)


def test_device_mesh_first_collective_on_dim1():
    _run(4, _mesh_dim1_first)


def test_dtensor_on_a_2x2_mesh_from_a_fresh_world():
    _run(4, _dtensor)


def test_hsdp_over_a_2d_mesh_from_a_fresh_world():
    _run(4, _hsdp)


def test_first_collectives_on_different_dimensions_per_rank():
    _run(4, _orders_differ)


def test_new_subgroups_from_a_fresh_world():
    _run(4, _new_subgroups)


def test_three_ranks_with_a_pair_first():
    _run(3, _three_ranks_pair_first)


def test_lazy_world_group_falls_back_to_tcp_for_a_partial_first_communicator():
    """``STREAMCOLL_EAGER_INIT=0``: no communicator at init_process_group,
    so the mesh's first communicators leave out half of the host's ranks;
    they run oneCCL over TCP (the rule in ``env.agreed_defaults``), and the
    second dimension's communicators form."""
    res = _run(4, _pairs_applied, env={"STREAMCOLL_EAGER_INIT": "0"})
    for r in res:
        assert r["streamcoll"]["transport"] == ("0", "tcp"), r["streamcoll"]["transport"]


def _pairs_applied(r, n):
    from streamcoll.startup import env_defaults as env
    out = _pairs(r, n, (0, 1))
    out["transport"] = (env.in_effect().get("CCL_ATL_SHM"), env.in_effect().get("FI_PROVIDER"))
    if dist.get_backend() == "gloo":
        out["transport"] = ("0", "tcp")  # the gloo run has no transport; only streamcoll's is compared
    return out


def _direct(comm, port, as_mpiexec=False):
    """The direct API: ``new_communicator`` over [0,2]/[1,3] first, then
    [0,1]/[2,3], on a store of the caller's; gloo groups over the same
    pairs in the same processes give the expected values. ``as_mpiexec``:
    no torchrun variables, the world size only in mpiexec's ``PMI_SIZE``."""
    import streamcoll
    from streamcoll.startup import env_defaults as env
    r, n = comm.rank, comm.size
    if as_mpiexec:
        for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK"):
            os.environ.pop(k, None)
        os.environ.update(PMI_RANK=str(r), PMI_SIZE=str(n))
    store = dist.TCPStore("127.0.0.1", port, n, r == 0, timeout=timedelta(seconds=60))
    a = [0, 2] if r in (0, 2) else [1, 3]
    b = [0, 1] if r in (0, 1) else [2, 3]
    out = {}
    ca = streamcoll.new_communicator(store=store, rank=a.index(r), world_size=2, name=f"a{a[0]}", timeout=60)
    t = torch.arange(4, dtype=torch.float32) * (r + 1)
    ca.all_reduce(t)
    cb = streamcoll.new_communicator(store=store, rank=b.index(r), world_size=2, name=f"b{b[0]}", timeout=60)
    u = torch.arange(4, dtype=torch.float32) + 10 * r
    cb.all_reduce(u)
    out["streamcoll"] = (t, u)
    out["transport"] = (env.in_effect().get("CCL_ATL_SHM"), env.in_effect().get("FI_PROVIDER"))
    cb.destroy()
    ca.destroy()
    dist.init_process_group("gloo", store=dist.PrefixStore("gloo/", store), rank=r, world_size=n)
    try:
        ga = [dist.new_group(p) for p in ([0, 2], [1, 3])]
        gb = [dist.new_group(p) for p in ([0, 1], [2, 3])]
        t = torch.arange(4, dtype=torch.float32) * (r + 1)
        dist.all_reduce(t, group=ga[0] if r in (0, 2) else ga[1])
        u = torch.arange(4, dtype=torch.float32) + 10 * r
        dist.all_reduce(u, group=gb[0] if r in (0, 1) else gb[1])
        out["gloo"] = (t, u)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return out


@pytest.mark.parametrize("as_mpiexec", [False, True], ids=["torchrun", "mpiexec_size"])
def test_direct_api_sub_communicators_first(as_mpiexec):
    w = World(4, timeout=TIMEOUT, fresh=True)
    try:
        res = w.run(_direct, free_port(), as_mpiexec, timeout=TIMEOUT)
    finally:
        w.close()
    for r, got in enumerate(res):
        assert _equal(got["streamcoll"], got["gloo"]), (r, got)
        assert got["transport"] == ("0", "tcp"), got["transport"]


def _mixed_eager(r, n):
    """Rank 0 makes the world's communicator lazily, the others at
    init_process_group: one name, so they meet at rank 0's first cpu
    collective (before, the eager ones waited under another name until the
    timeout)."""
    t = torch.full((3,), float(r + 1))
    dist.all_reduce(t)
    return {"world": t}


def test_eager_and_lazy_ranks_meet_under_one_name():
    _run(3, _mixed_eager, env={"STREAMCOLL_EAGER_INIT": "1"}, per_rank={0: {"STREAMCOLL_EAGER_INIT": "0"}})


def _remade_transport(comm, port):
    """The world group destroyed, then streamcoll sub-groups under a gloo
    default group: oneCCL remakes its transport from the first pair with the
    shared memory in effect; streamcoll refuses on every rank, naming why,
    instead of the second pair hanging."""
    import streamcoll  # noqa: F401
    r, n = comm.rank, comm.size
    store = dist.TCPStore("127.0.0.1", port, n, r == 0, timeout=timedelta(seconds=60))
    dist.init_process_group("streamcoll", store=dist.PrefixStore("a/", store), rank=r, world_size=n)
    dist.all_reduce(torch.ones(2))
    dist.destroy_process_group()
    dist.init_process_group("gloo", store=dist.PrefixStore("b/", store), rank=r, world_size=n)
    try:
        pairs = [dist.new_group(p, backend="streamcoll") for p in ([0, 2], [1, 3])]
        try:
            dist.all_reduce(torch.ones(2), group=pairs[0] if r in (0, 2) else pairs[1])
            return None
        except Exception as e:  # noqa: BLE001 - the type and text are asserted in the parent
            return type(e).__name__, str(e)
    finally:
        dist.barrier()
        dist.destroy_process_group()


def test_a_remade_transport_with_shared_memory_is_refused_on_every_rank():
    w = World(4, timeout=TIMEOUT, fresh=True)
    try:
        res = w.run(_remade_transport, free_port(), timeout=TIMEOUT)
    finally:
        w.close()
    for r in res:
        assert r is not None and "destroyed all their oneCCL communicators" in r[1], r
