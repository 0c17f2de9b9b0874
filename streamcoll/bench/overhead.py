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

from .machine import cpu_snapshot, cpu_usage, describe, loadavg, summary_line
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


CLOCKS = {"wall": time.perf_counter, "process": time.process_time}


def run(device: str = "cpu", calls: int = 1000, reps: int = 21, baseline: bool = True,
        warmup: int = 200, threshold: float = 1.5, clock: str = "wall") -> Dict[str, object]:
    """Time every variant; returns the JSON record.

    ``clock="process"`` counts the CPU time of all the process's threads
    instead of wall time: on a loaded machine it leaves out the time the
    process waited for a core, at the price of not counting thread hand-off
    latency (it flatters (d) and gloo, whose work runs on other threads)."""
    import torch
    comm = _setup(device, baseline)
    t = torch.full((1,), 3.0, dtype=torch.float32, device=device)
    variants = _variants(comm, t, baseline)
    names = list(variants)
    for fn in variants.values():
        fn(warmup)
    samples: Dict[str, List[float]] = {k: [] for k in names}
    pc = CLOCKS[clock]
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
        "device": device, "backend": comm.backend, "calls": calls, "reps": reps, "clock": clock,
        "tensor": {"numel": 1, "dtype": "float32"},
        "results": {
            k: {"label": LABELS[k], "time_us": s.as_us(), "ratio_to_raw": s.median / raw,
                "spread": s.spread, "noisy": s.noisy}
            for k, s in stats.items()
        },
    }
    b = stats["streamcoll.all_reduce"].median
    ratios = {"streamcoll.all_reduce / raw": b / raw}
    if baseline:
        ratios["torch.distributed / streamcoll.all_reduce"] = stats["torch.distributed.all_reduce"].median / b
    rec["ratios"] = ratios
    return rec


def layers(comm, t, calls: int = 500, reps: int = 41, clock: str = "wall") -> Dict[str, Dict[str, float]]:
    """The call path rebuilt layer by layer from the real pieces, each layer
    adding one step to the one before, timed interleaved like the variants:
    the differences say what each step costs in place (us per call)."""
    import streamcoll
    from streamcoll.communicator import _Tensor
    b = comm._backend
    f = getattr(b.lib(), b.funcs["all_reduce"])
    dt, op, h = b.dtypes[t.dtype], b.ops["SUM"], comm.handle
    ptr = comm._vp(t)
    null = comm._ffi.NULL
    rt = comm._rt
    dtypes, ptrs = comm._dtypes, comm._ptrs

    def l0(n):
        for _ in range(n):
            rc = f(ptr, ptr, 1, dt, op, h, null)
            if rc:
                raise RuntimeError(rc)

    def l1(n):  # + the per-call closure, as all_reduce builds it
        for _ in range(n):
            def fn(hh):
                rc = f(ptr, ptr, 1, dt, op, h, hh)
                if rc:
                    raise RuntimeError(rc)
            fn(null)

    def l2(n):  # + CpuRuntime.run_current (exec lock, pending check)
        run = rt.run_current
        for _ in range(n):
            def fn(hh):
                rc = f(ptr, ptr, 1, dt, op, h, hh)
                if rc:
                    raise RuntimeError(rc)
            run(fn, None)

    def l3(n):  # + reading and checking the tensor (type, device, layout, dtype, numel, pointer)
        run = rt.run_current
        for _ in range(n):
            x = t
            if not (type(x) is _Tensor and x.is_cpu and x.is_contiguous()):
                raise TypeError
            d = dtypes.get(x.dtype)
            cnt = x.numel()
            p = ptrs.get(x.data_ptr())

            def fn(hh):
                rc = f(p, p, cnt, d, op, h, hh)
                if rc:
                    raise RuntimeError(rc)
            run(fn, None)

    def l4(n):  # the real method: + op lookup, Communicator._launch (state checks, flight record)
        ar = comm.all_reduce
        for _ in range(n):
            ar(t)

    def l5(n):  # + the module-level function (default communicator lookup)
        ar = streamcoll.all_reduce
        for _ in range(n):
            ar(t)

    steps = {
        "raw C call": l0,
        "+ closure fn(h)": l1,
        "+ CpuRuntime.run_current": l2,
        "+ tensor checks and reads": l3,
        "= comm.all_reduce (+ op lookup, _launch)": l4,
        "= streamcoll.all_reduce (+ module function)": l5,
    }
    pc = CLOCKS[clock]
    samples: Dict[str, List[float]] = {k: [] for k in steps}
    names = list(steps)
    for fn in steps.values():
        fn(100)
    for r in range(reps):
        k = r % len(names)
        for name in names[k:] + names[:k]:
            t0 = pc()
            steps[name](calls)
            samples[name].append((pc() - t0) / calls * 1e6)
    return {k: {"median": Stats(v).median, "min": Stats(v).min} for k, v in samples.items()}


def step_costs(t) -> Dict[str, float]:
    """ns of single Python operations on the path (timeit, best of 5): what
    the layers are made of on this machine."""
    import threading
    import time as _time
    import weakref
    import torch
    lock = threading.Lock()
    env = {"t": t, "T": torch.Tensor, "lock": lock, "time": _time, "weakref": weakref}
    stmts = {
        "t.is_cpu and t.is_contiguous()": "t.is_cpu and t.is_contiguous()",
        "t.dtype": "t.dtype",
        "t.numel()": "t.numel()",
        "t.data_ptr()": "t.data_ptr()",
        "lock.acquire(); lock.release()": "lock.acquire(); lock.release()",
        "time.monotonic_ns()": "time.monotonic_ns()",
        "weakref.ref(t)": "weakref.ref(t)",
        "(t,)": "(t,)",
    }
    out = {}
    for label, stmt in stmts.items():
        n = 100000
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
             f"({rec['backend']}); median of {rec['reps']} x {rec['calls']} calls, {rec['clock']} clock",
             f"{'variant':44s} {'median us':>10s} {'min us':>8s} {'max us':>8s} {'x raw':>7s}"]
    for k, r in rec["results"].items():  # type: ignore[union-attr]
        tu = r["time_us"]
        flag = "  (noisy: spread %.2fx)" % r["spread"] if r["noisy"] else ""
        lines.append(f"{r['label']:44s} {tu['median']:10.2f} {tu['min']:8.2f} {tu['max']:8.2f} "
                     f"{r['ratio_to_raw']:7.2f}{flag}")
    for k, v in rec["ratios"].items():  # type: ignore[union-attr]
        lines.append(f"{k}: {v:.2f}")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m streamcoll.bench.overhead", description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu", help="cpu (oneCCL) or cuda (NCCL)")
    p.add_argument("--calls", type=int, default=1000, help="calls per repetition (default 1000)")
    p.add_argument("--reps", type=int, default=21, help="repetitions, interleaved across variants (default 21)")
    p.add_argument("--no-baseline", action="store_true", help="skip torch.distributed")
    p.add_argument("--clock", choices=tuple(CLOCKS), default="wall",
                   help="wall (default) or process: CPU time of the process, for a loaded machine")
    p.add_argument("--noise-threshold", type=float, default=1.5, help="warn when max/min of a variant exceeds this")
    p.add_argument("--profile", action="store_true", help="also print a cProfile of (b) and a per-step breakdown")
    p.add_argument("--json", help="write the results (and the machine description) here")
    p.add_argument("--table", help="write the printed table here too")
    p.add_argument("--out", help="prefix for --json/--table: PREFIX.json, PREFIX.txt "
                                 "(default: RESULTS_DIR/overhead_<date>)")
    p.add_argument("--results-dir", default="bench-results",
                   help="where results go without --out/--json/--table (default bench-results/, untracked)")
    a = p.parse_args(argv)
    if not (a.out or a.json or a.table):
        a.out = os.path.join(a.results_dir, f"overhead_{time.strftime('%Y%m%d-%H%M%S')}")
    if a.out:
        a.json = a.json or a.out + ".json"
        a.table = a.table or a.out + ".txt"
    if a.calls < 1 or a.reps < 1:
        p.error("--calls and --reps must be positive")
    for k, v in LOOPBACK.items():
        os.environ.setdefault(k, v)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    load0 = loadavg()
    cpu0 = cpu_snapshot()
    rec = run(a.device, a.calls, a.reps, not a.no_baseline, threshold=a.noise_threshold, clock=a.clock)
    import streamcoll
    comm = streamcoll.default_communicator()
    mach = describe(a.device)
    mach["loadavg_before"] = load0
    mach["cpu_usage"] = cpu_usage(cpu0, cpu_snapshot())
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
        ly = layers(comm, t, clock=a.clock)
        rec["layers_us"] = ly
        base = ly["raw C call"]["median"]
        out.append(f"\nthe call path layer by layer (us per call, {a.clock} clock; +us over the raw call):")
        out += [f"  {k:48s} median {v['median']:6.2f} (+{v['median'] - base:5.2f})  min {v['min']:6.2f}"
                for k, v in ly.items()]
        sc = step_costs(t)
        rec["step_costs_ns"] = sc
        out.append("\nsingle operations (ns, best of 5):")
        out += [f"  {k:48s} {v:6.0f}" for k, v in sc.items()]
        prof = profile(comm, t)
        rec["profile"] = prof
        out.append("\ncProfile of streamcoll.all_reduce(t), 20000 calls (profiler overhead inflates Python frames):")
        out.append(prof)
    s = "\n".join(out)
    print(s)
    for path in (a.table, a.json):
        if path:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
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
