"""nccl-tests-style sweep: message sizes x collectives, streamcoll side by
side with the raw C call through its binding, with torch.distributed (gloo on
the CPU, nccl on CUDA) and, where mpi4py is importable and the ranks form an
MPI world, with MPI, all measured in the same processes.

Launch with torchrun or mpiexec (``benchmarks/sweep.sh`` picks a free port,
sets the loopback variables, and uses mpiexec when the MPI venv of
``benchmarks/setup_mpi.sh`` exists)::

    python -m torch.distributed.run --nproc-per-node 2 --master-addr 127.0.0.1 \\
        --master-port 29511 -m streamcoll.bench --max-bytes 64M
    .venv-mpi/bin/mpiexec -n 2 .venv-mpi/bin/python -m streamcoll.bench --max-bytes 64M

Under mpiexec the launcher's rank variables become torchrun's
(:mod:`streamcoll.bench.mpi`); a torchrun launch has no MPI world, so the MPI
column is left out and the output says why. torch.distributed is initialised
first (``env://``) and streamcoll's default communicator reuses its store, so
every library lives in every rank process. Results go to ``bench-results/``
(untracked) unless ``--out`` names another place.

How a row is measured (one collective, one size): a few untimed warm-up
calls per library, then ``iters`` timed calls split into batches; batches of
the libraries are interleaved (streamcoll, raw, torch, streamcoll, ...) so
that a noisy moment hits all of them (in rotating order, so that none always
follows the same one). Before each batch the buffers are
refilled and the ranks synchronised by one tiny collective of the same
library; the batch's per-call time is averaged over ranks (as nccl-tests
averages its ranks' times). Reported: min/median/max over batches, algbw and
busbw from the median (definitions in :mod:`streamcoll.bench.metrics`), the
ratios, and the check of the last batch's results (closed forms, see
:mod:`streamcoll.bench.cases`). A failed check makes the exit status 1;
timings never do.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any, Callable, Dict, List, Optional

from .cases import CASES, Context, batches, make_case
from .machine import cpu_snapshot, cpu_usage, describe, loadavg, summary_line
from .metrics import bus_factor, fmt_bytes, ratio, summarise

__all__ = ["main", "parse_size", "sizes", "figure_refusal", "QUIET_LOAD", "QUOTED_DIR"]

#: The repository's ``benchmarks/results/``: the figures the READMEs quote.
QUOTED_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                          "benchmarks", "results")
#: The highest 1-minute load average from other processes at which a quoted
#: figure is written (see :func:`figure_refusal`).
QUIET_LOAD = 1.0

LOOPBACK = {"MASTER_ADDR": "127.0.0.1", "CCL_KVS_IFACE": "lo", "NCCL_SOCKET_IFNAME": "lo",
            "GLOO_SOCKET_IFNAME": "lo"}
LIBS = ("streamcoll", "raw", "mpi", "torch")
BASELINES = ("mpi", "torch")  # may lack a dtype or collective: the row goes on without them
DEFAULT_COLLECTIVES = tuple(CASES)
_UNITS = {"": 1, "B": 1, "K": 1 << 10, "KB": 1 << 10, "M": 1 << 20, "MB": 1 << 20, "G": 1 << 30, "GB": 1 << 30}


def parse_size(s: str) -> int:
    """'4', '64K', '256M', '1G' -> bytes (binary units, as nccl-tests' -b/-e)."""
    t = str(s).strip().upper()
    i = len(t)
    while i and not t[i - 1].isdigit():
        i -= 1
    num, unit = t[:i], t[i:]
    if not num or unit not in _UNITS:
        raise argparse.ArgumentTypeError(f"expected a size like 4, 64K, 256M, 1G; got {s!r}")
    v = int(num) * _UNITS[unit]
    if v < 1:
        raise argparse.ArgumentTypeError(f"expected a positive size, got {s!r}")
    return v


def sizes(min_bytes: int, max_bytes: int, factor: int) -> List[int]:
    if factor < 2:
        raise ValueError(f"factor: expected an integer >= 2, got {factor}")
    out, s = [], min_bytes
    while s <= max_bytes:
        out.append(s)
        s *= factor
    return out


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m streamcoll.bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--collectives", default=",".join(DEFAULT_COLLECTIVES),
                   help=f"comma-separated subset of {','.join(DEFAULT_COLLECTIVES)} (default: all)")
    p.add_argument("--min-bytes", "-b", type=parse_size, default=4, help="smallest message (default 4)")
    p.add_argument("--max-bytes", "-e", type=parse_size, default=256 << 20, help="largest message (default 256M)")
    p.add_argument("--factor", "-f", type=int, default=4, help="size step factor (default 4)")
    p.add_argument("--sizes", help="comma-separated sizes instead of -b/-e/-f, e.g. 4,64,1K,1M,64M")
    p.add_argument("--dtype", default="float32", help="comma-separated dtypes (default float32)")
    p.add_argument("--async-op", choices=("false", "true", "both"), default="false",
                   help="async_op=True runs call + wait() (default false)")
    p.add_argument("--device", default="cpu", help="cpu (oneCCL vs gloo) or cuda (NCCL vs nccl)")
    p.add_argument("--iters", type=int, default=None, help="timed calls per row (default: scaled by size)")
    p.add_argument("--min-iters", type=int, default=10)
    p.add_argument("--max-iters", type=int, default=200)
    p.add_argument("--iter-bytes", type=parse_size, default=256 << 20,
                   help="default iters = iter-bytes / size, clamped to [min-iters, max-iters]")
    p.add_argument("--warmup", type=int, default=None, help="untimed calls per library and row (default 5, 1 from 16M)")
    p.add_argument("--reps", type=int, default=5, help="batches per row to take min/median/max over (default 5)")
    p.add_argument("--no-baseline", action="store_true", help="skip torch.distributed")
    p.add_argument("--no-raw", action="store_true", help="skip the raw C call column")
    p.add_argument("--no-mpi", action="store_true", help="skip the MPI column (measured only under mpiexec)")
    p.add_argument("--format", choices=("table", "nccl-tests"), default="table",
                   help="printed output: the side-by-side table (default) or nccl-tests' format, "
                        "one block per system")
    p.add_argument("--noise-threshold", type=float, default=1.5, help="warn when a row's max/min exceeds this")
    p.add_argument("--json", help="write the results here (JSON)")
    p.add_argument("--plot", help="write a PNG plot here (busbw and latency vs size)")
    p.add_argument("--table", help="write the printed table here")
    p.add_argument("--out", help="prefix for --json/--plot/--table: PREFIX.json, PREFIX.png, PREFIX.txt "
                                 "(default: RESULTS_DIR/sweep_<n>ranks_<date>)")
    p.add_argument("--results-dir", default="bench-results",
                   help="where results go without --out (default bench-results/, untracked)")
    p.add_argument("--inject-error", nargs="?", const="streamcoll", default=None, choices=LIBS,
                   help="testing aid: corrupt this system's result (default streamcoll) on rank 0 before "
                        "each check, to show the checks run (the run then exits 1)")
    a = p.parse_args(argv)
    a.collectives = [c.strip() for c in a.collectives.split(",") if c.strip()]
    for c in a.collectives:
        if c not in CASES:
            p.error(f"--collectives: unknown {c!r} (choose from {', '.join(CASES)})")
    a.dtypes = [d.strip() for d in a.dtype.split(",") if d.strip()]
    a.asyncs = {"false": [False], "true": [True], "both": [False, True]}[a.async_op]
    if a.min_bytes > a.max_bytes:
        p.error("--min-bytes is larger than --max-bytes")
    a.size_list = (sorted({parse_size(x) for x in a.sizes.split(",") if x.strip()}) if a.sizes
                   else sizes(a.min_bytes, a.max_bytes, a.factor))
    if a.out:
        set_out(a, a.out)
    return a


def figure_refusal(path: str, load_before: Optional[List[float]], load_after: Optional[List[float]],
                   ranks: int) -> str:
    """Why the plot ``path`` may not be written ('' if it may).

    A plot in :data:`QUOTED_DIR` is what the READMEs show as streamcoll's
    performance. On this project's 2-core machine, at a load average of
    7.6-10 from other test runs, oneCCL's busy-waiting ranks lost their cores
    and small messages took milliseconds, 5x gloo, under a table that said
    the opposite: such a plot says nothing about the library. So a quoted
    plot needs the 1-minute load average (:func:`streamcoll.bench.machine.loadavg`,
    recorded in the JSON) at most :data:`QUIET_LOAD` before the run, and at
    most that above the run's own busy ranks after it. Anywhere else
    (``bench-results/``, a path of the user's) plots are written whatever
    the load, which their title states.
    """
    root = os.path.realpath(QUOTED_DIR)
    if os.path.commonpath([os.path.realpath(path), root]) != root:
        return ""
    if not load_before or not load_after:
        return "the load average is unknown (a quoted figure needs a quiet machine)"
    if load_before[0] > QUIET_LOAD:
        return (f"the 1-minute load average was {load_before[0]:g} before the run; a quoted figure needs at most "
                f"{QUIET_LOAD:g} (a quiet machine)")
    if load_after[0] > QUIET_LOAD + ranks:
        return (f"the 1-minute load average was {load_after[0]:g} after the run; a quoted figure needs at most "
                f"{QUIET_LOAD + ranks:g} ({ranks} ranks' own load plus {QUIET_LOAD:g})")
    return ""


def set_out(a: argparse.Namespace, prefix: str) -> None:
    a.out = prefix
    a.json = a.json or prefix + ".json"
    a.plot = a.plot or prefix + ".png"
    a.table = a.table or prefix + ".txt"


def iters_for(nbytes: int, a) -> int:
    if a.iters:
        return a.iters
    return max(a.min_iters, min(a.max_iters, a.iter_bytes // max(nbytes, 1)))


class Out:
    """Rank 0's printed lines, kept for --table."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.lines: List[str] = []

    def __call__(self, s: str = "") -> None:
        if self.rank == 0:
            print(s, flush=True)
            self.lines.append(s)


def _header(coll: str, dtype: str, n: int, async_op: bool, tlabel: str, raw: bool, mpi: bool,
            baseline: bool) -> List[str]:
    h1 = f"# {coll}  dtype={dtype}  ranks={n}  async_op={async_op}  busbw factor={bus_factor(coll, n):.3g}"
    cols = f"{'size':>9s} {'count':>10s} | {'streamcoll us':>13s} {'algbw':>7s} {'busbw':>7s}"
    if raw:
        cols += f" | {'raw us':>9s} {'sc/raw':>6s}"
    if mpi:
        cols += f" | {'mpi us':>10s} {'busbw':>7s} {'speedup':>7s}"
    if baseline:
        cols += f" | {tlabel + ' us':>12s} {'algbw':>7s} {'busbw':>7s} {'speedup':>7s}"
    cols += " | check"
    return [h1, cols]


def _fmt_row(r: Dict[str, Any], raw: bool, mpi: bool, baseline: bool) -> str:
    sc = r["libs"]["streamcoll"]
    s = f"{fmt_bytes(r['bytes']):>9s} {r['count']:>10d} | {sc['time_us']['median']:13.1f} {sc['algbw']:7.3f} {sc['busbw']:7.3f}"
    if raw:
        rw = r["libs"].get("raw")
        if rw:
            s += f" | {rw['time_us']['median']:9.1f} {r['streamcoll_over_raw']:6.3f}"
        else:
            s += f" | {'-':>9s} {'-':>6s}"
    if mpi:
        m = r["libs"].get("mpi")
        if m:
            s += f" | {m['time_us']['median']:10.1f} {m['busbw']:7.3f} {r['speedup_vs_mpi']:6.2f}x"
        else:
            s += f" | {r.get('errors', {}).get('mpi', 'n/a')[:26]:>26s}"
    if baseline:
        td = r["libs"].get("torch")
        if td:
            s += f" | {td['time_us']['median']:12.1f} {td['algbw']:7.3f} {td['busbw']:7.3f} {r['speedup_vs_torch']:6.1f}x"
        else:
            s += f" | {r.get('torch_error', 'n/a')[:37]:>37s}"
    checks = r["check"]
    s += " | " + ("ok" if all(v == "ok" for v in checks.values()) else
                  ",".join(f"{k}:{'ok' if v == 'ok' else 'FAIL'}" for k, v in checks.items()))
    noisy = [k for k, v in r["libs"].items() if v["noisy"]]
    if noisy:
        s += "  ~noisy"
    return s


def run_row(ctx: Context, coll: str, nbytes: int, a, devsync, tiny: Dict[str, Any],
            mpi_comm: Optional[Any] = None) -> Dict[str, Any]:
    """Measure one row on every rank; returns the (rank-averaged) record."""
    import torch
    import torch.distributed as dist
    case = make_case(coll, ctx, nbytes)
    runners: Dict[str, Any] = {"streamcoll": case.streamcoll()}
    errors: Dict[str, str] = {}
    if not a.no_raw:
        r = case.raw()
        if r is not None:
            runners["raw"] = r
    if mpi_comm is not None:
        from . import mpi as bench_mpi
        try:
            runners["mpi"] = bench_mpi.runner(case, mpi_comm)
        except NotImplementedError as e:  # same on every rank: decided before any call
            errors["mpi"] = str(e)
    if not a.no_baseline:
        t = case.torch()
        if t is not None:
            runners["torch"] = t
        else:  # the same on every rank
            errors["torch"] = f"torch.distributed has no {coll}"
    iters = iters_for(case.nbytes, a)
    bs, nb = batches(iters, case.cap, a.reps)
    warm = a.warmup if a.warmup is not None else (5 if case.nbytes < (16 << 20) else 1)
    if case.cap is not None:
        warm = min(warm, case.cap)
    for lib in list(runners):
        case.fill()
        devsync()
        try:
            tiny[lib]()
            for _ in range(warm):
                runners[lib]()
            devsync()
        except Exception as e:
            if lib not in BASELINES:
                raise
            # Unsupported by the baseline (a dtype gloo lacks, say): both ranks
            # fail the same way before communicating; the row goes on without it.
            errors[lib] = f"{type(e).__name__}: {e}".splitlines()[0]
            del runners[lib]
    libs = list(runners)
    times: Dict[str, List[float]] = {k: [] for k in libs}
    checks: Dict[str, Optional[str]] = {}
    wrong: Dict[str, int] = {}
    pc = time.perf_counter
    for b in range(nb):
        j = b % len(libs)
        for lib in libs[j:] + libs[:j]:  # rotate: no library always runs right after another
            fn = runners[lib]
            case.fill()
            devsync()
            tiny[lib]()
            t0 = pc()
            for _ in range(bs):
                fn()
            devsync()
            times[lib].append((pc() - t0) / bs)
            if b == nb - 1:
                if lib == a.inject_error and ctx.rank == 0:
                    case.corrupt()
                wrong[lib], checks[lib] = case.compare(bs)
    # Average over ranks (nccl-tests reports the ranks' average time); agree on checks.
    n = ctx.n
    T = torch.tensor([times[k] for k in libs], dtype=torch.float64)
    dist.all_reduce(T)
    T /= n
    ok = torch.tensor([1 if checks[k] is None else 0 for k in libs], dtype=torch.int32)
    dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    W = torch.tensor([wrong[k] for k in libs], dtype=torch.int64)
    dist.all_reduce(W)  # nccl-tests' #wrong: summed over ranks
    problems: List[str] = []
    if int(ok.min()) == 0:
        gathered: List[Any] = [None] * n
        dist.all_gather_object(gathered, {k: v for k, v in checks.items() if v is not None})
        for g in gathered:
            problems += [f"{k}: {v}" for k, v in (g or {}).items()]
    rec: Dict[str, Any] = {
        "collective": coll, "bytes": case.nbytes, "count": case.count, "dtype": str(ctx.dtype).replace("torch.", ""),
        "world_size": n, "async_op": ctx.async_op, "iters": bs * nb, "batches": nb, "calls_per_batch": bs,
        "warmup": warm, "libs": {},
        "check": {k: ("ok" if ok[i] else "FAIL") for i, k in enumerate(libs)},
        "wrong": {k: int(W[i]) for i, k in enumerate(libs)},
    }
    if problems:
        rec["check_errors"] = problems
    for i, k in enumerate(libs):
        rec["libs"][k] = summarise(coll, case.nbytes, n, T[i].tolist(), a.noise_threshold)
    t_sc = rec["libs"]["streamcoll"]["time_us"]["median"]
    if "raw" in rec["libs"]:
        rec["streamcoll_over_raw"] = ratio(t_sc, rec["libs"]["raw"]["time_us"]["median"])
        # The fastest batches are the ones least disturbed by other processes.
        rec["streamcoll_over_raw_min"] = ratio(rec["libs"]["streamcoll"]["time_us"]["min"],
                                               rec["libs"]["raw"]["time_us"]["min"])
    if "torch" in rec["libs"]:
        rec["speedup_vs_torch"] = ratio(rec["libs"]["torch"]["time_us"]["median"], t_sc)
    if "mpi" in rec["libs"]:
        rec["speedup_vs_mpi"] = ratio(rec["libs"]["mpi"]["time_us"]["median"], t_sc)
    if errors:
        rec["errors"] = errors
        if "torch" in errors:
            rec["torch_error"] = errors["torch"]
    del case
    return rec


def summary(rows: List[Dict[str, Any]]) -> Dict[str, Dict[str, float]]:
    """Ratios of the float32 synchronous all_reduce rows, per system against
    streamcoll (time of streamcoll / time of the other, so < 1 means
    streamcoll is faster): for messages up to 1 KB and from 1 MB up, the
    per-row values and their range. Facts for the reader, not pass marks."""
    ar = [r for r in rows if r["collective"] == "all_reduce" and not r["async_op"] and r["dtype"] == "float32"]
    out: Dict[str, Dict[str, float]] = {}
    for lib in ("raw", "mpi", "torch"):
        for band, sel in (("<=1K", lambda b: b <= 1024), (">=1M", lambda b: b >= 1 << 20)):
            per = {fmt_bytes(r["bytes"]): r["libs"]["streamcoll"]["time_us"]["median"] / r["libs"][lib]["time_us"]["median"]
                   for r in ar if sel(r["bytes"]) and lib in r["libs"]}
            if per:
                out[f"streamcoll/{lib} {band}"] = per
    return out


def main(argv=None) -> int:
    a = parse_args(argv)
    from . import mpi as bench_mpi
    under_mpi = bench_mpi.adopt_launcher_env()
    ws = os.environ.get("WORLD_SIZE")
    if os.environ.get("LOCAL_WORLD_SIZE", ws) == ws:  # one node (torchrun's word): loopback; else the network
        for k, v in LOOPBACK.items():
            os.environ.setdefault(k, v)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    rank0, n0 = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    # MPI before anything loads oneCCL (one libfabric.so.1 serves the process; see bench.mpi).
    mpi_comm, mpi_note = (None, "--no-mpi") if a.no_mpi else bench_mpi.open_world(rank0, n0)
    if mpi_comm is not None and "MASTER_PORT" not in os.environ:
        # mpiexec gives no rendezvous port for torch's store: rank 0 picks one, MPI tells the rest.
        port = _free_port() if rank0 == 0 else None
        os.environ["MASTER_PORT"] = str(mpi_comm.bcast(port, root=0))
    if under_mpi and "MASTER_PORT" not in os.environ:
        print("streamcoll.bench: under mpiexec without mpi4py, set MASTER_PORT (benchmarks/sweep.sh does)",
              file=sys.stderr)
        return 2
    import torch
    import torch.distributed as dist
    import streamcoll
    load0 = loadavg()
    cpu0 = cpu_snapshot()
    cuda = a.device.startswith("cuda")
    if cuda:
        local = int(os.environ.get("LOCAL_RANK", "0"))
        device = torch.device("cuda", local)
        torch.cuda.set_device(device)
        dist.init_process_group("cpu:gloo,cuda:nccl")
        devsync: Callable[[], None] = torch.cuda.synchronize
        if mpi_comm is not None:
            mpi_comm, mpi_note = None, "host buffers only (the sweep's MPI column is CPU-only)"
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
        devsync = lambda: None  # noqa: E731
    comm = streamcoll.init(device=device)
    rank, n = comm.rank, comm.size
    if n < 2:
        print("streamcoll.bench: the sweep needs at least 2 ranks (torchrun --nproc-per-node 2); "
              "for one rank use python -m streamcoll.bench.overhead", file=sys.stderr)
        return 2
    if not (a.out or a.json or a.table or a.plot):
        set_out(a, os.path.join(a.results_dir, f"sweep_{n}ranks_{time.strftime('%Y%m%d-%H%M%S')}"))
    tlabel = "nccl" if cuda else "gloo"
    out = Out(rank)
    mach = describe(a.device, memcpy=not cuda and rank == 0)
    mach["launcher"] = "mpiexec" if under_mpi else "torchrun"
    mach["libfabric"] = bench_mpi.loaded_libfabric()
    mach["mpi"] = mpi_note if mpi_comm is not None else f"not measured: {mpi_note}"
    gathered: List[Any] = [None] * n
    from .nccl_tests_format import rank_lines
    dist.all_gather_object(gathered, rank_lines(rank, n, a.device, mach.get("cpu", "")))
    dist.barrier()  # gloo's barrier blocks without spinning while rank 0 measures memcpy
    mach["loadavg_before"] = load0
    nccl_fmt = a.format == "nccl-tests"
    out(f"# streamcoll.bench sweep: {n} ranks ({mach['launcher']}), {summary_line(mach)}")
    out(f"# streamcoll vs raw {comm.backend} C call (same binding) vs MPI vs torch.distributed ({tlabel}); "
        f"times: median per-call us over batches; algbw/busbw: GB/s (nccl-tests definitions)")
    out(f"# mpi: {mach['mpi']}; libfabric: {mach['libfabric']}")
    out(f"# env: " + " ".join(f"{k}={v}" for k, v in mach["env"].items() if k.startswith(("CCL_", "FI_"))))
    meta_fmt = {"baseline": tlabel, "mpi": mpi_note if mpi_comm is not None else None,
                "args": {"factor": a.factor}, "ranks": gathered}

    # One-element per-library sync collectives that start every timed batch.
    def _tiny():
        sc_t = torch.zeros(1, device=device)
        td_t = torch.zeros(1, device=device)
        ctx1 = Context(comm, rank, n, device, torch.float32, False)
        ar1 = make_case("all_reduce", ctx1, 4)
        raw1 = ar1.raw()
        d = {"streamcoll": lambda: streamcoll.all_reduce(sc_t), "torch": lambda: dist.all_reduce(td_t)}
        if raw1 is not None:
            d["raw"] = raw1
        if mpi_comm is not None:
            d["mpi"] = bench_mpi.tiny(mpi_comm)
        return d, ar1
    tiny, _keep = _tiny()

    rows: List[Dict[str, Any]] = []
    t_start = time.time()
    failed = False
    for dname in a.dtypes:
        dtype = getattr(torch, dname, None)
        if not isinstance(dtype, torch.dtype):
            raise SystemExit(f"--dtype: unknown dtype {dname!r}")
        for async_op in a.asyncs:
            ctx = Context(comm, rank, n, device, dtype, async_op)
            for coll in a.collectives:
                if not nccl_fmt:
                    for line in _header(coll, dname, n, async_op, tlabel, not a.no_raw, mpi_comm is not None,
                                        not a.no_baseline):
                        out(line)
                seen = set()
                group: List[Dict[str, Any]] = []
                for s in a.size_list:
                    rec = run_row(ctx, coll, s, a, devsync, tiny, mpi_comm)
                    if rec["bytes"] in seen:  # rounding made it a repeat of a smaller size
                        continue
                    seen.add(rec["bytes"])
                    rows.append(rec)
                    group.append(rec)
                    if not nccl_fmt:
                        out(_fmt_row(rec, not a.no_raw, mpi_comm is not None, not a.no_baseline))
                    if rec.get("check_errors"):
                        failed = True
                        for e in rec["check_errors"]:
                            out(f"# CHECK FAILED {e}")
                if nccl_fmt and group:
                    from .nccl_tests_format import blocks
                    for line in blocks(group, LIBS, meta_fmt):
                        out(line)
                out()
    elapsed = time.time() - t_start
    mach["loadavg_after"] = loadavg()
    mach["cpu_usage"] = cpu_usage(cpu0, cpu_snapshot())
    noisy = [(r, k, v) for r in rows for k, v in r["libs"].items() if v["noisy"]]
    if noisy:
        out(f"# WARNING: {len(noisy)} measurements noisy (max/min over batches > {a.noise_threshold}); "
            f"load average before {load0}, after {mach['loadavg_after']}. min/median/max us:")
        for r, k, v in noisy[:40]:
            t = v["time_us"]
            out(f"#     {r['collective']} {fmt_bytes(r['bytes'])} {r['dtype']} async={r['async_op']} {k}: "
                f"{t['min']:.1f}/{t['median']:.1f}/{t['max']:.1f} (spread {v['spread']:.2f}x)")
        if len(noisy) > 40:
            out(f"#     ... and {len(noisy) - 40} more (see the JSON)")
    sm = summary(rows)
    if sm:
        out("# float32 all_reduce, time of streamcoll / time of each other system, per size:")
        for k, per in sm.items():
            out(f"#   {k}: " + ", ".join(f"{b} {v:.2f}" for b, v in per.items()))
    u = mach["cpu_usage"] or {}
    out(f"# {len(rows)} rows in {elapsed:.0f} s; load average before {load0}, after {mach['loadavg_after']}; "
        f"cores busy {u.get('busy_pct')}%, stolen by the hypervisor {u.get('steal_pct')}%; "
        f"checks: {'FAILED' if failed else 'all ok'}")
    if rank == 0:
        refused = figure_refusal(a.plot, load0, mach["loadavg_after"], n) if a.plot else ""
        if refused:
            out(f"# plot not written ({a.plot}): {refused}")
            a.plot = None
        doc = {"meta": {"machine": mach, "world_size": n, "backend": comm.backend, "baseline": tlabel,
                        "args": {k: v for k, v in vars(a).items() if k not in ("out",)},
                        "elapsed_s": elapsed, "command": " ".join(sys.argv), "plot_refused": refused or None},
               "summary": sm, "rows": rows}
        if a.json:
            _mkdir(a.json)
            with open(a.json, "w") as fh:
                json.dump(doc, fh, indent=1)
        if a.table:
            _mkdir(a.table)
            with open(a.table, "w") as fh:
                fh.write("\n".join(out.lines) + "\n")
        if a.plot:
            from .plot import plot
            _mkdir(a.plot)
            plot(doc, a.plot)
        print(f"# results: {', '.join(p for p in (a.table, a.json, a.plot) if p)}", flush=True)
    streamcoll.destroy()
    dist.destroy_process_group()
    return 1 if failed else 0


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _mkdir(path: str) -> None:
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
