"""DDP step time through the ``"streamcoll"`` backend against gloo, in the
same processes, interleaved, with the two runs' parameters compared.

    torchrun --nproc-per-node 2 --master-addr 127.0.0.1 benchmarks/ddp_step.py
    torchrun --nproc-per-node 2 --master-addr 127.0.0.1 benchmarks/ddp_step.py \\
        --rounds 6 --steps 20 --out benchmarks/results/ddp_step

Every rank makes two process groups over torchrun's store: gloo (the default
group) and streamcoll (``dist.new_group(backend="streamcoll")``), and, per
model, two copies from the same seed, each wrapped in
``DistributedDataParallel`` on one of the groups with the same
``bucket_cap_mb``. Both copies see the same batches in the same order (each
rank its own shard). A round runs ``--steps`` training steps on one copy,
then as many on the other, the order alternating from round to round, so
slow spells of a shared machine fall on both. A step is forward, loss,
``zero_grad``, backward (DDP all-reduces the buckets while it runs) and the
optimizer step; its time is the slowest rank's. The first ``--warmup`` steps
of each copy (DDP rebuilds its buckets after the first) are not timed.

The models:

- ``demo``: ``examples/train.py``'s MLP (64-512-512-512-10, 0.56 M
  parameters, what ``scripts/demo.sh`` trains), batch 64, DDP's default
  ``bucket_cap_mb`` (25: one 2.25 MB bucket once DDP has rebuilt them).
- ``small-buckets``: a deeper MLP of the same width (64, then ten 512x512
  layers, then 10; 2.7 M parameters), batch 8, ``bucket_cap_mb=1``: one
  bucket per layer, about eleven all-reduces of 1 MB per step.

Correctness, a differential check: after the last round the two copies have
taken the same steps on the same data, so their parameters must agree (the
two libraries may add in another order: float32 tolerance; whether they are
bitwise equal is printed too), and each copy must be identical on every
rank. The same comparison is then made with one parameter of rank 0's
streamcoll copy perturbed, and must fail: the check is seen to work in every
run. A failed check makes the run exit 1 (``--inject-error`` perturbs the
real comparison's input the same way, to show that it does). Timings never
fail anything.

Prints, on rank 0, per model the step time of each library (median, 10th
and 90th percentile, ms), the ratio gloo / streamcoll of the medians, the
median of the per-round ratios, the buckets DDP used and the checks;
``--out PREFIX`` also writes ``PREFIX.txt`` and ``PREFIX.json`` (every step
time, the load average before and after, the variables streamcoll applied).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys
import time
from typing import Any, Callable, Dict, Iterator, List, NamedTuple, Tuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402


def _demo() -> Any:
    """examples/train.py, the demo's own model and data (declared there once)."""
    spec = importlib.util.spec_from_file_location("_streamcoll_demo_train", os.path.join(ROOT, "examples", "train.py"))
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


DEMO = _demo()


def deep_model(seed: int, layers: int = 10) -> torch.nn.Module:
    """The demo's width, deeper: one 1 MB weight per hidden layer."""
    torch.manual_seed(seed)
    mods: List[torch.nn.Module] = [torch.nn.Linear(64, 512), torch.nn.ReLU()]
    for _ in range(layers):
        mods += [torch.nn.Linear(512, 512), torch.nn.ReLU()]
    mods.append(torch.nn.Linear(512, 10))
    return torch.nn.Sequential(*mods)


class Config(NamedTuple):
    name: str
    make: Callable[[int], torch.nn.Module]
    batch: int
    bucket_cap_mb: float
    what: str


CONFIGS: Dict[str, Config] = {
    "demo": Config("demo", DEMO.make_model, 64, 25.0,
                   "examples/train.py's MLP, batch 64, DDP's default bucket_cap_mb=25"),
    "small-buckets": Config("small-buckets", deep_model, 8, 1.0,
                            "64-(512x10)-10 MLP, batch 8, bucket_cap_mb=1"),
}


class Copy:
    """One model copy under DDP on one process group, with its optimizer
    and its own pass over the shared batches."""

    def __init__(self, cfg: Config, pg: Any, seed: int, data: List[Tuple[torch.Tensor, torch.Tensor]]):
        self.model = cfg.make(seed)
        self.ddp = DDP(self.model, process_group=pg, bucket_cap_mb=cfg.bucket_cap_mb)
        self.opt = torch.optim.SGD(self.ddp.parameters(), lr=0.05, momentum=0.9)
        self.data = data
        self.done = 0
        self.times: List[float] = []   # this rank's step times, s (timed steps only)
        self.rounds: List[int] = []    # the round of each timed step

    def step(self) -> float:
        x, y = self.data[self.done]
        self.done += 1
        t0 = time.perf_counter()
        loss = torch.nn.functional.cross_entropy(self.ddp(x), y)
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        self.opt.step()
        return time.perf_counter() - t0

    def flat(self) -> torch.Tensor:
        return torch.cat([p.detach().reshape(-1) for p in self.model.parameters()])

    def buckets(self) -> List[int]:
        """The gradient buckets' sizes in bytes, as DDP rebuilt them after
        the first step (in the order gradients became ready)."""
        ld = self.ddp._get_ddp_logging_data()
        s = str(ld.get("rebuilt_bucket_sizes" if ld.get("has_rebuilt_buckets") else "bucket_sizes", ""))
        return [int(b) for b in s.split(",") if b.strip()]


def batches(rank: int, n: int, batch: int) -> List[Tuple[torch.Tensor, torch.Tensor]]:
    it: Iterator[Tuple[torch.Tensor, torch.Tensor]] = DEMO.batches(rank, n, batch)
    return list(it)


def percentile(xs: List[float], q: float) -> float:
    s = sorted(xs)
    if not s:
        return float("nan")
    k = (len(s) - 1) * q
    lo = int(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def run_config(cfg: Config, a: argparse.Namespace, groups: Dict[str, Any], rank: int, world: int
               ) -> Dict[str, Any]:
    gloo_pg = groups["gloo"]
    total = a.warmup + a.rounds * a.steps
    data = batches(rank, total, cfg.batch)
    copies = {lib: Copy(cfg, groups[lib], a.seed, data) for lib in ("streamcoll", "gloo")}
    for c in copies.values():          # warm-up, not timed (DDP rebuilds its buckets after step 1)
        for _ in range(a.warmup):
            c.step()
    order = ["streamcoll", "gloo"]
    for r in range(a.rounds):
        for lib in (order if r % 2 == 0 else order[::-1]):
            c = copies[lib]
            dist.barrier(group=gloo_pg)  # line the ranks up (not timed)
            for _ in range(a.steps):
                c.times.append(c.step())
                c.rounds.append(r)

    # Every rank's step times -> the slowest rank's, per step.
    out: Dict[str, Any] = {"model": cfg.name, "what": cfg.what, "batch": cfg.batch,
                           "bucket_cap_mb": cfg.bucket_cap_mb,
                           "parameters": sum(p.numel() for p in copies["gloo"].model.parameters())}
    for lib, c in copies.items():
        t = torch.tensor(c.times, dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=gloo_pg)
        ms = [v * 1e3 for v in t.tolist()]
        per_round = [statistics.median([m for m, rr in zip(ms, c.rounds) if rr == r]) for r in range(a.rounds)]
        out[lib] = {"step_ms": ms, "median_ms": statistics.median(ms), "p10_ms": percentile(ms, 0.1),
                    "p90_ms": percentile(ms, 0.9), "round_median_ms": per_round, "buckets": c.buckets()}
    out["ratio_gloo_over_streamcoll"] = out["gloo"]["median_ms"] / out["streamcoll"]["median_ms"]
    out["round_ratios"] = [g / s for g, s in zip(out["gloo"]["round_median_ms"],
                                                 out["streamcoll"]["round_median_ms"])]

    # The differential check: same steps, same data -> same parameters;
    # then the same check on a copy perturbed on rank 0 must fail.
    sc, gl = copies["streamcoll"].flat(), copies["gloo"].flat()
    if a.inject_error and rank == 0:
        sc[sc.numel() // 2] += 1e-2
    out["check"] = dict(differential(sc, gl, gloo_pg), steps=copies["gloo"].done)
    bad = sc.clone()
    if rank == 0:
        bad[bad.numel() // 3] += 1e-2
    caught = differential(bad, gl, gloo_pg)
    out["check"]["catches_a_perturbed_parameter"] = not caught["allclose"] and not caught["identical_on_every_rank"][
        "streamcoll"]
    return out


def differential(sc: torch.Tensor, gl: torch.Tensor, gloo_pg: Any) -> Dict[str, Any]:
    """Compare the streamcoll copy's flat parameters ``sc`` with the gloo
    copy's ``gl`` (every rank), and each with rank 0's (over gloo)."""
    diff = (sc - gl).abs().max().item()
    close = bool(torch.allclose(sc, gl, rtol=1e-5, atol=1e-6))
    same_ranks = {}
    for lib, flat in (("streamcoll", sc), ("gloo", gl)):
        ref = flat.clone()
        dist.broadcast(ref, src=0, group=gloo_pg)
        bad = torch.tensor([0.0 if torch.equal(ref, flat) else 1.0])
        dist.all_reduce(bad, group=gloo_pg)
        same_ranks[lib] = bad.item() == 0.0
    ok = torch.tensor([1.0 if close else 0.0])
    dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=gloo_pg)
    d = torch.tensor([diff], dtype=torch.float64)
    dist.all_reduce(d, op=dist.ReduceOp.MAX, group=gloo_pg)
    return {"max_abs_diff": d.item(), "bitwise_equal": d.item() == 0.0, "allclose": ok.item() == 1.0,
            "identical_on_every_rank": same_ranks, "ok": ok.item() == 1.0 and all(same_ranks.values())}


def render(results: List[Dict[str, Any]], head: List[str]) -> str:
    lines = list(head)
    lines.append(f"{'model':>14s} {'lib':>10s} {'median ms':>10s} {'p10':>8s} {'p90':>8s} {'buckets':>8s}"
                 f" {'gloo/sc':>8s} {'per round gloo/sc':>24s}")
    for r in results:
        for lib in ("streamcoll", "gloo"):
            x = r[lib]
            ratio = f"{r['ratio_gloo_over_streamcoll']:8.2f}" if lib == "gloo" else " " * 8
            rounds = " ".join(f"{v:.2f}" for v in r["round_ratios"]) if lib == "gloo" else ""
            lines.append(f"{r['model']:>14s} {lib:>10s} {x['median_ms']:10.2f} {x['p10_ms']:8.2f} "
                         f"{x['p90_ms']:8.2f} {len(x['buckets']):8d} {ratio} {rounds:>24s}")
    for r in results:
        c = r["check"]
        lines.append(f"# check {r['model']}: {c['steps']} steps each; max |streamcoll - gloo| "
                     f"{c['max_abs_diff']:.3g} (bitwise equal: {c['bitwise_equal']}, allclose: {c['allclose']}); "
                     f"identical on every rank: {c['identical_on_every_rank']}; "
                     f"catches a perturbed parameter: {c['catches_a_perturbed_parameter']}; "
                     f"{'ok' if c['ok'] and c['catches_a_perturbed_parameter'] else 'FAILED'}")
    return "\n".join(lines) + "\n"


def main(argv: Any = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="demo,small-buckets", help="comma-separated: " + ", ".join(CONFIGS))
    ap.add_argument("--rounds", type=int, default=6, help="interleaved rounds (order alternates)")
    ap.add_argument("--steps", type=int, default=20, help="timed steps per library per round")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps per copy first")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="", help="also write PREFIX.txt and PREFIX.json")
    ap.add_argument("--inject-error", action="store_true",
                    help="perturb rank 0's streamcoll parameters before the check (it must fail)")
    a = ap.parse_args(argv)
    names = [m.strip() for m in a.models.split(",") if m.strip()]
    unknown = [m for m in names if m not in CONFIGS]
    if unknown:
        ap.error(f"--models: unknown {unknown}; known: {sorted(CONFIGS)}")
    if a.rounds < 1 or a.steps < 1 or a.warmup < 1:
        ap.error("--rounds, --steps and --warmup must be >= 1 (warm-up: DDP rebuilds its buckets after step 1)")

    torch.set_num_threads(1)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    load_before = os.getloadavg()
    import streamcoll
    from streamcoll.startup import env_defaults as sc_env

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    groups = {"gloo": dist.group.WORLD, "streamcoll": dist.new_group(backend="streamcoll")}
    t0 = time.time()
    results = [run_config(CONFIGS[m], a, groups, rank, world) for m in names]
    load_after = os.getloadavg()
    ok = all(r["check"]["ok"] and r["check"]["catches_a_perturbed_parameter"] for r in results)
    if rank == 0:
        head = [f"# DDP step time, {world} ranks, streamcoll backend vs gloo, same processes, interleaved: "
                f"{a.rounds} rounds x {a.steps} steps per library (after {a.warmup} untimed), slowest rank per step",
                f"# torch {torch.__version__}, streamcoll {streamcoll.__version__}; torch threads 1; "
                f"load average before {tuple(round(v, 2) for v in load_before)}, "
                f"after {tuple(round(v, 2) for v in load_after)}; {time.time() - t0:.1f} s",
                "# streamcoll applied: " + " ".join(f"{k}={v}" for k, v in sorted(sc_env.APPLIED.items())),
                "# command: " + " ".join([os.path.basename(sys.argv[0])] + sys.argv[1:])]
        for m in names:
            head.append(f"# {m}: {CONFIGS[m].what}")
        text = render(results, head) + ("OK\n" if ok else "FAILED\n")
        sys.stdout.write(text)
        sys.stdout.flush()
        if a.out:
            os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
            with open(a.out + ".txt", "w") as f:
                f.write(text)
            with open(a.out + ".json", "w") as f:
                json.dump({"meta": {"world_size": world, "rounds": a.rounds, "steps": a.steps, "warmup": a.warmup,
                                    "argv": sys.argv[1:], "loadavg_before": load_before,
                                    "loadavg_after": load_after, "torch": torch.__version__,
                                    "applied": dict(sc_env.APPLIED)},
                           "results": results, "ok": ok}, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
