"""The pair form of a widened bf16 reduction (issue 35, plans.PlanContext.pair_op):
at two ranks all_reduce SUM/PRODUCT of bf16 is an all-gather of the inputs
and one local op. The fast path and the general path issue that same C call,
so ranks on different paths (one's tensor requires grad, one has queued
async work, one coalesces) must still meet; every result is gloo's, bit for
bit, and the float32 form's (AVG).

The review of the pair form (the second part of this file): at two ranks
all_reduce SUM/PRODUCT of bf16 is an all-gather of the inputs and one local
torch add/mul, claimed to give the float32 form's bits but for a NaN's sign
and payload. Real oneCCL, real rank processes, every call bounded by the
world's timeout.

The review found (and its tests showed, when it compared every bit) that
torch's bf16 add/mul round a NaN to 0xFFFF in its vectorized loop and to
0x7FC0 in each chunk's scalar remainder: the pair form's NaN bits depend on
the element's position, the length, the intra-op thread count and the vector
width, where the float32 form's copy back always writes 0xFFFF. Making them
the float32 form's took one more pass over the output (4.4 us a call at 4 KB,
more than the pair form saves), so streamcoll leaves a NaN's bits to torch's
arithmetic, as every torch bf16 op does: what is pinned here is that every
other bit is the float32 form's and that a NaN is a NaN at the same places
on every rank, whatever its thread count.

The review of the widened (bf16) fast path's scratch-view cache (the third
part of this file; issue 35): results against gloo at 2 real ranks after the
cache grew and was cleared, and the cache's invariants under threads and
awkward shapes."""
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


# ======================================================== the pair form's NaNs
# (the review of the pair form: the module docstring's second part)


# NaN-producing inputs: NaN of either sign and payload, inf against -inf (SUM), 0 against inf (PRODUCT)
_NANS = torch.tensor([0x7FC0, -0x40, 0x7F81, -0x7F, 0x7FFF, 0x7F80, -0x80, 0x0000, 0x3F80],
                     dtype=torch.int16).view(torch.bfloat16)  # nan, -nan, snan, -snan, nan, inf, -inf, 0, 1


def _nan_inputs(rank: int, n: int) -> torch.Tensor:
    i = torch.arange(n)
    k = _NANS.numel()
    return _NANS[(i % k) if rank == 0 else ((i * 5 + 6) % k)].clone()


def _float32_form(a: torch.Tensor, b: torch.Tensor, op: str) -> torch.Tensor:
    """What the widened form computes from both inputs: the float32 result,
    rounded into bf16 by ``copy_`` (its copy back)."""
    w = torch.add(a.float(), b.float()) if op == "SUM" else torch.mul(a.float(), b.float())
    return torch.empty(a.shape, dtype=torch.bfloat16).copy_(w)


def _same_but_nan_bits(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """Where ``got`` (int16 views of bf16) differs from ``want``, a NaN
    against a NaN not counted."""
    gn, wn = torch.isnan(got.view(torch.bfloat16)), torch.isnan(want.view(torch.bfloat16))
    return ((got != want) & ~(gn & wn)).nonzero().flatten()


def w_nan_bits(comm, threads: int):
    """Each rank's result bits (a NaN's aside) against the float32 form's,
    with this rank's intra-op thread count ``threads`` (ranks of different
    hosts run with different counts and vector widths)."""
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    gen = comm.all_reduce.__globals__["_general"]
    out, bad = {}, []
    try:
        for n in (1, 3, 40, 100003):
            xs = [_nan_inputs(r, n) for r in range(2)]
            for op in ("SUM", "PRODUCT"):
                want = _float32_form(xs[0], xs[1], op).view(torch.int16)
                for path in ("fast", "general"):
                    t = xs[comm.rank].clone()
                    if path == "fast":
                        comm.all_reduce(t, ReduceOp[op])
                    else:
                        gen(comm, t, ReduceOp[op], False)
                    got = t.view(torch.int16)
                    d = _same_but_nan_bits(got, want)
                    if d.numel():
                        bad.append(f"{path} n={n} {op}: {d.numel()} differ from the float32 form, first at "
                                   f"{d[0].item()}: {got[d[0]].item() & 0xFFFF:#06x} instead of {want[d[0]].item() & 0xFFFF:#06x}")
                    out[f"{path} {n} {op}"] = got.tolist()
    finally:
        torch.set_num_threads(old)
    return {"bad": bad[:8], "bits": out}


def test_pair_form_is_the_float32_forms_on_every_rank_but_nan_bits(world2):
    """NaN-producing inputs (NaN of either sign and payload, inf against
    -inf, 0 against inf), 1 to 100003 elements, fast and general path, rank 0
    on one intra-op thread and rank 1 on two: every result the float32
    form's, a NaN's sign and payload aside, and the ranks' NaNs in the same
    places."""
    # rank 0 with one thread, rank 1 with two: one run, each rank its own count
    outs = world2.run(_w_threads_by_rank, timeout=90)
    bad = [f"rank {r}: {b}" for r, o in enumerate(outs) for b in o["bad"]]
    b0, b1 = outs[0]["bits"], outs[1]["bits"]
    for k in b0:
        d = _same_but_nan_bits(torch.tensor(b0[k], dtype=torch.int16), torch.tensor(b1[k], dtype=torch.int16))
        if d.numel():
            bad.append(f"{k}: the ranks' results differ at {d.numel()} elements (a NaN's bits aside)")
    assert not bad, "\n".join(bad)


def _w_threads_by_rank(comm):
    return w_nan_bits(comm, 1 if comm.rank == 0 else 2)


# ======================================================== the fast path's scratch-view cache
# (the review of the cache: the module docstring's third part)


OPS = ["SUM", "AVG", "MIN", "MAX", "PRODUCT"]


def _cache_inputs(rank: int, n: int) -> torch.Tensor:
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
            base = _cache_inputs(comm.rank, n).view(s) if s else _cache_inputs(comm.rank, 1)[0].clone()
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
            x = _cache_inputs(comm.rank, s[0])
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
