"""The small-async threshold (issues 25 and 33): up to where a CPU
``async_op=True`` call should be queued quietly (no comm-thread wake-up;
``wait()`` runs it on the calling thread, see ``streamcoll/core/work.py``) rather
than handed to the comm thread at once.

Per message size, in the same processes and interleaved round by round:
``sync`` (``comm.all_reduce(t)``), ``handoff`` (``all_reduce(t,
async_op=True).wait()`` on a communicator made with
``STREAMCOLL_INLINE_ASYNC_BYTES=0``: the comm thread, woken) and
``small`` (the same on a communicator with the threshold above every size
here: queued quietly; before issue 33 it ran inline). The hand-off's cost
is ``handoff - sync``. The small strategy saves most of that cost and gives
up overlapping the call with compute, which can win back at most the
call's own time (``sync``): it is right while ``handoff - sync >= sync``.
The threshold printed is the largest size where that held in the median,
rounded down to a power of two; the default
(``streamcoll.core.communicator.INLINE_ASYNC_BYTES``) was set from it.

    torchrun --nproc-per-node 2 benchmarks/inline_async.py
    python benchmarks/inline_async.py                       # world size 1
    torchrun --nproc-per-node 2 benchmarks/inline_async.py --out benchmarks/results/inline_async_2ranks

Prints (rank 0) per size the medians over rounds of the per-call times, in
microseconds; ``--out PREFIX`` also writes PREFIX.txt and PREFIX.json.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
from typing import Callable, Dict, List

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

from common import per_call_us as _per_call, single_process_defaults, write_out  # noqa: E402

SIZES = (4, 64, 1024, 4096, 16384, 65536, 262144, 1048576)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--budget-us", type=float, default=60000.0, help="time per (size, variant, round), about")
    ap.add_argument("--sizes", default=",".join(map(str, SIZES)), help="message sizes in bytes")
    ap.add_argument("--out", default="", help="write PREFIX.txt and PREFIX.json")
    a = ap.parse_args(argv)
    single_process_defaults(29571)
    import torch
    import streamcoll

    sizes = [int(s) for s in a.sizes.split(",")]
    world = streamcoll.init()
    os.environ["STREAMCOLL_INLINE_ASYNC_BYTES"] = "0"
    hand = world.split(0)
    os.environ["STREAMCOLL_INLINE_ASYNC_BYTES"] = str(max(sizes))
    inl = world.split(0)
    del os.environ["STREAMCOLL_INLINE_ASYNC_BYTES"]
    assert hand.inline_async_bytes == 0 and inl.inline_async_bytes == max(sizes)
    rank, n = world.rank, world.size
    variants: Dict[str, Callable[[torch.Tensor], object]] = {
        "sync": lambda t: inl.all_reduce(t),
        "handoff": lambda t: hand.all_reduce(t, async_op=True).wait(),
        "small": lambda t: inl.all_reduce(t, async_op=True).wait(),
    }
    bufs = {s: torch.ones(max(1, s // 4)) for s in sizes}
    # calls per measurement: from a first timing, so each takes about the budget (same on every rank)
    calls: Dict[int, int] = {}
    for s in sizes:
        t = bufs[s]
        for f in variants.values():
            _per_call(lambda: f(t), 20)
        per = _per_call(lambda: variants["handoff"](t), 50)
        c = torch.tensor([max(20, min(20000, int(a.budget_us / max(per, 1e-3))))])
        world.all_reduce(c, op=streamcoll.ReduceOp.MIN)
        calls[s] = int(c.item())
    times: Dict[int, Dict[str, List[float]]] = {s: {v: [] for v in variants} for s in sizes}
    for _ in range(a.rounds):
        for s in sizes:
            t = bufs[s]
            for v, f in variants.items():
                world.barrier()
                x = torch.tensor([_per_call(lambda: f(t), calls[s])])
                world.all_reduce(x)
                times[s][v].append(x.item() / n)
    # the small strategy's values are right at every size
    for s in sizes:
        t = torch.ones(max(1, s // 4))
        variants["small"](t)
        assert torch.all(t == n), (s, t[:2])
    if rank == 0:
        load = os.getloadavg()[0]
        lines = [f"# small vs hand-off, {n} rank(s), load {load:.2f}, medians of {a.rounds} rounds, us per call",
                 f"{'bytes':>8} {'sync':>9} {'handoff':>9} {'small':>9} {'handoff-sync':>13} {'small wins':>12} "
                 f"{'small/sync':>11}"]
        rows = []
        for s in sizes:
            m = {v: statistics.median(times[s][v]) for v in variants}
            cost = m["handoff"] - m["sync"]
            wins = cost >= m["sync"]
            rows.append({"bytes": s, **{k: round(v, 2) for k, v in m.items()}, "handoff_cost": round(cost, 2),
                         "small_wins": wins, "rounds": {k: [round(x, 2) for x in v] for k, v in times[s].items()}})
            lines.append(f"{s:>8} {m['sync']:>9.1f} {m['handoff']:>9.1f} {m['small']:>9.1f} {cost:>13.1f} "
                         f"{'yes' if wins else 'no':>12} {m['small'] / m['sync']:>11.2f}")
        # the largest size below which inline won at every size, as a power of two
        thr = 0
        for r in rows:
            if not r["small_wins"]:
                break
            thr = r["bytes"]
        thr = 1 << (thr.bit_length() - 1) if thr else 0
        lines.append(f"threshold: {thr} bytes (small wins at every size up to it)")
        text = "\n".join(lines)
        print(text, flush=True)
        if a.out:
            write_out(a.out, text, {"world_size": n, "load": load, "rows": rows, "threshold": thr})
    hand.destroy()
    inl.destroy()
    streamcoll.destroy()
    return 0


if __name__ == "__main__":
    sys.exit(main())
