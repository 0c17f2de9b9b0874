"""Per-call host overhead of streamcoll's collectives, against the raw C
call and torch.distributed, on a one-rank communicator with 1-element tensors.

    python -m streamcoll.bench.overhead [--calls 1000] [--reps 21] [--profile] [--out PREFIX]

At world size 1 the library does no communication, so what is left is the
cost of a call: argument checks, the launch strategy, the C call itself.
For each of all_reduce, broadcast, all_gather_into_tensor and
reduce_scatter_tensor (by default; ``--collectives`` takes any collective
the benchmark cases derive from the declaration table, whose buffers,
arguments and raw call it uses) the variants are, each timed as ``calls``
back-to-back calls per repetition and reported as the median per-call time
over the repetitions (all variants are interleaved within every repetition,
in rotating order, so that drift of the machine hits them alike):

- raw: the C function through streamcoll's cffi binding with the arguments
  bound once in its header's order (a C-level partial: the floor for any
  Python wrapper);
- ``streamcoll.<name>(...)``: the module-level function, async_op=False;
- ``comm.<name>(...)``: the Communicator method (its generated fast path);
- ``torch.distributed.<name>(...)``: gloo on the CPU, nccl on CUDA;
- for all_reduce also ``async_op=True`` + ``wait()``.

Every timed call runs on the case's buffers, which are checked against the
collective's reference implementation at the end. Timings never gate tests. ``--profile`` adds the Python frames one call
enters and a cProfile of ``streamcoll.all_reduce``.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import timeit
from typing import Any, Callable, Dict, List

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


COLLECTIVES = ("all_reduce", "broadcast", "all_gather_into_tensor", "reduce_scatter_tensor")


def _cases(comm, collectives) -> Dict[str, Any]:
    """The benchmark case of each collective (:mod:`streamcoll.bench.cases`,
    derived from the declaration table) with 1-element float32 buffers: its
    arguments, its raw C call, its reference check."""
    import torch
    from .cases import Context, make_case
    ctx = Context(comm, comm.rank, comm.size, comm.device, torch.float32, False)
    out = {name: make_case(name, ctx, 4) for name in collectives}
    for c in out.values():
        c.fill()
    return out


def _raw(case) -> Callable[[int], None]:
    """The case's C call with its arguments bound once in the header's order
    (a C-level partial): the floor for any wrapper."""
    call = case.raw_bound()
    if call is None:
        raise ValueError(f"{case.name}: the {case.ctx.backend.name} library has no single C call for it")
    err, name = case.ctx.raise_rc, case.name

    def raw(n: int) -> None:
        for _ in range(n):
            rc = call()
            if rc:
                err(name, rc)
    return raw


def _variants(comm, cases: Dict[str, Any], baseline: bool) -> Dict[str, Callable[[int], None]]:
    import torch
    import streamcoll
    from .cases import torch_function
    sync = torch.cuda.synchronize if comm.is_gpu else None
    out: Dict[str, Callable[[int], None]] = {}

    def loop(fn, args):
        def run(n: int) -> None:
            for _ in range(n):
                fn(*args)
        return run

    for name, case in cases.items():
        args = case.args
        out[f"{name}/raw"] = _raw(case)
        out[f"{name}/streamcoll"] = loop(getattr(streamcoll, name), args)
        out[f"{name}/comm"] = loop(getattr(comm, name), args)
        tf = torch_function(case.spec) if baseline else None
        if tf is not None:
            out[f"{name}/torch.distributed"] = loop(tf, args)
    if "all_reduce" in cases:
        t = cases["all_reduce"].args[0]

        def async_wait(n: int) -> None:
            ar = streamcoll.all_reduce
            for _ in range(n):
                ar(t, async_op=True).wait()
        out["all_reduce/async+wait"] = async_wait

    def empty(n: int) -> None:
        for _ in range(n):
            pass

    out["empty loop"] = empty
    if sync is not None:
        def synced(fn: Callable[[int], None]) -> Callable[[int], None]:
            def run(n: int) -> None:
                fn(n)
                sync()
            return run
        out = {k: synced(v) for k, v in out.items()}
    return out


def _label(key: str) -> str:
    if key == "empty loop":
        return "    (empty Python loop, per iteration)"
    name, v = key.split("/")
    if v == "torch.distributed":
        from streamcoll.core import spec
        from .cases import torch_function
        f = torch_function(spec.get(name))
        return f"{name}: torch.distributed.{getattr(f, '__name__', name)}"
    return {"raw": f"{name}: raw C call via cffi", "streamcoll": f"{name}: streamcoll.{name}",
            "comm": f"{name}: comm.{name}", "async+wait": f"{name}: async_op=True + wait()"}[v]


CLOCKS = {"wall": time.perf_counter, "process": time.process_time}


def run(device: str = "cpu", calls: int = 1000, reps: int = 21, baseline: bool = True,
        warmup: int = 200, threshold: float = 1.5, clock: str = "wall",
        collectives=COLLECTIVES) -> Dict[str, Any]:
    """Time every variant; returns the JSON record.

    ``clock="process"`` counts the CPU time of all the process's threads
    instead of wall time: on a loaded machine it leaves out the time the
    process waited for a core, at the price of not counting thread hand-off
    latency (it flatters async+wait and gloo, whose work runs on other threads)."""
    comm = _setup(device, baseline)
    cases = _cases(comm, collectives)
    variants = _variants(comm, cases, baseline)
    names = list(variants)
    for fn in variants.values():
        fn(warmup)
    samples: Dict[str, List[float]] = {k: [] for k in names}
    pc = CLOCKS[clock]
    for r in range(reps):
        j = r % len(names)
        for name in names[j:] + names[:j]:  # rotate the order every repetition
            fn = variants[name]
            t0 = pc()
            fn(calls)
            samples[name].append((pc() - t0) / calls)
    # Every timed call ran on the case's buffers: they hold what the reference says.
    for name, case in cases.items():
        why = case.check((warmup + reps * calls) * sum(1 for v in names if v.startswith(name + "/")))
        if why is not None:
            raise AssertionError(f"a timed call gave a wrong result: {why}")
    stats = {k: Stats(v, threshold) for k, v in samples.items()}
    results: Dict[str, Dict[str, Any]] = {}
    for k, st in stats.items():
        raw = stats[k.split("/")[0] + "/raw"].median if "/" in k else stats[f"{collectives[0]}/raw"].median
        results[k] = {"label": _label(k), "time_us": st.as_us(), "ratio_to_raw": st.median / raw,
                      "spread": st.spread, "noisy": st.noisy}
    rec: Dict[str, Any] = {
        "device": device, "backend": comm.backend, "calls": calls, "reps": reps, "clock": clock,
        "tensor": {"numel": 1, "dtype": "float32"}, "results": results,
    }
    rec["ratios"] = {name: {"streamcoll / raw": results[f"{name}/streamcoll"]["ratio_to_raw"],
                            "comm / raw": results[f"{name}/comm"]["ratio_to_raw"],
                            **({"torch.distributed / streamcoll":
                                stats[f"{name}/torch.distributed"].median / stats[f"{name}/streamcoll"].median}
                               if f"{name}/torch.distributed" in stats else {})}
                     for name in collectives}
    return rec


def frames(comm, name: str = "all_reduce") -> Dict[str, int]:
    """Python frames entered by one synchronous call (``sys.setprofile``):
    the deterministic proxy for the fast path's cost that tests assert on."""
    import streamcoll
    args = _cases(comm, (name,))[name].args
    return {f"streamcoll.{name}": count_frames(getattr(streamcoll, name), *args),
            f"comm.{name}": count_frames(getattr(comm, name), *args)}


def count_frames(fn: Callable[..., Any], *args: Any) -> int:
    """Python frames one call of ``fn(*args)`` enters (after a warm-up call)."""
    fn(*args)
    n = 0

    def prof(frame: Any, event: str, arg: Any) -> None:
        nonlocal n
        if event == "call":
            n += 1
    sys.setprofile(prof)
    try:
        fn(*args)
    finally:
        sys.setprofile(None)
    return n


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


def format_table(rec: Dict[str, Any]) -> str:
    lines = [f"per-call overhead, world size 1, 1-element float32, device {rec['device']} "
             f"({rec['backend']}); median of {rec['reps']} x {rec['calls']} calls, {rec['clock']} clock",
             f"{'variant':58s} {'median us':>10s} {'min us':>8s} {'max us':>8s} {'x raw':>7s}"]
    for k, r in rec["results"].items():  # type: ignore[union-attr]
        tu = r["time_us"]
        flag = "  (noisy: spread %.2fx)" % r["spread"] if r["noisy"] else ""
        lines.append(f"{r['label']:58s} {tu['median']:10.2f} {tu['min']:8.2f} {tu['max']:8.2f} "
                     f"{r['ratio_to_raw']:7.2f}{flag}")
    for k, v in rec["ratios"].items():  # type: ignore[union-attr]
        lines.append(f"{k}: " + ", ".join(f"{a} {b:.2f}" for a, b in v.items()))
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
    from .cases import CASES
    p.add_argument("--collectives", nargs="+", default=list(COLLECTIVES), choices=[n for n in CASES if n != "sendrecv"],
                   help=f"which collectives (default: {' '.join(COLLECTIVES)})")
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
    rec = run(a.device, a.calls, a.reps, not a.no_baseline, threshold=a.noise_threshold, clock=a.clock,
              collectives=tuple(a.collectives))
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
        fr = {name: frames(comm, name) for name in a.collectives}
        rec["frames"] = fr
        out.append("\nPython frames entered by one synchronous call (sys.setprofile):")
        out += [f"  {k:48s} {v}" for d in fr.values() for k, v in d.items()]
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
