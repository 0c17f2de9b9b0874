"""The pair form of a widened bf16 reduction (issue 35, plans.PlanContext.pair_op):
at two ranks all_reduce SUM/PRODUCT of bf16 is an all-gather of the inputs
and one local op. The fast path and the general path issue that same C call,
so ranks on different paths (one's tensor requires grad, one has queued
async work, one coalesces) must still meet; every result is gloo's, bit for
bit, and the float32 form's (AVG)."""
from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

import streamcoll
from streamcoll import ReduceOp
from conftest import needs_oneccl
from world import free_port, settle_gloo

pytestmark = [needs_oneccl]


def _inputs(rank: int, n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(700 + 10 * seed + rank)
    x = torch.randn(n, generator=g, dtype=torch.float64) * torch.logspace(-25, 25, n, base=2.0, dtype=torch.float64)
    x = x.to(torch.bfloat16)
    sp = torch.tensor([float("inf"), -0.0, 0.0, 1e-40, -1e-40, 3.38e38, 1.7e38, 1.0], dtype=torch.bfloat16)
    k = min(n, sp.numel())
    x[:k] = (sp if rank == 0 else sp.flip(0))[:k]
    return x


def _bits(t: torch.Tensor) -> list:
    return t.detach().reshape(-1).view(torch.int16).tolist()


def w_paths_meet(comm, port: int):
    """Each rank takes a different path for the same call, in every
    combination; each result against gloo's, bit for bit."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=comm.rank,
                            world_size=comm.size, timeout=timedelta(seconds=30))
    rank = comm.rank
    bad = []
    gen = comm.all_reduce.__globals__["_general"]
    try:
        assert comm.fast_path and comm.all_reduce.__globals__.get("_pair"), "no pair form at 2 ranks"

        def fast(t, op):
            comm.all_reduce(t, op)

        def general(t, op):
            gen(comm, t, op, False)

        def grad(t, op):  # a leaf that requires grad: the general path, reduced in place
            t.requires_grad_(True)
            comm.all_reduce(t, op)

        def behind_async(t, op):  # queued async work first: the general path, queued behind it
            comm.all_reduce(t, op)

        def async_wait(t, op):
            comm.all_reduce(t, op, async_op=True).wait()

        def coalesced(t, op):
            f = torch.ones(3)
            with comm.coalescing():
                comm.all_reduce(f)
                comm.all_reduce(t, op)
            if f.tolist() != [2.0] * 3:
                bad.append(f"rank {rank}: the float32 call coalesced with it: {f.tolist()}")

        paths = {"fast": fast, "general": general, "grad": grad, "behind_async": behind_async,
                 "async": async_wait, "coalesced": coalesced}
        names = list(paths)
        # rank 0 takes path i, rank 1 path j (coalescing must match: both or neither)
        pairs = [(a, b) for a in names for b in names if (a == "coalesced") == (b == "coalesced")]
        for case, (p0, p1) in enumerate(pairs):
            for shape in ((2048,), (3, 5), (), (0,)):
                n = torch.Size(shape).numel()
                for op in ("SUM", "PRODUCT", "AVG"):
                    x = _inputs(rank, max(n, 1), case)[:n].view(shape).clone()
                    t = x.clone()
                    mine = p0 if rank == 0 else p1
                    # every rank issues the same calls: a float32 one first, left queued (async) by
                    # the rank whose path is behind_async, synchronous on the other
                    before = torch.ones(1 << 12)
                    w = comm.all_reduce(before, async_op=mine == "behind_async")
                    paths[mine](t, ReduceOp[op])
                    if w is not None:
                        w.wait()
                    if before[0].item() != 2.0:
                        bad.append(f"{p0}/{p1}: the float32 call before: {before[0].item()}")
                    ref = x.clone() if op != "AVG" else x.float()
                    dist.all_reduce(ref, op=getattr(dist.ReduceOp, "SUM" if op == "AVG" else op))
                    if op == "AVG":
                        ref = (ref * 0.5).to(torch.bfloat16)
                    if _bits(t) != _bits(ref):
                        bad.append(f"{p0}/{p1} {shape} {op}: differs from gloo")
                    if t.requires_grad and t.grad_fn is not None:
                        bad.append(f"{p0}/{p1} {shape} {op}: autograd history {t.grad_fn}")
        return {"bad": bad[:20], "cases": len(pairs), "gather": comm.all_reduce.__globals__["_gsc"][0].numel()}
    finally:
        settle_gloo()
        dist.destroy_process_group()


def test_bf16_pair_form_meets_across_paths_and_matches_gloo(world2):
    """Fails if the fast and general paths decided the pair form apart (a
    rank's all-gather against the other's float32 all-reduce: a hang or
    garbage) or if its bits left gloo's."""
    res = world2.run(w_paths_meet, free_port(), timeout=120)
    for r, out in enumerate(res):
        assert not out["bad"], (r, out)
        assert out["gather"] >= 2 * 2048, out  # the fast path's gather scratch was used (and grew)


def w_large_and_reused(comm):
    """The fast path's gather scratch grown across sizes, reused, then shrunk
    shapes: against the float32 form computed locally from both inputs
    (each rank's input is known to both: a seeded generator)."""
    bad = []
    for n in (1, 7, 4096, 1 << 20, 3000, 1 << 22, 5):
        xs = [_inputs(r, n, n % 97) for r in range(2)]
        for op, f in (("SUM", torch.add), ("PRODUCT", torch.mul)):
            want = f(xs[0].float(), xs[1].float()).to(torch.bfloat16)
            t = xs[comm.rank].clone()
            comm.all_reduce(t, ReduceOp[op])
            if not torch.equal(t.view(torch.int16), want.view(torch.int16)):
                bad.append(f"{n} {op}: {int((t.view(torch.int16) != want.view(torch.int16)).sum())} differ")
    g = comm.all_reduce.__globals__
    return {"bad": bad, "gather": g["_gsc"][0].numel(), "entries": len(g["_gv"])}


def test_bf16_pair_form_large_and_reused(world2):
    for r, out in enumerate(world2.run(w_large_and_reused, timeout=180)):
        assert not out["bad"], (r, out)
        assert out["gather"] >= 2 << 22, out


def w_not_at_three(comm):
    g = comm.all_reduce.__globals__
    t = torch.ones(16, dtype=torch.bfloat16)
    comm.all_reduce(t)
    return {"pair": "_pair" in g, "value": t[0].item()}


def test_no_pair_form_at_three_ranks(world3):
    """At three ranks the float32 reduction's order is oneCCL's: the pair
    form's claim (the same bits) no longer holds, so it is not built."""
    for out in world3.run(w_not_at_three, timeout=60):
        assert out == {"pair": False, "value": 3.0}, out
