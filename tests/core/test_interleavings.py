"""Shuffle the interleavings (issue 33): the two-thread and two-communicator
scenarios rerun with random short sleeps injected at line events in
streamcoll's code, on every thread (the caller's, the comm threads', the
callback thread), several seeds, values compared with gloo in the same
processes. Real oneCCL, 2 ranks; every rank issues its calls in one program
order (the rule), the sleeps move everything streamcoll does around them.
"""
from __future__ import annotations

import os
import random
import sys
import threading
import time
from datetime import timedelta
from typing import Any, Dict, List

import pytest
import torch
import torch.distributed as dist

import streamcoll
from conftest import needs_oneccl

SEEDS = (1, 2, 3, 4, 5, 6)
_STATE: Dict[str, Any] = {}


class Shuffler:
    """``sys.settrace``/``threading.settrace``: at a line event in a
    streamcoll frame, with probability ``p``, sleep up to ``max_s``."""

    def __init__(self, seed: int, p: float = 0.05, max_s: float = 0.0005) -> None:
        self.pkg = os.path.dirname(os.path.abspath(streamcoll.__file__)) + os.sep
        self.rng = random.Random(seed)
        self.p = p
        self.max_s = max_s
        self.sleeps = 0

    def _global(self, frame, event, arg):
        f = frame.f_code.co_filename
        if event == "call" and (f.startswith(self.pkg) or f.startswith("<streamcoll generated")):
            return self._local
        return None

    def _local(self, frame, event, arg):
        if event == "line" and self.rng.random() < self.p:
            self.sleeps += 1
            time.sleep(self.rng.random() * self.max_s)
        return self._local

    def __enter__(self) -> "Shuffler":
        threading.settrace(self._global)
        sys.settrace(self._global)
        return self

    def __exit__(self, *exc) -> None:
        sys.settrace(None)
        threading.settrace(None)  # type: ignore[arg-type]


def _setup(comm) -> Dict[str, Any]:
    """Once per rank process: a gloo process group (the reference; made
    directly on a store of its own, so the pooled rank's later scenarios
    find torch's default group as they left it: uninitialized) and a second
    streamcoll communicator B over the same ranks."""
    if not _STATE:
        # rank 0's store on a port the system picks, sent to the others (a fixed offset from
        # MASTER_PORT was once in use by another connection: EADDRINUSE in a CI run)
        port = torch.zeros(1, dtype=torch.int64)
        if comm.rank == 0:
            store = dist.TCPStore("127.0.0.1", 0, comm.size, True, timeout=timedelta(seconds=60),
                                  wait_for_workers=False)
            port[0] = store.port
        comm.broadcast(port, 0)
        if comm.rank != 0:
            store = dist.TCPStore("127.0.0.1", int(port[0]), comm.size, False, timeout=timedelta(seconds=60))
        _STATE["store"] = store
        _STATE["gloo"] = dist.ProcessGroupGloo(store, comm.rank, comm.size, timedelta(seconds=60))
        _STATE["B"] = comm.split(0)
    return _STATE


def _ref(ts: List[torch.Tensor]) -> List[List[float]]:
    g = _STATE["gloo"]
    out = []
    for t in ts:
        r = t.clone()
        g.allreduce([r]).wait()
        out.append(r.tolist())
    return out


def _inputs(comm, seed: int, n: int, size: int) -> List[torch.Tensor]:
    g = torch.Generator().manual_seed(seed * 100 + comm.rank)
    return [torch.randint(-50, 50, (size,), generator=g).float() for _ in range(n)]


def w_async_on_a_sync_on_b(comm, seed: int):
    """Async calls on A (big ones queue on A's comm thread, small ones
    inline) interleaved with sync calls on B, in one program order."""
    st = _setup(comm)
    b = st["B"]
    xs = _inputs(comm, seed, 8, 1 << 15) + _inputs(comm, seed + 50, 4, 8)
    ys = _inputs(comm, seed + 99, 12, 16)
    want = _ref(xs) + _ref(ys)
    xa, ya = [x.clone() for x in xs], [y.clone() for y in ys]
    with Shuffler(seed * 10 + comm.rank) as sh:
        works = []
        for x, y in zip(xa, ya):
            works.append(comm.all_reduce(x, async_op=True))
            b.all_reduce(y)
        for w in works:
            w.wait()
    return [t.tolist() for t in xa + ya] == want, sh.sleeps


def w_callbacks_issue_collectives(comm, seed: int):
    """A Work's future callback issues a collective on B (from the callback
    thread); the caller waits for the chained future before its next call,
    so the program order is the same on both ranks."""
    st = _setup(comm)
    b = st["B"]
    xs = _inputs(comm, seed, 5, 1 << 15)
    ys = _inputs(comm, seed + 7, 5, 8)
    want = _ref(xs) + _ref(ys)
    xa, ya = [x.clone() for x in xs], [y.clone() for y in ys]
    with Shuffler(seed * 10 + comm.rank) as sh:
        for x, y in zip(xa, ya):
            fut = comm.all_reduce(x, async_op=True).get_future()
            chained = fut.then(lambda f, y=y: b.all_reduce(y))
            chained.wait()
            comm.all_reduce(torch.zeros(2))  # a sync call after the callback's
    return [t.tolist() for t in xa + ya] == want, sh.sleeps


def w_destroy_while_queued(comm, seed: int):
    """A split communicator C gets async calls (queued on its comm thread)
    and is destroyed at once, while they run; destroy waits for them, then
    A still works."""
    st = _setup(comm)
    xs = _inputs(comm, seed, 6, 1 << 15)
    want = _ref(xs)
    xa = [x.clone() for x in xs]
    with Shuffler(seed * 10 + comm.rank) as sh:
        c = comm.split(0)
        works = [c.all_reduce(x, async_op=True) for x in xa]
        c.destroy()
        ok_done = all(w.is_completed() for w in works)
        z = torch.full((3,), float(comm.rank + 1))
        comm.all_reduce(z)
    return ([t.tolist() for t in xa] == want and ok_done and z.tolist() == [3.0] * 3), sh.sleeps


def w_mismatch_async_then_sync(comm, seed: int):
    """A mismatched signature (rank 1's tensor longer), new on both ranks,
    issued async and then synchronously before the async one is waited:
    both raise MismatchError on every rank whatever the interleaving (the
    second call's check is decided where it runs, after the first's), no C
    call is made, and the communicator's next calls give gloo's values."""
    _setup(comm)
    pooled, comm = comm, comm.split(0)  # its own bound of checked signatures (the pooled one may be full)
    n = 3000 + 10 * seed
    bad = torch.ones(n + (5 if comm.rank == 1 else 0))
    xs = _inputs(comm, seed, 3, 64)
    want = _ref(xs)
    errs = []
    with Shuffler(seed * 10 + comm.rank) as sh:
        w = comm.all_reduce(bad, async_op=True)
        try:
            comm.all_reduce(bad)
            errs.append(None)
        except Exception as e:  # noqa: BLE001
            errs.append(type(e).__name__)
        try:
            w.wait()
            errs.append(None)
        except Exception as e:  # noqa: BLE001
            errs.append(type(e).__name__)
        for x in xs:
            comm.all_reduce(x, async_op=True).wait()
    comm.destroy()
    pooled.barrier()
    ok = errs == ["MismatchError", "MismatchError"] and bad.eq(1).all().item()
    return ok and [x.tolist() for x in xs] == want, sh.sleeps


def w_busy_issuer(comm, seed: int):
    """Asymmetric ranks: rank 0 issues small async calls and spends 30 ms
    elsewhere (asleep) before each wait; rank 1 issues and waits at once,
    timed. Its waits stay far below rank 0's 30 ms (the quiet call's
    deadline: it is in flight within 1 ms of being issued), values gloo's.
    (Rank 0 in Python holding the GIL: tests/core/test_async_contract.py, without
    the tracer, whose sleeps hand the GIL back and forth 5 ms at a time.)"""
    _setup(comm)
    xs = _inputs(comm, seed, 4, 16)
    want = _ref(xs)
    xa = [x.clone() for x in xs]
    waits = []
    with Shuffler(seed * 10 + comm.rank) as sh:
        for x in xa:
            _STATE["gloo"].barrier().wait()
            if comm.rank == 0:
                w = comm.all_reduce(x, async_op=True)
                time.sleep(0.03)
                w.wait()
            else:
                time.sleep(0.005)
                t0 = time.monotonic()
                comm.all_reduce(x, async_op=True).wait()
                waits.append(time.monotonic() - t0)
    ok = [x.tolist() for x in xa] == want
    return ok and (comm.rank == 0 or sorted(waits)[len(waits) // 2] < 0.015), sh.sleeps


SCENARIOS = {"async_on_a_sync_on_b": w_async_on_a_sync_on_b,
             "mismatch_async_then_sync": w_mismatch_async_then_sync,
             "busy_issuer": w_busy_issuer,
             "callbacks_issue_collectives": w_callbacks_issue_collectives,
             "destroy_while_queued": w_destroy_while_queued}


@needs_oneccl
@pytest.mark.parametrize("name", list(SCENARIOS))
def test_shuffled_interleavings_give_gloo_values(world2, name):
    for seed in SEEDS:
        res = world2.run(SCENARIOS[name], seed, timeout=60)
        assert all(ok for ok, _ in res), (name, seed, res)
        assert sum(n for _, n in res) > 0, "no sleep was injected: the tracer saw no streamcoll line"
