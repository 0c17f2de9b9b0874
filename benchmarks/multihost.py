"""streamcoll against gloo on two simulated hosts (issue 13): 4 B all_reduce
latency and 16 MB busbw, 2 hosts x 1 and x 2 ranks, one run.

The hosts are the test tier's (``tests/netns.py``: two network namespaces
joined by a veth pair ``mn0``, private hostnames, IPC, PID namespaces and
``/dev/shm``); each host runs ``torchrun --nnodes 2`` with the sweep
(``python -m streamcoll.bench --collectives all_reduce``), which measures
streamcoll and gloo interleaved in the same processes and checks every
result. The ranks get a clean environment (no CCL_/NCCL_/FI_/GLOO_/MASTER_
variables) plus the variant's variables, so ``defaults`` is what a user with
no variables gets and the other variants are what the defaults were chosen
against. Needs root.

    python benchmarks/multihost.py                       # defaults, 2x1 and 2x2
    python benchmarks/multihost.py --variants all        # every variant (the defaults' evidence)
    python benchmarks/multihost.py --out benchmarks/results/multihost/run   # PREFIX.txt, PREFIX.json

Both simulated hosts share this machine's cores: 2 x 2 puts 4 ranks on them
(oversubscribed, which streamcoll detects through the shared boot id).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Dict, List, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "tests"))

import netns  # noqa: E402

# name -> (variables, per-host sizes it applies to, hostnames)
DISTINCT = ("node-a", "node-b")
SAME = ("node", "node")
VARIANTS: Dict[str, tuple] = {
    "defaults": ({}, (1, 2), DISTINCT),
    "defaults, same hostname": ({}, (2,), SAME),
    "oneCCL defaults (offload on)": ({"CCL_WORKER_OFFLOAD": "1"}, (1, 2), DISTINCT),
    "offload on + sched_yield": ({"CCL_WORKER_OFFLOAD": "1", "CCL_YIELD": "sched_yield"}, (1,), DISTINCT),
    "offload off (spin)": ({"CCL_WORKER_OFFLOAD": "0"}, (2,), DISTINCT),
    "offload off + sched_yield": ({"CCL_WORKER_OFFLOAD": "0", "CCL_YIELD": "sched_yield"}, (2,), DISTINCT),
    "no shm (CCL_ATL_SHM=0)": ({"CCL_ATL_SHM": "0"}, (2,), DISTINCT),
    "FI_PROVIDER=tcp": ({"FI_PROVIDER": "tcp"}, (1, 2), DISTINCT),
    "CCL_ALLREDUCE=ring": ({"CCL_ALLREDUCE": "ring"}, (1, 2), DISTINCT),
    "CCL_ALLREDUCE=rabenseifner": ({"CCL_ALLREDUCE": "rabenseifner"}, (1, 2), DISTINCT),
    "CCL_ALLREDUCE=recursive_doubling": ({"CCL_ALLREDUCE": "recursive_doubling"}, (1, 2), DISTINCT),
    "CCL_ALLREDUCE=nreduce": ({"CCL_ALLREDUCE": "nreduce"}, (1, 2), DISTINCT),
    "CCL_ALLREDUCE=rd<=16K+nreduce": ({"CCL_ALLREDUCE": "recursive_doubling:0-16384;nreduce:16385-max"}, (1, 2),
                                      DISTINCT),
    "CCL_SPIN_COUNT=10": ({"CCL_SPIN_COUNT": "10"}, (2,), DISTINCT),
    "CCL_WORKER_WAIT=1": ({"CCL_WORKER_WAIT": "1"}, (2,), DISTINCT),
}


def run_one(per_host: int, variant: str, workdir: str, port: int, timeout: float) -> dict:
    extra, _, hostnames = VARIANTS[variant]
    jpath = os.path.join(workdir, f"{per_host}_{abs(hash(variant))}.json")
    env = {"PYTHONPATH": os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p), **extra}
    procs = []
    with netns.Hosts(hostnames, pid_shift=(0, 5)) as hosts:
        for g in range(2):
            argv = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(g),
                    "--nproc-per-node", str(per_host), "--master-addr", hosts.addr(0), "--master-port", str(port),
                    "-m", "streamcoll.bench", "--collectives", "all_reduce", "-b", "4", "-e", "16M",
                    "-f", str(4 << 20), "--no-raw", "--json", jpath]
            log = open(os.path.join(workdir, f"log_{per_host}_{g}_{abs(hash(variant))}"), "w")
            procs.append(subprocess.Popen(hosts.command(g, argv), env=netns.clean_env(env), stdout=log,
                                          stderr=subprocess.STDOUT, start_new_session=True))
            log.close()
        deadline = time.monotonic() + timeout
        try:
            while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
                time.sleep(0.1)
        finally:
            for p in procs:
                if p.poll() is None:
                    os.killpg(p.pid, 9)
                    p.wait(10)
    rcs = [p.returncode for p in procs]
    if rcs != [0, 0] or not os.path.exists(jpath):
        return {"error": f"exit {rcs}; logs in {workdir}"}
    with open(jpath) as f:
        rows = json.load(f)["rows"]
    out = {}
    for row in rows:
        key = "4B" if row["bytes"] == 4 else "16MB"
        for lib in ("streamcoll", "torch"):
            L = row["libs"][lib]
            out[f"{lib}_{key}_us"] = L["time_us"]["median"]
            out[f"{lib}_{key}_busbw"] = L["busbw"]
            out[f"{lib}_{key}_noisy"] = L["noisy"]
        if any(v != "ok" for v in row["check"].values()):
            out["error"] = f"check failed: {row['check']}"
    return out


def table(results: List[dict]) -> str:
    lines = ["| hosts x ranks | variant | streamcoll 4 B | gloo 4 B | ratio | streamcoll 16 MB busbw | "
             "gloo 16 MB busbw | ratio |", "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in results:
        m = r["m"]
        if "error" in m and "streamcoll_4B_us" not in m:
            lines.append(f"| 2 x {r['per_host']} | {r['variant']} | {m['error']} | | | | | |")
            continue

        def us(v):
            return f"{v / 1000:.2f} ms" if v >= 1000 else f"{v:.1f} us"
        lines.append(
            f"| 2 x {r['per_host']} | {r['variant']} | {us(m['streamcoll_4B_us'])} | {us(m['torch_4B_us'])} | "
            f"{m['torch_4B_us'] / m['streamcoll_4B_us']:.1f}x | {m['streamcoll_16MB_busbw']:.3f} GB/s | "
            f"{m['torch_16MB_busbw']:.3f} GB/s | {m['streamcoll_16MB_busbw'] / m['torch_16MB_busbw']:.2f}x |")
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--per-host", default="1,2", help="ranks per host, comma-separated (default 1,2)")
    p.add_argument("--variants", default="defaults",
                   help=f"comma-separated, or 'all' (default: defaults). Known: {'; '.join(VARIANTS)}")
    p.add_argument("--timeout", type=float, default=180, help="per run, seconds")
    p.add_argument("--rounds", type=int, default=1, help="repeat the set of runs, interleaved (default 1)")
    p.add_argument("--out", help="PREFIX: write PREFIX.txt (the table) and PREFIX.json")
    a = p.parse_args(argv)
    why = netns.unavailable()
    if why:
        print(f"simulated hosts unavailable: {why}", file=sys.stderr)
        return 2
    names = list(VARIANTS) if a.variants == "all" else [v.strip() for v in a.variants.split(",") if v.strip()]
    for v in names:
        if v not in VARIANTS:
            p.error(f"unknown variant {v!r}")
    sizes = [int(x) for x in a.per_host.split(",")]
    workdir = tempfile.mkdtemp(prefix="streamcoll-multihost-")
    results = []
    for per_host, v in [(ph, v) for _ in range(a.rounds) for ph in sizes for v in names]:
        if per_host in VARIANTS[v][1]:
            t0 = time.monotonic()
            m = run_one(per_host, v, workdir, 29500 + len(results) % 400, a.timeout)
            results.append({"per_host": per_host, "variant": v, "vars": VARIANTS[v][0],
                            "hostnames": VARIANTS[v][2], "m": m, "wall_s": time.monotonic() - t0})
            print(f"2 x {per_host} {v}: {json.dumps(m)} ({results[-1]['wall_s']:.0f} s)", flush=True)
    text = table(results)
    print(text)
    if a.out:
        os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
        with open(a.out + ".txt", "w") as f:
            f.write(text + "\n")
        with open(a.out + ".json", "w") as f:
            json.dump({"results": results, "loadavg": os.getloadavg()}, f, indent=1)
    return 1 if any("error" in r["m"] for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
