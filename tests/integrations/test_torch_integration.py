"""torch.distributed's machinery on the "streamcoll" backend, against gloo.

DeviceMesh, FSDP2 ``fully_shard``, DTensor and the functional collectives
(eager and under ``torch.compile``) all find their process group by the name
torch assigns it (``pg.group_name``); subgroups (``new_group``) and
``destroy_process_group(subgroup)`` too. Each check runs the same program on
gloo and on streamcoll at 2 CPU ranks and compares the results.
"""
from __future__ import annotations

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

import streamcoll  # noqa: F401  (importing registers the backend)
from streamcoll.integrations.process_group import ProcessGroupStreamcoll

from conftest import get_world, needs_oneccl
from workloads import fsdp2_train
from world import World, free_port, settle_gloo

pytestmark = [needs_oneccl, pytest.mark.world]


def _init(backend: str, port: int, rank: int, size: int) -> None:
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size,
                            timeout=timedelta(seconds=60))


def _machinery(comm, backend: str, port: int, compile_backend: str):
    """FSDP2, DTensor, funcol (eager, compiled), subgroups and object
    collectives on ``backend``; returns plain tensors and values."""
    import torch.distributed._functional_collectives as funcol
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    r, n = comm.rank, comm.size
    _init(backend, port, r, n)
    out = {}
    try:
        pg = dist.group.WORLD
        out["name"] = (pg.group_name, dist.distributed_c10d._get_process_group_name(pg), pg.group_desc)
        mesh = init_device_mesh("cpu", (n,))

        out["fsdp"] = fsdp2_train(mesh, r, 3)

        a = torch.arange(16, dtype=torch.float32).reshape(4, 4) / 7 + 0.5
        d = distribute_tensor(a, mesh, [Shard(0)])
        out["dtensor"] = (d @ d.T).redistribute(mesh, [Replicate()]).to_local().clone()
        out["dtensor_sum"] = d.sum().full_tensor().clone()

        x = torch.arange(4, dtype=torch.float32) + r / 3
        out["funcol_ar"] = funcol.wait_tensor(funcol.all_reduce(x, "sum", mesh)).clone()
        out["funcol_ag"] = funcol.wait_tensor(funcol.all_gather_tensor(x, 0, mesh)).clone()
        out["funcol_rs"] = funcol.wait_tensor(funcol.reduce_scatter_tensor(x, "sum", 0, mesh)).clone()

        def f(y: torch.Tensor) -> torch.Tensor:
            return funcol.all_reduce(y * 2, "sum", mesh) + 1

        out["funcol_compiled"] = torch.compile(f, backend=compile_backend, fullgraph=True)(x).clone()

        sub = dist.new_group([0, 1])
        y = torch.full((2,), float(r + 1))
        dist.all_reduce(y, group=sub)
        out["sub"] = (y.clone(), sub.group_name, dist.distributed_c10d._get_process_group_name(sub))
        dist.destroy_process_group(sub)
        out["sub_gone"] = sub not in dist.distributed_c10d._world.pg_names

        objs = [None] * n
        dist.all_gather_object(objs, {"rank": r, "s": "x" * (r + 1)})
        lst = [{"k": 7}] if r == 0 else [None]
        dist.broadcast_object_list(lst, src=0)
        out["objects"] = (objs, lst)
        if backend == "gloo":
            settle_gloo()
    finally:
        dist.destroy_process_group()
    return out


@pytest.fixture(scope="module")
def w2():
    return get_world(2)


def test_unnamed_group_says_why():
    pg = ProcessGroupStreamcoll(dist.HashStore(), 0, 1, timedelta(seconds=5))
    with pytest.raises(RuntimeError, match="name not set"):
        pg.group_name
    with pytest.raises(TypeError, match="name: expected a str"):
        pg._set_group_name(3)
    pg._set_group_name("7")
    assert pg.group_name == "7"


@pytest.mark.slow
def test_fsdp2_dtensor_funcol_match_gloo(w2):
    # inductor: what torch.compile uses by default (funcol lowers to its
    # comm ops); about 16 s of compilation per backend on this machine.
    gloo = w2.run(_machinery, "gloo", free_port(), "inductor", timeout=300)
    sc = w2.run(_machinery, "streamcoll", free_port(), "inductor", timeout=300)
    _check_machinery(gloo, sc)


@pytest.mark.slow
def test_fsdp2_dtensor_funcol_match_gloo_from_a_fresh_world():
    """The same program in processes that made no communicator before
    (issue 32; the pooled ``w2`` has one over every rank from its start),
    streamcoll first, compiled with the eager backend (the subject here is
    the process's first communicators, not inductor)."""
    w = World(2, timeout=300, fresh=True)
    try:
        sc = w.run(_machinery, "streamcoll", free_port(), "eager", timeout=300)
        gloo = w.run(_machinery, "gloo", free_port(), "eager", timeout=300)
    finally:
        w.close()
    _check_machinery(gloo, sc)


def _check_machinery(gloo, sc):
    for r in range(2):
        a, b = gloo[r], sc[r]
        assert b["name"][0] == b["name"][1] == a["name"][0] and b["name"][2] == "default_pg"
        for p, q in zip(a["fsdp"], b["fsdp"]):
            torch.testing.assert_close(q, p, rtol=0, atol=1e-6)
        for k in ("dtensor", "dtensor_sum", "funcol_ar", "funcol_ag", "funcol_rs", "funcol_compiled"):
            torch.testing.assert_close(b[k], a[k], rtol=0, atol=1e-6, msg=k)
        assert b["sub"][0].tolist() == [3.0, 3.0]
        assert b["sub"][1] == b["sub"][2] == a["sub"][1]
        assert b["sub_gone"] and a["sub_gone"]
        assert b["objects"] == a["objects"]
    # FSDP2 kept the ranks' parameters equal (and they trained).
    for p, q in zip(sc[0]["fsdp"], sc[1]["fsdp"]):
        assert torch.equal(p, q)
