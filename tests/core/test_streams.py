"""The launch strategies through the cpu runtime (issue 4, CPU tier): which
strategy runs, the per-(device, current stream) comm-stream cache, event-pool
reuse, Work semantics, and the lifetime of tensors whose caller dropped them. Real
oneCCL ranks; the GPU twin of these checks is tests/core/test_cuda.py. Scenarios
about the comm thread run with the small-async inline strategy off
(``world.on_comm_thread``); ``w_inline_async`` is that strategy's (queued
quietly, run by ``wait()``)."""
from __future__ import annotations

import threading
import time

import pytest
import torch

import streamcoll
from world import comm_thread, on_comm_thread


@on_comm_thread
def w_strategy_choice(comm):
    rt = comm._rt
    lanes_before = len(comm._lanes)
    t = torch.ones(4)
    assert streamcoll.all_reduce(t) is None  # current-stream strategy: no Work
    # No comm stream was made for a synchronous call and it ran inline (the
    # comm thread only exists once async work was issued).
    assert len(comm._lanes) == lanes_before
    me = threading.get_ident()
    w = streamcoll.all_reduce(t, async_op=True)
    assert isinstance(w, streamcoll.Work)
    w.wait()
    assert me in comm._lanes, "the comm stream is keyed by the caller's current stream (thread)"
    assert rt._thread is not None and rt._thread.is_alive() and rt._thread is not threading.current_thread()
    assert t.tolist() == [float(comm.size ** 2)] * 4
    return True


@on_comm_thread
def w_cache_keying(comm):
    """Different current streams (threads) get different comm streams; the
    same key reuses its stream and recycles its events."""
    lanes = {}
    results = {}
    order = threading.Lock()  # same issue order on every rank: one thread at a time
    alive = threading.Barrier(3)  # keep all threads alive (thread ids are recycled)

    def body(name):
        try:
            _body(name)
        finally:
            alive.wait(timeout=30)

    def _body(name):
        with order:
            t = torch.full((3,), 1.0)
            w = comm.all_reduce(t, async_op=True)
            w.wait()
            lane1 = comm._lanes[threading.get_ident()]
            w2 = comm.all_reduce(t, async_op=True)
            w2.wait()
            lane2 = comm._lanes[threading.get_ident()]
            lanes[name] = (lane1, lane2)
            results[name] = t.tolist()

    threads = []
    for name in ("a", "b", "c"):
        th = threading.Thread(target=body, args=(name,))
        th.start()
        threads.append(th)
        while name not in lanes and th.is_alive():  # deterministic issue order across ranks
            time.sleep(0.001)
    for th in threads:
        th.join()
    assert all(l1 is l2 for l1, l2 in lanes.values()), "same key must reuse its comm stream"
    distinct = {id(l1) for l1, _ in lanes.values()}
    assert len(distinct) == 3, "different current streams must get different comm streams"
    assert all(v == [float(comm.size ** 2)] * 3 for v in results.values()), results
    return True


@on_comm_thread
def w_event_pool_no_growth(comm, n):
    # A thread of its own: its current stream gets a fresh lane, so works
    # still held by earlier tests on this rank do not enter the accounting.
    out = []
    th = threading.Thread(target=lambda: out.append(_event_pool_body(comm, n)))
    th.start()
    th.join()
    return out[0]


def _event_pool_body(comm, n):
    t = torch.ones(1)
    comm.all_reduce(t, async_op=True).wait()
    lane = comm._lanes[threading.get_ident()]
    before = lane.created
    want = float(sum(range(1, comm.size + 1)))
    wrong = 0
    for i in range(n):
        t.fill_(comm.rank + 1)
        w = comm.all_reduce(t, async_op=True)
        w.wait()
        del w
        wrong += t.item() != want
    after_n = lane.created
    # A burst of outstanding works needs as many events, then they come back.
    ws = [comm.all_reduce(torch.ones(1), async_op=True) for _ in range(8)]
    for w in ws:
        w.wait()
    del ws, w
    return before, after_n, lane.created, len(lane.pool), wrong


def w_work_semantics(comm):
    """A Work of the comm thread is pending until its peers join; then
    completed, successful, with a future holding the outputs."""
    t = torch.full((2,), float(comm.rank))
    comm.barrier()
    with comm_thread(comm):
        if comm.rank == 0:
            w = comm.all_reduce(t, async_op=True)
            pending_seen = not w.is_completed()  # the other ranks join 0.5 s later
        else:
            time.sleep(0.5)
            w = comm.all_reduce(t, async_op=True)
            pending_seen = None
    assert w.wait() is True
    assert w.is_completed() and w.is_success() and w.exception() is None
    assert w.get_future().done()
    exp = float(sum(range(comm.size)))
    assert t.tolist() == [exp, exp]
    assert w.result()[0] is t
    return pending_seen


def w_inline_async(comm):
    """Issue 33 (issue 25's inline strategy before): a small async call
    returns a pending Work at once (queued quietly; here rank 1 joins 0.5 s
    late) which ``wait()`` runs on the calling thread, with the right values;
    behind queued work it stays behind it (never overtakes), here behind a
    large call. Returns what rank 0 saw right after issuing."""
    n, r = comm.size, comm.rank
    exp = float(n * (n + 1) // 2)
    t = torch.full((3,), float(r + 1))
    comm.barrier()
    if r == 1:
        time.sleep(0.5)
    t0 = time.monotonic()
    w = comm.all_reduce(t, async_op=True)
    alone = [time.monotonic() - t0 < 0.25, w._here]
    assert w.wait() and t.tolist() == [exp] * 3, t
    big = torch.full((comm.inline_async_bytes // 4 + 1,), float(r + 1))
    small = torch.full((2,), float(r + 1))
    comm.barrier()
    seen = None
    if r == 1:
        time.sleep(0.5)
    wb = comm.all_reduce(big, async_op=True)
    ws = comm.all_reduce(small, async_op=True, op=streamcoll.ReduceOp.MAX)
    if r == 0:
        seen = alone + [wb.is_completed(), ws.is_completed()]
    assert ws.wait() and wb.wait()
    assert small.tolist() == [float(n)] * 2 and bool(torch.all(big == exp)), (small, big[:2])
    return seen


_DROPPED: dict = {}


def _drop_one(comm):
    """An async call whose caller keeps nothing (``all_reduce(torch.full(...),
    async_op=True)``, the Work dropped); a weak reference to its tensor."""
    import gc
    import weakref
    x = torch.full((1 << 14,), 1.0)
    ref = weakref.ref(x)
    comm.all_reduce(x, async_op=True)  # the Work is dropped here
    del x
    gc.collect()
    return ref


@on_comm_thread
def w_drop_on_rank0(comm):
    """Rank 0 issues a call and drops everything; rank 1 does not join yet,
    so the call cannot complete: only the queued call can keep its buffer
    alive. Answered before the call can complete (were the buffer freed,
    oneCCL would later write into freed memory, and the rank would hang or
    crash: the answer comes first)."""
    if comm.rank != 0:
        return None
    ref = _DROPPED["ref"] = _drop_one(comm)
    return ref() is not None


@on_comm_thread
def w_join_and_release(comm):
    """The other ranks join rank 0's call; once it completed (a synchronous
    collective goes behind it) its tensor must be gone (nothing leaks)."""
    import gc
    ref = _DROPPED.pop("ref") if comm.rank == 0 else _drop_one(comm)
    t = torch.ones(1)
    comm.all_reduce(t)
    gc.collect()
    for _ in range(200):  # the comm thread lets go of the finished call
        if ref() is None:
            break
        time.sleep(0.01)
    return ref() is None


def w_fire_and_forget(comm, n: int):
    """``n`` fire-and-forget calls on 1 MB temporaries, each followed by a
    same-size poisoned allocation (oneCCL reading freed memory aborts the
    rank: "SEND entry failed", SIGABRT), then a synchronous all_reduce whose
    value is checked."""
    for i in range(n):
        comm.all_reduce(torch.full((1 << 18,), float(i)), async_op=True)  # 1 MB, dropped
        poison = torch.full((1 << 18,), -7.0)
        del poison
    t = torch.full((3,), float(comm.rank + 1))
    comm.all_reduce(t)
    return t.tolist()


@on_comm_thread
def w_stream_argument_and_comm_stream(comm):
    # stream= on the CPU: the host has one stream (the thread); a CPU stream gives the same
    # result, anything else raises (issue 15: it used to be ignored).
    t = torch.ones(2)
    assert comm.all_reduce(t, stream=torch.cpu.current_stream()) is None
    assert t.tolist() == [float(comm.size)] * 2
    try:
        comm.all_reduce(t, stream=object())
        raise AssertionError("stream=object() accepted")
    except TypeError as e:
        assert "expects a cpu stream" in str(e), e
    s = comm.comm_stream()
    assert comm._lanes[threading.get_ident()].stream is s
    return True


def test_strategy_choice(world):
    assert world.run(w_strategy_choice) == [True] * world.size


def test_cache_keying_per_current_stream(world2):
    assert world2.run(w_cache_keying) == [True, True]


def test_event_pool_does_not_grow_over_10k_calls(world2):
    res = world2.run(w_event_pool_no_growth, 10_000, timeout=240)
    for before, after_n, after_burst, pooled, wrong in res:
        assert before >= 1  # a recycled thread id may find an earlier thread's lane
        assert after_n == before, f"10k sequential async calls grew the event pool {before} -> {after_n}"
        assert after_burst <= max(before, 8), "8 outstanding works need at most 8 events"
        assert pooled == after_burst, "every event came back to the pool"
        assert wrong == 0, f"{wrong} of the 10k all_reduces gave a wrong sum"


def test_work_semantics(world2):
    res = world2.run(w_work_semantics)
    assert res[0] is True, "rank 0's Work was reported completed while its peer had not joined"


def test_small_async_calls_return_at_once_and_stay_behind_queued_work(world2):
    seen = world2.run(w_inline_async, timeout=60)[0]
    assert seen == [True, True, False, False], \
        f"(returned before the late peer, small, big done, small done): {seen}"


def test_async_results_survive_dropped_tensors(world):
    """On the CPU both lifetime modes run the same code (host memory has no
    stream-ordered allocator: the queued call holds the tensors), so one
    test; the modes differ on CUDA (tests/core/test_cuda.py::test_no_use_after_free)."""
    alive = world.run(w_drop_on_rank0, timeout=60)[0]
    if not alive:
        world.close(kill=True)  # rank 0's queued call would now use freed memory: end this world
        raise AssertionError("a queued async call's tensor was freed: nothing held it but the caller")
    released = world.run(w_join_and_release, timeout=60)
    assert all(released), f"the tensor of a completed, dropped call is still held: {released}"
    n = world.size
    assert world.run(w_fire_and_forget, 20, timeout=60) == [[float(n * (n + 1) // 2)] * 3] * n


def test_stream_argument_and_comm_stream(world2):
    assert world2.run(w_stream_argument_and_comm_stream) == [True, True]


def w_posted_lane_serves_the_posting_stream(comm):
    """Issue 27 (1): posted p2p ops launched later, from another current
    stream, get a lane that serves the stream they were *posted* under. On
    the GPU the lane's "inputs ready" event is recorded on that stream; before,
    ``new_lane`` took whatever stream was current at flush time, so the send
    could read its input before the posting stream's producer finished. On
    the CPU the current "stream" is the thread: the op is posted on one
    thread and launched by a wait on another, and the lane is built from the
    posting thread's stream (recorded here: the CPU lane is the same either way)."""
    seen = []
    real = comm._rt.new_lane

    def recording(key, current=None):
        seen.append((key, current))
        return real(key, current)

    comm._rt.new_lane = recording
    try:
        peer = 1 - comm.rank
        x = torch.full((4,), float(comm.rank + 1))
        box = {}

        def post():
            box["key"] = k = comm._rt.current_key()
            # thread idents are recycled: a lane cached for an earlier thread with this ident would be reused
            comm._lanes.pop(k, None)
            box["w"] = comm.isend(x, peer) if comm.rank == 0 else comm.irecv(x, peer)

        th = threading.Thread(target=post)
        th.start()
        th.join(30)
        box["w"].wait()  # launched from this thread, another current stream
        assert x.tolist() == [1.0] * 4
        posted = [c for k, c in seen if k == box["key"]]
        assert posted == [box["key"]], (seen, box["key"])  # the posting stream, not None (flush-time current)
    finally:
        del comm._rt.new_lane
    return True


def test_posted_ops_lane_serves_the_stream_they_were_posted_under(world2):
    assert world2.run(w_posted_lane_serves_the_posting_stream, timeout=60) == [True, True]
