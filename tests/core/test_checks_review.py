"""Review of issue 42's fixes (the rank-symmetric first-call checks, their
store keys, the quiet call's 1 ms deadline): the scenarios that found a
defect, each on real oneCCL ranks. The scenarios that found none (posted
p2p and coalescing blocks behind pending checks, the bound reached with
calls in flight, debug mode switched with async work queued, a failure and
an interrupt while a synchronous first call drains, two threads on one
communicator, 600 quiet calls at random gaps, quiet calls on two
communicators and at destroy) are in this file's first commit."""
from __future__ import annotations

import time

import pytest
import torch

import streamcoll

from conftest import get_world, needs_oneccl

pytestmark = [needs_oneccl, pytest.mark.world]


# ------------------------------------------- all-to-all counts in the key
def _a2a_changing_self_count(comm, n0, iters, form):
    """A correct program (every count matches its peer's) whose uneven
    all-to-all changes only what rank 1 keeps for itself: rank 0's counts,
    its signature, stay the same every iteration (MoE routing does this).
    Each call must complete on both ranks, with the right values."""
    r, size = comm.rank, comm.size
    assert size == 2
    comm = comm.split(0)  # its own signatures (the pooled communicator's are other tests')
    comm.timeout = 8  # a hang shows as a CollectiveTimeout in seconds
    out = []
    try:
        for i in range(iters):
            # send[i][j]: what rank i sends to rank j
            send = [[n0, n0 + 1], [n0 + 2, n0 + 3 + (i if r == 1 else 0)]]
            if r == 1:
                send[1][1] = n0 + 3 + i
            ins = send[r]
            outs = [send[j][r] for j in range(size)]
            t0 = time.monotonic()
            try:
                if form == "single":
                    inp = torch.full((sum(ins),), float(r + 1))
                    o = torch.zeros(sum(outs))
                    comm.all_to_all_single(o, inp, outs, ins)
                    got = o.tolist()
                else:
                    o = [torch.zeros(c) for c in outs]
                    comm.all_to_all(o, [torch.full((c,), float(r + 1)) for c in ins])
                    got = torch.cat(o).tolist()
                want = sum(([float(j + 1)] * outs[j] for j in range(size)), [])
                out.append({"i": i, "ok": got == want, "s": round(time.monotonic() - t0, 3)})
            except Exception as e:  # noqa: BLE001
                out.append({"i": i, "raised": type(e).__name__, "msg": str(e)[:300],
                            "s": round(time.monotonic() - t0, 3)})
                break
    finally:
        if not out or out[-1].get("ok"):
            comm.destroy()
    return out


@pytest.mark.parametrize("form,n0", [("single", 301), ("list", 307)])
def test_uneven_all_to_all_with_one_rank_changing_its_counts(form, n0):
    """Found on ``checks``: rank 0's signature (its own send and receive
    counts) is seen after the first call, rank 1's is new each time: rank 1
    checks (waits in the store), rank 0 goes into the C call, both stuck
    until the timeout (CollectiveTimeout on rank 1: "rank 0 never reached
    this collective"), though every count matches its peer's."""
    w = get_world(2)
    res = w.run(_a2a_changing_self_count, n0, 3, form, timeout=90)
    for r, x in enumerate(res):
        assert len(x) == 3 and all(e.get("ok") for e in x), (r, res)


# ------------------------------------------------ store keys
def _keys_after_debug_cycles(comm, cycles, n0):
    """Split, debug mode on for a call, off again, a new signature, destroy,
    ``cycles`` times: the store holds no more keys afterwards."""
    from streamcoll.core import checks as debug
    base = comm._store
    comm.barrier()
    k0 = base.num_keys()
    for i in range(cycles):
        c = comm.split(0)
        c.all_reduce(torch.ones(n0 + i))        # a first-call check
        debug.enable(c)
        c.all_reduce(torch.ones(n0 + i))        # a debug check
        debug.disable(c)
        c.all_reduce(torch.ones(n0 + 100 + i))  # a first-call check again
        c.destroy()
    comm.barrier()
    return {"before": k0, "after": base.num_keys()}


def test_debug_mode_switched_off_leaves_no_keys():
    w = get_world(2)
    res = w.run(_keys_after_debug_cycles, 5, 4111, timeout=120)
    assert res[0]["after"] - res[0]["before"] <= 0, res


# ------------------------- the quiet call's deadline, from the peers' side
def _gil_busy(seconds):
    """A C call that holds the GIL throughout (no eval-breaker point):
    sorting a list of floats, sized to about ``seconds`` (a pickle of a big
    state dict, json.dumps, a C extension that keeps the GIL)."""
    import random
    n = 200_000
    xs = [random.random() for _ in range(n)]
    t0 = time.monotonic()
    sorted(xs)
    one = max(time.monotonic() - t0, 1e-4)
    big = [random.random() for _ in range(int(n * seconds / one))]
    return big


def _peer_behind_gil(comm, port, reps, inline):
    from datetime import timedelta
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=comm.rank,
                            world_size=comm.size, timeout=timedelta(seconds=30))
    old = comm.inline_async_bytes
    if inline is not None:
        comm.inline_async_bytes = inline
    big = _gil_busy(0.3) if comm.rank == 0 else None
    out = {}
    try:
        for name, issue in (("gloo", lambda t: dist.all_reduce(t, async_op=True)),
                            ("streamcoll", lambda t: comm.all_reduce(t, async_op=True))):
            runs = []
            for _ in range(reps):
                t = torch.ones(4)
                dist.barrier()
                if comm.rank == 0:
                    w = issue(t)
                    t1 = time.monotonic()
                    sorted(big)  # holds the GIL
                    busy = time.monotonic() - t1
                    w.wait()
                    runs.append(busy)
                else:
                    time.sleep(0.02)
                    t0 = time.monotonic()
                    issue(t).wait()
                    runs.append(time.monotonic() - t0)
            out[name] = sorted(runs)
        dist.barrier()
        time.sleep(0.1)
    finally:
        comm.inline_async_bytes = old
        dist.destroy_process_group()
    return out


@pytest.mark.xfail(strict=True, reason="a Python comm thread cannot start a call while the issuer's C call "
                   "keeps the GIL: the limit work.py states (this test failed on `checks`, whose work.py "
                   "promised the deadline whatever the issuer does)")
def test_peer_wait_behind_an_issuer_in_a_gil_holding_c_call():
    """work.py: 'in flight within 1 ms of being issued (plus ... at most the
    interpreter's switch interval, 5 ms)', 'whatever its issuer does
    meanwhile (Python code, a sleep, another library's C call ...)'. An
    issuer inside a C call that keeps the GIL (0.3 s here) holds the comm
    thread off the GIL: the peer waits the whole call (gloo: milliseconds).
    Measured on ``checks``: 0.50-0.96 s (median 0.93) against gloo's 0.6-9 ms; with
    ``inline_async_bytes = 0`` 0.0005/0.43/0.43 s (the comm thread, woken at
    issue, sometimes takes the GIL before the sort starts)."""
    from world import free_port
    w = get_world(2)
    res = w.run(_peer_behind_gil, free_port(), 3, None, timeout=120)
    r1 = res[1]
    gloo, sc = r1["gloo"][1], r1["streamcoll"][1]
    assert sc <= gloo + 0.010, (res)


# ------------------------------- the deferred checks' store connection
def _fds_after_cycles(comm, cycles, n0, how="async", collect=False):
    """Split, an async call of a new signature (its check on the comm
    thread, through a clone of the store: a connection of its own), destroy,
    ``cycles`` times: open file descriptors afterwards."""
    import os
    comm.barrier()
    f0 = len(os.listdir("/proc/self/fd"))
    for i in range(cycles):
        c = comm.split(0)
        if how == "async":
            c.all_reduce(torch.ones(n0 + i), async_op=True).wait()
        else:
            c.all_reduce(torch.ones(n0 + i))
        c.destroy()
        del c
    if collect:
        import gc
        gc.collect()
    comm.barrier()
    return {"before": f0, "after": len(os.listdir("/proc/self/fd"))}


def test_deferred_check_connections_are_closed():
    w = get_world(2)
    res = w.run(_fds_after_cycles, 40, 5901, timeout=120)
    for x in res:
        assert x["after"] - x["before"] < 10, res


# --------------------------------------- a call behind a quiet call
def _sync_behind_quiet(comm, deadline_s, reps):
    """A small async call, then at once a synchronous call (or a barrier)
    on the same communicator, then the wait. work.py: a quiet call starts at
    "any later call on the same communicator (it is queued behind, and its
    queueing wakes the comm thread)". With the quiet deadline stretched to
    ``deadline_s`` the synchronous call must still return in milliseconds."""
    import faulthandler
    import tempfile
    c = comm.split(0)
    c._rt.quiet_start_ns = int(deadline_s * 1e9)
    out = {}
    # every thread's stack if a call stalls past 1 s (a CI run saw 5.0 s on both ranks, once)
    with tempfile.TemporaryFile("w+") as stacks:
        try:
            a, b = torch.ones(4), torch.ones(4)
            for kind in ("sync", "barrier"):
                ts = []
                for _ in range(reps):
                    faulthandler.dump_traceback_later(1.0, file=stacks)
                    t0 = time.monotonic()
                    w = c.all_reduce(a, async_op=True)
                    if kind == "sync":
                        c.all_reduce(b)
                    else:
                        c.barrier()
                    ts.append(time.monotonic() - t0)
                    faulthandler.cancel_dump_traceback_later()
                    w.wait()
                out[kind] = max(ts)
            out["a"], out["b"] = a[0].item(), b[0].item()
        finally:
            faulthandler.cancel_dump_traceback_later()
            c.destroy()
            stacks.seek(0)
            out["stalled"] = stacks.read()[-6000:]
    return out


def test_a_sync_call_starts_the_quiet_call_queued_before_it():
    """Found on ``checks``: the comm thread, woken by the synchronous call's
    queueing, finds the quiet call at the head and waits for its deadline
    (1 ms; here stretched to 2 s: 0.50 s, a watchdog pass, started it):
    async-then-sync of 4 floats on one communicator took 1.23 ms a step
    against 81-97 us on the old tree."""
    w = get_world(2)
    res = w.run(_sync_behind_quiet, 2.0, 3, timeout=120)
    for x in res:
        assert x["sync"] < 0.2 and x["barrier"] < 0.2, "\n".join([repr([{k: v for k, v in y.items() if k != "stalled"}
                                                                   for y in res])]
                                                            + [f"rank {r}'s stacks 1 s into the stall:\n{y['stalled']}"
                                                               for r, y in enumerate(res)])
