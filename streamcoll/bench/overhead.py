"""Per-call host overhead of streamcoll's all_reduce, against the raw C call
and torch.distributed, on a one-rank communicator with a 1-element tensor.

    python -m streamcoll.bench.overhead [--calls 1000] [--reps 21] [--profile] [--out PREFIX]

At world size 1 the library does no communication, so what is left is the
cost of a call: argument checks, the launch strategy, the C call itself.
Variants, each timed as ``calls`` back-to-back calls per repetition and
reported as the median per-call time over the repetitions (the variants are
interleaved within every repetition, in rotating order, so that drift of the
machine hits them alike):

(a) raw: the C function through streamcoll's cffi binding, pointer cast and
    enum values hoisted out of the loop (the floor for any Python wrapper);
(b) ``streamcoll.all_reduce(t)``: the module-level function, async_op=False;
(c) ``comm.all_reduce(t)``: the Communicator method;
(d) ``streamcoll.all_reduce(t, async_op=True).wait()``;
(e) ``torch.distributed.all_reduce(t)``: gloo on the CPU, nccl on CUDA.

Targets (issue 5, CPU): (b) <= 1.3x (a); (e) >= 5x (b). Timings never gate
tests. ``--profile`` adds a cProfile of (b) and a step-by-step breakdown of
what one call does, to show where the time above the raw call goes.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import timeit
from typing import Callable, Dict, List

from .machine import describe, loadavg, summary_line
from .metrics import Stats

__all__ = ["main", "run"]

LOOPBACK = {"MASTER_ADDR": "127.0.0.1", "CCL_KVS_IFACE": "lo", "NCCL_SOCKET_IFNAME": "lo"}


def _setup(device: str, baseline: bool):
    """One-rank streamcoll communicator (the default one) and, if asked, a
    one-rank torch.distributed group, both over an in-process HashStore."""
    import torch.distributed as dist
    import streamcoll
    store = dist.HashStore()
    if baseline:
        backend = "nccl" if device.startswith("cuda") else "gloo"
        dist.init_process_group(backend, store=dist.PrefixStore("td", store), rank=0, world_size=1)
    comm = streamcoll.init(device=device, rank=0, world_size=1, store=store)
    return comm


def _variants(comm, t, baseline: bool) -> Dict[str, Callable[[int], None]]:
    import torch
    import torch.distributed as dist
    import streamcoll
    b = comm._backend
    ffi = b.ffi
    f = getattr(b.lib(), b.funcs["all_reduce"])
    dt = b.dtypes[t.dtype]
    op = b.ops["SUM"]
    handle = comm.handle
    ptr = ffi.cast("void *", t.data_ptr())
    gpu = t.is_cuda
    if gpu:
        stream = ffi.cast("cudaStream_t", torch.cuda.current_stream().cuda_stream)
        sync = torch.cuda.synchronize
    else:
        stream = ffi.NULL
        sync = None

    def raw(n: int) -> None:
        for _ in range(n):
            rc = f(ptr, ptr, 1, dt, op, handle, stream)
            if rc:
                raise b.binding.error(b.funcs["all_reduce"], rc, handle)

    def module_level(n: int) -> None:
        ar = streamcoll.all_reduce
        for _ in range(n):
            ar(t)

    def method(n: int) -> None:
        ar = comm.all_reduce
        for _ in range(n):
            ar(t)

    def async_wait(n: int) -> None:
        ar = streamcoll.all_reduce
        for _ in range(n):
            ar(t, async_op=True).wait()

    def torch_dist(n: int) -> None:
        ar = dist.all_reduce
        for _ in range(n):
            ar(t)

    def empty(n: int) -> None:
        for _ in range(n):
            pass

    out = {
        "raw": raw,
        "streamcoll.all_reduce": module_level,
        "comm.all_reduce": method,
        "all_reduce(async_op=True).wait()": async_wait,
    }
    if baseline:
        out["torch.distributed.all_reduce"] = torch_dist
    out["empty loop"] = empty
    if sync is not None:
        out = {k: (lambda fn: (lambda n: (fn(n), sync())))(v) for k, v in out.items()}
    return out


LABELS = {
    "raw": "(a) raw C call via cffi",
    "streamcoll.all_reduce": "(b) streamcoll.all_reduce(t)",
    "comm.all_reduce": "(c) comm.all_reduce(t)",
    "all_reduce(async_op=True).wait()": "(d) all_reduce(t, async_op=True).wait()",
    "torch.distributed.all_reduce": "(e) torch.distributed.all_reduce(t)",
    "empty loop": "    (empty Python loop, per iteration)",
}


def run(device: str = "cpu", calls: int = 1000, reps: int = 21, baseline: bool = True,
        warmup: int = 200, threshold: float = 1.5) -> Dict[str, object]:
    """Time every variant; returns the JSON record."""
    import torch
    comm = _setup(device, baseline)
    t = torch.full((1,), 3.0, dtype=torch.float32, device=device)
    variants = _variants(comm, t, baseline)
    names = list(variants)
    for fn in variants.values():
        fn(warmup)
    samples: Dict[str, List[float]] = {k: [] for k in names}
    pc = time.perf_counter
    for r in range(reps):
        k = r % len(names)
        for name in names[k:] + names[:k]:  # rotate the order every repetition
            fn = variants[name]
            t0 = pc()
            fn(calls)
            samples[name].append((pc() - t0) / calls)
    # World size 1: SUM of one contribution leaves the value as it was.
    if float(t.item()) != 3.0:
        raise AssertionError(f"all_reduce at world size 1 changed the value: 3.0 -> {t.item()}")
    stats = {k: Stats(v, threshold) for k, v in samples.items()}
    raw = stats["raw"].median
    rec: Dict[str, object] = {
        "device": device, "backend": comm.backend, "calls": calls, "reps": reps,
        "tensor": {"numel": 1, "dtype": "float32"},
        "results": {
            k: {"label": LABELS[k], "time_us": s.as_us(), "ratio_to_raw": s.median / raw,
                "spread": s.spread, "noisy": s.noisy}
            for k, s in stats.items()
        },
    }
    b = stats["streamcoll.all_reduce"].median
    targets = {"streamcoll.all_reduce / raw": {"value": b / raw, "target": "<= 1.3", "met": b / raw <= 1.3}}
    if baseline:
        g = stats["torch.distributed.all_reduce"].median
        targets["torch.distributed / streamcoll.all_reduce"] = {"value": g / b, "target": ">= 5", "met": g / b >= 5}
    rec["targets"] = targets
    return rec


def breakdown(comm, t) -> Dict[str, float]:
    """ns per step of what ``comm.all_reduce(t)`` does, each timed alone."""
    import threading
    import torch
    import streamcoll
    ffi = comm._ffi
    lock = threading.Lock()
    b = comm._backend
    f = getattr(b.lib(), b.funcs["all_reduce"])
    dt, op, h = b.dtypes[t.dtype], b.ops["SUM"], comm.handle
    ptr = ffi.cast("void *", t.data_ptr())
    null = ffi.NULL
    env = {"t": t, "T": torch.Tensor, "ffi": ffi, "lock": lock, "comm": comm, "SUM": streamcoll.ReduceOp.SUM,
           "f": f, "dt": dt, "op": op, "h": h, "ptr": ptr, "null": null, "dts": comm._dtypes}
    steps = {
        "type(t) is Tensor and t.is_cpu and t.is_contiguous()": "type(t) is T and t.is_cpu and t.is_contiguous()",
        "dtype table lookup (t.dtype)": "dts.get(t.dtype)",
        "t.numel()": "t.numel()",
        "ffi.cast('void *', t.data_ptr())": "ffi.cast('void *', t.data_ptr())",
        "closure creation": "def fn(hh): pass",
        "with threading.Lock()": "with lock: pass",
        "raw C call": "f(ptr, ptr, 1, dt, op, h, null)",
        "comm.all_reduce(t) (whole call)": "comm.all_reduce(t)",
    }
    out = {}
    for label, stmt in steps.items():
        n = 20000
        out[label] = min(timeit.repeat(stmt, globals=env, number=n, repeat=5)) / n * 1e9
    return out


def profile(comm, t, calls: int = 20000, top: int = 15) -> str:
    import cProfile
    import io
    import pstats
    import streamcoll
    ar = streamcoll.all_reduce
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(calls):
        ar(t)
    pr.disable()
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(top)
    return s.getvalue()


def format_table(rec: Dict[str, object]) -> str:
    lines = [f"per-call overhead, world size 1, 1-element float32 all_reduce, device {rec['device']} "
             f"({rec['backend']}); median of {rec['reps']} x {rec['calls']} calls",
             f"{'variant':44s} {'median us':>10s} {'min us':>8s} {'max us':>8s} {'x raw':>7s}"]
    for k, r in rec["results"].items():  # type: ignore[union-attr]
        tu = r["time_us"]
        flag = "  (noisy: spread %.2fx)" % r["spread"] if r["noisy"] else ""
        lines.append(f"{r['label']:44s} {tu['median']:10.2f} {tu['min']:8.2f} {tu['max']:8.2f} "
                     f"{r['ratio_to_raw']:7.2f}{flag}")
    for k, v in rec["targets"].items():  # type: ignore[union-attr]
        lines.append(f"target {k}: {v['value']:.2f} (want {v['target']}): {'met' if v['met'] else 'NOT met'}")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m streamcoll.bench.overhead", description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu", help="cpu (oneCCL) or cuda (NCCL)")
    p.add_argument("--calls", type=int, default=1000, help="calls per repetition (default 1000)")
    p.add_argument("--reps", type=int, default=21, help="repetitions, interleaved across variants (default 21)")
    p.add_argument("--no-baseline", action="store_true", help="skip torch.distributed")
    p.add_argument("--noise-threshold", type=float, default=1.5, help="warn when max/min of a variant exceeds this")
    p.add_argument("--profile", action="store_true", help="also print a cProfile of (b) and a per-step breakdown")
    p.add_argument("--json", help="write the results (and the machine description) here")
    p.add_argument("--table", help="write the printed table here too")
    p.add_argument("--out", help="prefix for --json/--table: PREFIX.json, PREFIX.txt")
    a = p.parse_args(argv)
    if a.out:
        a.json = a.json or a.out + ".json"
        a.table = a.table or a.out + ".txt"
    if a.calls < 1 or a.reps < 1:
        p.error("--calls and --reps must be positive")
    for k, v in LOOPBACK.items():
        os.environ.setdefault(k, v)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    load0 = loadavg()
    rec = run(a.device, a.calls, a.reps, not a.no_baseline, threshold=a.noise_threshold)
    import streamcoll
    comm = streamcoll.default_communicator()
    mach = describe(a.device)
    mach["loadavg_before"] = load0
    rec["machine"] = mach
    text = format_table(rec)
    noisy = [k for k, r in rec["results"].items() if r["noisy"]]  # type: ignore[union-attr]
    out = [f"# {summary_line(mach)}", text]
    if noisy:
        out.append(f"WARNING: noisy measurements (max/min > {a.noise_threshold}) for: {', '.join(noisy)}; "
                   f"load average {mach['loadavg']}. Rerun on a quieter machine for figures to quote.")
    if a.profile:
        import torch
        t = torch.full((1,), 3.0, dtype=torch.float32, device=a.device)
        bd = breakdown(comm, t)
        rec["breakdown_ns"] = bd
        out.append("\nstep-by-step (each timed alone, best of 5, ns):")
        out += [f"  {k:58s} {v:8.0f}" for k, v in bd.items()]
        prof = profile(comm, t)
        rec["profile"] = prof
        out.append("\ncProfile of streamcoll.all_reduce(t), 20000 calls (profiler overhead inflates Python frames):")
        out.append(prof)
    s = "\n".join(out)
    print(s)
    if a.table:
        with open(a.table, "w") as fh:
            fh.write(s + "\n")
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(rec, fh, indent=1)
    streamcoll.destroy()
    try:
        import torch.distributed as dist
        if dist.is_initialized():
            dist.destroy_process_group()
    except Exception:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
