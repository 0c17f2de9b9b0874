"""The benchmarks: definitions (busbw factors, sizes, batching), and smoke runs
of the real thing: a tiny two-rank sweep under torchrun (table and
nccl-tests format, the latter parsed back as nccl-tests parsers read it),
the sweep under mpiexec with the MPI column (where ``benchmarks/setup_mpi.sh``
made its venv: ``scripts/test.sh`` does, in seconds; skipped with the reason
otherwise), the one-rank overhead benchmark, the DDP step benchmark (2 ranks,
streamcoll against gloo, parameters compared) and the after-a-oneCCL-call
reproducer (1 rank), checking the JSON they write and that their correctness
checks really run (an injected wrong result must be caught). Timings are never
asserted."""
from __future__ import annotations

import json
import os
import re
import statistics
import subprocess
import sys

import pytest

from conftest import ROOT, needs_oneccl
from world import TORCHRUN_ENV, free_port

from streamcoll.bench.cases import batches, exact_limit
from streamcoll.bench.metrics import Stats, algbw, bus_factor, busbw, summarise
from streamcoll.bench.mpi import adopt_launcher_env
from streamcoll.bench.nccl_tests_format import block, fmt_time
from streamcoll.bench.sweep import parse_size, sizes

ALL = "all_reduce,all_gather_into_tensor,reduce_scatter_tensor,broadcast,all_to_all_single,sendrecv"
MPI_VENV = os.environ.get("STREAMCOLL_MPI_VENV") or os.path.join(ROOT, ".venv-mpi")
MPI_PY = os.path.join(MPI_VENV, "bin", "python")


def _mpi_why_not() -> str:
    """Empty when the MPI venv can run the MPI column, else why not."""
    if not os.path.exists(os.path.join(MPI_VENV, "bin", "mpiexec")):
        return f"no MPI venv at {MPI_VENV} (bash benchmarks/setup_mpi.sh makes it; scripts/test.sh runs that)"
    p = subprocess.run([MPI_PY, "-c", "import mpi4py"], capture_output=True, text=True)
    return "" if p.returncode == 0 else f"mpi4py not importable in {MPI_VENV}: {p.stderr.strip()[-300:]}"


needs_mpi = pytest.mark.skipif(bool(_mpi_why_not()), reason=_mpi_why_not() or "ok")


# ------------------------------------------------------- nccl-tests parsing
def parse_nccl_tests(text: str):
    """Read nccl-tests output the way tools that consume it do (data lines
    are the ones not starting with '#': 13 whitespace-separated fields; the
    two summary lines by their labels). Independent of the formatter."""
    tests, cur = [], None
    for line in text.splitlines():
        m = re.match(r"# Collective test starting: (\S+)", line)
        if m:
            cur = {"name": m.group(1), "rows": [], "system": None}
            tests.append(cur)
            continue
        if cur is None:
            continue
        if line.startswith("# System:"):
            cur["system"] = line.split(":", 1)[1].strip()
        elif line.startswith("# Out of bounds values"):
            f = line.split(":", 1)[1].split()
            cur["oob"], cur["oob_status"] = int(f[0]), f[1]
        elif line.startswith("# Avg bus bandwidth"):
            cur["avg_busbw"] = float(line.split(":", 1)[1])
        elif line.strip() and not line.startswith("#"):
            f = line.split()
            assert len(f) == 13, line
            num = lambda x: None if x == "N/A" else float(x)  # noqa: E731
            cur["rows"].append({"size": int(f[0]), "count": int(f[1]), "type": f[2], "redop": f[3],
                                "root": int(f[4]),
                                "out": dict(zip(("time", "algbw", "busbw", "wrong"), map(num, f[5:9]))),
                                "in": dict(zip(("time", "algbw", "busbw", "wrong"), map(num, f[9:13])))})
    return tests


# ---------------------------------------------------------------- definitions
def test_bus_factors_are_nccl_tests():
    # doc/PERFORMANCE.md: allreduce 2(n-1)/n; allgather, reducescatter, alltoall (n-1)/n; bcast, sendrecv 1.
    assert bus_factor("all_reduce", 2) == 1.0
    assert bus_factor("all_reduce", 4) == 1.5
    assert bus_factor("all_gather_into_tensor", 4) == 0.75
    assert bus_factor("reduce_scatter_tensor", 3) == pytest.approx(2 / 3)
    assert bus_factor("all_to_all_single", 2) == 0.5
    assert bus_factor("broadcast", 8) == 1.0
    assert bus_factor("sendrecv", 8) == 1.0
    assert algbw(2_000_000_000, 2.0) == 1.0
    assert busbw("all_reduce", 1_000_000_000, 1.0, 4) == 1.5
    with pytest.raises(ValueError, match="collective"):
        bus_factor("gossip", 2)


def test_sizes_and_parse():
    assert parse_size("4") == 4 and parse_size("64K") == 65536 and parse_size("256M") == 256 << 20
    assert parse_size("1g") == 1 << 30
    with pytest.raises(Exception, match="size"):
        parse_size("12 parsecs")
    s = sizes(4, 256 << 20, 4)
    assert s[0] == 4 and s[-1] == 256 << 20 and len(s) == 14
    assert all(b == 4 * a for a, b in zip(s, s[1:]))
    with pytest.raises(ValueError, match="factor"):
        sizes(4, 64, 1)


def test_batches_respect_cap_and_total():
    assert batches(200, None, 5) == (40, 5)
    bs, nb = batches(200, 22, 5)
    assert bs == 22 and nb * bs >= 200
    assert batches(5, None, 5) == (1, 5)
    assert batches(3, 1, 5) == (1, 3)
    assert exact_limit(__import__("torch").bfloat16) == 256


def test_stats_noise_and_summary():
    st = Stats([1e-6, 2e-6, 3e-6], threshold=1.5)
    assert (st.min, st.median, st.max) == (1e-6, 2e-6, 3e-6)
    assert st.spread == pytest.approx(3.0) and st.noisy
    assert not Stats([1e-6, 1.1e-6], threshold=1.5).noisy
    rec = summarise("all_reduce", 1000, 2, [1e-6, 1e-6, 1e-6])
    assert rec["time_us"]["median"] == pytest.approx(1.0)
    assert rec["algbw"] == pytest.approx(1.0) and rec["busbw"] == pytest.approx(1.0)
    with pytest.raises(ValueError, match="samples"):
        Stats([])


def test_nccl_tests_block_reads_back():
    lib = {"time_us": {"min": 10.0, "median": 12.345, "max": 20.0}, "algbw": 0.5, "busbw": 0.25}
    rows = [{"collective": c, "bytes": 4 << i, "count": 1 << i, "dtype": "float32", "warmup": 5, "iters": 20,
             "libs": {"streamcoll": lib}, "wrong": {"streamcoll": w}}
            for i, (c, w) in enumerate([("all_reduce", 0), ("all_reduce", 3)])]
    meta = {"ranks": [{"rank": 0, "pid": 1, "host": "h", "device": "cpu", "what": "x"}]}
    t = parse_nccl_tests("\n".join(block(rows, "streamcoll", meta)))
    assert len(t) == 1 and t[0]["name"] == "all_reduce_perf" and t[0]["system"] == "streamcoll"
    r0, r1 = t[0]["rows"]
    assert (r0["size"], r0["count"], r0["type"], r0["redop"], r0["root"]) == (4, 1, "float", "sum", -1)
    assert r0["out"] == {"time": None, "algbw": None, "busbw": None, "wrong": None}  # in place only
    assert r0["in"] == {"time": 12.35, "algbw": 0.5, "busbw": 0.25, "wrong": 0}
    assert r1["in"]["wrong"] == 3 and t[0]["oob"] == 3 and t[0]["oob_status"] == "FAILED"
    assert t[0]["avg_busbw"] == pytest.approx(0.25)
    # all_gather is timed out of place; broadcast prints its root.
    rows[0]["collective"] = "all_gather_into_tensor"
    t = parse_nccl_tests("\n".join(block(rows[:1], "streamcoll", meta)))
    assert t[0]["name"] == "all_gather_perf" and t[0]["rows"][0]["in"]["time"] is None
    assert t[0]["rows"][0]["redop"] == "none" and t[0]["oob_status"] == "OK"
    assert fmt_time(5.0) == "   5.00" and fmt_time(123.4) == "  123.4" and fmt_time(12345.6) == "  12346"


def test_adopt_launcher_env():
    e = {"PMI_RANK": "1", "PMI_SIZE": "2", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2"}
    assert adopt_launcher_env(e)
    assert (e["RANK"], e["WORLD_SIZE"], e["LOCAL_RANK"], e["LOCAL_WORLD_SIZE"]) == ("1", "2", "1", "2")
    e = {"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "3", "RANK": "0", "WORLD_SIZE": "3"}
    assert adopt_launcher_env(e) and e["LOCAL_WORLD_SIZE"] == "3"  # no local size: one host
    assert not adopt_launcher_env({"RANK": "0", "WORLD_SIZE": "2"})  # torchrun


def test_every_benchmarkable_collective_has_a_benchmark_case():
    """The benchmark cases derive from the declaration table: every collective
    with a fast path gets one (the point-to-point ones through nccl-tests'
    sendrecv pair), and so does any entry declaring a bus factor."""
    from streamcoll.core import spec
    from streamcoll.bench import cases
    from streamcoll.bench.metrics import BUS_FACTOR
    fast = {n for n, s in spec.TABLE.items() if s.fast and not s.p2p}
    declared = {n for n, s in spec.TABLE.items() if s.bus_factor is not None}
    assert fast <= set(cases.CASES) and declared == {n for n in cases.CASES if n in spec.TABLE}
    assert {n for n, s in spec.TABLE.items() if s.fast and s.p2p} == {"send", "recv"} and "sendrecv" in cases.CASES
    assert set(cases.CASES) <= set(BUS_FACTOR)
    for n in declared:
        assert cases.benchmarkable(spec.TABLE[n]) and cases.torch_function(spec.TABLE[n]) is not None, n
    # The exact-range cap of the in-place sums: 11 * 2**(k-1) <= 2**24 at 2 ranks (1 + r + i % 5 summed).
    assert cases.call_cap("all_reduce", 2, __import__("torch").float32) == 21
    assert cases.call_cap("broadcast", 2, __import__("torch").float32) is None


@needs_oneccl
def test_table_cases_run_and_check_at_world_size_1():
    """Every derived case at one rank: its streamcoll and raw calls run on its
    buffers and the reference check passes; a corrupted result is caught."""
    import torch
    import torch.distributed as dist
    import streamcoll
    from streamcoll.bench.cases import CASES, Context, make_case
    comm = streamcoll.init(backend="oneccl", device="cpu", rank=0, world_size=1, store=dist.HashStore())
    try:
        for dtype in (torch.float32, torch.bfloat16):
            ctx = Context(comm, 0, 1, torch.device("cpu"), dtype, False)
            for name in CASES:
                if name == "sendrecv":
                    continue
                for nbytes in (4, 4096):
                    case = make_case(name, ctx, nbytes)
                    for lib in ("streamcoll", "raw"):
                        case.fill()
                        run = getattr(case, lib)()
                        assert run is not None, (name, lib)
                        for _ in range(3):
                            run()
                        assert case.compare(3) == (0, None), (name, lib, dtype, nbytes)
                    case.corrupt()
                    assert case.compare(3)[0] == 1, name
    finally:
        streamcoll.destroy()


# ---------------------------------------------------------------- real runs
def _env():
    e = dict(os.environ)
    e.update(TORCHRUN_ENV)
    e["GLOO_SOCKET_IFNAME"] = "lo"
    e["PYTHONPATH"] = ROOT + os.pathsep + e.get("PYTHONPATH", "")
    return e


def _sweep(tmp_path, *args, timeout=180):
    out = tmp_path / "sweep"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
           "-m", "streamcoll.bench", "--out", str(out), *args]
    p = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=timeout)
    doc = json.loads((tmp_path / "sweep.json").read_text()) if (tmp_path / "sweep.json").exists() else None
    return p, doc, out


@needs_oneccl
@pytest.mark.world
def test_sweep_two_ranks_writes_table_json_png(tmp_path):
    p, doc, out = _sweep(tmp_path, "--collectives", ALL, "--max-bytes", "256", "--iters", "12", "--reps", "3",
                         "--dtype", "float32,bfloat16")
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert doc is not None
    rows = doc["rows"]
    # 4..256 B in x4 steps: all_reduce, broadcast, sendrecv 4 sizes each; split collectives round
    # 4 B up to n elements and dedupe, per dtype.
    colls = {r["collective"] for r in rows}
    assert colls == set(ALL.split(","))
    assert {r["dtype"] for r in rows} == {"float32", "bfloat16"}
    for r in rows:
        assert r["world_size"] == 2
        for k in ("bytes", "count", "dtype", "iters", "batches", "calls_per_batch", "check", "libs"):
            assert k in r, k
        assert r["bytes"] == r["count"] * (4 if r["dtype"] == "float32" else 2)
        assert set(r["libs"]) == {"streamcoll", "raw", "torch"}, (r["collective"], r.get("torch_error"))
        assert r["check"] == {"streamcoll": "ok", "raw": "ok", "torch": "ok"}
        for lib, v in r["libs"].items():
            t = v["time_us"]
            assert 0 < t["min"] <= t["median"] <= t["max"]
            assert v["algbw"] == pytest.approx(r["bytes"] / (t["median"] * 1e-6) / 1e9)
            assert v["busbw"] == pytest.approx(v["algbw"] * bus_factor(r["collective"], 2))
            assert v["samples"] == r["batches"]
        assert r["speedup_vs_torch"] == pytest.approx(
            r["libs"]["torch"]["time_us"]["median"] / r["libs"]["streamcoll"]["time_us"]["median"])
        assert r["calls_per_batch"] * r["batches"] >= 12
    # bfloat16 all_reduce is capped so the in-place sums stay exact (11 * 2**(k-1) <= 256: k <= 5).
    bf = [r for r in rows if r["collective"] == "all_reduce" and r["dtype"] == "bfloat16"]
    assert bf and all(r["calls_per_batch"] <= 5 for r in bf)
    m = doc["meta"]["machine"]
    assert m["nproc"] >= 1 and m["cpu"] and m["torch"] and m["oneccl"].count(".") == 2
    text = (tmp_path / "sweep.txt").read_text()
    assert "all_reduce" in text and "busbw" in text and "checks: all ok" in text
    assert "target" not in text  # no internal pass marks in what users read
    # torchrun gives no MPI world: the column is absent and the output says why.
    assert doc["meta"]["machine"]["launcher"] == "torchrun"
    assert doc["meta"]["machine"]["mpi"].startswith("not measured")
    png = (tmp_path / "sweep.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000


@needs_oneccl
@pytest.mark.world
def test_sweep_catches_a_wrong_result(tmp_path):
    """--inject-error corrupts streamcoll's timed output on rank 0 before the
    check: the check must see it, name it, and the run must fail."""
    p, doc, _ = _sweep(tmp_path, "--collectives", "all_reduce,sendrecv", "--max-bytes", "16", "--iters", "3",
                       "--reps", "1", "--no-baseline", "--inject-error")
    assert p.returncode != 0
    assert "CHECK FAILED" in p.stdout
    assert doc is not None and doc["rows"]
    for r in doc["rows"]:
        assert r["check"]["streamcoll"] == "FAIL" and r["check"]["raw"] == "ok"
        assert any("rank 0" in e and "wrong" in e for e in r["check_errors"])


@needs_oneccl
@pytest.mark.world
def test_overhead_benchmark_runs(tmp_path):
    out = tmp_path / "ov.json"
    cmd = [sys.executable, "-m", "streamcoll.bench.overhead", "--calls", "50", "--reps", "3", "--json", str(out)]
    p = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    rec = json.loads(out.read_text())
    res = rec["results"]
    four = ("all_reduce", "broadcast", "all_gather_into_tensor", "reduce_scatter_tensor")
    assert set(res) >= {f"{n}/{v}" for n in four for v in ("raw", "streamcoll", "comm", "torch.distributed")} \
        | {"all_reduce/async+wait"}
    for n in four:
        assert res[f"{n}/raw"]["ratio_to_raw"] == 1.0
        assert set(rec["ratios"][n]) == {"streamcoll / raw", "comm / raw", "torch.distributed / streamcoll"}
    for v in res.values():
        assert 0 < v["time_us"]["min"] <= v["time_us"]["median"] <= v["time_us"]["max"]
    assert "target" not in p.stdout
    assert "broadcast: streamcoll.broadcast" in p.stdout


def _nccl_tests_checks(stdout: str, doc, systems):
    tests = parse_nccl_tests(stdout)
    rows = doc["rows"]
    assert {(t["name"], t["system"].split(" ")[0]) for t in tests} >= {
        (n, s) for n in ("all_reduce_perf", "sendrecv_perf") for s in systems}
    for t in tests:
        lib = {"streamcoll": "streamcoll", "raw": "raw", "MPI": "mpi", "torch.distributed": "torch"}[
            t["system"].split(" ")[0]]
        coll = "all_reduce" if t["name"] == "all_reduce_perf" else "sendrecv"
        dtype = {"float": "float32", "bfloat16": "bfloat16"}[t["rows"][0]["type"]]
        mine = [r for r in rows if r["collective"] == coll and r["dtype"] == dtype]
        assert [r["size"] for r in t["rows"]] == [r["bytes"] for r in mine]
        assert [r["count"] for r in t["rows"]] == [r["count"] for r in mine]
        place = "in" if coll == "all_reduce" else "out"
        if lib not in mine[0]["libs"]:  # MPI has no bfloat16: the system's block is not printed
            raise AssertionError(f"block for {lib} {dtype} printed without measurements")
        for got, r in zip(t["rows"], mine):
            assert got[place]["wrong"] == 0
            assert got[place]["time"] == pytest.approx(r["libs"][lib]["time_us"]["median"], rel=0.01, abs=0.01)
            assert got[place]["busbw"] == pytest.approx(r["libs"][lib]["busbw"], abs=0.006)
        assert t["oob"] == 0 and t["oob_status"] == "OK"
        assert t["avg_busbw"] == pytest.approx(statistics.mean(r["libs"][lib]["busbw"] for r in mine), rel=1e-4)


@needs_oneccl
@pytest.mark.world
def test_sweep_nccl_tests_format_into_results_dir(tmp_path):
    """--format nccl-tests prints what nccl-tests parsers read; without --out
    the files go to the results folder (bench-results/ by default, untracked)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
           "-m", "streamcoll.bench", "--collectives", "all_reduce,sendrecv", "--sizes", "4,1K",
           "--iters", "6", "--reps", "2", "--format", "nccl-tests", "--results-dir", str(tmp_path / "res")]
    p = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=180)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    files = sorted(os.listdir(tmp_path / "res"))
    assert [f.rsplit(".", 1)[1] for f in files] == ["json", "png", "txt"] and files[0].startswith("sweep_2ranks_")
    doc = json.loads((tmp_path / "res" / files[0]).read_text())
    _nccl_tests_checks(p.stdout, doc, ("streamcoll", "raw", "torch.distributed"))
    assert (tmp_path / "res" / files[2]).read_text().count("# Avg bus bandwidth") == 6


@needs_oneccl
@needs_mpi
@pytest.mark.world
def test_sweep_under_mpiexec_has_the_mpi_column(tmp_path):
    """Under mpiexec the launcher's ranks become torchrun's, MPI is timed in
    the same processes and checked like the others; a dtype MPI lacks leaves
    the row without it, saying why."""
    env = _env()
    env["MASTER_PORT"] = str(free_port())
    cmd = [os.path.join(MPI_VENV, "bin", "mpiexec"), "-n", "2", "-bind-to", "none", MPI_PY, "-m", "streamcoll.bench",
           "--collectives", "all_reduce,sendrecv", "--sizes", "4,1K", "--iters", "6", "--reps", "2",
           "--dtype", "float32,bfloat16", "--format", "nccl-tests", "--out", str(tmp_path / "m")]
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    doc = json.loads((tmp_path / "m.json").read_text())
    m = doc["meta"]["machine"]
    assert m["launcher"] == "mpiexec" and m["mpi"].startswith("mpi4py")
    for r in doc["rows"]:
        if r["dtype"] == "float32":
            assert set(r["libs"]) == {"streamcoll", "raw", "mpi", "torch"}
            assert r["check"]["mpi"] == "ok" and r["wrong"]["mpi"] == 0
            assert r["speedup_vs_mpi"] == pytest.approx(
                r["libs"]["mpi"]["time_us"]["median"] / r["libs"]["streamcoll"]["time_us"]["median"])
        else:
            assert "mpi" not in r["libs"] and "bfloat16" in r["errors"]["mpi"]
    _nccl_tests_checks(p.stdout, doc, ("streamcoll", "raw", "MPI", "torch.distributed"))


@needs_oneccl
@needs_mpi
@pytest.mark.world
def test_sweep_catches_a_wrong_mpi_result(tmp_path):
    """The MPI column's check is real: corrupting MPI's output fails the run."""
    env = _env()
    env["MASTER_PORT"] = str(free_port())
    cmd = [os.path.join(MPI_VENV, "bin", "mpiexec"), "-n", "2", "-bind-to", "none", MPI_PY, "-m", "streamcoll.bench",
           "--collectives", "all_reduce", "--sizes", "16", "--iters", "3", "--reps", "1", "--no-baseline",
           "--inject-error", "mpi", "--json", str(tmp_path / "m.json")]
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
    assert p.returncode != 0 and "CHECK FAILED" in p.stdout
    r = json.loads((tmp_path / "m.json").read_text())["rows"][0]
    assert r["check"]["mpi"] == "FAIL" and r["check"]["streamcoll"] == "ok" and r["wrong"]["mpi"] == 1


# ------------------------------------------------- DDP step time (issue 25)
def _ddp_step(tmp_path, *args, timeout=120):
    out = tmp_path / "ddp"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
           os.path.join(ROOT, "benchmarks", "ddp_step.py"), "--out", str(out), *args]
    p = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=timeout)
    js = tmp_path / "ddp.json"
    return p, (json.loads(js.read_text()) if js.exists() else None)


@needs_oneccl
@pytest.mark.world
def test_ddp_step_benchmark_runs_and_checks_against_gloo(tmp_path):
    """benchmarks/ddp_step.py, briefly: DDP on the streamcoll backend and on
    gloo in the same two processes, both models; the two runs' parameters
    agree, each is identical on both ranks, and the same comparison catches
    a parameter perturbed on one rank (in the same run: one world start
    keeps this test short). Step times are recorded, never asserted."""
    p, doc = _ddp_step(tmp_path, "--rounds", "2", "--steps", "2", "--warmup", "1")
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert doc is not None and doc["ok"] is True
    assert [r["model"] for r in doc["results"]] == ["demo", "small-buckets"]
    for r in doc["results"]:
        c = r["check"]
        assert c["steps"] == 1 + 2 * 2 and c["allclose"] and c["identical_on_every_rank"] == {
            "streamcoll": True, "gloo": True}, r["model"]
        assert c["catches_a_perturbed_parameter"] is True, r["model"]
        for lib in ("streamcoll", "gloo"):
            assert len(r[lib]["step_ms"]) == 4 and all(t > 0 for t in r[lib]["step_ms"]), (r["model"], lib)
            assert sum(r[lib]["buckets"]) == 4 * r["parameters"], (r["model"], lib)  # float32 gradients
        assert r["streamcoll"]["buckets"] == r["gloo"]["buckets"]
    assert len(doc["results"][0]["streamcoll"]["buckets"]) == 1  # 2.25 MB of gradients, a 25 MB cap
    assert len(doc["results"][1]["streamcoll"]["buckets"]) >= 10  # bucket_cap_mb=1: one per layer
    assert "CCL_WORKER_OFFLOAD" in doc["meta"]["applied"]  # the streamcoll group really ran on oneCCL
    assert "# check demo:" in p.stdout and p.stdout.rstrip().endswith("OK")


@needs_oneccl
def test_after_call_reproducer_runs_at_world_size_1(tmp_path):
    """benchmarks/after_call.py (issue 25, the cost of a torch op right after
    a oneCCL call), briefly, at world size 1: every variant is timed (wall and
    the thread's CPU time) and the excesses are computed. Times are never
    asserted."""
    out = tmp_path / "after.json"
    cmd = [sys.executable, os.path.join(ROOT, "benchmarks", "after_call.py"), "--reps", "2", "--calls", "50",
           "--json", str(out)]
    p = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["world_size"] == 1
    want = {"all_reduce", "div_", "all_reduce; div_", "all_reduce AVG", "raw", "raw; div_", "spin",
            "all_reduce; spin", "pyloop", "all_reduce; pyloop", "numpy", "all_reduce; numpy"}
    assert want <= set(doc["median_us"]) and want <= set(doc["cpu_median_us"])
    assert all(v > 0 for v in doc["median_us"].values())
    assert doc["applied"].get("CCL_WORKER_OFFLOAD") == "0"  # streamcoll's world-size-1 default was in effect
    assert "# excess all_reduce; div_ - all_reduce - div_:" in p.stdout
