"""What ``Work.get_future()`` costs, this tree against a git revision, A/B in
one process (world size 1, oneCCL on the CPU, watchdog off).

The revision's ``Work.get_future`` and ``AsyncLaunch._complete_future_when_done``
(their source from git, compiled in the same modules) take turns with this
tree's, block by block (the order alternating). Three figures, small
(8-byte) all_reduce:

- ``done``: ``get_future()`` of a call already waited, the fastest call of
  each block (no preemption; the Work made and waited outside the timing);
- ``pending``: ``get_future()`` right after the async call, the same;
- ``round trip``: async call + ``get_future()`` + ``wait()`` on the future,
  the block's mean (comm thread, callback thread, wake-ups: load-sensitive).

Usage: ``PYTHONPATH=. python benchmarks/get_future_cost.py [--rev main] [--n 2000] [--rounds 31]``.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import textwrap
import time

os.environ.setdefault("STREAMCOLL_WATCHDOG", "off")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import streamcoll  # noqa: E402
from streamcoll.core import async_launch as A, work as W  # noqa: E402
from streamcoll.core.callbacks import CALLBACKS  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def method(rev: str, path: str, name: str, mod) -> object:
    src = subprocess.run(["git", "-C", ROOT, "show", f"{rev}:{path}"], capture_output=True, text=True,
                         check=True).stdout.split("\n")
    i = next(k for k, ln in enumerate(src) if ln.startswith(f"    def {name}("))
    j = next((k for k in range(i + 1, len(src)) if src[k].startswith(("    def ", "class "))), len(src))
    ns: dict = {}
    exec(compile(textwrap.dedent("\n".join(src[i:j])), f"<{rev}:{path}>", "exec"), mod.__dict__, ns)
    return ns[name]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rev", default="main")
    ap.add_argument("--n", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=31)
    a = ap.parse_args()
    c = streamcoll.new_communicator(backend="oneccl", device="cpu", rank=0, world_size=1,
                                    store=dist.HashStore(), name="get-future-cost")
    impl = {a.rev: (method(a.rev, "streamcoll/core/work.py", "get_future", W),
                    method(a.rev, "streamcoll/core/async_launch.py", "_complete_future_when_done", A)),
            "tree": (W.Work.get_future, A.AsyncLaunch._complete_future_when_done)}
    t = torch.ones(2)
    pc = time.perf_counter_ns

    def use(k: str) -> None:
        W.Work.get_future, type(c)._complete_future_when_done = impl[k]

    def settle() -> None:
        while CALLBACKS._queue or CALLBACKS._owner is not None:
            time.sleep(0.001)

    def done() -> float:
        settle()
        best = 1 << 62
        for _ in range(a.n):
            w = c.all_reduce(t, async_op=True)
            w.wait()
            t0 = pc(); w.get_future(); dt = pc() - t0
            best = min(best, dt)
        return best / 1e3

    def pending() -> float:
        settle()
        best = 1 << 62
        for _ in range(a.n):
            w = c.all_reduce(t, async_op=True)
            t0 = pc(); f = w.get_future(); dt = pc() - t0
            f.wait()
            best = min(best, dt)
        return best / 1e3

    def round_trip() -> float:
        settle()
        t0 = pc()
        for _ in range(a.n // 4):
            c.all_reduce(t, async_op=True).get_future().wait()
        return (pc() - t0) / (a.n // 4) / 1e3

    for fig, fn in (("done", done), ("pending", pending), ("round trip", round_trip)):
        res = {k: [] for k in impl}
        for r in range(a.rounds + 1):
            for k in (list(impl) if r % 2 else list(impl)[::-1]):
                use(k)
                v = fn()
                if r:
                    res[k].append(v)
        d = [y - x for x, y in zip(res[a.rev], res["tree"])]
        q = statistics.quantiles(d, n=4)
        print(f"{fig:10s} {a.rev}: {statistics.median(res[a.rev]):.3f} us, tree: {statistics.median(res['tree']):.3f} us; "
              f"tree - {a.rev}, paired: median {statistics.median(d) * 1000:+.0f} ns, quartiles "
              f"{q[0] * 1000:+.0f} / {q[2] * 1000:+.0f} ns ({a.rounds} pairs of {a.n}-call blocks)", flush=True)
    use("tree")
    c.destroy()


if __name__ == "__main__":
    main()
