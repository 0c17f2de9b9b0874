"""What a torch op right after a oneCCL call costs (issue 25, "the 10 us
after a oneCCL call"): times, in one process per rank and interleaved, a
1-element-pair float32 ``comm.all_reduce`` alone, a 2-element ``div_``
alone, the two in one loop, and stand-ins that tell what the extra is.

    python benchmarks/after_call.py                                    # world size 1
    torchrun --nproc-per-node 2 --master-addr 127.0.0.1 benchmarks/after_call.py
    CCL_WORKER_OFFLOAD=1 python benchmarks/after_call.py               # any oneCCL variable

Variants (``t``, ``u``: 2-element float32 tensors; ``n`` the world size):

- ``all_reduce``: ``comm.all_reduce(t)``, then ``t.div_(n)`` is *not* run
  (at 2 ranks ``t`` doubles each call; harmless for the time).
- ``div_``: ``u.div_(1.0)`` alone (a divisor of 1 keeps ``u`` normal: a
  halving loop reaches denormals).
- ``all_reduce; div_``: both, ``t.div_(n)`` (AVG done by hand; ``t`` stays put).
- ``all_reduce AVG``: ``comm.all_reduce(t, op=AVG)`` (oneCCL has no AVG: SUM, then streamcoll divides).
- ``raw; div_``: the raw C call through streamcoll's binding, then ``div_``
  (is streamcoll's wrapper part of it?).
- ``all_reduce; spin``: the call, then a pure-Python busy wait as long as
  ``div_`` alone (host work that is not a torch op).
- ``div_; div_``: two torch ops (the same pair without oneCCL);
  ``all_reduce; div_; div_``: does the second op after the call pay too?
- ``pyloop``, ``all_reduce; pyloop``: a fixed-count Python loop about as
  long as ``div_`` (fixed work: the busy wait above absorbs its own
  slowdown); ``numpy``, ``all_reduce; numpy``, ``div_; numpy``: numpy's
  in-place divide of a 2-element array (another native library's op);
  ``all_reduce; t.numpy() divide``: AVG's division by numpy on ``t``'s own
  buffer, a view made per call (what a division that skips torch's
  dispatcher would cost);
  ``4 ops``, ``all_reduce; 4 ops``: ``div_``, ``add_``, ``mul_``, ``sub_``
  (does the excess grow with the torch work after the call?).

Each time is taken twice: wall clock, and the calling thread's CPU time
(``time.thread_time``), which leaves out the time other processes held the
core: on a shared machine the wall excess is mostly that.

``--sweep`` runs the above once per setting (each its own world: oneCCL
reads its variables once per process), the settings in rotating order over
``--rounds``, at ``--ranks`` 1 or 2, and prints per setting the medians over
rounds:

    python benchmarks/after_call.py --sweep --ranks 1 --rounds 3
    python benchmarks/after_call.py --sweep --ranks 2 --rounds 3 --settings default,offload

``--perf FILE --only VARIANT --reps 1 --calls 100000`` samples one loop
with Debian's ``perf`` (``apt-get install linux-perf``; software clock only:
this VM exposes no hardware counters) into ``FILE.<rank>``; ``perf report -i
FILE.0 --sort dso -n`` then gives the CPU time per library, for the loops
side by side (``benchmarks/results/after_call_perf_1rank.txt``).

Prints on rank 0, per variant, the median over repetitions of the per-call
time averaged over ranks, and the excess of each pair over the sum of its
parts (``all_reduce; div_`` minus ``all_reduce`` minus ``div_``: the issue's
"10 us").
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Callable, Dict, List

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


SETTINGS = {
    "default": {},                                                   # streamcoll's defaults
    "offload": {"CCL_WORKER_OFFLOAD": "1"},                          # oneCCL's worker thread progresses
    "offload+yield": {"CCL_WORKER_OFFLOAD": "1", "CCL_YIELD": "sched_yield"},
    "offload+affinity": {"CCL_WORKER_OFFLOAD": "1", "CCL_WORKER_AFFINITY": "1"},
    "yield": {"CCL_YIELD": "sched_yield"},
    "spin_count=1": {"CCL_SPIN_COUNT": "1"},
    "worker_wait": {"CCL_WORKER_WAIT": "1"},
    "affinity=1": {"CCL_WORKER_AFFINITY": "1"},
    "omp_passive": {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "0"},
    "torch_threads=2": {"_THREADS": "0"},                            # torch's own intra-op pool (2 here)
}
KEY = ("all_reduce", "div_", "all_reduce; div_", "all_reduce AVG", "raw", "raw; div_", "spin",
       "all_reduce; spin")


def sweep(a) -> int:
    """Each setting its own world, rotating order, ``a.rounds`` rounds."""
    import shutil
    import socket
    import subprocess
    import tempfile
    names = [s.strip() for s in a.settings.split(",") if s.strip()]
    bad = [s for s in names if s not in SETTINGS]
    if bad:
        raise SystemExit(f"--settings: unknown {bad}; known: {sorted(SETTINGS)}")
    here = os.path.abspath(__file__)
    res: Dict[str, List[dict]] = {s: [] for s in names}
    tmp = tempfile.mkdtemp(prefix="after_call_")
    print(f"# after_call sweep, {a.ranks} rank(s), {a.rounds} rounds, {a.reps} x {a.calls} calls per variant; "
          f"load before {tuple(round(x, 2) for x in os.getloadavg())}", flush=True)
    for r in range(a.rounds):
        k = r % len(names)
        for name in names[k:] + names[:k]:
            env = dict(os.environ)
            extra = dict(SETTINGS[name])
            threads = extra.pop("_THREADS", str(a.threads))
            env.update(extra)
            out = os.path.join(tmp, f"{name}_{r}.json")
            cmd = [here, "--reps", str(a.reps), "--calls", str(a.calls), "--threads", threads, "--json", out]
            if a.ranks == 1:
                cmd = [sys.executable] + cmd
            else:
                s = socket.socket()
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
                s.close()
                cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(a.ranks),
                       "--master-addr", "127.0.0.1", "--master-port", str(port)] + cmd
                env.setdefault("OMP_NUM_THREADS", "1")
            p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
            if p.returncode or not os.path.exists(out):
                print(f"# {name} round {r}: failed (rc {p.returncode}): {p.stderr[-500:]}", flush=True)
                continue
            with open(out) as fh:
                res[name].append(json.load(fh))
    shutil.rmtree(tmp, ignore_errors=True)
    print(f"# load after {tuple(round(x, 2) for x in os.getloadavg())}; medians over rounds, us; "
          "excess = pair - its parts")
    print(f"{'setting':>18s} " + " ".join(f"{k:>16s}" for k in KEY) + f" {'excess div_':>12s} {'excess spin':>12s}"
          f" {'excess raw':>11s} {'cpu excess div_':>15s}")
    summary = {}
    for name in names:
        runs = res[name]
        if not runs:
            continue
        med = {k: statistics.median(x["median_us"][k] for x in runs) for k in KEY}
        ex = [statistics.median(x["median_us"][p] - sum(x["median_us"][q] for q in parts) for x in runs)
              for p, parts in (("all_reduce; div_", ("all_reduce", "div_")),
                               ("all_reduce; spin", ("all_reduce", "spin")),
                               ("raw; div_", ("raw", "div_")))]
        cex = statistics.median(x["cpu_median_us"]["all_reduce; div_"] - x["cpu_median_us"]["all_reduce"]
                                - x["cpu_median_us"]["div_"] for x in runs)
        summary[name] = {"median_us": med, "cpu_excess_div_us": cex, "excess_div_us": ex[0], "excess_spin_us": ex[1], "excess_raw_us": ex[2],
                         "rounds": len(runs), "per_round_excess_div_us": [
                             x["median_us"]["all_reduce; div_"] - x["median_us"]["all_reduce"]
                             - x["median_us"]["div_"] for x in runs]}
        print(f"{name:>18s} " + " ".join(f"{med[k]:16.2f}" for k in KEY) + f" {ex[0]:+12.2f} {ex[1]:+12.2f}"
              f" {ex[2]:+11.2f} {cex:+15.2f}")
    for name, v in summary.items():
        print(f"# {name}: excess div_ per round " + ", ".join(f"{e:+.2f}" for e in v["per_round_excess_div_us"]))
    if a.json:
        with open(a.json, "w") as fh:
            json.dump({"ranks": a.ranks, "rounds": a.rounds, "settings": {n: SETTINGS[n] for n in names},
                       "summary": summary, "load_after": os.getloadavg()}, fh, indent=1)
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (0: leave torch's)")
    ap.add_argument("--json", default="", help="also write the medians here")
    ap.add_argument("--only", default="", help="comma-separated variant names (default: all)")
    ap.add_argument("--perf", default="",
                    help="record the timed loops with `perf record -e cpu-clock` into PERF.<rank> (with --only: one loop)")
    ap.add_argument("--sweep", action="store_true", help="run once per --settings, each its own world")
    ap.add_argument("--settings", default=",".join(SETTINGS), help="with --sweep: " + ", ".join(SETTINGS))
    ap.add_argument("--ranks", type=int, default=1, choices=(1, 2), help="with --sweep: world size")
    ap.add_argument("--rounds", type=int, default=3, help="with --sweep: rounds")
    a = ap.parse_args(argv)
    if a.sweep:
        return sweep(a)
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "0")
    import torch
    import streamcoll
    from streamcoll.bench.cases import Context, make_case
    if a.threads:
        torch.set_num_threads(a.threads)
    if os.environ["WORLD_SIZE"] == "1":
        comm = streamcoll.init(rank=0, world_size=1, store=torch.distributed.HashStore(), device="cpu")
    else:
        comm = streamcoll.init(device="cpu")
    rank, n = comm.rank, comm.size
    t = torch.ones(2)
    u = torch.ones(2)
    case = make_case("all_reduce", Context(comm, rank, n, torch.device("cpu"), torch.float32, False), 8)
    raw = case.raw()
    assert raw is not None
    pc = time.perf_counter
    ar, AVG, nf = comm.all_reduce, streamcoll.ReduceOp.AVG, float(n)

    def div() -> None:
        u.div_(1.0)

    d = 2.5e-6  # set to div_'s own time after the warm-up below

    def spin() -> None:
        end = pc() + d
        while pc() < end:
            pass

    def ar_div() -> None:
        ar(t)
        t.div_(nf)

    def ar_div_div() -> None:
        ar(t)
        t.div_(nf)
        u.div_(1.0)

    def ar_avg() -> None:
        ar(t, op=AVG)

    def raw_div() -> None:
        raw()
        u.div_(1.0)

    def ar_spin() -> None:
        ar(t)
        end = pc() + d
        while pc() < end:
            pass

    def div_div() -> None:
        u.div_(1.0)
        u.div_(1.0)

    def four() -> None:  # four different ops: more of torch's code after the call
        u.div_(1.0)
        u.add_(0.0)
        u.mul_(1.0)
        u.sub_(0.0)

    def ar_four() -> None:
        ar(t)
        four()

    # Fixed work, not fixed time: a Python loop of k steps (calibrated to
    # about div_'s time below), and numpy's own in-place divide (another
    # native library's kernel and dispatch).
    import numpy as np
    v = np.ones(2, dtype=np.float32)
    npdiv, one, nfn = np.divide, np.float32(1.0), np.float32(n)
    nloop = 40

    def pyloop() -> None:
        for _ in range(nloop):
            pass

    def ar_pyloop() -> None:
        ar(t)
        for _ in range(nloop):
            pass

    def nump() -> None:
        npdiv(v, one, out=v)

    def ar_nump() -> None:
        ar(t)
        npdiv(v, one, out=v)

    def ar_tnump() -> None:  # AVG's division without torch's dispatcher: numpy on t's own buffer
        ar(t)
        a = t.numpy()
        npdiv(a, nfn, out=a)

    def div_nump() -> None:
        u.div_(1.0)
        npdiv(v, one, out=v)

    variants: Dict[str, Callable[[], None]] = {
        "all_reduce": lambda: ar(t), "div_": div, "all_reduce; div_": ar_div, "all_reduce; div_; div_": ar_div_div,
        "all_reduce AVG": ar_avg,
        "raw": raw, "raw; div_": raw_div, "spin": spin, "all_reduce; spin": ar_spin, "div_; div_": div_div,
        "pyloop": pyloop, "all_reduce; pyloop": ar_pyloop, "numpy": nump, "all_reduce; numpy": ar_nump,
        "all_reduce; t.numpy() divide": ar_tnump,
        "div_; numpy": div_nump, "4 ops": four, "all_reduce; 4 ops": ar_four,
    }
    if a.only:
        keep = [k.strip() for k in a.only.split(",")]
        variants = {k: v for k, v in variants.items() if k in keep}
    names = list(variants)
    times: Dict[str, List[float]] = {k: [] for k in names}
    cpu: Dict[str, List[float]] = {k: [] for k in names}
    tiny = torch.zeros(1)
    for f in variants.values():
        for _ in range(200):
            f()

    # The busy wait lasts as long as div_ alone: the fastest of a few
    # batches (the undisturbed cost; a loaded core only adds to it).
    def per_call(f: Callable[[], None], calls: int = 2000) -> float:
        t0 = pc()
        for _ in range(calls):
            f()
        return (pc() - t0) / calls
    d = min(per_call(div) for _ in range(9))
    nloop = max(1, int(40 * d / min(per_call(pyloop) for _ in range(5))))
    tt = time.thread_time
    perf = None
    if a.perf:  # sample only the timed loops (not the imports and init)
        import subprocess
        perf = subprocess.Popen(["perf", "record", "-q", "-e", "cpu-clock", "-F", "10000", "-p", str(os.getpid()),
                                 "-o", f"{a.perf}.{rank}"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(1.0)  # perf attaches
    for rep in range(a.reps):
        k = rep % len(names)
        for name in names[k:] + names[:k]:
            f = variants[name]
            t.fill_(1.0)
            comm.all_reduce(tiny)  # line the ranks up
            c0 = tt()
            t0 = pc()
            for _ in range(a.calls):
                f()
            t1 = pc()
            cpu[name].append((tt() - c0) / a.calls * 1e6)
            times[name].append((t1 - t0) / a.calls * 1e6)
    if perf is not None:
        import signal
        perf.send_signal(signal.SIGINT)
        perf.wait()
    T = torch.tensor([times[k] for k in names] + [cpu[k] for k in names], dtype=torch.float64)
    comm.all_reduce(T)
    T /= n
    if rank == 0:
        med = {k: statistics.median(T[i].tolist()) for i, k in enumerate(names)}
        cmed = {k: statistics.median(T[len(names) + i].tolist()) for i, k in enumerate(names)}

        def excess(pair: str, *parts: str) -> str:
            if pair not in med or any(p not in med for p in parts):
                return ""
            return (f"{med[pair] - sum(med[p] for p in parts):+.2f} wall, "
                    f"{cmed[pair] - sum(cmed[p] for p in parts):+.2f} cpu")
        print(f"# per-call us, {n} rank(s), 2-element float32, median of {a.reps} x {a.calls} calls, "
              f"interleaved; torch threads {torch.get_num_threads()}; spin {d * 1e6:.2f} us; pyloop {nloop} steps; "
              f"load {tuple(round(x, 2) for x in os.getloadavg())}")
        print("# env: " + " ".join(f"{k}={v}" for k, v in sorted(os.environ.items())
                                   if k.startswith(("CCL_", "FI_", "OMP_", "KMP_", "GOMP_"))))
        from streamcoll.startup import env_defaults as sc_env
        print("# streamcoll applied: " + " ".join(f"{k}={v}" for k, v in sorted(sc_env.APPLIED.items())))
        print(f"{'variant':>20s} {'wall us':>8s} {'cpu us':>8s}  (cpu: the calling thread's CPU time, without "
              "the time other processes held its core)")
        for k in names:
            print(f"{k:>20s} {med[k]:8.2f} {cmed[k]:8.2f}")
        ex = {"all_reduce; div_ - all_reduce - div_": excess("all_reduce; div_", "all_reduce", "div_"),
              "all_reduce AVG - all_reduce - div_": excess("all_reduce AVG", "all_reduce", "div_"),
              "raw; div_ - raw - div_": excess("raw; div_", "raw", "div_"),
              "all_reduce; spin - all_reduce - spin": excess("all_reduce; spin", "all_reduce", "spin"),
              "div_; div_ - 2 div_": excess("div_; div_", "div_", "div_"),
              "all_reduce; div_; div_ - all_reduce - 2 div_": excess("all_reduce; div_; div_", "all_reduce", "div_",
                                                                     "div_"),
              "all_reduce; pyloop - all_reduce - pyloop": excess("all_reduce; pyloop", "all_reduce", "pyloop"),
              "all_reduce; numpy - all_reduce - numpy": excess("all_reduce; numpy", "all_reduce", "numpy"),
              "div_; numpy - div_ - numpy": excess("div_; numpy", "div_", "numpy"),
              "all_reduce; 4 ops - all_reduce - 4 ops": excess("all_reduce; 4 ops", "all_reduce", "4 ops")}
        for k, v in ex.items():
            if v:
                print(f"# excess {k}: {v} us")
        if a.json:
            with open(a.json, "w") as fh:
                json.dump({"world_size": n, "median_us": med, "cpu_median_us": cmed, "excess_us": ex, "spin_us": d * 1e6,
                           "load": os.getloadavg(), "applied": dict(sc_env.APPLIED)}, fh, indent=1)
    streamcoll.destroy()
    return 0


if __name__ == "__main__":
    sys.exit(main())
