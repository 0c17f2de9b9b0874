"""Where streamcoll's per-call cost goes at 2 ranks against 1: times, in the
same processes and interleaved, the raw oneCCL call, the raw call followed by
a pure-Python busy wait of D us (a stand-in for wrapper work of known cost),
``comm.all_reduce`` and ``streamcoll.all_reduce``, all on a 1-element float32
tensor. If host work between calls added only its own duration, the
``raw+D`` rows would be ``raw + D`` at every world size; how much more they
cost at 2 ranks is what lockstep (every call waits for the slower rank)
adds to any wrapper, streamcoll's included (``--phases``: how much of it
is spent inside the C call, waiting). Under mpiexec the same is done
around an MPI all-reduce (mpi4py), which tells whether the amplification is
lockstep's (MPI shows it too) or oneCCL's.

    python benchmarks/percall.py                                  # world size 1
    .venv-mpi/bin/mpiexec -n 2 -bind-to none .venv-mpi/bin/python benchmarks/percall.py
    (or torchrun --nproc-per-node 2 benchmarks/percall.py)

Prints, on rank 0, per variant the median over repetitions of the per-call
time averaged over ranks, and its excess over raw.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Callable, Dict, List

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--spins", default="1,2,3", help="busy-wait lengths D in us")
    ap.add_argument("--phases", action="store_true",
                    help="also time the C call itself inside raw + D (per rank: does the call grow with D?)")
    a = ap.parse_args(argv)
    from streamcoll.bench import mpi as bench_mpi
    bench_mpi.adopt_launcher_env()
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("CCL_KVS_IFACE", "lo")
    mpi_comm = None
    if bench_mpi.launched_by_mpi() is not None:
        # MPI first, before oneCCL is loaded (see streamcoll.bench.mpi).
        mpi_comm, why = bench_mpi.open_world(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]))
        if mpi_comm is not None and "MASTER_PORT" not in os.environ:
            import socket
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(mpi_comm.bcast(s.getsockname()[1], root=0))
            s.close()
    os.environ.setdefault("MASTER_PORT", "0")
    import torch
    import streamcoll
    from streamcoll.bench.cases import Context, make_case
    if os.environ["WORLD_SIZE"] == "1":
        store = torch.distributed.HashStore()
        comm = streamcoll.init(rank=0, world_size=1, store=store, device="cpu")
    else:
        comm = streamcoll.init(device="cpu")
    rank, n = comm.rank, comm.size
    t = torch.ones(1)
    case = make_case("all_reduce", Context(comm, rank, n, torch.device("cpu"), torch.float32, False), 4)
    raw = case.raw()
    pc = time.perf_counter

    inside: Dict[str, List[float]] = {}  # variant -> [seconds inside the call, calls] (this rank)

    def spin(call: Callable[[], None], us: float, key: str = "") -> Callable[[], None]:
        d = us * 1e-6
        if a.phases and key:
            acc = inside.setdefault(key, [0.0, 0])

            def g():
                t0 = pc()
                call()
                t1 = pc()
                acc[0] += t1 - t0
                acc[1] += 1
                end = t1 + d
                while pc() < end:
                    pass
            return g

        def f():
            call()
            end = pc() + d
            while pc() < end:
                pass
        return f

    variants: Dict[str, Callable[[], None]] = {"raw": raw}
    for d in a.spins.split(","):
        variants[f"raw + {d} us Python"] = spin(raw, float(d))
    if a.phases:
        for d in ["0"] + a.spins.split(","):
            variants[f"raw + {d} us, C timed"] = spin(raw, float(d), f"raw + {d} us, C timed")
    if mpi_comm is not None:  # the same stand-in around MPI: is the amplification oneCCL's or lockstep's?
        from streamcoll.bench.mpi import tiny as mpi_tiny
        mpi = mpi_tiny(mpi_comm)
        variants["mpi"] = mpi
        for d in a.spins.split(","):
            variants[f"mpi + {d} us Python"] = spin(mpi, float(d))
    method, fn = comm.all_reduce, streamcoll.all_reduce
    variants["comm.all_reduce(t)"] = lambda: method(t)
    variants["streamcoll.all_reduce(t)"] = lambda: fn(t)
    names = list(variants)
    times: Dict[str, List[float]] = {k: [] for k in names}
    tiny = torch.zeros(1)
    for f in variants.values():
        for _ in range(200):
            f()
    for rep in range(a.reps):
        k = rep % len(names)
        for name in names[k:] + names[:k]:
            f = variants[name]
            t.fill_(0)
            streamcoll.all_reduce(tiny)  # line the ranks up
            t0 = pc()
            for _ in range(a.calls):
                f()
            times[name].append((pc() - t0) / a.calls * 1e6)
    T = torch.tensor([times[k] for k in names], dtype=torch.float64)
    streamcoll.all_reduce(T)
    T /= n
    if rank == 0:
        med = {k: statistics.median(T[i].tolist()) for i, k in enumerate(names)}
        print(f"# per-call us, 1-element float32 all_reduce, {n} rank(s), median of {a.reps} x {a.calls} calls, "
              f"interleaved; load {os.getloadavg()}")
        print("# env: " + " ".join(f"{k}={v}" for k, v in sorted(os.environ.items()) if k.startswith(("CCL_", "FI_"))))
        print(f"{'variant':>28s} {'us':>8s} {'over raw':>9s}")
        for k in names:
            print(f"{k:>28s} {med[k]:8.2f} {med[k] - med['raw']:9.2f}")
    if a.phases:
        keys = sorted(inside)
        C = torch.zeros(n, len(keys), dtype=torch.float64)
        for j, k in enumerate(keys):
            C[rank, j] = inside[k][0] / max(inside[k][1], 1) * 1e6
        streamcoll.all_reduce(C)
        if rank == 0:
            print("# time inside the raw C call per rank (us), mean over all timed and warm-up calls:")
            for j, k in enumerate(keys):
                print(f"{k:>28s} " + " ".join(f"rank {r}: {C[r, j]:6.2f}" for r in range(n)))
    streamcoll.destroy()
    return 0


if __name__ == "__main__":
    sys.exit(main())
