"""The benchmarks: definitions (busbw factors, sizes, batching), and smoke runs
of the real thing: a tiny two-rank sweep under torchrun and the one-rank
overhead benchmark, checking the JSON they write and that their correctness
checks really run (an injected wrong result must be caught). Timings are
never asserted."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import needs_oneccl
from world import LOOPBACK_ENV, free_port

from streamcoll.bench.cases import batches, exact_limit
from streamcoll.bench.metrics import Stats, algbw, bus_factor, busbw, summarise
from streamcoll.bench.sweep import parse_size, sizes

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ALL = "all_reduce,all_gather_into_tensor,reduce_scatter_tensor,broadcast,all_to_all_single,sendrecv"


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


# ---------------------------------------------------------------- real runs
def _env():
    e = dict(os.environ)
    e.update(LOOPBACK_ENV)
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
    assert "broadcast: streamcoll.broadcast" in p.stdout
