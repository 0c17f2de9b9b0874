"""One job for every launcher (README, "Launching"): ``torchrun``, ``srun``,
``mpiexec``. ``streamcoll.init()`` takes the rank, world size, local rank
and node from whichever launcher started the process (streamcoll/startup/launchers.py)
and finds rank 0 the launcher's way.

``--backend gloo`` runs the same job on torch.distributed's gloo under the
same launcher (``streamcoll.launchers.adopt()`` exports the launcher's ranks
as torchrun's variables, so ``init_process_group``'s env:// works there too);
tests/startup/test_launchers.py compares the two. Prints one JSON line per rank, with
the seconds from the process's start to the end of its first collective.
"""
import argparse
import json
import os
import sys
import time

import torch
import torch.distributed as dist

import streamcoll


def started() -> float:
    """When this process started (seconds since the epoch), from /proc."""
    with open("/proc/self/stat") as f:
        ticks = int(f.read().rsplit(")", 1)[1].split()[19])
    with open("/proc/stat") as f:
        boot = next(int(line.split()[1]) for line in f if line.startswith("btime"))
    return boot + ticks / os.sysconf("SC_CLK_TCK")


parser = argparse.ArgumentParser()
parser.add_argument("--backend", default="streamcoll", choices=["streamcoll", "gloo"])
backend = parser.parse_args().backend
if backend == "gloo":
    streamcoll.launchers.adopt()
    dist.init_process_group("gloo")
    rank, world, all_reduce, broadcast = dist.get_rank(), dist.get_world_size(), dist.all_reduce, dist.broadcast
else:
    streamcoll.init()
    rank, world = streamcoll.get_rank(), streamcoll.get_world_size()
    all_reduce, broadcast = streamcoll.all_reduce, streamcoll.broadcast
t = torch.arange(4.0) * (rank + 1)
all_reduce(t)
first_s = round(time.time() - started(), 3)
b = torch.full((2,), float(rank))
broadcast(b, src=world - 1)
line = json.dumps({"backend": backend, "rank": rank, "world": world, "values": t.tolist(),
                   "broadcast": b.tolist(), "host": os.uname().nodename, "local_rank": os.environ.get("LOCAL_RANK"),
                   "rendezvous": f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}",
                   "first_collective_s": first_s})
sys.stdout.write(line + "\n")  # one write: the ranks share the launcher's output
sys.stdout.flush()
if backend == "gloo":
    dist.destroy_process_group()
else:
    streamcoll.destroy()
