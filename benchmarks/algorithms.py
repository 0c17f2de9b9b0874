"""Which oneCCL allreduce algorithm to default to on one host, per message
size: runs the all_reduce sweep once per ``CCL_ALLREDUCE`` value (a name, a
per-size string like ``recursive_doubling:0-16384;nreduce:16385-max``, or
``default``) and tabulates the raw C call's time per size (the algorithm's
own cost, without streamcoll's wrapper).

    python benchmarks/algorithms.py [--ranks 2,3] [--algos nreduce,ring,...] [--max-bytes 64M] \\
        [--rounds 4] [--out benchmarks/results/allreduce_algorithms/NAME] [-- more sweep arguments]
    python benchmarks/algorithms.py --render NAME.json     # print a saved run again

``default`` is oneCCL's own choice (``CCL_ALLREDUCE`` set empty, so
streamcoll's env defaults leave it alone). Rounds alternate the order of the
algorithms; per size both the median and the best of the rounds' medians are
shown. Differences below ~10% are within this shared machine's noise.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from typing import Dict, List

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


def render(results: Dict[str, dict], algos: List[str], rounds: int) -> List[str]:
    """Tables (median of rounds, then best of rounds) for every rank count."""
    lines: List[str] = []
    for nproc, table in results.items():
        kept = all("rounds_us" in v for row in table.values() for v in row["by_algo"].values())
        for title, pick in ((("median", statistics.median),) if kept else ()) + (("best", min),):
            lines.append(f"# allreduce, {nproc} ranks, raw C call: {title} of {rounds} rounds' median us "
                         f"(busbw GB/s from 1M)")
            for i, al in enumerate(algos):
                lines.append(f"#   [{i}] CCL_ALLREDUCE={al}")
            lines.append(f"{'size':>10s} " + " ".join(f"{'[' + str(i) + ']':>12s}" for i in range(len(algos)))
                         + "  fastest")
            for s in sorted(table, key=int):
                by = table[s]["by_algo"]
                # Runs saved before per-round values were kept hold only the best.
                vals = {al: pick(by[al].get("rounds_us") or [by[al]["time_us"]]) for al in algos if al in by}
                win = min(vals, key=vals.get)
                cells = []
                for al in algos:
                    v = vals.get(al)
                    if v is None:
                        cells.append(f"{'-':>12s}")
                    elif int(s) >= 1 << 20:
                        cells.append(f"{v:7.0f}/{int(s) / v / 1e3 * (2 * (int(nproc) - 1) / int(nproc)):4.1f}")
                    else:
                        cells.append(f"{v:12.1f}")
                lines.append(f"{int(s):>10d} " + " ".join(cells) + f"  [{algos.index(win)}]")
            lines.append("")
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", default="2,3")
    ap.add_argument("--algos", default=",".join(ALGOS))
    ap.add_argument("--max-bytes", default="64M")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", help="write PREFIX.json and PREFIX.txt")
    ap.add_argument("--render", help="print the tables of a saved PREFIX.json and exit")
    ap.add_argument("extra", nargs="*", help="more sweep arguments (after --)")
    a = ap.parse_args(argv)
    if a.render:
        with open(a.render) as fh:
            doc = json.load(fh)
        print("\n".join(render(doc["results"], doc["algos"], doc["rounds"])))
        return 0
    algos = a.algos.split(",")
    results: Dict[str, dict] = {}
    meta = None
    for nproc in [int(x) for x in a.ranks.split(",")]:
        table: Dict[str, dict] = {}
        for rnd in range(a.rounds):
            order = algos if rnd % 2 == 0 else algos[::-1]
            for algo in order:
                doc = run_one(nproc, algo, a.max_bytes, a.extra)
                meta = meta or doc["meta"]
                for r in doc["rows"]:
                    if any(v != "ok" for v in r["check"].values()):
                        raise RuntimeError(f"check failed: {algo} {nproc} ranks {r['bytes']} B")
                    raw = r["libs"]["raw"]
                    e = table.setdefault(str(r["bytes"]), {"by_algo": {}})["by_algo"].setdefault(
                        algo, {"rounds_us": [], "streamcoll_rounds_us": []})
                    e["rounds_us"].append(raw["time_us"]["median"])
                    e["streamcoll_rounds_us"].append(r["libs"]["streamcoll"]["time_us"]["median"])
        results[str(nproc)] = table
    lines = render(results, algos, a.rounds)
    print("\n".join(lines))
    if a.out:
        os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
        with open(a.out + ".json", "w") as fh:
            json.dump({"meta": meta, "algos": algos, "rounds": a.rounds, "results": results}, fh, indent=1)
        with open(a.out + ".txt", "w") as fh:
            fh.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
