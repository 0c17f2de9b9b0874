"""Where ``dist.all_reduce`` on the streamcoll backend spends its time, line
by line (issue 35): each statement of the generated
``ProcessGroupStreamcoll.allreduce`` timed on its own, with the objects a
real call has, beside the whole call, the communicator call inside it and
the do-nothing Python backend (the floor of any Python process group), and
the same for ``async_op=True`` plus ``wait()`` (with the wrapper Work's own
frame), all in one process, interleaved round by round.

    python benchmarks/pg_lines.py --rounds 7 --out benchmarks/results/paths/pg_lines

World size 1 (the per-line costs do not depend on the peers). Prints the
minimum and median over rounds, microseconds per execution; the lines' sum
against "whole method - communicator call" shows what the table misses
(the method's own call and return).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import timeit
from typing import Dict, List

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import single_process_defaults, write_out  # noqa: E402
from paths import _register_nothing  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--number", type=int, default=20000, help="executions per row and round")
    ap.add_argument("--out", default="")
    a = ap.parse_args(argv)
    single_process_defaults(29587)
    import torch
    import torch.distributed as dist
    import streamcoll  # noqa: F401  (registers the backend)
    from streamcoll.integrations.process_group import StreamcollWork, _ROPTS

    dist.init_process_group("streamcoll", rank=0, world_size=1)
    nothing = dist.new_group(backend=_register_nothing(dist))
    pg = dist.distributed_c10d._get_default_group()
    t = torch.ones(1)
    dist.all_reduce(t)  # the communicator exists: the fast path's state
    c = pg._fast_cpu
    o = dist.AllreduceOptions()
    o.reduceOp = dist.ReduceOp.SUM
    o.asyncOp = False
    oa = dist.AllreduceOptions()
    oa.reduceOp = dist.ReduceOp.SUM
    oa.asyncOp = True
    done = c.all_reduce(t, dist.ReduceOp.SUM, True)  # a completed streamcoll Work: wait() returns at once
    done.wait()
    wrapped = StreamcollWork()
    wrapped._work = done
    g = {"dist": dist, "oa": oa, "done": done, "wrapped": wrapped, "pg": pg, "nothing": nothing, "t": t, "tensors": [t], "c": c, "opts": o,
         "_SUM": dist.ReduceOp.SUM, "_ROPTS": _ROPTS, "_Tensor": torch.Tensor, "_Work": StreamcollWork,
         "w": StreamcollWork(), "self": pg, "timeout": None}
    rows: Dict[str, str] = {
        "dist.all_reduce(t), streamcoll": "dist.all_reduce(t)",
        "dist.all_reduce(t), do-nothing Python backend": "dist.all_reduce(t, group=nothing)",
        "pg.allreduce([t], opts) (the method alone)": "pg.allreduce(tensors, opts)",
        "c.all_reduce(t, SUM, False) (its communicator call)": "c.all_reduce(t, _SUM, False)",
        "line: tensor = tensors[0] if type(...) is list and len(...) == 1": 
            "tensor = tensors[0] if type(tensors) is list and len(tensors) == 1 else None",
        "line: op = _SUM if type(opts) in _ROPTS and opts.reduceOp == _SUM":
            "op = _SUM if type(opts) in _ROPTS and opts.reduceOp == _SUM else None",
        "line: type(tensor) is _Tensor and (c := self._fast_cpu if is_cpu ...)":
            "type(t) is _Tensor and (cc := self._fast_cpu if t.is_cpu else None) is not None",
        "line: self._last_comm = c": "self._last_comm = c",
        "line: w = _Work() (torch's constructor)": "w = _Work()",
        "line: getattr(opts, 'asyncOp', True)": "getattr(opts, 'asyncOp', True)",
        "line: w._work = ...; w._outputs = [tensor]; w._op = ...": "w._work = None; w._outputs = [t]; w._op = 'x'",
        "line: return w if timeout is None else ...": "w if timeout is None else None",
        "torch's wait() on the returned Work": "w.wait()",
        # async + wait (issue 35's "async the same"): the whole, its parts, the wrapper's wait frame
        "async: dist.all_reduce(t, async_op=True).wait(), streamcoll": "dist.all_reduce(t, async_op=True).wait()",
        "async: the same, do-nothing Python backend": "dist.all_reduce(t, group=nothing, async_op=True).wait()",
        "async: pg.allreduce([t], opts).wait() (the method alone)": "pg.allreduce(tensors, oa).wait()",
        "async: c.all_reduce(t, SUM, True).wait() (its communicator call)": "c.all_reduce(t, _SUM, True).wait()",
        "async line: StreamcollWork.wait() over a completed Work": "wrapped.wait()",
        "async line: that Work's own wait()": "done.wait()",
        "control: an empty statement": "pass",
    }
    times: Dict[str, List[float]] = {k: [] for k in rows}
    timers = {k: timeit.Timer(s, globals=g) for k, s in rows.items()}
    for tm in timers.values():
        tm.timeit(1000)
    for _ in range(a.rounds):
        for k, tm in timers.items():
            times[k].append(tm.timeit(a.number) / a.number * 1e6)
    load = os.getloadavg()[0]
    med = {k: statistics.median(v) for k, v in times.items()}
    lines = [f"# ProcessGroupStreamcoll.allreduce line by line, world size 1, load {load:.2f}, "
             f"{a.rounds} rounds x {a.number}; us per execution, min / median"]
    lines += [f"{k:<72} {min(v):7.3f} {med[k]:7.3f}" for k, v in times.items()]
    ln = [k for k in rows if k.startswith("line:")]
    own = med["pg.allreduce([t], opts) (the method alone)"] - med["c.all_reduce(t, SUM, False) (its communicator call)"]
    lines.append(f"{'sum of the lines (medians)':<72} {'':7} {sum(med[k] for k in ln):7.3f}")
    lines.append(f"{'method - communicator call (medians)':<72} {'':7} {own:7.3f}")
    aown = med["async: pg.allreduce([t], opts).wait() (the method alone)"] \
        - med["async: c.all_reduce(t, SUM, True).wait() (its communicator call)"]
    lines.append(f"{'async: method + wait - communicator call + wait (medians)':<72} {'':7} {aown:7.3f}")
    over = med["async: dist.all_reduce(t, async_op=True).wait(), streamcoll"] - (
        med["async: the same, do-nothing Python backend"]
        + med["async: c.all_reduce(t, SUM, True).wait() (its communicator call)"])
    lines.append(f"{'async: dist - (do-nothing + communicator) (medians; goal <= 2)':<72} {'':7} {over:7.3f}")
    text = "\n".join(lines)
    print(text, flush=True)
    if a.out:
        write_out(a.out, text, {"load": load, "rows": {k: [round(x, 4) for x in v] for k, v in times.items()}})
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
