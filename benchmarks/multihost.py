"""streamcoll against gloo on simulated hosts (issues 13 and 25): 4 B
all_reduce latency and 16 MB busbw at 2 x 1, 4 x 1 (and 2 x 2) hosts x ranks,
with streamcoll's defaults and with each transport variant.

The hosts are the test tier's (``tests/netns.py``: network namespaces, two
joined by a veth pair, four by a bridge in a switch namespace; the interface
is ``mn0`` in each; private hostnames, IPC, PID namespaces and ``/dev/shm``);
each host runs ``torchrun --nnodes N`` with the sweep (``python -m
streamcoll.bench --collectives all_reduce --sizes 4,16M``), which measures
streamcoll and gloo interleaved in the same processes and checks every
result, so a row's ratio is measured in one run. The ranks get a clean
environment (no CCL_/NCCL_/FI_/GLOO_/MASTER_ variables) plus the variant's
variables, so ``defaults`` is what a user with no variables gets and the
other variants are what the defaults were chosen against. Each run records
the load average before and after it. Needs root.

    python benchmarks/multihost.py                                   # defaults, 2x1 and 4x1
    python benchmarks/multihost.py --variants all --rounds 2         # every variant (the defaults' evidence)
    python benchmarks/multihost.py --layouts 4x1 --variant defaults --variant CCL_ALLREDUCE=ring
    python benchmarks/multihost.py --out benchmarks/results/multihost/run   # PREFIX.txt, PREFIX.json
    python benchmarks/multihost.py --rounds 3 --variant defaults --variant 'CCL_ATL_TRANSPORT=mpi (MPICH)'

The ``CCL_ATL_TRANSPORT=mpi`` variants (issue 35) start the ranks with an MPI
venv's hydra ``mpiexec`` instead (``MPI_VENVS``: ``$STREAMCOLL_MPI_VENV``,
default ``.venv-mpi`` of ``benchmarks/setup_mpi.sh``; ``$STREAMCOLL_IMPI_VENV``,
default ``.venv-impi``, the same with ``impi-rt``), run in host 0, with a
generated ``-launcher-exec`` script standing in for ssh: it enters the host
whose address hydra names. The sweep then also times mpi4py over that MPI.

All simulated hosts share this machine's cores: 4 x 1 and 2 x 2 put 4 ranks
on 2 cores (oversubscribed, which streamcoll detects through the shared boot
id, and sets its defaults for).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import statistics
from typing import Dict, List, Optional, Tuple

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "tests"))

import netns  # noqa: E402

LAYOUTS = ("2x1", "2x2", "4x1")
HOSTS = {2: ("node-a", "node-b"), 4: ("node-a", "node-b", "node-c", "node-d")}
SAME = ("node", "node")
POW2_RING = "recursive_doubling:0-16384;ring:16385-max"

# name -> (variables, the layouts it is measured at, whether the hosts share a hostname).
# "defaults" is streamcoll's (no variables); each other row names what it sets on top of
# them. The 2 x 1 defaults spin inline (2 ranks, 2 cores), 2 x 2 and 4 x 1 (4 ranks on 2
# cores) hand the collective to oneCCL's worker thread, which sleeps while it waits
# (streamcoll.startup.env_defaults; before issue 25 it called sched_yield).
VARIANTS: Dict[str, tuple] = {
    "defaults": ({}, LAYOUTS, False),
    "defaults, same hostname": ({}, ("2x2",), True),
    # libfabric's provider (oneCCL's own choice here is "tcp;ofi_rxm": tcp under the RxM utility)
    "FI_PROVIDER=tcp": ({"FI_PROVIDER": "tcp"}, LAYOUTS, False),
    "FI_PROVIDER=tcp;ofi_rxm": ({"FI_PROVIDER": "tcp;ofi_rxm"}, LAYOUTS, False),
    # who progresses the collective, and how a waiting rank waits
    "oneCCL defaults (offload on)": ({"CCL_WORKER_OFFLOAD": "1"}, ("2x1", "2x2"), False),
    "offload on + sched_yield": ({"CCL_WORKER_OFFLOAD": "1", "CCL_YIELD": "sched_yield"}, ("2x1",), False),
    "CCL_YIELD=sched_yield (the default before issue 25)": ({"CCL_YIELD": "sched_yield"}, ("2x2", "4x1"), False),
    "offload on, yield pause": ({"CCL_YIELD": "pause"}, ("2x2", "4x1"), False),
    "offload on + CCL_YIELD=sleep": ({"CCL_WORKER_OFFLOAD": "1", "CCL_YIELD": "sleep"}, LAYOUTS, False),
    "offload off + CCL_YIELD=sleep": ({"CCL_WORKER_OFFLOAD": "0", "CCL_YIELD": "sleep"}, LAYOUTS, False),
    "offload off + CCL_YIELD=sleep + nreduce": (
        {"CCL_WORKER_OFFLOAD": "0", "CCL_YIELD": "sleep", "CCL_ALLREDUCE": "nreduce"}, ("2x2", "4x1"), False),
    "offload on + CCL_YIELD=sleep + nreduce": (
        {"CCL_WORKER_OFFLOAD": "1", "CCL_YIELD": "sleep", "CCL_ALLREDUCE": "nreduce"}, ("2x2", "4x1"), False),
    "offload off (spin)": ({"CCL_WORKER_OFFLOAD": "0"}, ("2x2", "4x1"), False),
    "offload off + sched_yield": ({"CCL_WORKER_OFFLOAD": "0", "CCL_YIELD": "sched_yield"}, ("2x2", "4x1"), False),
    "CCL_WORKER_COUNT=2": ({"CCL_WORKER_COUNT": "2"}, ("4x1",), False),
    "CCL_WORKER_WAIT=1": ({"CCL_WORKER_WAIT": "1"}, ("2x2", "4x1"), False),
    "CCL_SPIN_COUNT=10": ({"CCL_SPIN_COUNT": "10"}, ("2x2", "4x1"), False),
    "no shm (CCL_ATL_SHM=0)": ({"CCL_ATL_SHM": "0"}, ("2x2",), False),
    # the all-reduce algorithm (all sizes unless a range says otherwise) and its chunking
    "CCL_ALLREDUCE=ring": ({"CCL_ALLREDUCE": "ring"}, LAYOUTS, False),
    "CCL_ALLREDUCE=rabenseifner": ({"CCL_ALLREDUCE": "rabenseifner"}, LAYOUTS, False),
    "CCL_ALLREDUCE=recursive_doubling": ({"CCL_ALLREDUCE": "recursive_doubling"}, LAYOUTS, False),
    "CCL_ALLREDUCE=nreduce": ({"CCL_ALLREDUCE": "nreduce"}, LAYOUTS, False),
    "CCL_ALLREDUCE=rd<=16K+ring": ({"CCL_ALLREDUCE": POW2_RING}, LAYOUTS, False),
    "ring, CCL_RS_CHUNK_COUNT=4": ({"CCL_ALLREDUCE": "ring", "CCL_RS_CHUNK_COUNT": "4"}, LAYOUTS, False),
    "nreduce, CCL_ALLREDUCE_NREDUCE_SEGMENT_SIZE=1M": (
        {"CCL_ALLREDUCE": "nreduce", "CCL_ALLREDUCE_NREDUCE_SEGMENT_SIZE": str(1 << 20)}, LAYOUTS, False),
    # oneCCL over MPI (issue 35): ranks started by that MPI's mpiexec (see MPI_VENVS)
    "CCL_ATL_TRANSPORT=mpi (MPICH)": ({"CCL_ATL_TRANSPORT": "mpi"}, LAYOUTS, False),
    "CCL_ATL_TRANSPORT=mpi (Intel MPI)": ({"CCL_ATL_TRANSPORT": "mpi"}, LAYOUTS, False),
    "CCL_ATL_TRANSPORT=mpi + direct<=16M (Intel MPI)": (
        {"CCL_ATL_TRANSPORT": "mpi", "CCL_ALLREDUCE": "direct:0-16777216;nreduce:16777217-max"}, LAYOUTS, False),
}
# variant -> (the variable naming its MPI venv, the default venv): these run under that venv's mpiexec.
MPI_VENVS: Dict[str, Tuple[str, str]] = {
    "CCL_ATL_TRANSPORT=mpi (MPICH)": ("STREAMCOLL_MPI_VENV", os.path.join(ROOT, ".venv-mpi")),
    "CCL_ATL_TRANSPORT=mpi (Intel MPI)": ("STREAMCOLL_IMPI_VENV", os.path.join(ROOT, ".venv-impi")),
    "CCL_ATL_TRANSPORT=mpi + direct<=16M (Intel MPI)": ("STREAMCOLL_IMPI_VENV", os.path.join(ROOT, ".venv-impi")),
}


def parse_layout(text: str) -> Tuple[int, int]:
    """``"4x1"`` -> (hosts, ranks per host)."""
    try:
        h, r = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise ValueError(f"layout {text!r}: expected HOSTSxRANKS, e.g. 4x1") from None
    if h not in HOSTS or r < 1:
        raise ValueError(f"layout {text!r}: hosts must be one of {sorted(HOSTS)}, ranks per host >= 1")
    return h, r


def _mpi_launch(hosts: "netns.Hosts", venv: str, per_host: int, sweep: List[str], workdir: str, tag: str,
                port: int) -> Tuple[List[str], Dict[str, str]]:
    """Host 0's command and the ranks' extra variables for a world started
    by ``venv``'s hydra mpiexec: a ``-launcher-exec`` script (hydra calls it
    as ``script [options] ADDRESS COMMAND...``, as it would call ssh) runs
    the proxy command in the host with that address."""
    import shlex

    n = len(hosts.names)
    # A new veth has no carrier for a moment, and an MPI runtime that starts
    # then sees only loopback (UCX: "network device 'mn0' is not available").
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and not all(
            "state UP" in subprocess.run(["ip", "-n", name, "link", "show", hosts.iface], capture_output=True,
                                         text=True).stdout for name in hosts.names):
        time.sleep(0.05)
    lines = ["#!/bin/sh", 'while [ $# -gt 0 ]; do case "$1" in -*) shift;; *) break;; esac; done',
             'h="$1"; shift', 'case "$h" in']
    for g in range(n):
        prefix = " ".join(shlex.quote(x) for x in hosts.command(g, ["sh", "-c"]))
        lines.append(f'  {hosts.addr(g)}|{hosts.hostnames[g]}) exec {prefix} "$*";;')
    lines += ['  *) echo "launcher-exec: unknown host $h" >&2; exit 9;;', "esac"]
    script = os.path.join(workdir, f"launch_{tag}.sh")
    with open(script, "w") as f:
        f.write("\n".join(lines) + "\n")
    os.chmod(script, 0o755)
    py = os.path.join(venv, "bin", "python")
    argv = [os.path.join(venv, "bin", "mpiexec"), "-launcher", "ssh", "-launcher-exec", script,
            "-iface", hosts.iface, "-hosts", ",".join(hosts.addr(g) for g in range(n)), "-ppn", str(per_host),
            "-n", str(n * per_host), "-bind-to", "none", py, "-m", "streamcoll.bench", *sweep]
    return hosts.command(0, argv), {"MASTER_ADDR": hosts.addr(0), "MASTER_PORT": str(port), "I_MPI_PIN": "off",
                                    "CCL_MPI_LIBRARY_PATH": os.path.join(venv, "lib", "libmpi.so.12")}


def run_one(layout: str, variant: str, workdir: str, port: int, timeout: float, sizes: str) -> dict:
    """One world of ``layout`` with ``variant``'s variables: the sweep's
    medians at 4 B and 16 MB for streamcoll and gloo (and MPI under an MPI
    launcher), or an error."""
    extra, _, same = VARIANTS[variant]
    nhosts, per_host = parse_layout(layout)
    hostnames = SAME if same else HOSTS[nhosts]
    tag = f"{layout}_{abs(hash(variant))}_{port}"
    jpath = os.path.join(workdir, f"{tag}.json")
    env = {"PYTHONPATH": os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p), **extra}
    procs = []
    # Distinct pids on every host (oneCCL cannot tell apart ranks with equal hostname and pid).
    sweep = ["--collectives", "all_reduce", "--sizes", sizes, "--no-raw", "--json", jpath]
    with netns.Hosts(hostnames, pid_shift=[5 * g for g in range(nhosts)]) as hosts:
        if variant in MPI_VENVS:
            var, default = MPI_VENVS[variant]
            argv, more = _mpi_launch(hosts, os.environ.get(var) or default, per_host, sweep, workdir, tag, port)
            log = open(os.path.join(workdir, f"log_{tag}_0"), "w")
            procs.append(subprocess.Popen(argv, env=netns.clean_env({**env, **more}), stdout=log,
                                          stderr=subprocess.STDOUT, start_new_session=True))
            log.close()
        for g in range(0 if variant in MPI_VENVS else nhosts):
            argv = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nhosts), "--node-rank", str(g),
                    "--nproc-per-node", str(per_host), "--master-addr", hosts.addr(0), "--master-port", str(port),
                    "-m", "streamcoll.bench", *sweep]
            log = open(os.path.join(workdir, f"log_{tag}_{g}"), "w")
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
    if any(rcs) or not os.path.exists(jpath):
        return {"error": f"exit {rcs}; logs in {workdir} ({tag})"}
    with open(jpath) as f:
        rows = json.load(f)["rows"]
    out: Dict[str, object] = {}
    for row in rows:
        key = "4B" if row["bytes"] == 4 else "16MB"
        for lib in ("streamcoll", "torch", "mpi"):
            if lib not in row["libs"]:
                continue
            L = row["libs"][lib]
            out[f"{lib}_{key}_us"] = L["time_us"]["median"]
            out[f"{lib}_{key}_busbw"] = L["busbw"]
            out[f"{lib}_{key}_noisy"] = L["noisy"]
        if any(v != "ok" for v in row["check"].values()):
            out["error"] = f"check failed: {row['check']}"
    return out


def _us(v: float) -> str:
    return f"{v / 1000:.2f} ms" if v >= 1000 else f"{v:.1f} us"


def table(results: List[dict]) -> str:
    """One line per run, in the order run, with the load average around it."""
    lines = ["| layout | variant | streamcoll 4 B | gloo 4 B | gloo/sc | streamcoll 16 MB busbw | "
             "gloo 16 MB busbw | sc/gloo | load | MPI 4 B | MPI 16 MB busbw |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in results:
        m = r["m"]
        load = "-".join(f"{x:.1f}" for x in (r["load"][0], r["load_after"][0]))
        if "streamcoll_4B_us" not in m:
            lines.append(f"| {r['layout']} | {r['variant']} | {m.get('error')} | | | | | | {load} |")
            continue
        lines.append(
            f"| {r['layout']} | {r['variant']} | {_us(m['streamcoll_4B_us'])} | {_us(m['torch_4B_us'])} | "
            f"{m['torch_4B_us'] / m['streamcoll_4B_us']:.1f}x | {m['streamcoll_16MB_busbw']:.3f} GB/s | "
            f"{m['torch_16MB_busbw']:.3f} GB/s | {m['streamcoll_16MB_busbw'] / m['torch_16MB_busbw']:.2f}x | {load} | "
            + (f"{_us(m['mpi_4B_us'])} | {m['mpi_16MB_busbw']:.3f} GB/s |" if "mpi_4B_us" in m else " | |"))
    return "\n".join(lines)


def summary(results: List[dict]) -> str:
    """Per layout and variant over the rounds: the range and median of the
    in-run ratios (16 MB busbw streamcoll/gloo, 4 B time gloo/streamcoll)."""
    groups: Dict[Tuple[str, str], List[dict]] = {}
    for r in results:
        if "streamcoll_4B_us" in r["m"]:
            groups.setdefault((r["layout"], r["variant"]), []).append(r["m"])
    lines = ["| layout | variant | runs | 16 MB busbw sc/gloo: min-max (median) | streamcoll 16 MB GB/s | "
             "4 B gloo/sc: min-max (median) | streamcoll 4 B |", "| --- | --- | ---: | --- | --- | --- | --- |"]
    for (layout, variant), ms in groups.items():
        bw = sorted(m["streamcoll_16MB_busbw"] / m["torch_16MB_busbw"] for m in ms)
        lat = sorted(m["torch_4B_us"] / m["streamcoll_4B_us"] for m in ms)
        sbw = sorted(m["streamcoll_16MB_busbw"] for m in ms)
        slat = sorted(m["streamcoll_4B_us"] for m in ms)
        lines.append(f"| {layout} | {variant} | {len(ms)} | {bw[0]:.2f}-{bw[-1]:.2f}x ({statistics.median(bw):.2f}x) | "
                     f"{sbw[0]:.3f}-{sbw[-1]:.3f} | {lat[0]:.1f}-{lat[-1]:.1f}x ({statistics.median(lat):.1f}x) | "
                     f"{_us(slat[0])}-{_us(slat[-1])} |")
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layouts", default="2x1,4x1",
                   help=f"comma-separated HOSTSxRANKS (default 2x1,4x1; known {', '.join(LAYOUTS)})")
    p.add_argument("--variant", action="append", default=[],
                   help=f"a variant to run (repeat for several; default: defaults). Known: {'; '.join(VARIANTS)}")
    p.add_argument("--variants", choices=("all",), help="all: every variant (the defaults' evidence)")
    p.add_argument("--sizes", default="4,16M", help="the sweep's sizes (default 4,16M: the table's two)")
    p.add_argument("--timeout", type=float, default=240, help="per run, seconds")
    p.add_argument("--rounds", type=int, default=1, help="repeat the set of runs, interleaved (default 1)")
    p.add_argument("--out", help="PREFIX: write PREFIX.txt (the tables) and PREFIX.json")
    a = p.parse_args(argv)
    why = netns.unavailable()
    if why:
        print(f"simulated hosts unavailable: {why}", file=sys.stderr)
        return 2
    # "all" leaves out the MPI variants whose venv is missing (they need one set up first).
    names = ([v for v in VARIANTS if v not in MPI_VENVS or os.path.exists(os.path.join(
        os.environ.get(MPI_VENVS[v][0]) or MPI_VENVS[v][1], "bin", "mpiexec"))]
             if a.variants == "all" else (a.variant or ["defaults"]))
    for v in names:
        if v not in VARIANTS:
            p.error(f"unknown variant {v!r}")
    layouts = [x.strip() for x in a.layouts.split(",") if x.strip()]
    for x in layouts:
        try:
            parse_layout(x)
        except ValueError as e:
            p.error(str(e))
    workdir = tempfile.mkdtemp(prefix="streamcoll-multihost-")
    results: List[dict] = []
    for layout, v in [(x, v) for _ in range(a.rounds) for x in layouts for v in names]:
        if layout in VARIANTS[v][1]:
            t0 = time.monotonic()
            load = os.getloadavg()
            m = run_one(layout, v, workdir, 29500 + len(results) % 400, a.timeout, a.sizes)
            results.append({"layout": layout, "variant": v, "vars": VARIANTS[v][0], "same_hostname": VARIANTS[v][2],
                            "m": m, "wall_s": time.monotonic() - t0, "load": load, "load_after": os.getloadavg()})
            print(f"{layout} {v}: {json.dumps(m)} ({results[-1]['wall_s']:.0f} s, load {load[0]:.1f})", flush=True)
    text = table(results) + "\n\n" + summary(results)
    print(text)
    if a.out:
        os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
        with open(a.out + ".txt", "w") as f:
            f.write(text + "\n")
        with open(a.out + ".json", "w") as f:
            json.dump({"results": results, "argv": sys.argv[1:]}, f, indent=1)
    return 1 if any("error" in r["m"] for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
