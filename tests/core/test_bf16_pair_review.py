"""Review of the pair form of a widened bf16 reduction (issue 35,
plans.PlanContext.pair_op): at two ranks all_reduce SUM/PRODUCT of bf16 is
an all-gather of the inputs and one local torch add/mul, claimed to give the
float32 form's bits but for a NaN's sign and payload. Real oneCCL, real rank
processes, every call bounded by the world's timeout.

The review found (and this file showed, when it compared every bit) that
torch's bf16 add/mul round a NaN to 0xFFFF in its vectorized loop and to
0x7FC0 in each chunk's scalar remainder: the pair form's NaN bits depend on
the element's position, the length, the intra-op thread count and the vector
width, where the float32 form's copy back always writes 0xFFFF. Making them
the float32 form's took one more pass over the output (4.4 us a call at 4 KB,
more than the pair form saves), so streamcoll leaves a NaN's bits to torch's
arithmetic, as every torch bf16 op does: what is pinned here is that every
other bit is the float32 form's and that a NaN is a NaN at the same places
on every rank, whatever its thread count."""
from __future__ import annotations

import torch

import streamcoll
from streamcoll import ReduceOp
from conftest import needs_oneccl

pytestmark = [needs_oneccl]

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
