"""GradientSync: equal to DDP (gloo) step for step, and overlapping backward.

2 real oneCCL ranks. The DDP reference runs in the same rank processes over
a gloo process group on a free loopback port (destroyed afterwards).
"""
from __future__ import annotations

import contextlib
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

import streamcoll
from streamcoll import GradientSync

from conftest import get_world, needs_oneccl
from world import free_port, settle_gloo


class Net(torch.nn.Module):
    """A frozen layer (no grads), a shared trunk, and a head that is used on
    some steps by some ranks only (locally / globally unused parameters)."""

    def __init__(self) -> None:
        super().__init__()
        self.frozen = torch.nn.Linear(8, 8)
        self.frozen.requires_grad_(False)
        self.l1 = torch.nn.Linear(8, 32)
        self.l2 = torch.nn.Linear(32, 32)
        self.head_a = torch.nn.Linear(32, 4)
        self.head_b = torch.nn.Linear(32, 4)

    def forward(self, x, use_b: bool):
        h = torch.relu(self.l2(torch.relu(self.l1(self.frozen(x)))))
        out = self.head_a(h)
        if use_b:
            out = out + self.head_b(h)
        return out


def _uses_b(step: int, rank: int) -> bool:
    # step 0: rank 0 only; 1: nobody; 2: rank 1 only; 3: rank 0 only; ...
    return (step + rank) % 3 == 0


def _batches(rank: int, steps: int, micro: int):
    g = torch.Generator().manual_seed(500 + rank)
    return [[(torch.randn(6, 8, generator=g), torch.randn(6, 4, generator=g)) for _ in range(micro)]
            for _ in range(steps)]


def _train_ddp(rank, size, port, data):
    from torch.nn.parallel import DistributedDataParallel as DDP

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size,
                            timeout=timedelta(seconds=60))
    try:
        torch.manual_seed(0)
        model = Net()
        ddp = DDP(model, find_unused_parameters=True, bucket_cap_mb=0.002)
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        for s, micro in enumerate(data):
            use_b = _uses_b(s, rank)
            for k, (x, y) in enumerate(micro):
                loss = torch.nn.functional.mse_loss(ddp(x, use_b), y)
                if k < len(micro) - 1:
                    with ddp.no_sync():
                        loss.backward()
                else:
                    loss.backward()
            opt.step()
            opt.zero_grad()
        settle_gloo()
        return [p.detach().clone() for p in model.parameters()]
    finally:
        dist.destroy_process_group()


def _train_gradient_sync(data, rank):
    torch.manual_seed(0)
    model = Net()
    sync = GradientSync(model.parameters(), bucket_mb=0.002)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    ptrs = []
    for s, micro in enumerate(data):
        use_b = _uses_b(s, rank)
        for k, (x, y) in enumerate(micro):
            loss = torch.nn.functional.mse_loss(model(x, use_b), y)
            if k < len(micro) - 1:
                with sync.no_sync():
                    loss.backward()
            else:
                loss.backward()
        sync.finish()
        ptrs.append([b.flat.data_ptr() for b in sync._buckets])
        opt.step()
        opt.zero_grad()
    head_b_grad_none = model.head_b.weight.grad is None
    return [p.detach().clone() for p in model.parameters()], ptrs, sync.buffer_allocations, len(sync._buckets), head_b_grad_none


def _compare_with_ddp(comm, port, steps, micro):
    data = _batches(comm.rank, steps, micro)
    ref = _train_ddp(comm.rank, comm.size, port, data)
    mine, ptrs, allocs, nbuckets, _ = _train_gradient_sync(data, comm.rank)
    return ref, mine, ptrs, allocs, nbuckets


def _globally_unused_keeps_grad_none(comm):
    """A step in which no rank uses head_b: its .grad stays None (DDP's rule);
    a step where only the other rank uses it: this rank gets the average."""
    torch.manual_seed(0)
    model = Net()
    sync = GradientSync(model, bucket_mb=0.002)
    x = torch.ones(2, 8) * (comm.rank + 1)
    model(x, False).sum().backward()
    sync.finish()
    nobody = model.head_b.weight.grad is None and model.head_b.bias.grad is None
    model.zero_grad()
    model(x, comm.rank == 1).sum().backward()
    sync.finish()
    g = model.head_b.bias.grad
    return nobody, None if g is None else g.tolist()


def _overlap(comm, steps):
    """A deeper MLP with one layer per bucket: when did each bucket launch,
    relative to the gradients becoming ready and to backward returning?"""
    torch.manual_seed(0)
    layers = []
    for _ in range(6):
        layers += [torch.nn.Linear(256, 256), torch.nn.Tanh()]
    model = torch.nn.Sequential(*layers)
    sync = GradientSync(model.parameters(), bucket_mb=0.3, record_timeline=True)
    x = torch.randn(256, 256)
    out = None
    for _ in range(steps):
        sync.clear_timeline()
        t0 = time.perf_counter()
        model(x).pow(2).mean().backward()
        t_bwd = time.perf_counter()
        sync.finish()
        t_fin = time.perf_counter()
        model.zero_grad()
        tl = sync.timeline()
        out = {"t0": t0, "bwd_end": t_bwd, "finish_end": t_fin, "launch": tl["launch"],
               "ready": tl["ready"], "done": tl["done"], "nbuckets": len(sync._buckets)}
    return out


def _errors(comm):
    torch.manual_seed(0)
    model = Net()
    sync = GradientSync(model, bucket_mb=0.002)
    x = torch.ones(2, 8)
    model(x, True).sum().backward()
    msgs = []
    try:
        model(x, True).sum().backward()  # second backward without finish()
    except RuntimeError as e:
        msgs.append(str(e))
    sync.finish()  # every rank still completes the step consistently
    with sync.no_sync():
        try:
            sync.finish()
        except RuntimeError as e:
            msgs.append(str(e))
    sync.remove()
    model(x, True).sum().backward()  # hooks gone: no error, no launch
    return msgs, sync.steps


# ---------------------------------------------------------------- tests
pytestmark = [needs_oneccl, pytest.mark.world]


@pytest.fixture(scope="module")
def w2():
    return get_world(2)


# Tolerance: with 2 ranks DDP computes g0/2 + g1/2, GradientSync (g0 + g1)/2;
# halving is exact in binary floating point, so both are the same float32
# (bitwise); the bound allows an ulp in case a backend orders the sum differently.
RTOL, ATOL = 1e-6, 1e-7


@pytest.mark.slow
def test_matches_ddp_gloo(w2):
    res = w2.run(_compare_with_ddp, free_port(), 6, 2, timeout=180)
    for r, (ref, mine, ptrs, allocs, nbuckets) in enumerate(res):
        assert len(ref) == len(mine) == 10
        for a, b in zip(mine, ref):
            torch.testing.assert_close(a, b, rtol=RTOL, atol=ATOL)
        # buffers: allocated for the first layout, once more at the rebuild, then reused
        assert all(p == ptrs[1] for p in ptrs[1:]), ptrs
        assert nbuckets > 1 and allocs <= 2 * nbuckets
    for a, b in zip(res[0][1], res[1][1]):
        assert torch.equal(a, b)


def test_unused_parameters(w2):
    res = w2.run(_globally_unused_keeps_grad_none)
    for r, (nobody, g) in enumerate(res):
        assert nobody is True
        # head_b.bias gradient of sum(): 2 rows -> 2.0 on rank 1, 0 on rank 0; averaged: 1.0
        assert g == [1.0] * 4, g


def test_overlaps_backward(w2):
    res = w2.run(_overlap, 3, timeout=120)
    for r, out in enumerate(res):
        launch, ready = out["launch"], out["ready"]
        assert out["nbuckets"] >= 6 and len(launch) == out["nbuckets"]
        last_ready = max(t for _, t in ready)
        # The first bucket went out while backward still had gradients to
        # produce, and every bucket was launched before backward returned.
        assert launch[0] < last_ready < out["bwd_end"], out
        assert all(t < out["bwd_end"] for t in launch)
        assert launch == sorted(launch)


def test_errors(w2):
    for msgs, steps in w2.run(_errors):
        assert "became ready twice before finish()" in msgs[0]
        assert "inside no_sync()" in msgs[1]
        assert steps == 1


def test_bad_arguments():
    p = torch.nn.Parameter(torch.ones(2))
    with pytest.raises(ValueError, match="bucket_mb"):
        GradientSync([p], bucket_mb=0)
    with pytest.raises(ValueError, match="op: expected SUM, AVG"):
        GradientSync([p], op=streamcoll.ReduceOp.MAX)
    with pytest.raises(TypeError, match="params: expected an iterable"):
        GradientSync(p)
    with pytest.raises(TypeError, match=r"params\[0\]"):
        GradientSync(["x"])
    with pytest.raises(TypeError, match="group"):
        GradientSync([p], group="g")


def _initial_state(comm, sync: bool):
    """Replicas seeded differently: GradientSync makes them rank 0's (params,
    frozen params and buffers), unless told not to."""
    torch.manual_seed(100 + comm.rank)
    m = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 2))
    m[2].requires_grad_(False)
    m[1].running_mean.normal_()
    m[1].num_batches_tracked.fill_(comm.rank + 7)
    GradientSync(m, group=comm, sync_initial_state=sync)
    return {k: v.tolist() for k, v in m.state_dict().items()}


@pytest.mark.parametrize("sync", [True, False], ids=["default", "opt_out"])
def test_initial_parameters_and_buffers_from_rank_0(w2, sync):
    """Before: GradientSync broadcast nothing; replicas seeded differently trained apart."""
    a, b = w2.run(_initial_state, sync)
    assert a.keys() == b.keys()
    differ = [k for k in a if a[k] != b[k]]
    if sync:
        assert differ == [], differ
    else:
        # seeded tensors differ when nothing is broadcast (BatchNorm's weight/bias/var start equal)
        assert {"0.weight", "0.bias", "2.weight", "1.running_mean", "1.num_batches_tracked"} <= set(differ), differ


# ------------------------------------- issue 21, finding 2: DDP's reduction rule
class Two(torch.nn.Module):
    """Two scalar parameters: ``a`` always used, ``b`` only where asked;
    the loss's gradient of each is the sum of the input, so values are exact."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Parameter(torch.ones(()))
        self.b = torch.nn.Parameter(torch.ones(()))

    def forward(self, x, use_b: bool):
        out = self.a * x
        if use_b:
            out = out + self.b * x
        return out


# Each plan: steps of micro-batches (x, use_b) per rank; the last micro-batch
# of a step is the synchronised one, the others run inside no_sync();
# zero_grad between steps or not.
_PLANS = {
    # b used only in a no_sync micro-batch (gradient 2 on rank 0, 4 on rank 1):
    # DDP counts that use and reduces the accumulated .grad, 3.0 on both
    "no_sync": ([[(lambda r: 2.0 * (r + 1), True), (lambda r: 1.0, False)]], True),
    # accumulation over synced steps without zero_grad, b unused on rank 1 in
    # step 2 (DDP reduces rank 1's standing .grad), then unused by everyone
    # in step 3 (DDP leaves .grad as it is)
    "accumulate": ([[(lambda r: float(r + 1), True)],
                    [(lambda r: float(r + 1), lambda r: r == 0)],
                    [(lambda r: float(r + 1), False)]], False),
}


def _grads_after_each_step(plan, rank, step_fn):
    steps, zero = plan
    out = []
    for micro in steps:
        for k, (x, use_b) in enumerate(micro):
            step_fn(torch.full((2,), x(rank) / 2), use_b(rank) if callable(use_b) else use_b,
                    k < len(micro) - 1)
        out.append([None if p.grad is None else p.grad.item() for p in (step_fn.model.a, step_fn.model.b)])
        if zero:
            step_fn.model.zero_grad(set_to_none=False)
    return out


def _ddp_vs_gradient_sync(comm, port, name):
    from torch.nn.parallel import DistributedDataParallel as DDP

    plan = _PLANS[name]
    r = comm.rank
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=r, world_size=comm.size,
                            timeout=timedelta(seconds=60))
    try:
        model = Two()
        ddp = DDP(model, find_unused_parameters=True)

        def ddp_step(x, use_b, accumulate):
            ctx = ddp.no_sync() if accumulate else contextlib.nullcontext()
            with ctx:
                ddp(x, use_b).sum().backward()

        ddp_step.model = model
        ref = _grads_after_each_step(plan, r, ddp_step)
        settle_gloo()
    finally:
        dist.destroy_process_group()
    model = Two()
    sync = GradientSync(model, group=comm)

    def sync_step(x, use_b, accumulate):
        if accumulate:
            with sync.no_sync():
                model(x, use_b).sum().backward()
        else:
            model(x, use_b).sum().backward()
            sync.finish()

    sync_step.model = model
    return ref, _grads_after_each_step(plan, r, sync_step)


@pytest.mark.parametrize("name", sorted(_PLANS))
def test_reduces_what_ddp_reduces(w2, name):
    """Issue 21, finding 2: a synced step reduces every parameter's standing
    ``.grad`` (accumulated in no_sync or over steps without zero_grad), and a
    parameter counts as used if its gradient was produced anywhere since the
    last synced step, no_sync included: GradientSync equals
    DDP(find_unused_parameters=True) on gloo, value for value, on both ranks."""
    res = w2.run(_ddp_vs_gradient_sync, free_port(), name, timeout=120)
    for r, (ref, mine) in enumerate(res):
        assert mine == ref, (r, mine, ref)
    assert res[0][1] == res[1][1]  # the replicas agree
    if name == "no_sync":
        assert res[0][0][0][1] == 3.0
