"""Ray Train on streamcoll (README, "Launching"): ``TorchTrainer`` with
``TorchConfig(backend="streamcoll")`` and nothing else. No setup hook and no
``import streamcoll`` in the train function: Ray's fresh worker processes
know the backend name from streamcoll's ``torch.backends`` entry point,
loaded by ``import torch``.

Each ``--backend`` (default: streamcoll) trains the same tiny DDP model on 2
CPU workers in one Ray session (Ray's start-up, most of the time, is paid
once); rank 0's parameters are printed as a JSON line, so tests/startup/test_launchers.py
compares streamcoll's with gloo's. Ray 2.60's Train V2 needs
``RAY_TRAIN_V2_ENABLED=1`` (set here when unset).
"""
import argparse
import json
import os
import tempfile

os.environ.setdefault("RAY_TRAIN_V2_ENABLED", "1")

import ray  # noqa: E402
import ray.train  # noqa: E402
from ray.train import RunConfig, ScalingConfig  # noqa: E402
from ray.train.torch import TorchConfig, TorchTrainer  # noqa: E402


def train(config):
    import torch
    import torch.distributed as dist

    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(dist.get_rank())
    for _ in range(3):
        x = torch.randn(8, 4, generator=g)
        opt.zero_grad()
        ((model(x) - x.sum(1, keepdim=True)) ** 2).mean().backward()
        opt.step()
    ranks = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(ranks)
    if dist.get_rank() == 0:  # Train V2 keeps reported metrics only with a checkpoint: a file instead
        with open(config["out"], "w") as f:
            json.dump({"backend": dist.get_backend(), "world": dist.get_world_size(), "rank_sum": ranks.item(),
                       "params": [p.detach().flatten().tolist() for p in model.parameters()]}, f)


parser = argparse.ArgumentParser()
parser.add_argument("--backend", action="append", choices=["streamcoll", "gloo"])
parser.add_argument("--workers", type=int, default=2)
args = parser.parse_args()
ray.init(num_cpus=args.workers + 2, include_dashboard=False, log_to_driver=False)
with tempfile.TemporaryDirectory() as storage:
    for backend in args.backend or ["streamcoll"]:
        out = os.path.join(storage, f"{backend}.json")
        TorchTrainer(train, train_loop_config={"out": out}, scaling_config=ScalingConfig(num_workers=args.workers),
                     torch_config=TorchConfig(backend=backend),
                     run_config=RunConfig(storage_path=storage, name=f"launch-{backend}")).fit()
        with open(out) as f:
            print(f.read(), flush=True)
ray.shutdown()
