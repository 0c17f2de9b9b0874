"""The Ray side of tests/multihost/test_two_nodes.py: run on the head node of a
two-node Ray cluster (``ray start --head`` on node01, ``ray start
--address=...`` on node02, each a simulated host), it waits for both nodes,
then trains the same tiny DDP model with Ray Train's ``TorchTrainer`` and
``TorchConfig(backend=...)`` for each case: 2 workers of 2 CPUs (one per
node) and 4 workers of 1 CPU (two per node), streamcoll then gloo. No setup
hook, nothing set for the library: Ray's workers know the backend from
streamcoll's ``torch.backends`` entry point. Every worker writes what it
saw (rank, local rank, node, rendezvous, parameters) to a JSON file under
``OUT``; ``OUT/cases.json`` lists the cases run and their times.

``python tests/two_nodes_ray.py GCS_ADDRESS OUT``
"""
import json
import os
import sys
import time

os.environ.setdefault("RAY_TRAIN_V2_ENABLED", "1")

import ray  # noqa: E402
from ray.train import RunConfig, ScalingConfig  # noqa: E402
from ray.train.torch import TorchConfig, TorchTrainer  # noqa: E402

CASES = [(2, 2), (4, 1)]  # (workers, CPUs per worker) on two nodes of 2 CPUs


def train(config):
    import torch
    import torch.distributed as dist

    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    rank = dist.get_rank()
    g = torch.Generator().manual_seed(rank)
    for _ in range(3):
        x = torch.randn(8, 4, generator=g)
        opt.zero_grad()
        ((model(x) - x.sum(1, keepdim=True)) ** 2).mean().backward()
        opt.step()
    ranks = torch.tensor([float(rank + 1)])
    dist.all_reduce(ranks)
    b = torch.full((2,), float(rank))
    dist.broadcast(b, src=dist.get_world_size() - 1)
    row = {"backend": dist.get_backend(), "rank": rank, "world": dist.get_world_size(),
           "local_rank": int(os.environ.get("LOCAL_RANK", "-1")), "node": os.uname().nodename,
           "rendezvous": f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}",
           "rank_sum": ranks.item(), "broadcast": b.tolist(),
           "params": [p.detach().flatten().tolist() for p in model.parameters()]}
    path = os.path.join(config["out"], f"rank{rank}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(row, f)
    os.replace(path + ".tmp", path)


def main(address: str, out: str) -> None:
    ray.init(address=address, include_dashboard=False, log_to_driver=False)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:  # bounded: the worker node joins after the head
        alive = [n for n in ray.nodes() if n.get("Alive")]
        if len(alive) == 2 and ray.cluster_resources().get("CPU", 0) >= 4:
            break
        time.sleep(0.5)
    else:
        raise RuntimeError(f"the second node did not join within 120 s: {ray.nodes()}")
    cases = []
    for workers, cpus in CASES:
        for backend in ("streamcoll", "gloo"):
            d = os.path.join(out, f"{backend}-{workers}")
            os.makedirs(d)
            t0 = time.monotonic()
            TorchTrainer(train, train_loop_config={"out": d},
                         scaling_config=ScalingConfig(num_workers=workers, resources_per_worker={"CPU": cpus}),
                         torch_config=TorchConfig(backend=backend),
                         run_config=RunConfig(storage_path=os.path.join(out, "storage"),
                                              name=f"{backend}-{workers}")).fit()
            cases.append({"backend": backend, "workers": workers, "dir": d, "s": round(time.monotonic() - t0, 1)})
            with open(os.path.join(out, "cases.json"), "w") as f:
                json.dump(cases, f)
    ray.shutdown()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
