"""What a plan keeps (``Plan.keep``, streamcoll.core.spec): the tensors the call
uses, on every rank, root or not (a scatter's, below; an all_gather's input
at the end).

``Plan.keep`` has two roles. Lifetime: on a GPU the Work, the Reaper or
``record_stream`` hold these tensors until the comm stream is done with
them. On the CPU that role cannot be observed for a scatter's receiver:
the queued item holds the whole plan until the C call returned, and the
plan's ``outputs`` are the same tensor (a non-root rank's keep and outputs
are both ``(tensor,)``), so dropping it from ``keep`` changes no lifetime.
Description: the flight record takes an async entry's tensors, and a
running synchronous call's, from ``keep`` (streamcoll.core.recorder); they are
the shapes a dump and a hang's diagnosis show. That role is observable on
the CPU, and is what this test checks: a plan that keeps nothing (the
mutation check's ``scatter: keep-alive skipped``) leaves the receiving
rank's entries without tensors.

Real oneCCL ranks."""
from __future__ import annotations

import threading
import time
from typing import Any, Dict, List, Optional

import torch

from streamcoll.diagnostics import flight

from conftest import needs_oneccl

pytestmark = [needs_oneccl]

N = 6


def _entry(comm: Any, seq: int) -> Optional[Dict[str, Any]]:
    es = [e for e in flight.snapshot(comm)["entries"] if e["seq"] == seq]
    assert len(es) <= 1, (seq, es)
    return es[0] if es else None


def _scatter_records(comm: Any) -> Dict[str, Any]:
    """An async scatter from rank 0 (its entry read after the wait, the
    tensors alive), then a synchronous scatter from rank 0 that rank 0
    starts 2 s late: rank 1's entry is read while its call runs (the
    first snapshot that shows it running)."""
    r, n = comm.rank, comm.size
    out: Dict[str, Any] = {}
    t = torch.zeros(N)
    lst = [torch.full((N,), float(p + 1)) for p in range(n)] if r == 0 else None
    w = comm.scatter(t, lst, 0, async_op=True)
    w.wait()
    assert t.tolist() == [float(r + 1)] * N, t
    out["async"] = _entry(comm, w.seq)
    assert out["async"] is not None

    t2 = torch.zeros(N)
    lst2 = [torch.full((N,), float(p + 10)) for p in range(n)] if r == 0 else None
    seq = comm.seq + 1
    seen: List[Dict[str, Any]] = []
    if r == 0:
        time.sleep(2.0)
    else:
        def look() -> None:
            deadline = time.monotonic() + 1.5  # rank 1 is in its call, waiting for the root
            while time.monotonic() < deadline:
                e = _entry(comm, seq)
                if e is not None and e["state"] == "running":
                    seen.append(e)
                    return
                time.sleep(0.01)
        th = threading.Thread(target=look)
        th.start()
    comm.scatter(t2, lst2, 0)
    if r != 0:
        th.join(10)
        out["running"] = seen[0] if seen else None
    assert t2.tolist() == [float(r + 10)] * N, t2
    return out


def test_every_rank_s_flight_record_names_the_tensors_of_its_scatter(world2):
    """Seen failing with the mutation check's ``scatter: keep-alive skipped``
    applied (the non-root plan keeps ``()``): rank 1's async entry and its
    running synchronous entry had ``shapes == []``, where each must name the
    tensor it receives into ([6])."""
    res = world2.run(_scatter_records, timeout=60)
    for r, out in enumerate(res):
        e = out["async"]
        assert e["op"] == "scatter" and e["state"] == "completed", (r, e)
        assert [N] in e["shapes"] and "float32" in e["dtypes"], (r, e)
    e = res[1]["running"]
    assert e is not None and e["op"] == "scatter" and e["state"] == "running", e
    assert e["shapes"] == [[N]] and e["dtypes"] == ["float32"], e


# ------------------------------------- all_gather: the input's lifetime
def _temporary_input(comm: Any) -> Dict[str, Any]:
    """An async all_gather of a temporary input (nothing but the call holds
    it after the issue), its memory handed out again at once and
    overwritten, the peer 50 ms late: the call must still send the input's
    values. The queued item holds the plan, whose C arguments are bare
    pointers; ``Plan.keep`` is what holds the input (seen failing with the
    mutation check's ``all_gather: keep-alive skipped``: rank 0's slot
    gathered -7s)."""
    r, n = comm.rank, 4096  # 16 KB: queued quietly, its C call at most 1 ms after the issue
    outs = [torch.zeros(n) for _ in range(comm.size)]
    if r == 1:
        time.sleep(0.05)
    w = comm.all_gather(outs, torch.full((n,), float(r + 1)), async_op=True)
    junk = [torch.full((n,), -7.0) for _ in range(32)]  # the freed input's memory, reused and overwritten
    w.wait()
    del junk
    return {"got": [sorted(set(o.tolist())) for o in outs]}


def test_an_async_all_gather_keeps_a_temporary_input_alive(world2):
    res = world2.run(_temporary_input, timeout=60)
    for r, x in enumerate(res):
        assert x["got"] == [[1.0], [2.0]], (r, res)
