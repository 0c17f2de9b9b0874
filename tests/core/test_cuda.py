"""GPU tier (issue 4): the two launch strategies on CUDA with a one-rank NCCL
communicator (one GPU cannot host two NCCL ranks). With one rank NCCL's
all_gather is a device copy, which makes stream ordering observable: the
output equals the input only if the copy ran after the kernels that wrote
the input and before the kernels that read the output.

Skipped (with the reason) where there is no CUDA device.
"""
from __future__ import annotations

import os
import time

import pytest
import torch

import streamcoll

pytestmark = pytest.mark.cuda

SLEEP_CYCLES = 200_000_000  # ~0.1 s on an H200: long enough to expose missing waits


@pytest.fixture(scope="module")
def comm():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")
    import torch.distributed as dist
    c = streamcoll.new_communicator(backend="nccl", device="cuda:0", rank=0, world_size=1,
                                    store=dist.HashStore(), name="cuda-test")
    yield c
    c.destroy()


def _sleep_then_fill(x: torch.Tensor, value: float) -> None:
    torch.cuda._sleep(SLEEP_CYCLES)
    x.fill_(value)


def test_sync_is_ordered_on_the_current_stream(comm):
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        inp = torch.zeros(1 << 20, device="cuda")
        out = torch.full((1 << 20,), -1.0, device="cuda")
        _sleep_then_fill(inp, 3.0)  # a long kernel writes the input
        assert comm.all_gather_into_tensor(out, inp) is None
        res = out * 2  # a kernel on the same stream reads the result
        # No event, no cross-stream wait: the collective went on this stream.
        assert comm._lanes == {} or all(k != s.cuda_stream for k in comm._lanes)
    s.synchronize()
    assert torch.all(res == 6.0)


def test_sync_on_the_default_stream(comm):
    # The legacy default stream (handle 0) is resolved and used as is.
    assert torch.cuda.current_stream().cuda_stream == 0
    inp = torch.zeros(4096, device="cuda")
    out = torch.empty(4096, device="cuda")
    _sleep_then_fill(inp, 5.0)
    comm.all_gather_into_tensor(out, inp)
    assert torch.all(out * 1 == 5.0)


def test_async_waits_for_inputs_and_overlaps(comm):
    inp = torch.zeros(1 << 20, device="cuda")
    out = torch.empty(1 << 20, device="cuda")
    _sleep_then_fill(inp, 7.0)  # on the current stream
    w = comm.all_gather_into_tensor(out, inp, async_op=True)
    # The comm stream waited on the current stream's event: result is 7, not 0.
    w.wait()
    assert torch.all(out == 7.0)
    # Overlap: a long kernel on another stream does not hold the collective back.
    other = torch.cuda.Stream()
    with torch.cuda.stream(other):
        torch.cuda._sleep(SLEEP_CYCLES * 10)
    w2 = comm.all_gather_into_tensor(out, inp, async_op=True)
    w2.synchronize()
    assert not other.query(), "the collective had to wait for an unrelated stream"
    other.synchronize()


def test_comm_stream_cache_per_current_stream(comm):
    a, b = torch.cuda.Stream(), torch.cuda.Stream()
    x = torch.ones(16, device="cuda")
    got = {}
    for s in (a, b, a):
        with torch.cuda.stream(s):
            comm.all_reduce(x, async_op=True).wait()
            got.setdefault(s.cuda_stream, []).append(comm.comm_stream())
    assert got[a.cuda_stream][0] is got[a.cuda_stream][1]
    assert got[a.cuda_stream][0] is not got[b.cuda_stream][0]
    torch.cuda.synchronize()


@pytest.mark.parametrize("record_stream", [False, True], ids=["stash", "record_stream"])
def test_no_use_after_free(comm, record_stream):
    comm.record_stream = record_stream
    try:
        with torch.cuda.stream(comm.comm_stream()):
            torch.cuda._sleep(SLEEP_CYCLES)  # keep the comm stream busy
        inp = torch.full((1 << 20,), 9.0, device="cuda")
        out = torch.empty(1 << 20, device="cuda")
        w = comm.all_gather_into_tensor(out, inp, async_op=True)
        del inp  # the caller drops its input while the copy is queued
        poison = torch.full((1 << 20,), -1.0, device="cuda")  # same size: reuses freed memory if unprotected
        w.wait()
        assert torch.all(out == 9.0)
        del poison
    finally:
        comm.record_stream = False
    torch.cuda.synchronize()


def test_stash_releases_after_wait_and_reaper(comm):
    """The stash itself holds the input: an input-only tensor (not among the
    Work's outputs) dropped by the caller stays allocated until wait()."""
    torch.cuda.synchronize()
    out = torch.empty(1 << 22, device="cuda")
    base = torch.cuda.memory_allocated()
    x = torch.ones(1 << 22, device="cuda")
    w = comm.all_gather_into_tensor(out, x, async_op=True)
    assert all(o is not x for o in w.result())
    del x
    held = torch.cuda.memory_allocated()
    assert held >= base + (1 << 22) * 4, "the Work's stash must hold the input until waited"
    w.wait()
    del w
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() <= base + 4096
    # Never waited: the reaper drops it once the completion event fired.
    y = torch.ones(1 << 22, device="cuda")
    w2 = comm.all_gather_into_tensor(out, y, async_op=True)
    del y
    torch.cuda.synchronize()
    from streamcoll.core.work import REAPER
    REAPER.reap()
    assert torch.cuda.memory_allocated() <= base + 4096
    del w2


def test_async_with_an_explicit_stream_raises(comm):
    x = torch.ones(16, device="cuda")
    with pytest.raises(ValueError, match="stream"):
        comm.all_reduce(x, async_op=True, stream=torch.cuda.Stream())


def test_comm_stream_for_another_stream_serves_it(comm):
    s = torch.cuda.Stream()
    cs = comm.comm_stream(s)
    with torch.cuda.stream(s):
        assert comm.comm_stream() is cs  # the lane made for s is the one s's async calls use
        inp = torch.zeros(1 << 20, device="cuda")
        out = torch.empty(1 << 20, device="cuda")
        _sleep_then_fill(inp, 4.0)
        comm.all_gather_into_tensor(out, inp, async_op=True).wait()
        res = out.clone()
    s.synchronize()
    assert torch.all(res == 4.0)


def test_sync_fast_path_enters_one_frame_on_cuda(comm):
    import sys
    x = torch.ones(16, device="cuda")
    comm.all_reduce(x)
    n = 0

    def prof(frame, event, arg):
        nonlocal n
        n += event == "call"
    sys.setprofile(prof)
    try:
        comm.all_reduce(x)
    finally:
        sys.setprofile(None)
    torch.cuda.synchronize()
    assert n == 1 and torch.all(x == 1.0)


def test_sync_calls_carry_completion_events(comm):
    """Issue 12 (6): a synchronous collective's flight entry holds a
    completion event recorded after it on its stream (streamcoll.core.sync_events),
    so the watchdog can tell a kernel that never finishes; a capture gets none."""
    from streamcoll.core.sync_events import SlotEvent
    x = torch.ones(1 << 20, device="cuda")
    _sleep_then_fill(x, 1.0)  # the stream is busy for ~0.1 s
    comm.all_reduce(x)
    e = comm.flight.at(comm.seq)
    assert isinstance(e.event, SlotEvent) and e.t_enq > 0
    assert comm.flight.state(comm, e) == "launched"  # behind the sleep
    torch.cuda.synchronize()
    assert comm.flight.state(comm, e) == "completed" and torch.all(x == 1.0)
    g = torch.cuda.CUDAGraph()
    y = torch.ones(16, device="cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        comm.all_reduce(y)  # warm up outside capture
    torch.cuda.current_stream().wait_stream(s)
    with torch.cuda.graph(g):
        comm.all_reduce(y)
        assert comm.flight.at(comm.seq).event is None  # a graph node: nothing to watch
    g.replay()
    torch.cuda.synchronize()


def test_a_pending_event_query_leaves_torch_no_error(comm):
    """Issue 27 (4): the flight recorder's query of a pending completion
    event returns cudaErrorNotReady, which the runtime keeps as the thread's
    last error; torch's next kernel-launch check read it and raised "device
    not ready" as its own until streamcoll cleared it."""
    x = torch.ones(1 << 20, device="cuda")
    _sleep_then_fill(x, 1.0)  # the stream is busy for ~0.1 s
    comm.all_reduce(x)
    e = comm.flight.at(comm.seq)
    assert comm.flight.state(comm, e) == "launched"  # queried: not ready
    y = torch.ones(4, device="cuda") * 2  # a launch: torch checks cudaGetLastError()
    torch.cuda.synchronize()
    assert torch.all(y == 2) and torch.all(x == 1.0)


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
def test_sync_events_from_a_thread_on_another_device():
    """Issue 27 (3): a communicator on GPU 1 called from a new thread (which
    starts on device 0) on the legacy stream: the completion event is
    recorded on GPU 1's legacy stream and no CUDA error is left behind."""
    import threading
    import torch.distributed as dist
    c = streamcoll.new_communicator(backend="nccl", device="cuda:1", rank=0, world_size=1,
                                    store=dist.HashStore(), name="cuda-test-dev1")
    try:
        x = torch.ones(16, device="cuda:1")
        out = {}

        def call() -> None:
            c.all_reduce(x)
            out["event"] = c.flight.at(c.seq).event
            torch.ones(1, device="cuda:0").add_(1)  # torch's launch check sees no stale error
        t = threading.Thread(target=call)
        t.start()
        t.join(60)
        assert out["event"] is not None
        torch.cuda.synchronize(1)
    finally:
        c.destroy()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_premul_sum_is_nccls_own(comm, dtype):
    """Issue 27 (7): premul_sum runs as NCCL's PreMulSum (created per launch),
    sync and async, in place and out of place, values as torch computes them
    (x * f, rounded once, in the tensor's dtype)."""
    x = torch.full((1024,), 6.0e4 if dtype == torch.float16 else 3.0, dtype=dtype, device="cuda")
    want = x * 0.25
    y = x.clone()
    comm.all_reduce(y, op=streamcoll.premul_sum(0.25))
    assert torch.equal(y, want)
    y = x.clone()
    comm.all_reduce(y, op=streamcoll.premul_sum(0.25), async_op=True).wait()
    assert torch.equal(y, want)
    out = torch.empty_like(x)
    comm.reduce_scatter_tensor(out, x, op=streamcoll.premul_sum(0.25))
    assert torch.equal(out, want)


def test_helper_thread_queries_do_not_invalidate_a_global_capture(comm):
    """Issue 12 (3): the reaper polls a pending event every 2 ms while the
    main thread captures a graph in torch's default global mode. Its thread
    is in thread-local capture mode (streamcoll.core.helper_threads), so the
    queries are allowed and the capture stays valid; before, the first query
    invalidated it and capture_end raised."""
    from streamcoll.core import helper_threads
    from streamcoll.core.work import REAPER
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        torch.cuda._sleep(SLEEP_CYCLES * 10)  # ~1 s: the event stays pending through the capture
        ev = torch.cuda.Event()
        ev.record(side)
    entry = REAPER.add(ev, [torch.empty(1, device="cuda")], 0)
    time.sleep(0.05)  # the reaper thread is polling it
    assert REAPER._thread is not None and REAPER._thread.is_alive()
    inp = torch.ones(1024, device="cuda")
    out = torch.zeros(1024, device="cuda")
    g = torch.cuda.CUDAGraph()
    cs = torch.cuda.Stream()
    # By hand, not torch.cuda.graph(): its __enter__ synchronizes the device,
    # which would let the event fire before the capture begins.
    with torch.cuda.stream(cs):
        g.capture_begin()  # capture_error_mode "global", the default
        out.copy_(inp * 2)
        time.sleep(0.3)  # ~150 reaper queries of the still pending event meanwhile
        g.capture_end()  # raised (capture invalidated) before the fix
    assert entry[1] is not None  # still pending: the tensors are still held
    g.replay()
    torch.cuda.synchronize()
    assert torch.all(out == 2)
    t0 = time.monotonic()
    while entry[1] is not None and time.monotonic() - t0 < 5:
        time.sleep(0.01)
    assert entry[1] is None  # fired: released
    assert helper_threads.thread_mode() is None  # the main thread was left alone


def test_functional_ops_compile_with_a_communicator_group(comm):
    """Issue 12 (1): compiled code gets the communicator as an int id (torch
    2.11's Dynamo cannot pass a user object to a constant-result function)."""
    from streamcoll.integrations import custom_ops

    @torch.compile(fullgraph=True, backend="aot_eager")
    def f(x):
        y = custom_ops.functional_all_reduce(x, group=comm)
        streamcoll.all_reduce(y, group=comm)
        z = custom_ops.functional_all_reduce(y, op=streamcoll.premul_sum(0.5), group=comm)  # a user object
        return custom_ops.functional_all_gather_into_tensor(y, group=comm), z

    x = torch.arange(8, dtype=torch.float32, device="cuda")
    g, z = f(x)
    assert torch.equal(g, x) and torch.equal(z, x * 0.5)


def test_graph_capture_and_replay(comm):
    inp = torch.zeros(1024, device="cuda")
    out = torch.zeros(1024, device="cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm up outside capture
        comm.all_gather_into_tensor(out, inp)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        comm.all_gather_into_tensor(out, inp)
        with pytest.raises(RuntimeError, match="capture"):
            comm.all_reduce(inp, async_op=True)
    for v in (1.0, 2.0, 3.0):
        inp.fill_(v)
        g.replay()
        torch.cuda.synchronize()
        assert torch.all(out == v)
