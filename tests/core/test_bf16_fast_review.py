"""Review of the widened (bf16) fast path's scratch-view cache (issue 35):
results against gloo at 2 real ranks after the cache grew and was cleared,
and the cache's invariants under threads and awkward shapes."""
from __future__ import annotations

import math

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

import streamcoll
from streamcoll import ReduceOp
from conftest import needs_oneccl
from world import free_port, settle_gloo

pytestmark = [needs_oneccl]

OPS = ["SUM", "AVG", "MIN", "MAX", "PRODUCT"]


def _inputs(rank: int, n: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + rank)
    x = (torch.randn(n, generator=g, dtype=torch.float64) * torch.logspace(-30, 30, n, dtype=torch.float64))
    x = x.to(torch.bfloat16)
    # special values at fixed places: inf, nan, -0.0, bf16 subnormals, near the bf16 maximum
    sp = torch.tensor([float("inf"), float("nan"), -0.0, 0.0, 1e-40, -1e-40, 9.2e-41, 1.7e38, -1.7e38,
                       3.38e38, 1.0, -1.0], dtype=torch.bfloat16)
    if rank:
        sp = sp.flip(0)
    k = min(n, sp.numel())
    x[:k] = sp[:k]
    return x


def _same(a: torch.Tensor, b: torch.Tensor, nan_free: bool = False) -> bool:
    """Bit-identical, any NaN matching any NaN. ``nan_free``: where either
    is NaN not compared (MIN/MAX: oneCCL's min(NaN, x) depends on the
    operand order, for every float dtype and on the general path too: the
    ranks' results differ there; not this cache's doing)."""
    an, bn = torch.isnan(a), torch.isnan(b)
    if nan_free:
        keep = ~(an | bn)
        a, b, an, bn = a[keep], b[keep], an[keep], bn[keep]
    return bool(torch.equal(an, bn)) and bool(torch.equal(a.view(torch.int16)[~an], b.view(torch.int16)[~bn]))


def w_bf16_vs_gloo(world, port: int):
    # A communicator of its own: its ~300 signatures would fill the pooled one's first-call check
    # bound (STREAMCOLL_SIGNATURE_CHECKS), and later tests' new signatures would go unchecked.
    comm = world.split(0)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=comm.rank,
                            world_size=comm.size, timeout=timedelta(seconds=30))
    try:
        assert comm.fast_path
        g = comm.all_reduce.__globals__
        wv, sc = g["_wv"], g["_sc"]
        bad = []
        # grow, fill past the 64-entry limit (clears), grow again, then shapes smaller than the scratch
        shapes = [(5,), (1 << 12,)] + [(k,) for k in range(100, 170)] + [(1 << 15,), (3, 700), (64, 64), (1,), ()]
        for i, s in enumerate(shapes):
            n = max(1, torch.Size(s).numel())
            base = _inputs(comm.rank, n).view(s) if s else _inputs(comm.rank, 1)[0].clone()
            for op in OPS:
                t = base.clone()
                comm.all_reduce(t, op=ReduceOp[op])
                # gloo's: bf16 reduced in float and rounded once per step (at 2 ranks: once); gloo has no AVG
                ref = base.clone()
                if op == "AVG":
                    r32 = base.float().clone()
                    dist.all_reduce(r32)
                    ref = (r32 * 0.5).to(torch.bfloat16)
                else:
                    dist.all_reduce(ref, op=getattr(dist.ReduceOp, op))
                if not _same(t, ref, op in ("MIN", "MAX")):
                    diff = (t.view(torch.int16) != ref.view(torch.int16)).nonzero()[:3].flatten().tolist()
                    bad.append(f"{s} {op}: differ at {diff}")
        # reduce_scatter_tensor and reduce through their own caches, after the same workload
        for s in [(64,), (1 << 13,)] + [(2 * k,) for k in range(40, 110)] + [(2,)]:
            x = _inputs(comm.rank, s[0])
            for op in OPS:
                out = torch.empty(s[0] // 2, dtype=torch.bfloat16)
                comm.reduce_scatter_tensor(out, x.clone(), op=ReduceOp[op])
                r32 = x.float().clone() if op == "AVG" else x.clone()
                dist.all_reduce(r32, op=dist.ReduceOp.SUM if op == "AVG" else getattr(dist.ReduceOp, op))
                ref = (r32 * 0.5).to(torch.bfloat16) if op == "AVG" else r32
                ref = ref[comm.rank * (s[0] // 2):(comm.rank + 1) * (s[0] // 2)]
                if not _same(out, ref, op in ("MIN", "MAX")):
                    bad.append(f"reduce_scatter_tensor {s} {op}")
        return {"bad": bad[:10], "views": len(wv), "scratch": sc[0].numel()}
    finally:
        settle_gloo()
        dist.destroy_process_group()
        comm.destroy()


def test_bf16_fast_path_matches_gloo_after_growth_and_clear(world2):
    port = free_port()
    for r, res in enumerate(world2.run(w_bf16_vs_gloo, port, timeout=120)):
        assert not res["bad"], (r, res)


def w_nan_min_max(comm, port: int):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=comm.rank,
                            world_size=comm.size, timeout=timedelta(seconds=30))
    out = {}
    try:
        for dt in (torch.bfloat16, torch.float32, torch.float16):
            for op in ("MIN", "MAX"):
                x = torch.tensor([float("nan"), 1.0] if comm.rank == 0 else [1.0, float("nan")], dtype=dt)
                a = x.clone()
                comm.all_reduce(a, op=ReduceOp[op])
                b = x.clone()
                comm.all_reduce(b, op=ReduceOp[op], async_op=True).wait()
                c = x.clone()
                dist.all_reduce(c, op=getattr(dist.ReduceOp, op))
                out[f"{dt} {op}"] = (a.tolist(), b.tolist(), c.tolist())
    finally:
        settle_gloo()
        dist.destroy_process_group()
    return out


def _same_nan(x, y) -> bool:
    return len(x) == len(y) and all((math.isnan(p) and math.isnan(q)) or p == q for p, q in zip(x, y))


@pytest.mark.xfail(strict=True, reason="oneCCL 2022.2's MIN/MAX of a NaN and a number depends on the operand "
                   "order, so ranks disagree (rank 0 [1.0, nan], rank 1 [nan, 1.0]); gloo propagates NaN on every "
                   "rank. Known, not yet handled (a strict xfail: it fails once streamcoll matches gloo)")
def test_nan_min_max_match_gloo(world2):
    """MIN/MAX with a NaN on one rank, fast and general path, against gloo."""
    bad = []
    for r, res in enumerate(world2.run(w_nan_min_max, free_port(), timeout=60)):
        for k, (fast, general, gloo) in res.items():
            if not (_same_nan(fast, gloo) and _same_nan(general, gloo)):
                bad.append(f"rank {r} {k}: fast {fast}, general {general}, gloo {gloo}")
    assert not bad, "\n".join(bad)


def w_autograd_and_inference(comm):
    """What every other dtype (and torch's own backends) accepts: a tensor
    that requires grad, an inference tensor, a call made in inference mode.
    bf16 goes through the float32 scratch; its copies must not record
    autograd history into the scratch (which the next calls would hand on)
    nor leave an inference-mode scratch behind (which in-place updates
    outside inference mode refuse)."""
    n = comm.size
    bad = []

    def run(what, fn):
        try:
            fn()
        except Exception as e:  # noqa: BLE001
            bad.append(f"{what}: raised {type(e).__name__}: {str(e)[:80]}")

    for dt in (torch.float32, torch.bfloat16):
        # a leaf that requires grad (a parameter): reduced in place like a plain tensor
        leaf = torch.ones(6, dtype=dt, requires_grad=True)
        run(f"{dt} leaf", lambda: comm.all_reduce(leaf))
        if leaf.detach().tolist() != [float(n)] * 6 or not leaf.is_leaf or leaf.grad_fn is not None:
            bad.append(f"{dt} leaf: {leaf}")
        # a later plain tensor of that shape stays plain (no history handed on through the scratch)
        y = torch.ones(6, dtype=dt)
        run(f"{dt} plain after leaf", lambda: comm.all_reduce(y))
        if y.requires_grad or y.grad_fn is not None or y.tolist() != [float(n)] * 6:
            bad.append(f"{dt} plain after leaf: requires_grad {y.requires_grad}, grad_fn {y.grad_fn}")
        x = torch.ones(2 * n, dtype=dt, requires_grad=True)
        out = torch.empty(2, dtype=dt)
        run(f"{dt} reduce_scatter_tensor of a leaf", lambda: comm.reduce_scatter_tensor(out, x))
        out2 = torch.empty(2, dtype=dt)
        run(f"{dt} reduce_scatter_tensor after", lambda: comm.reduce_scatter_tensor(out2, torch.ones(2 * n, dtype=dt)))
        if out2.requires_grad or out2.tolist() != [float(n)] * 2:
            bad.append(f"{dt} reduce_scatter_tensor after a leaf: requires_grad {out2.requires_grad}")
        a = torch.ones(6, dtype=dt, requires_grad=True)
        run(f"{dt} leaf async", lambda: comm.all_reduce(a, async_op=True).wait())
        # the first call in inference mode (an evaluation loop): it may grow the scratch
        k = 1 << 13 if dt is torch.float32 else 1 << 14
        with torch.inference_mode():
            m = torch.ones(k, dtype=dt)
            run(f"{dt} in inference mode", lambda: comm.all_reduce(m))
            big = torch.ones(1 << 16, dtype=dt)
            run(f"{dt} async in inference mode", lambda: comm.all_reduce(big, async_op=True).wait())
            inf = torch.ones(3, dtype=dt)
        for s in (k, 5):
            z = torch.ones(s, dtype=dt)
            run(f"{dt} {s} after inference mode", lambda: comm.all_reduce(z))
        # an inference tensor, reduced outside inference mode
        run(f"{dt} inference tensor", lambda: comm.all_reduce(inf))
    return bad


@pytest.mark.timeout(120)
def test_bf16_takes_what_float32_takes_and_keeps_its_scratch_clean(world2):
    res = world2.run(w_autograd_and_inference, timeout=60)
    for r, bad in enumerate(res):
        print(f"rank {r}:", *bad, sep="\n  ")
    assert not any(res), res
