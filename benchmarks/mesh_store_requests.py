"""Store requests of a 2-D device mesh on the streamcoll backend, per rank
and per phase, counted by a wrapper under torch's default store.

    PYTHONPATH=. python benchmarks/mesh_store_requests.py            # 4 ranks, init_device_mesh("cpu", (2, 2))
    PYTHONPATH=. python benchmarks/mesh_store_requests.py --dp 3 --tp 1

Phases: ``init_process_group("streamcoll")``; ``init_device_mesh`` (torch
makes a group per mesh dimension and slice); the first collective on the
world group (streamcoll creates its communicator: a full rendezvous); the
first collective on each dimension's group (each a communicator whose
topology is derived from the world's: rank 0 reads no facts); then the
same on a second mesh made before any world collective (a rendezvous of its
own per group). Real oneCCL across real processes; real TCPStore.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from datetime import timedelta

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _rank(rank: int, n: int, port: int, dp: int, tp: int, q) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(n), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(n),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RES_OPTIONS="use-vc",
                      CCL_KVS_IFACE="lo", OMP_NUM_THREADS="1")
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    import streamcoll  # noqa: F401  (registers the backend)
    from streamcoll.bench.rendezvous import CountingStore
    tcp = dist.TCPStore("127.0.0.1", port, n, rank == 0, timedelta(seconds=120), wait_for_workers=False)
    store = CountingStore(tcp)
    counts = {}
    last = 0

    def mark(phase: str) -> None:
        nonlocal last
        counts[phase] = store.requests - last
        last = store.requests

    dist.init_process_group("streamcoll", store=store, rank=rank, world_size=n, timeout=timedelta(seconds=120))
    mark("init_process_group")
    mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
    mark("init_device_mesh")
    t = torch.ones(4)
    dist.all_reduce(t)
    mark("world collective (world communicator)")
    for d in ("dp", "tp"):
        dist.all_reduce(t, group=mesh.get_group(d))
        mark(f"{d} collective ({d} communicator, derived)")
    dist.barrier()
    mark("barrier")
    q.put((rank, counts))
    dist.destroy_process_group()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dp", type=int, default=2)
    ap.add_argument("--tp", type=int, default=2)
    a = ap.parse_args()
    import multiprocessing as mp
    import socket
    n = a.dp * a.tp
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    ps = [ctx.Process(target=_rank, args=(r, n, port, a.dp, a.tp, q)) for r in range(n)]
    for p in ps:
        p.start()
    got = dict(q.get(timeout=300) for _ in ps)
    for p in ps:
        p.join(60)
    phases = list(got[0])
    print(f"store requests per rank, init_device_mesh('cpu', ({a.dp}, {a.tp})) on the streamcoll backend, "
          f"{n} ranks")
    print("| phase | " + " | ".join(f"rank {r}" for r in range(n)) + " |")
    print("|---|" + "---|" * n)
    for ph in phases:
        print(f"| {ph} | " + " | ".join(str(got[r][ph]) for r in range(n)) + " |")
    print("| total | " + " | ".join(str(sum(got[r].values())) for r in range(n)) + " |")
    print(json.dumps(got))
    return 0


if __name__ == "__main__":
    sys.exit(main())
