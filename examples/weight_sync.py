"""Weight sync between a trainer and a server started on its own.

The trainer runs under torchrun (its own world, data parallel); every
``--every`` steps its rank 0 broadcasts the model's weights to a server,
a separate ``python`` process with an asyncio loop, which evaluates with
them. The two jobs share no launcher: they meet through a store address
(``--store host:port``; the trainer's rank 0 hosts it).

    # the trainer (2 ranks) and the server, in any order:
    torchrun --nproc-per-node 2 examples/weight_sync.py trainer --store 127.0.0.1:29600
    python examples/weight_sync.py server --store 127.0.0.1:29600

``--backend gloo`` runs the same program on torch.distributed's gloo (the
server then waits for its broadcasts in a thread): the same values.

oneCCL (the CPU backend) makes its transport with a process's first
communicator, for that communicator's members only; the trainer's first is
its own world, which the server is not part of. Every process that joins a
communicator beyond its first one therefore runs oneCCL over TCP from its
start (``CCL_ATL_SHM=0 FI_PROVIDER=tcp``, set below before streamcoll makes
any communicator; docs/api.md, "Beyond one job", says what it costs). On
NCCL (GPUs) nothing of the kind is needed.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from datetime import timedelta

os.environ.setdefault("CCL_ATL_SHM", "0")   # both jobs, from the start: see the module docstring
os.environ.setdefault("FI_PROVIDER", "tcp")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import streamcoll  # noqa: E402

SERVER_RANK = 1  # the weight-sync group: the trainer's rank 0 (rank 0) and the server


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))


def flat(m: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in m.parameters()])


def load(m: torch.nn.Module, w: torch.Tensor) -> None:
    at = 0
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(w[at:at + p.numel()].view_as(p))
            at += p.numel()


def batch(seed: int) -> tuple:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(64, 16, generator=g)
    return x, x.sum(dim=1, keepdim=True).sin()


def weight_group(backend: str, address: str, rank: int, timeout: float):
    """The weight-sync group: a streamcoll communicator over the store at
    ``address``, or gloo's process group over the same store."""
    if backend == "streamcoll":
        return streamcoll.new_communicator(backend="oneccl", device="cpu", store=address, rank=rank,
                                           world_size=2, name="weights", timeout=timeout)
    host, port = address.rsplit(":", 1)
    store = dist.TCPStore(host, int(port), None, rank == 0, timedelta(seconds=timeout), wait_for_workers=False)
    return dist.ProcessGroupGloo(dist.PrefixStore("weights", store), rank, 2, timedelta(seconds=timeout))


def trainer(args: argparse.Namespace) -> None:
    dist.init_process_group(args.backend, timeout=timedelta(seconds=args.timeout))
    rank, size = dist.get_rank(), dist.get_world_size()
    m = model()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    group = weight_group(args.backend, args.store, 0, args.timeout) if rank == 0 else None
    for step in range(1, args.steps + 1):
        x, y = batch(1000 * step + rank)
        loss = torch.nn.functional.mse_loss(m(x), y)
        opt.zero_grad()
        loss.backward()
        for p in m.parameters():
            dist.all_reduce(p.grad)
            p.grad /= size
        opt.step()
        if step % args.every == 0 and rank == 0:
            w = flat(m)
            if args.backend == "streamcoll":
                group.broadcast(w, src=0)
            else:
                group.broadcast([w], dist.BroadcastOptions()).wait()
            print(json.dumps({"step": step, "sent": float(w.sum())}), flush=True)
    dist.barrier()
    if group is not None and args.backend == "streamcoll":
        group.destroy()
    dist.destroy_process_group()


async def server(args: argparse.Namespace) -> None:
    loop = asyncio.get_running_loop()
    gaps = []  # the ticker's gaps while a broadcast is awaited
    awaiting = [False]

    async def ticker() -> None:  # stands for the server's other work: it must keep running
        last = loop.time()
        while True:
            await asyncio.sleep(0.01)
            now = loop.time()
            if awaiting[0]:
                gaps.append(now - last)
            last = now

    tick = asyncio.create_task(ticker())
    group = await asyncio.to_thread(weight_group, args.backend, args.store, SERVER_RANK, args.timeout)
    m = model()
    x, y = batch(7)
    n = flat(m).numel()
    results = []
    for k in range(args.steps // args.every):
        w = torch.empty(n)
        awaiting[0] = True
        if args.backend == "streamcoll":
            await group.broadcast(w, src=0, async_op=True)  # the loop runs on while the weights arrive
        else:
            work = group.broadcast([w], dist.BroadcastOptions())
            await asyncio.to_thread(work.wait)
        awaiting[0] = False
        load(m, w)
        with torch.no_grad():
            loss = float(torch.nn.functional.mse_loss(m(x), y))
        results.append({"sync": k + 1, "received": float(w.sum()), "eval_loss": loss})
        print(json.dumps(results[-1]), flush=True)
    tick.cancel()
    if args.backend == "streamcoll":
        group.destroy()
    print(json.dumps({"server": results, "ticks_while_awaiting": len(gaps),
                      "max_tick_gap_s": round(max(gaps, default=0.0), 4)}), flush=True)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("role", choices=["trainer", "server"])
    ap.add_argument("--store", required=True, help="host:port of the weight-sync store (the trainer's rank 0 hosts it)")
    ap.add_argument("--backend", choices=["streamcoll", "gloo"], default="streamcoll")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--every", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=60.0)
    args = ap.parse_args(argv)
    if args.role == "trainer":
        trainer(args)
    else:
        asyncio.run(server(args))


if __name__ == "__main__":
    main(sys.argv[1:])
