"""bf16 all_reduce through float32 against oneCCL's own bf16 (issue 35).

oneCCL 2022.2 truncates in its CPU bf16 reduction, so streamcoll reduces bf16
in float32 scratch and rounds once (``streamcoll/core/backends.py``, ``_WIDENED``).
This driver times, interleaved round by round in one 2-rank run, per size:

- ``raw bf16``: oneCCL's own bf16 all_reduce, the raw C call (a C-level
  partial through streamcoll's binding), in place, the same buffer size;
- ``raw f32``: the raw float32 call of the same element count (twice the bytes);
- ``raw f32 + copies``: that call between the two conversions the widened
  path makes (bf16 to float32 before, float32 to bf16 after), written as
  plainly as torch allows: the floor of the approach without streamcoll;
- ``all_reduce``: ``comm.all_reduce(x)`` on the bf16 tensor (SUM, sync);
- ``all_reduce f32``: ``comm.all_reduce`` on the float32 buffer of ``raw f32``
  (streamcoll's own cost on an unwidened call, for comparison);
- ``all_reduce AVG``: the same with ``op=AVG`` (SUM, then the scaling in float32);
- ``async+wait``: ``comm.all_reduce(x, async_op=True).wait()`` (a widened
  async call takes the general path: per-call float32 buffers).

A time is the slowest rank's for a batch of calls (buffers of zeros: the
values stay put); each row gives the min and median over the rounds and the
ratio of its median to ``raw bf16``'s median in the same run. The tree under
test is whatever ``streamcoll`` imports: run the driver against the old and
the new tree alternately, each run timing its own ``raw bf16``::

    git archive <old commit> | tar -x -C /tmp/old     # the tree before the change
    i=0
    for t in old new old new old new; do
        i=$((i + 1)); uptime
        [ $t = old ] && P=/tmp/old || P=$PWD
        flock /tmp/streamcoll-bench.lock env PYTHONPATH=$P torchrun --nproc-per-node 2 \\
            --master-addr 127.0.0.1 benchmarks/bf16.py --tree $t --out benchmarks/results/bf16/$t-$i
    done

Bit-exactness (``--dump FILE``, 2 ranks): fixed random bf16 inputs (normal,
subnormal, signed zeros, infinities, NaN, large values that overflow) through
all_reduce SUM/AVG/MIN/MAX/PRODUCT (1-D, 2-D, 0-d, empty, 64 KB), reduce and
reduce_scatter_tensor, with the results saved per rank; with ``--gloo`` the
finite inputs also go through gloo in the same world and must match it bit
for bit. ``--compare A B`` compares two dumps (old tree against new)::

    PYTHONPATH=/tmp/old torchrun --nproc-per-node 2 --master-addr 127.0.0.1 benchmarks/bf16.py --dump /tmp/old.pt
    torchrun --nproc-per-node 2 --master-addr 127.0.0.1 benchmarks/bf16.py --dump /tmp/new.pt --gloo
    python benchmarks/bf16.py --compare /tmp/old.pt /tmp/new.pt
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

SIZES = {"4K": 4 << 10, "64K": 64 << 10, "1M": 1 << 20}
CALLS = {"4K": 2000, "64K": 500, "1M": 60}
OPS = ("SUM", "AVG", "MIN", "MAX", "PRODUCT")


def _inputs(rank: int, n: int, special: bool):
    """bf16 inputs of rank ``rank``: random over 40 binades, with special values if asked."""
    import torch
    g = torch.Generator().manual_seed(1000 + rank + n)
    x = torch.randn(n, generator=g, dtype=torch.float64) * torch.logspace(-20, 20, n, base=2.0, dtype=torch.float64)
    x = x.to(torch.bfloat16)
    if special and n >= 64:
        sp = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan"), 1e-40, -1e-40, 9.2e-41,
                           3.38e38, -3.38e38, 1.7e38, 1.0, 1.0 + 2 ** -7, 2 ** -126, 2 ** -133, 3.0],
                          dtype=torch.bfloat16)
        idx = torch.randperm(n, generator=g)[:sp.numel()]
        x[idx] = sp if rank % 2 == 0 else sp.flip(0)
    return x


def dump(a) -> int:
    import torch
    import torch.distributed as dist
    import streamcoll
    comm = streamcoll.init(device="cpu")
    rank, size = comm.rank, comm.size
    R = streamcoll.ReduceOp
    out = {}
    shapes = {"1d": (2048,), "2d": (3, 700), "0d": (), "empty": (0,), "64K": (32768,), "odd": (1001,)}
    cases = []  # (name, input, op)
    for special in (False, True):
        for sn, shp in shapes.items():
            n = 1
            for s in shp:
                n *= s
            x = _inputs(rank, n, special).view(shp)
            for op in OPS:
                cases.append((f"all_reduce {op} {sn} {'special' if special else 'finite'}", x, op))
    for name, x, op in cases:
        t = x.clone()
        comm.all_reduce(t, getattr(R, op))
        out[name] = t.view(torch.int16).clone()
        t = x.clone()  # the async (general) path too
        comm.all_reduce(t, getattr(R, op), async_op=True).wait()
        out[name + " async"] = t.view(torch.int16).clone()
    for special in (False, True):
        x = _inputs(rank, 4096, special)
        for op in ("SUM", "AVG", "MAX"):
            for dst in range(size):
                t = x.clone()
                comm.reduce(t, dst, getattr(R, op))
                if rank == dst:
                    out[f"reduce {op} dst{dst} {special}"] = t.view(torch.int16).clone()
            o = torch.empty(4096 // size, dtype=torch.bfloat16)
            comm.reduce_scatter_tensor(o, x, getattr(R, op))
            out[f"reduce_scatter_tensor {op} {special}"] = o.view(torch.int16).clone()
    gloo_ok = None
    if a.gloo:
        dist.init_process_group("gloo")
        gops = {"SUM": dist.ReduceOp.SUM, "MIN": dist.ReduceOp.MIN, "MAX": dist.ReduceOp.MAX,
                "PRODUCT": dist.ReduceOp.PRODUCT, "AVG": dist.ReduceOp.SUM}
        bad = []
        checked = 0
        for name, x, op in cases:
            if "finite" not in name:
                continue
            t = x.clone()
            dist.all_reduce(t, gops[op])
            if op == "AVG":  # gloo has no AVG: its SUM (correctly rounded at 2 ranks), halved
                assert size == 2
                t = t / 2
            for k in (name, name + " async"):
                checked += 1
                if not torch.equal(out[k], t.view(torch.int16)):
                    diff = int((out[k] != t.view(torch.int16)).sum())
                    bad.append(f"{k}: {diff} of {t.numel()} elements differ from gloo")
        gloo_ok = {"checked": checked, "differ": bad}
        print(f"rank {rank}: gloo: {checked} finite results compared, {len(bad)} differ", *bad, sep="\n  ")
        dist.destroy_process_group()
    comm.destroy()
    torch.save({"results": out, "gloo": gloo_ok, "path": streamcoll.__file__}, f"{a.dump}.{rank}")
    print(f"rank {rank}: {len(out)} results from {streamcoll.__file__} in {a.dump}.{rank}")
    return 0 if not (gloo_ok and gloo_ok["differ"]) else 1


def compare(a, b) -> int:
    import glob
    import torch
    bad = n = 0
    for fa in sorted(glob.glob(a + ".*")):
        ra = torch.load(fa)
        rb = torch.load(b + fa[len(a):])
        print(f"{fa} ({ra['path']}) against {b + fa[len(a):]} ({rb['path']})")
        assert ra["results"].keys() == rb["results"].keys()
        for k, v in ra["results"].items():
            n += 1
            if not torch.equal(v, rb["results"][k]):
                bad += 1
                print(f"  differ: {k}: {int((v != rb['results'][k]).sum())} elements")
    print(f"{n} results compared bit for bit, {bad} differ")
    return 1 if bad or not n else 0


def bench(a) -> int:
    import torch
    import streamcoll
    from streamcoll.bench.cases import Context
    torch.set_num_threads(1)
    comm = streamcoll.init(device="cpu")
    rank, size = comm.rank, comm.size
    cpu = torch.device("cpu")
    ctx = {dt: Context(comm, rank, size, cpu, dt, False) for dt in (torch.bfloat16, torch.float32)}
    SUM = comm._backend.ops["SUM"]
    AVG = streamcoll.ReduceOp.AVG
    ar = comm.all_reduce
    sizes = [s for s in a.sizes.split(",") if s]
    variants = {}
    keep = []  # the raw calls hold bare addresses: their tensors must outlive them
    for s in sizes:
        n = SIZES[s] // 2
        xb, xf, xr, xc, xw = (torch.zeros(n, dtype=torch.bfloat16), torch.zeros(n),
                              torch.zeros(n, dtype=torch.bfloat16), torch.zeros(n, dtype=torch.bfloat16), torch.zeros(n))

        def raw(dt, t):
            c = ctx[dt]
            return c.bound("all_reduce", {"send": c.ptr(t), "recv": c.ptr(t), "count": n, "op": SUM})

        rb, rf, rw = raw(torch.bfloat16, xb), raw(torch.float32, xf), raw(torch.float32, xw)
        keep += [xb, xf, xr, xc, xw]

        def copies(rw=rw, xc=xc, xw=xw):
            xw.copy_(xc)
            rw()
            xc.copy_(xw)

        variants[s] = {
            "raw bf16": rb, "raw f32": rf, "raw f32 + copies": copies,
            "all_reduce": lambda xr=xr: ar(xr),
            "all_reduce f32": lambda xf=xf: ar(xf),
            "all_reduce AVG": lambda xr=xr: ar(xr, AVG),
        }
        if not a.no_async:
            variants[s]["async+wait"] = lambda xr=xr: ar(xr, async_op=True).wait()
    names = list(next(iter(variants.values())))
    for s in sizes:  # warm-up: scratch grown, pointers cached, first-call checks done
        for f in variants[s].values():
            for _ in range(20):
                f()
    pc = time.perf_counter
    times = {s: {v: [] for v in names} for s in sizes}
    for rnd in range(a.rounds):
        for s in sizes:
            k = rnd % len(names)
            calls = max(1, int(CALLS[s] * a.scale))
            for v in names[k:] + names[:k]:  # the order rotates each round
                f = variants[s][v]
                comm.barrier()
                t0 = pc()
                for _ in range(calls):
                    f()
                times[s][v].append((pc() - t0) / calls * 1e6)
    # the slowest rank's time per batch
    flat = torch.tensor([x for s in sizes for v in names for x in times[s][v]], dtype=torch.float64)
    comm.all_reduce(flat, streamcoll.ReduceOp.MAX)
    it = iter(flat.tolist())
    times = {s: {v: [next(it) for _ in range(a.rounds)] for v in names} for s in sizes}
    comm.destroy()
    if rank != 0:
        return 0
    lines = [f"tree {a.tree} ({streamcoll.__file__}), {size} ranks, {a.rounds} rounds, load before: {a.load or '?'}",
             f"{'size':>5s} {'variant':18s} {'min us':>9s} {'median us':>9s} {'x raw bf16':>10s}"]
    doc = {"tree": a.tree, "path": streamcoll.__file__, "ranks": size, "rounds": a.rounds, "load": a.load,
           "calls": {s: max(1, int(CALLS[s] * a.scale)) for s in sizes}, "times_us": times, "summary": {}}
    for s in sizes:
        base = statistics.median(times[s]["raw bf16"])
        for v in names:
            xs = times[s][v]
            med = statistics.median(xs)
            doc["summary"][f"{s} {v}"] = {"min_us": min(xs), "median_us": med, "ratio": med / base}
            lines.append(f"{s:>5s} {v:18s} {min(xs):9.2f} {med:9.2f} {med / base:10.2f}")
    text = "\n".join(lines)
    print(text)
    if a.out:
        os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
        with open(a.out + ".txt", "w") as f:
            f.write(text + "\n")
        with open(a.out + ".json", "w") as f:
            json.dump(doc, f, indent=1)
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="4K,64K,1M", help="comma-separated: " + ", ".join(SIZES))
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--scale", type=float, default=1.0, help="calls per batch, times this")
    ap.add_argument("--no-async", action="store_true")
    ap.add_argument("--tree", default="?", help="a label for the tree under test (old, new)")
    ap.add_argument("--load", default="", help="the load average before the run (default: read now)")
    ap.add_argument("--out", default="", help="write OUT.txt and OUT.json")
    ap.add_argument("--dump", default="", help="bit-exactness: save the results of fixed inputs to DUMP.<rank>")
    ap.add_argument("--gloo", action="store_true", help="with --dump: compare the finite results with gloo")
    ap.add_argument("--compare", nargs=2, metavar=("A", "B"), help="compare two --dump outputs")
    a = ap.parse_args(argv)
    if a.compare:
        return compare(*a.compare)
    if not a.load:
        a.load = " ".join(open("/proc/loadavg").read().split()[:3])
    return dump(a) if a.dump else bench(a)


if __name__ == "__main__":
    sys.exit(main())
