"""Issue 25's table: a 1-element float32 all_reduce by every path a program
or a framework takes, in one process, interleaved round by round.

Rows: the raw C call (streamcoll's cffi binding, the communicator's handle),
``comm.all_reduce(t)``, ``dist.all_reduce(t)`` on the ``"streamcoll"``
backend, on torch's ``fake`` backend (torch's own dispatch, no
communication; world size 1 only), on two Python backends that are the
controls of the process-group rows (issue 35: one does nothing, the other
makes the raw C call and nothing else, the floor of any Python backend over
oneCCL) and on gloo, then the async forms (``...(t, async_op=True).wait()``). One process group per backend in the
same processes (the default one is streamcoll's; gloo and fake are
``new_group``s), so every row sees the same machine state.

    python benchmarks/paths.py                                  # world size 1
    torchrun --nproc-per-node 2 benchmarks/paths.py
    PYTHONPATH=/path/to/other/checkout python benchmarks/paths.py --label before

Prints on rank 0, per row, the minimum and median over rounds of the
per-call time (microseconds, averaged over ranks); ``--out PREFIX`` writes
PREFIX.txt and PREFIX.json. Runs against any streamcoll checkout on
PYTHONPATH (it uses only the public API, the communicator's handle and the
binding), so two trees can be compared on one machine.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
from typing import Callable, Dict, List

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import per_call_us as _per_call, single_process_defaults, write_out  # noqa: E402


def _register_nothing(dist, call=None, name: str = "nothing") -> str:
    """A ``torch.distributed`` backend in Python that communicates nothing:
    the control for the process-group rows (what torch's Python dispatch, a
    Python ``ProcessGroup`` and a ``_Work`` cost with no library behind
    them). With ``call``, its ``allreduce`` calls ``call()`` (the raw C call)
    and nothing else: the floor of any Python backend over that call,
    including what torch's code costs when it runs right after oneCCL's
    (issue 35). Its name."""

    class _Done(dist._Work):
        def wait(self, timeout=None):
            return True

        def is_completed(self):
            return True

        def is_success(self):
            return True

    class _Nothing(dist.ProcessGroup):
        if call is None:
            def allreduce(self, tensors, opts=None):
                return _Done()
        else:
            def allreduce(self, tensors, opts=None):
                call()
                return _Done()

        def getBackendName(self):
            return name

    if name.upper() not in getattr(dist.Backend, "_plugins", {}):
        dist.Backend.register_backend(name, lambda store, rank, size, timeout=None: _Nothing(rank, size),
                                      devices=["cpu"])
    return name


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--calls", type=int, default=3000, help="calls per row and round (async rows: a third)")
    ap.add_argument("--label", default="", help="a name for this tree in the output")
    ap.add_argument("--out", default="")
    a = ap.parse_args(argv)
    single_process_defaults(29583)
    import torch
    import torch.distributed as dist
    import streamcoll

    rank, n = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("streamcoll", rank=rank, world_size=n)
    gloo = dist.new_group(backend="gloo")
    fake = None
    if n == 1:
        try:
            from torch.testing._internal.distributed.fake_pg import FakeStore  # noqa: F401  (registers "fake")
            fake = dist.new_group(backend="fake")
        except Exception as e:  # pragma: no cover - torch without the fake backend
            print(f"(no fake backend: {type(e).__name__}: {e})", file=sys.stderr)
    nothing = dist.new_group(backend=_register_nothing(dist))
    comm = streamcoll.new_communicator(backend="oneccl", device="cpu", name="paths")
    t = torch.ones(1)
    lib, h = comm._lib, comm._handle
    ffi = comm._ffi
    ptr = ffi.cast("void *", t.data_ptr())
    dt = comm._backend.dtypes[torch.float32]
    op = comm._backend.ops["SUM"]
    null = ffi.NULL
    raw_fn = getattr(lib, comm._backend.funcs["all_reduce"])

    raw = dist.new_group(backend=_register_nothing(dist, lambda: raw_fn(ptr, ptr, 1, dt, op, h, null), "rawcall"))
    rows: Dict[str, Callable[[], object]] = {
        "raw C call": lambda: raw_fn(ptr, ptr, 1, dt, op, h, null),
        "comm.all_reduce(t)": lambda: comm.all_reduce(t),
        "dist.all_reduce(t) on streamcoll": lambda: dist.all_reduce(t),
    }
    if fake is not None:
        rows["dist.all_reduce(t) on fake"] = lambda: dist.all_reduce(t, group=fake)
    # the floor of any Python backend (issue 35): torch's dispatch to a Python ProcessGroup whose
    # allreduce does nothing and returns a completed Work; every row beside it in the same run
    rows["dist.all_reduce(t) on a do-nothing Python PG"] = lambda: dist.all_reduce(t, group=nothing)
    # ... and whose allreduce makes the raw C call: any Python backend over oneCCL's call, at its floor
    rows["dist.all_reduce(t) on a raw-C-call Python PG"] = lambda: dist.all_reduce(t, group=raw)
    rows["dist.all_reduce(t) on gloo"] = lambda: dist.all_reduce(t, group=gloo)
    asyncs = {
        "comm.all_reduce(t, async_op=True).wait()": lambda: comm.all_reduce(t, async_op=True).wait(),
        "dist async + wait on streamcoll": lambda: dist.all_reduce(t, async_op=True).wait(),
        "dist async + wait on a do-nothing Python PG": lambda: dist.all_reduce(t, group=nothing,
                                                                             async_op=True).wait(),
        "dist async + wait on gloo": lambda: dist.all_reduce(t, group=gloo, async_op=True).wait(),
    }
    rows.update(asyncs)
    times: Dict[str, List[float]] = {k: [] for k in rows}
    for f in rows.values():  # warm-up
        _per_call(f, 100)
    for _ in range(a.rounds):
        for k, f in rows.items():
            dist.barrier()
            x = torch.tensor([_per_call(f, a.calls // 3 if k in asyncs else a.calls)])
            dist.all_reduce(x, group=gloo)
            times[k].append(x.item() / n)
    if rank == 0:
        load = os.getloadavg()[0]
        head = f"# {a.label or 'this tree'}: 1-element float32 all_reduce, {n} rank(s), load {load:.2f}, " \
               f"{a.rounds} rounds x {a.calls} calls; us per call, min / median"
        lines = [head] + [f"{k:<45} {min(v):8.2f} {statistics.median(v):8.2f}" for k, v in times.items()]
        text = "\n".join(lines)
        print(text, flush=True)
        if a.out:
            write_out(a.out, text, {"label": a.label, "world_size": n, "load": load,
                                    "rows": {k: [round(x, 3) for x in v] for k, v in times.items()}})
    comm.destroy()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
