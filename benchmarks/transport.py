"""oneCCL's transport, OFI against MPI (issue 35): the 2-rank all_reduce sweep
once per configuration, configurations in a fixed order repeated over rounds
(A B C A B C ...), and per size the ratio of each configuration's time to the
first configuration's (the baseline, ``ofi``) in the same round, so every
cross-transport ratio comes from two runs minutes apart, while streamcoll/raw
and streamcoll/MPI are ratios within one run. oneCCL reads its transport once
per process, so two transports cannot be interleaved inside one run.

A configuration is ``NAME:LAUNCHER:VAR=value ...``: LAUNCHER ``torchrun``
(the system python, no MPI column) or the path of an MPI venv (its
``bin/mpiexec`` starts its ``bin/python``; the sweep then times mpi4py over
that MPI in the same processes). ``CCL_ATL_TRANSPORT=mpi`` needs the MPI
launch and oneCCL able to ``dlopen("libmpi.so.12")``: the driver passes
``CCL_MPI_LIBRARY_PATH=<venv>/lib/libmpi.so.12`` (oneCCL's own variable) for
every MPI configuration; without a loadable libmpi oneCCL 2022.2 quietly
falls back to OFI. Each run records ``os.getloadavg()`` before and after.

    flock /tmp/streamcoll-bench.lock python benchmarks/transport.py --rounds 3 \\
        --config 'ofi:torchrun:' \\
        --config 'mpi (Intel MPI):.venv-impi19:CCL_ATL_TRANSPORT=mpi' \\
        --config 'mpi+direct (Intel MPI):.venv-impi19:CCL_ATL_TRANSPORT=mpi CCL_ALLREDUCE=direct' \\
        --out benchmarks/results/transport/onehost_impi
    python benchmarks/transport.py --render benchmarks/results/transport/onehost_impi.json
    python benchmarks/transport.py --render-hosts benchmarks/results/transport/hosts_2x1.json

Simulated hosts: ``benchmarks/multihost.py`` runs the MPI variants (hydra's
mpiexec across network namespaces); ``--render-hosts`` reads its ``--out``
JSON files and gives each variant's ratio to ``defaults`` in the same round.

The MPI venvs: ``bash benchmarks/setup_mpi.sh`` (mpi4py + the ``mpich``
wheel), and for Intel MPI the same with ``impi-rt`` (docs/benchmarks.md,
"oneCCL's transport: OFI against MPI").
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Dict, List, Optional, Tuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LOOPBACK = {"MASTER_ADDR": "127.0.0.1", "CCL_KVS_IFACE": "lo", "NCCL_SOCKET_IFNAME": "lo",
            "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
Config = Tuple[str, str, Dict[str, str]]


def parse_config(s: str) -> Config:
    """``NAME:LAUNCHER:VAR=value ...`` -> (name, launcher, variables)."""
    parts = s.split(":", 2)
    if len(parts) != 3 or not parts[0] or not parts[1]:
        raise SystemExit(f"--config {s!r}: expected NAME:LAUNCHER:VAR=value ...")
    env: Dict[str, str] = {}
    for kv in parts[2].split():
        k, eq, v = kv.partition("=")
        if not eq:
            raise SystemExit(f"--config {s!r}: expected VAR=value, got {kv!r}")
        env[k] = v
    launcher = parts[1] if parts[1] == "torchrun" else os.path.abspath(parts[1])
    return parts[0], launcher, env


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def command(launcher: str, nproc: int, sweep_args: List[str]) -> Tuple[List[str], Dict[str, str]]:
    """The argv and extra variables of one run."""
    port = _port()
    if launcher == "torchrun":
        return ([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-addr",
                 "127.0.0.1", "--master-port", str(port), "-m", "streamcoll.bench", *sweep_args],
                {"MASTER_PORT": str(port)})
    # hydra hands the whole environment to the ranks; -bind-to none and
    # I_MPI_PIN=off: the kernel places the ranks, as under torchrun.
    return ([os.path.join(launcher, "bin", "mpiexec"), "-n", str(nproc), "-bind-to", "none",
             os.path.join(launcher, "bin", "python"), "-m", "streamcoll.bench", *sweep_args],
            {"MASTER_PORT": str(port), "I_MPI_PIN": "off",
             "CCL_MPI_LIBRARY_PATH": os.path.join(launcher, "lib", "libmpi.so.12")})


def run_one(cfg: Config, nproc: int, sizes: str, extra: List[str], timeout: float) -> dict:
    name, launcher, over = cfg
    with tempfile.TemporaryDirectory() as d:
        js = os.path.join(d, "r.json")
        argv, env_extra = command(launcher, nproc, ["--collectives", "all_reduce", "--no-baseline", "--sizes",
                                                    sizes, "--json", js, *extra])
        env = {k: v for k, v in os.environ.items() if not k.startswith(("CCL_", "FI_", "I_MPI_", "MASTER_"))}
        env.update(LOOPBACK)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)
        env.update(env_extra)
        env.update(over)
        load = os.getloadavg()
        t0 = time.monotonic()
        p = subprocess.run(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           timeout=timeout)
        wall = time.monotonic() - t0
        load_after = os.getloadavg()
        if p.returncode != 0 or not os.path.exists(js):
            raise RuntimeError(f"{name} failed ({p.returncode}):\n{p.stdout[-3000:]}")
        with open(js) as fh:
            doc = json.load(fh)
    rows = {}
    for r in doc["rows"]:
        if any(v != "ok" for v in r["check"].values()):
            raise RuntimeError(f"check failed: {name} {r['bytes']} B: {r['check']}")
        rows[str(r["bytes"])] = {lib: {"us": v["time_us"]["median"], "busbw": v["busbw"], "noisy": v["noisy"]}
                                 for lib, v in r["libs"].items()}
    m = doc["meta"]["machine"] if "machine" in doc["meta"] else doc["meta"]
    return {"config": name, "launcher": launcher, "vars": over, "rows": rows, "load": list(load),
            "load_after": list(load_after), "wall_s": wall, "mpi": m.get("mpi"), "libfabric": m.get("libfabric"),
            "date": m.get("date")}


def _sz(b: int) -> str:
    return f"{b >> 20} MB" if b >= 1 << 20 else f"{b >> 10} KB" if b >= 1024 else f"{b} B"


def _us(v: float) -> str:
    return f"{v / 1000:.2f} ms" if v >= 1000 else f"{v:.1f} us"


def _rng(xs: List[float], f: str = "{:.2f}") -> str:
    xs = sorted(xs)
    return f"{f.format(xs[0])}-{f.format(xs[-1])} ({f.format(statistics.median(xs))})" if len(xs) > 1 \
        else f.format(xs[0])


def render(doc: dict) -> List[str]:
    """Per configuration and size: streamcoll's and raw's time (median over
    rounds), their ratio to the baseline's in the same round (min-max
    (median)), and the within-run ratios streamcoll/raw and MPI's time."""
    runs = doc["runs"]
    base = doc["configs"][0][0]
    lines = [f"# all_reduce float32, {doc['nproc']} ranks, one host, {doc['rounds']} rounds in the order "
             f"{' '.join(c[0] for c in doc['configs'])}; ratios to '{base}' are per round (adjacent runs)"]
    for name, launcher, env in doc["configs"]:
        lines.append(f"#   {name}: {launcher} {' '.join(f'{k}={v}' for k, v in env.items()) or '(defaults)'}")
    lines.append("# load (1-min average) before-after each run, in order: " + ", ".join(
        f"{r['config']} {r['load'][0]:.2f}-{r['load_after'][0]:.2f}" for r in runs))
    lines += ["", "| config | size | streamcoll | raw | sc / base sc | raw / base raw | sc / raw (in run) | "
              "MPI (mpi4py) | raw / MPI (in run) |", "| --- | --- | ---: | ---: | --- | --- | --- | ---: | --- |"]
    by_round: Dict[int, Dict[str, dict]] = {}
    for r in runs:
        by_round.setdefault(r["round"], {})[r["config"]] = r
    sizes = sorted({int(s) for r in runs for s in r["rows"]})
    for name, _, _ in doc["configs"]:
        for b in sizes:
            s = str(b)
            mine = [rd[name]["rows"][s] for rd in by_round.values() if name in rd and s in rd[name]["rows"]]
            if not mine:
                continue
            sc = statistics.median(x["streamcoll"]["us"] for x in mine)
            raw = statistics.median(x["raw"]["us"] for x in mine) if all("raw" in x for x in mine) else None
            rs, rr = [], []
            for rd in by_round.values():
                if name in rd and base in rd and s in rd[name]["rows"] and s in rd[base]["rows"]:
                    a, z = rd[name]["rows"][s], rd[base]["rows"][s]
                    rs.append(a["streamcoll"]["us"] / z["streamcoll"]["us"])
                    if "raw" in a and "raw" in z:
                        rr.append(a["raw"]["us"] / z["raw"]["us"])
            scr = [x["streamcoll"]["us"] / x["raw"]["us"] for x in mine if "raw" in x]
            mpi = [x["mpi"]["us"] for x in mine if "mpi" in x]
            rm = [x["raw"]["us"] / x["mpi"]["us"] for x in mine if "mpi" in x and "raw" in x]
            bw = "" if b < 1 << 20 else f" ({statistics.median(x['streamcoll']['busbw'] for x in mine):.2f} GB/s)"
            lines.append(
                f"| {name} | {_sz(b)} | {_us(sc)}{bw} | {_us(raw) if raw else ''} | "
                f"{'' if name == base else _rng(rs)} | {'' if name == base or not rr else _rng(rr)} | "
                f"{_rng(scr) if scr else ''} | {_us(statistics.median(mpi)) if mpi else ''} | "
                f"{_rng(rm) if rm else ''} |")
    return lines


def render_hosts(docs: List[dict], base: str = "defaults") -> List[str]:
    """``benchmarks/multihost.py`` JSON files (``--out``) as transport
    pairs: per layout and variant, streamcoll's 4 B time and 16 MB busbw
    (median over rounds) and their ratios to ``base``'s run of the same
    round (a round: each (layout, variant) once, in the order run), with
    gloo's and MPI's in-run figures and the load of every run."""
    seen: Dict[Tuple[str, str], int] = {}
    rounds: Dict[Tuple[str, int], Dict[str, dict]] = {}
    for k, doc in enumerate(docs):
        for r in doc["results"]:
            key = (r["layout"], r["variant"])
            n = seen[key] = seen.get(key, -1) + 1
            rounds.setdefault((r["layout"], k * 1000 + n), {})[r["variant"]] = r
    lines = ["| layout | variant | runs | streamcoll 4 B | 4 B time / defaults' | gloo 4 B / sc (in run) | MPI 4 B | "
             "streamcoll 16 MB busbw | 16 MB busbw / defaults' | sc / gloo busbw (in run) | MPI 16 MB busbw | load |",
             "| --- | --- | ---: | ---: | --- | --- | ---: | ---: | --- | --- | ---: | --- |"]
    groups: Dict[Tuple[str, str], List[Tuple[dict, Optional[dict]]]] = {}
    for (layout, _), by_v in rounds.items():
        for v, r in by_v.items():
            if "streamcoll_4B_us" in r["m"]:
                b = by_v.get(base)
                groups.setdefault((layout, v), []).append((r, b if b and "streamcoll_4B_us" in b["m"] else None))
    for (layout, v), rs in sorted(groups.items(), key=lambda kv: (kv[0][0], kv[0][1] != base, kv[0][1])):
        ms = [r["m"] for r, _ in rs]
        t4 = statistics.median(m["streamcoll_4B_us"] for m in ms)
        bw = statistics.median(m["streamcoll_16MB_busbw"] for m in ms)
        r4 = [r["m"]["streamcoll_4B_us"] / b["m"]["streamcoll_4B_us"] for r, b in rs if b]
        rb = [r["m"]["streamcoll_16MB_busbw"] / b["m"]["streamcoll_16MB_busbw"] for r, b in rs if b]
        g4 = [m["torch_4B_us"] / m["streamcoll_4B_us"] for m in ms]
        gb = [m["streamcoll_16MB_busbw"] / m["torch_16MB_busbw"] for m in ms]
        mp4 = [m["mpi_4B_us"] for m in ms if "mpi_4B_us" in m]
        mpb = [m["mpi_16MB_busbw"] for m in ms if "mpi_16MB_busbw" in m]
        load = ", ".join(f"{r['load'][0]:.1f}-{r['load_after'][0]:.1f}" for r, _ in rs)
        lines.append(f"| {layout} | {v} | {len(ms)} | {_us(t4)} | {'' if v == base else _rng(r4)} | {_rng(g4, '{:.1f}')} | "
                     f"{_us(statistics.median(mp4)) if mp4 else ''} | {bw:.3f} GB/s | {'' if v == base else _rng(rb)} | "
                     f"{_rng(gb)} | {f'{statistics.median(mpb):.3f} GB/s' if mpb else ''} | {load} |")
    return lines


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", action="append", default=[], help="NAME:LAUNCHER:VAR=value ... (repeatable; "
                    "the first is the baseline)")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--sizes", default="4,64,1K,16K,256K,1M,4M,16M,64M")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--timeout", type=float, default=240, help="per run, seconds")
    ap.add_argument("--out", help="write PREFIX.json and PREFIX.txt")
    ap.add_argument("--render", help="print the table of a saved PREFIX.json and exit")
    ap.add_argument("--render-hosts", nargs="+", metavar="JSON",
                    help="print benchmarks/multihost.py results (--out PREFIX.json files) as transport pairs and exit")
    ap.add_argument("extra", nargs="*", help="more sweep arguments (after --)")
    a = ap.parse_args(argv)
    if a.render_hosts:
        docs = []
        for path in a.render_hosts:
            with open(path) as fh:
                docs.append(json.load(fh))
        print("\n".join(render_hosts(docs)))
        return 0
    if a.render:
        with open(a.render) as fh:
            print("\n".join(render(json.load(fh))))
        return 0
    configs = [parse_config(c) for c in (a.config or ["ofi:torchrun:"])]
    runs: List[dict] = []
    doc = {"nproc": a.ranks, "rounds": a.rounds, "configs": configs, "sizes": a.sizes, "runs": runs,
           "argv": sys.argv[1:]}
    for rnd in range(a.rounds):
        for cfg in configs:
            r = run_one(cfg, a.ranks, a.sizes, a.extra, a.timeout)
            r["round"] = rnd
            runs.append(r)
            print(f"# round {rnd + 1}: {cfg[0]} done in {r['wall_s']:.0f} s, load {r['load'][0]:.2f}-"
                  f"{r['load_after'][0]:.2f}", file=sys.stderr, flush=True)
            write(a.out, doc)  # after every run: a run stopped part-way keeps its finished rounds
    print("\n".join(render(doc)))
    return 0


def write(prefix: Optional[str], doc: dict) -> None:
    """``PREFIX.json`` (every run) and ``PREFIX.txt`` (the table)."""
    if not prefix:
        return
    os.makedirs(os.path.dirname(os.path.abspath(prefix)), exist_ok=True)
    with open(prefix + ".json", "w") as fh:
        json.dump(doc, fh, indent=1)
    with open(prefix + ".txt", "w") as fh:
        fh.write("\n".join(render(doc)) + "\n")


if __name__ == "__main__":
    sys.exit(main())
