"""Which oneCCL allreduce algorithm to default to on one host, per message
size, at 2 and 3 ranks: runs the all_reduce sweep once per ``CCL_ALLREDUCE``
value and tabulates the raw C call's time (the algorithm's own cost, without
streamcoll's wrapper) per size.

    python benchmarks/algorithms.py [--ranks 2,3] [--max-bytes 64M] [--rounds 2] \\
        [--out benchmarks/results/allreduce_algorithms]

``default`` is oneCCL's own choice (``CCL_ALLREDUCE`` set empty, so
streamcoll's env defaults leave it alone). Rounds alternate the order of the
algorithms; per size the best (lowest) median of the rounds is kept, which
discounts moments when other processes held the cores.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ALGOS = ["default", "direct", "rabenseifner", "nreduce", "ring", "double_tree", "recursive_doubling"]


def run_one(nproc: int, algo: str, max_bytes: str, extra) -> dict:
    env = dict(os.environ)
    env["NPROC"] = str(nproc)
    env["CCL_ALLREDUCE"] = "" if algo == "default" else algo
    with tempfile.TemporaryDirectory() as d:
        js = os.path.join(d, "r.json")
        cmd = ["bash", os.path.join(ROOT, "benchmarks", "sweep.sh"), "--collectives", "all_reduce",
               "--no-baseline", "--max-bytes", max_bytes, "--json", js, *extra]
        p = subprocess.run(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                           text=True, timeout=900)
        if p.returncode != 0 or not os.path.exists(js):
            raise RuntimeError(f"{algo} at {nproc} ranks failed ({p.returncode}):\n{p.stdout[-2000:]}")
        with open(js) as fh:
            return json.load(fh)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", default="2,3")
    ap.add_argument("--algos", default=",".join(ALGOS))
    ap.add_argument("--max-bytes", default="64M")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", help="write PREFIX.json and PREFIX.txt")
    ap.add_argument("extra", nargs="*", help="more sweep arguments (after --)")
    a = ap.parse_args(argv)
    algos = a.algos.split(",")
    res: dict = {}
    lines = []

    def say(s=""):
        print(s, flush=True)
        lines.append(s)

    meta = None
    for nproc in [int(x) for x in a.ranks.split(",")]:
        best: dict = {}
        for rnd in range(a.rounds):
            order = algos if rnd % 2 == 0 else algos[::-1]
            for algo in order:
                doc = run_one(nproc, algo, a.max_bytes, a.extra)
                meta = meta or doc["meta"]
                for r in doc["rows"]:
                    if any(v != "ok" for v in r["check"].values()):
                        raise RuntimeError(f"check failed: {algo} {nproc} ranks {r['bytes']} B")
                    t = r["libs"]["raw"]["time_us"]["median"]
                    key = (algo, r["bytes"])
                    if key not in best or t < best[key]["time_us"]:
                        best[key] = {"time_us": t, "busbw": r["libs"]["raw"]["busbw"],
                                     "streamcoll_us": r["libs"]["streamcoll"]["time_us"]["median"]}
        sizes = sorted({b for _, b in best})
        say(f"# allreduce, {nproc} ranks, raw C call median us (best of {a.rounds} rounds); busbw GB/s at >= 1M")
        say(f"{'size':>10s} " + " ".join(f"{x:>12s}" for x in algos) + "  best")
        table = {}
        for s in sizes:
            row = {al: best[(al, s)] for al in algos if (al, s) in best}
            win = min(row, key=lambda al: row[al]["time_us"])
            cells = []
            for al in algos:
                v = row.get(al)
                if v is None:
                    cells.append(f"{'-':>12s}")
                elif s >= 1 << 20:
                    cells.append(f"{v['time_us']:7.0f}/{v['busbw']:4.1f}")
                else:
                    cells.append(f"{v['time_us']:12.1f}")
            say(f"{s:>10d} " + " ".join(cells) + f"  {win}")
            table[s] = {"best": win, "by_algo": row}
        res[nproc] = table
        say()
    if a.out:
        with open(a.out + ".json", "w") as fh:
            json.dump({"meta": meta, "algos": algos, "rounds": a.rounds,
                       "results": {str(k): {str(s): v for s, v in t.items()} for k, t in res.items()}}, fh, indent=1)
        with open(a.out + ".txt", "w") as fh:
            fh.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
