"""A custom training loop that averages gradients with streamcoll.

Run (2 CPU ranks; `bash scripts/demo.sh` does set-up and picks a free port):

    torchrun --nproc-per-node 2 --master-addr 127.0.0.1 examples/train.py

Each rank trains the same MLP on its own shard of synthetic data.
streamcoll.GradientSync all-reduces gradients in buckets with async_op=True
while backward is still running, and ``finish()`` waits before the optimizer
step. The same loop is then run again with torch.distributed (gloo)
all-reducing each gradient after backward, from the same seed and data, and
the script checks that (1) every rank ends with identical parameters and
(2) they equal the gloo run's. It exits non-zero if either check fails.
"""
from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist

import streamcoll


def make_model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(64, 512), torch.nn.ReLU(),
        torch.nn.Linear(512, 512), torch.nn.ReLU(),
        torch.nn.Linear(512, 512), torch.nn.ReLU(),
        torch.nn.Linear(512, 10),
    )


def batches(rank: int, steps: int, batch: int):
    g = torch.Generator().manual_seed(1000 + rank)  # each rank its own shard
    w_true = torch.randn(64, 10, generator=torch.Generator().manual_seed(7))
    for _ in range(steps):
        x = torch.randn(batch, 64, generator=g)
        yield x, (x @ w_true).argmax(1)


def train_streamcoll(args, rank: int, world: int):
    model = make_model(args.seed)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    sync = streamcoll.GradientSync(model, bucket_mb=args.bucket_mb, record_timeline=True)
    losses, times = [], []
    for step, (x, y) in enumerate(batches(rank, args.steps, args.batch)):
        t0 = time.perf_counter()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()                # buckets are all-reduced while this runs
        sync.finish()                  # wait for them; .grad now holds the average
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
        losses.append(loss.item())
        if rank == 0:
            print(f"[streamcoll] step {step:3d}  loss {loss.item():.4f}  {times[-1] * 1e3:7.2f} ms", flush=True)
    tl = sync.timeline()
    return model, losses, times, tl


def train_gloo(args, rank: int, world: int):
    model = make_model(args.seed)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    times = []
    for step, (x, y) in enumerate(batches(rank, args.steps, args.batch)):
        t0 = time.perf_counter()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
            p.grad.div_(world)
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
        if rank == 0 and step % 10 == 0:
            print(f"[gloo]       step {step:3d}  loss {loss.item():.4f}  {times[-1] * 1e3:7.2f} ms", flush=True)
    return model, times


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--bucket-mb", type=float, default=0.5)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.set_num_threads(1)

    # torch.distributed (gloo) for the reference run; streamcoll reuses its store.
    dist.init_process_group("gloo")
    comm = streamcoll.init()
    rank, world = comm.rank, comm.size
    if rank == 0:
        print(f"streamcoll {streamcoll.__version__}: {world} ranks, backend {comm.backend}, device {comm.device}")

    model, losses, times, tl = train_streamcoll(args, rank, world)
    ref, gloo_times = train_gloo(args, rank, world)

    # (1) identical parameters on every rank: gather them with streamcoll.
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    everyone = torch.empty(world * flat.numel())
    streamcoll.all_gather_into_tensor(everyone, flat)
    same = all(torch.equal(everyone.view(world, -1)[r], flat) for r in range(world))
    # (2) equal to the gloo run (the reductions may add in another order:
    #     float32 tolerance).
    ref_flat = torch.cat([p.detach().reshape(-1) for p in ref.parameters()])
    diff = (flat - ref_flat).abs().max().item()
    close = torch.allclose(flat, ref_flat, rtol=1e-5, atol=1e-6)

    # Overlap: the first bucket launched before backward finished?
    # (the last gradient became ready at the end of backward)
    overlap = None
    if tl.get("launch") and tl.get("ready"):
        overlap = min(tl["launch"]) < max(t for _, t in tl["ready"])

    med = sorted(times[2:])[len(times[2:]) // 2] if len(times) > 2 else times[-1]
    gmed = sorted(gloo_times[2:])[len(gloo_times[2:]) // 2] if len(gloo_times) > 2 else gloo_times[-1]
    ok = same and close
    if rank == 0:
        print(f"final loss {losses[-1]:.4f} (first {losses[0]:.4f})")
        print(f"median step: streamcoll {med * 1e3:.2f} ms, gloo {gmed * 1e3:.2f} ms")
        if overlap is not None:
            print(f"first bucket launched before backward ended: {bool(overlap)}")
        print(f"parameters identical on all {world} ranks: {same}")
        print(f"max |streamcoll - gloo| over {flat.numel()} parameters: {diff:.3g} (allclose: {close})")
        print("OK" if ok else "FAILED")
    streamcoll.destroy()
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
