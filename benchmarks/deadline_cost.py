"""What per-call deadlines cost: a 64 B (16 x float32) all_reduce at world
size 1, one process, by the paths a program takes, without ``timeout=``
(whose cost must not change) and, where the tree has it, with ``timeout=``
(the general path: on the CPU the call runs on the comm thread while the
caller waits up to its deadline).

Rows, interleaved round by round: ``comm.all_reduce(t)`` (the generated fast
path), ``streamcoll.all_reduce(t, group=comm)``, ``dist.all_reduce(t)`` on
the ``"streamcoll"`` group (which now reads ``opts.timeout``),
``comm.all_reduce(t, async_op=True).wait()``, and the two with
``timeout=60``. Per-call microseconds of the process's CPU time (the
machines here are shared and loaded: wall time moves with the load, the
process's CPU time much less), min and median over rounds.

    PYTHONPATH=/path/to/other/checkout python benchmarks/deadline_cost.py --label before
    PYTHONPATH=. python benchmarks/deadline_cost.py --label after

Uses only the public API, so it runs against a tree without ``timeout=``
(those rows are then left out); run the trees alternately, several times.
"""
from __future__ import annotations

import argparse
import inspect
import os
import statistics
import time


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=25)
    ap.add_argument("--calls", type=int, default=2000, help="calls per row and round (timeout= rows: a fifth)")
    ap.add_argument("--label", default="")
    a = ap.parse_args(argv)
    import torch
    import torch.distributed as dist
    import streamcoll
    dist.init_process_group("streamcoll", store=dist.HashStore(), rank=0, world_size=1)
    comm = streamcoll.new_communicator(backend="oneccl", device="cpu", rank=0, world_size=1, store=dist.HashStore())
    t = torch.ones(16)
    rows = {
        "comm.all_reduce(t)": lambda: comm.all_reduce(t),
        "streamcoll.all_reduce(t, group=comm)": lambda: streamcoll.all_reduce(t, group=comm),
        "dist.all_reduce(t) on streamcoll": lambda: dist.all_reduce(t),
        "comm.all_reduce(t, async_op=True).wait()": lambda: comm.all_reduce(t, async_op=True).wait(),
    }
    if "timeout" in inspect.signature(comm.all_reduce).parameters:
        rows["comm.all_reduce(t, timeout=60)"] = lambda: comm.all_reduce(t, timeout=60)
        rows["comm.all_reduce(t, async_op=True, timeout=60).wait()"] = \
            lambda: comm.all_reduce(t, async_op=True, timeout=60).wait()
    try:
        for f in rows.values():
            for _ in range(500):
                f()
        us = {k: [] for k in rows}
        for _ in range(a.rounds):
            for k, f in rows.items():
                n = a.calls // 5 if "timeout" in k else a.calls
                p0 = time.process_time()
                for _ in range(n):
                    f()
                us[k].append((time.process_time() - p0) / n * 1e6)
        print(f"# {a.label}: 64 B all_reduce, world size 1, {a.rounds} rounds; process CPU time per call, us "
              f"(min / median); load {os.getloadavg()[0]:.2f}")
        for k, v in us.items():
            print(f"{a.label:8s} {k:55s} {min(v):7.2f} {statistics.median(v):7.2f}")
    finally:
        comm.destroy()
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
