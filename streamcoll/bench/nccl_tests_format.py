"""The sweep's rows printed as NVIDIA/nccl-tests prints its results, so that
scripts written for nccl-tests output (``all_reduce_perf`` and friends) read
them unchanged (``python -m streamcoll.bench --format nccl-tests``).

What nccl-tests prints, and so what this prints, per test: a ``#`` header
(parameters, the ranks and their devices), the two column header lines,
one line per size::

    size count type redop root | time algbw busbw #wrong (out-of-place) | time algbw busbw #wrong (in-place)

then ``# Out of bounds values : N OK|FAILED`` and ``# Avg bus bandwidth :
X``. Widths follow nccl-tests' (``%12li %12li %8s %6s %6i``, then per
placement ``%7s %6.2f %6.2f %5s``, two spaces between), and so does the
time's precision (2 decimals below 100 us, 1 below 10 ms, none above).

One nccl-tests run measures one system; the sweep measures several in the
same processes, so it prints one such block per system and collective, each
headed ``# Collective test starting: <collective>_perf`` and
``# System: <name>``, as if each had been a run of its own.

Placement. nccl-tests times each collective out of place and in place; the
sweep times the placement each API has: all_reduce, broadcast and reduce in place
(torch.distributed's in-place signatures, mpi4py's ``MPI.IN_PLACE``), the
others out of place. The placement not measured is printed ``N/A`` in every
column, which is what nccl-tests itself prints for ``#wrong`` when it did
not check.
"""
from __future__ import annotations

import os
import socket
from typing import Any, Dict, Iterable, List, Optional

from ..core import spec

__all__ = ["NCCL_TESTS_NAME", "TYPE_NAME", "IN_PLACE", "fmt_time", "block", "blocks", "rank_lines"]

# NCCL's C function -> nccl-tests' binary name (without ``_perf``): nccl-tests
# times NCCL's functions, so a collective's name there follows its NCCL
# function (streamcoll.core.spec); the benchmarks' send/recv pair is "sendrecv".
_NCCL_TESTS_BY_C = {
    "ncclAllReduce": "all_reduce", "ncclAllGather": "all_gather", "ncclReduceScatter": "reduce_scatter",
    "ncclBroadcast": "broadcast", "ncclReduce": "reduce", "ncclAlltoAll": "alltoall",
    "ncclGather": "gather", "ncclScatter": "scatter",
}
NCCL_TESTS_NAME = {
    **{n: _NCCL_TESTS_BY_C[s.c["nccl"]] for n, s in spec.TABLE.items() if s.c.get("nccl") in _NCCL_TESTS_BY_C},
    "sendrecv": "sendrecv",
}
# torch dtype name -> nccl-tests' type column.
TYPE_NAME = {
    "int8": "int8", "uint8": "uint8", "int32": "int32", "uint32": "uint32", "int64": "int64",
    "uint64": "uint64", "float16": "half", "float32": "float", "float64": "double", "bfloat16": "bfloat16",
}
# Collectives the sweep times in place (one buffer is the C call's send and
# receive buffer; the rest: out of place), and those that reduce.
IN_PLACE = frozenset(n for n, s in spec.TABLE.items() if s.send is not None and s.send == s.recv)
_REDUCING = frozenset(n for n, s in spec.TABLE.items() if s.reduces)

SYSTEM_LABEL = {"streamcoll": "streamcoll", "raw": "raw C call (streamcoll's binding)",
                "torch": "torch.distributed", "mpi": "MPI (mpi4py)"}


def fmt_time(us: float) -> str:
    """nccl-tests' time column: 7 wide, fewer decimals as it grows."""
    if us >= 10000.0:
        return f"{us:7.0f}"
    if us >= 100.0:
        return f"{us:7.1f}"
    return f"{us:7.2f}"


def _placement(lib: Optional[Dict[str, Any]], wrong: Optional[int]) -> str:
    if lib is None:
        return f"  {'N/A':>7s}  {'N/A':>6s}  {'N/A':>6s}  {'N/A':>5s}"
    w = "N/A" if wrong is None else str(wrong)
    return f"  {fmt_time(lib['time_us']['median'])}  {lib['algbw']:6.2f}  {lib['busbw']:6.2f}  {w:>5s}"


def _root(coll: str) -> int:
    """The root the sweep uses (its default), -1 for collectives without one."""
    s = spec.TABLE.get(coll)
    return s.param(s.root).default if s is not None and s.root else -1


def rank_lines(rank: int, size: int, device: str, what: str) -> Dict[str, Any]:
    """This rank's entry for the ``# Using devices`` list (gathered to rank 0)."""
    return {"rank": rank, "pid": os.getpid(), "host": socket.gethostname(), "device": device, "what": what}


def block(rows: List[Dict[str, Any]], lib: str, meta: Dict[str, Any]) -> List[str]:
    """One nccl-tests block: the rows (one collective, dtype, async mode, in
    size order) as measured for system ``lib``."""
    coll = rows[0]["collective"]
    name = NCCL_TESTS_NAME.get(coll, coll)
    label = SYSTEM_LABEL.get(lib, lib)
    if lib == "torch":
        label += f" ({meta.get('baseline', '?')})"
    if lib == "mpi" and meta.get("mpi"):
        label += f", {meta['mpi']}"
    a = meta.get("args", {})
    out = [f"# Collective test starting: {name}_perf",
           f"# System: {label}",
           f"# nThread 1 nGpus 1 minBytes {rows[0]['bytes']} maxBytes {rows[-1]['bytes']} "
           f"step: {a.get('factor', 4)}(factor) warmup iters: {rows[0].get('warmup', 0)} "
           f"iters: {rows[0].get('iters', 0)} agg iters: 1 validation: 1 graph: 0",
           "#", "# Using devices"]
    for r in meta.get("ranks", []):
        out.append(f"#  Rank {r['rank']:2d} Group  0 Pid {r['pid']:6d} on {r['host']:>10s} device  0 "
                   f"[{r['device']}] {r['what']}")
    out += ["#",
            f"# {'':>10s}  {'':>12s}  {'':>8s}  {'':>6s}  {'':>6s}  {'out-of-place':^29s}  {'in-place':^29s}",
            f"# {'size':>10s}  {'count':>12s}  {'type':>8s}  {'redop':>6s}  {'root':>6s}  "
            f"{'time':>7s}  {'algbw':>6s}  {'busbw':>6s} {'#wrong':>6s}  "
            f"{'time':>7s}  {'algbw':>6s}  {'busbw':>6s} {'#wrong':>6s}",
            f"# {'(B)':>10s}  {'(elements)':>12s}  {'':>8s}  {'':>6s}  {'':>6s}  "
            f"{'(us)':>7s}  {'(GB/s)':>6s}  {'(GB/s)':>6s}  {'':>5s}  "
            f"{'(us)':>7s}  {'(GB/s)':>6s}  {'(GB/s)':>6s}  {'':>5s}"]
    wrong_total = 0
    bws: List[float] = []
    for r in rows:
        m = r["libs"].get(lib)
        wrong = r.get("wrong", {}).get(lib)
        if m is not None:
            bws.append(m["busbw"])
            wrong_total += wrong or 0
        inplace = coll in IN_PLACE
        line = (f"{r['bytes']:12d}  {r['count']:12d}  {TYPE_NAME.get(r['dtype'], r['dtype']):>8s}  "
                f"{'sum' if coll in _REDUCING else 'none':>6s}  {_root(coll):6d}")
        line += _placement(None if inplace else m, wrong) + _placement(m if inplace else None, wrong)
        out.append(line)
    ok = "OK" if wrong_total == 0 else "FAILED"
    avg = sum(bws) / len(bws) if bws else 0.0
    out += [f"# Out of bounds values : {wrong_total} {ok}", f"# Avg bus bandwidth    : {avg:g} ", "#"]
    return out


def blocks(rows: List[Dict[str, Any]], libs: Iterable[str], meta: Dict[str, Any]) -> List[str]:
    """One block per system in ``libs`` that has at least one of ``rows``."""
    out: List[str] = []
    for lib in libs:
        if any(lib in r["libs"] for r in rows):
            out += block(rows, lib, meta)
    return out
