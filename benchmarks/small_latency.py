"""Small-message all_reduce latency against MPI, one environment setting at a
time: runs the all_reduce sweep under mpiexec (so MPI, mpi4py over the
``benchmarks/setup_mpi.sh`` venv's MPICH, is measured in the same processes,
interleaved) once per configuration, in rotating order over rounds, and
tabulates per size the within-run ratios streamcoll/MPI and raw/MPI (the
figures to read on a shared machine: absolute times move by tens of percent
between runs, ratios within a run much less).

    python benchmarks/small_latency.py --rounds 3 --sizes 4,64,1K,1M,64M \\
        --config 'defaults:' --config 'ring:CCL_ALLREDUCE=ring' \\
        [--out bench-results/small_latency] [-- more sweep arguments]
    python benchmarks/small_latency.py --render bench-results/small_latency.json

A configuration is ``NAME:VAR=value VAR=value ...`` (environment of the
ranks; ``VAR=`` sets it empty, which streamcoll's env defaults leave alone).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from typing import Dict, List, Tuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def parse_config(s: str) -> Tuple[str, Dict[str, str]]:
    name, _, rest = s.partition(":")
    env: Dict[str, str] = {}
    for kv in rest.split():
        k, eq, v = kv.partition("=")
        if not eq:
            raise SystemExit(f"--config {s!r}: expected VAR=value, got {kv!r}")
        env[k] = v
    return name, env


def run_one(env_over: Dict[str, str], nproc: int, sizes: str, extra: List[str], launcher: str) -> dict:
    env = dict(os.environ)
    env.update(env_over)
    env["NPROC"] = str(nproc)
    env["LAUNCHER"] = launcher
    with tempfile.TemporaryDirectory() as d:
        js = os.path.join(d, "r.json")
        cmd = ["bash", os.path.join(ROOT, "benchmarks", "sweep.sh"), "--collectives", "all_reduce",
               "--no-baseline", "--sizes", sizes, "--json", js, *extra]
        p = subprocess.run(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           text=True, timeout=600)
        if p.returncode != 0 or not os.path.exists(js):
            raise RuntimeError(f"{env_over} failed ({p.returncode}):\n{p.stdout[-3000:]}")
        with open(js) as fh:
            return json.load(fh)


def render(doc: dict) -> List[str]:
    lines = [f"# all_reduce float32, {doc['nproc']} ranks, {doc['rounds']} rounds (rotating order); "
             f"per size: median over rounds of each run's median us, and of the within-run ratios"]
    for name, env in doc["configs"]:
        lines.append(f"#   {name}: {' '.join(f'{k}={v}' for k, v in env.items()) or '(streamcoll defaults)'}")
    lines.append(f"{'config':>18s} {'size':>6s} {'streamcoll':>10s} {'raw':>8s} {'mpi':>8s} "
                 f"{'sc/mpi':>7s} {'raw/mpi':>7s} {'sc/raw':>7s}")
    for name, _ in doc["configs"]:
        for size, r in sorted(doc["results"][name].items(), key=lambda kv: int(kv[0])):
            med = {k: statistics.median(v) for k, v in r.items() if v}
            b = int(size)
            sz = f"{b >> 20}M" if b >= 1 << 20 else f"{b >> 10}K" if b >= 1024 else str(b)
            lines.append(f"{name:>18s} {sz:>6s} {med.get('streamcoll', 0):10.1f} {med.get('raw', 0):8.1f} "
                         f"{med.get('mpi', float('nan')):8.1f} {med.get('sc/mpi', float('nan')):7.2f} "
                         f"{med.get('raw/mpi', float('nan')):7.2f} {med.get('sc/raw', float('nan')):7.2f}")
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", action="append", default=[], help="NAME:VAR=value ... (repeatable)")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--sizes", default="4,64,1K,1M")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--launcher", default="mpiexec", choices=("mpiexec", "torchrun"))
    ap.add_argument("--out", help="write PREFIX.json and PREFIX.txt")
    ap.add_argument("--render", help="print the table of a saved PREFIX.json and exit")
    ap.add_argument("extra", nargs="*", help="more sweep arguments (after --)")
    a = ap.parse_args(argv)
    if a.render:
        with open(a.render) as fh:
            print("\n".join(render(json.load(fh))))
        return 0
    configs = [parse_config(c) for c in (a.config or ["defaults:"])]
    results: Dict[str, Dict[str, Dict[str, List[float]]]] = {n: {} for n, _ in configs}
    meta = None
    for rnd in range(a.rounds):
        k = rnd % len(configs)
        for name, env in configs[k:] + configs[:k]:
            doc = run_one(env, a.ranks, a.sizes, a.extra, a.launcher)
            meta = meta or doc["meta"]
            for r in doc["rows"]:
                if any(v != "ok" for v in r["check"].values()):
                    raise RuntimeError(f"check failed: {name} {r['bytes']} B")
                t = {lib: v["time_us"]["median"] for lib, v in r["libs"].items()}
                e = results[name].setdefault(str(r["bytes"]), {})
                for lib, v in t.items():
                    e.setdefault(lib, []).append(v)
                if "mpi" in t:
                    e.setdefault("sc/mpi", []).append(t["streamcoll"] / t["mpi"])
                    if "raw" in t:
                        e.setdefault("raw/mpi", []).append(t["raw"] / t["mpi"])
                if "raw" in t:
                    e.setdefault("sc/raw", []).append(t["streamcoll"] / t["raw"])
            print(f"# round {rnd + 1}: {name} done", file=sys.stderr, flush=True)
    doc = {"meta": meta, "nproc": a.ranks, "rounds": a.rounds, "configs": configs, "results": results}
    lines = render(doc)
    print("\n".join(lines))
    if a.out:
        os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
        with open(a.out + ".json", "w") as fh:
            json.dump(doc, fh, indent=1)
        with open(a.out + ".txt", "w") as fh:
            fh.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
