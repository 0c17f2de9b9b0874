"""Issue 12, findings 3 and 6, on the CPU: the CUDA runtime binding the
helper threads and the synchronous-op completion events use (against the
real ``libcudart`` of the nvidia-cuda-runtime wheel: without a GPU driver its
calls return ``cudaErrorInsufficientDriver``, which exercises the error
path), and the watchdog's reading of sync entries with completion events
(pure logic over a real FlightRecorder; the events are stand-ins with a
``query()``). The GPU halves are in tests/core/test_cuda.py and
tests/diagnostics/test_reliability.py (``cuda`` marker).
"""
from __future__ import annotations

import logging
import os
import pickle
import threading
import time
import types

import pytest
import torch

import streamcoll
from streamcoll.core import backends, helper_threads, recorder
from streamcoll.diagnostics import watchdog
from streamcoll._ffi.cudart import CUDART

_CI = any(os.environ.get(v, "") not in ("", "0", "false") for v in ("CI", "STREAMCOLL_REQUIRE_ABI"))


def _need_cudart() -> None:
    if not CUDART.is_available():
        why = "no CUDA runtime found: " + "; ".join(CUDART.tried)
        if _CI:
            pytest.fail("CI installs nvidia-cuda-runtime-cu12 (scripts/setup.sh): " + why)
        pytest.skip(why)


def _gpu_driver() -> bool:
    v = CUDART.ffi.new("int *")
    return CUDART.lib().cudaDriverGetVersion(v) == 0 and v[0] > 0


# ---- the binding ---------------------------------------------------------------
def test_cudart_loads_the_real_runtime_and_its_errors_name_the_call():
    _need_cudart()
    assert CUDART.path and os.path.basename(CUDART.path).startswith("libcudart.so.")
    major, _, _ = CUDART.split_version(CUDART.version())
    assert major >= 12
    assert CUDART.const("cudaStreamCaptureModeThreadLocal") == 1
    assert CUDART.const("cudaErrorNotReady") == 600
    if _gpu_driver():
        assert helper_threads.set_thread_local_capture_mode() in (0, 1, 2)
        return
    with pytest.raises(streamcoll.CudaError) as ei:
        helper_threads.set_thread_local_capture_mode()
    e = ei.value
    assert e.function == "cudaThreadExchangeStreamCaptureMode"
    assert e.code_name == "cudaErrorInsufficientDriver" and e.code == 35
    assert "driver" in str(e)
    again = pickle.loads(pickle.dumps(e))
    assert type(again) is streamcoll.CudaError and str(again) == str(e)


def test_a_missing_runtime_is_one_aggregated_error(monkeypatch, tmp_path):
    from streamcoll._ffi.cudart import _Cudart
    b = _Cudart()
    monkeypatch.setenv("STREAMCOLL_CUDART_LIBRARY", str(tmp_path / "libcudart.so.13"))
    monkeypatch.setattr(b, "candidates", lambda: b._env_candidates())
    with pytest.raises(streamcoll.LibraryNotFoundError) as ei:
        b.lib()
    assert "STREAMCOLL_CUDART_LIBRARY" in str(ei.value) and "no such file" in str(ei.value)


# ---- finding 3: helper threads switch to thread-local capture mode -------------
def test_prepare_sets_the_mode_once_per_thread_and_warns_once(monkeypatch, caplog):
    _need_cudart()
    monkeypatch.setattr(helper_threads, "_warned", False)
    calls = []
    real = helper_threads.set_thread_local_capture_mode

    def counted() -> int:
        calls.append(threading.current_thread().name)
        return real()

    monkeypatch.setattr(helper_threads, "set_thread_local_capture_mode", counted)
    modes = {}

    def helper(name: str) -> None:
        helper_threads.prepare(None)
        helper_threads.prepare(None)  # the second time costs an attribute read
        modes[name] = helper_threads.thread_mode()

    with caplog.at_level(logging.WARNING, logger="streamcoll"):
        for n in ("h1", "h2"):
            t = helper_threads.Thread(target=helper, args=(n,), name=n)
            t.start()
            t.join(10)
    assert calls == ["h1", "h2"]  # once per thread
    if _gpu_driver():
        assert modes == {"h1": 0, "h2": 0}  # replaced the default (global) mode
    else:
        assert modes == {"h1": -1, "h2": -1}
        warnings = [r.getMessage() for r in caplog.records if "thread-local CUDA graph capture" in r.getMessage()]
        assert len(warnings) == 1, warnings  # once per process
        assert "cudaErrorInsufficientDriver" in warnings[0] and "capture_error_mode='thread_local'" in warnings[0]


def test_prepare_leaves_a_users_thread_alone(monkeypatch):
    """Issue 27 (5): prepare() on a thread that is not streamcoll's (a user
    calling REAPER.reap() on the main thread) must not switch that thread's
    capture mode or device; before, it did, and a later
    ``thread_mode() is None`` on the main thread failed."""
    calls = []
    monkeypatch.setattr(helper_threads, "set_thread_local_capture_mode", lambda: calls.append(1) or 0)
    monkeypatch.setattr(torch.cuda, "set_device", lambda i: calls.append(("set_device", i)))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(helper_threads, "_local", threading.local())
    out = {}

    def user() -> None:
        helper_threads.prepare(3)
        out["mode"], out["helper"] = helper_threads.thread_mode(), helper_threads.is_helper()

    t = threading.Thread(target=user, name="users-thread")
    t.start()
    t.join(10)
    assert out == {"mode": None, "helper": False} and calls == []

    def helper() -> None:
        helper_threads.prepare(3)
        out["mode"], out["helper"] = helper_threads.thread_mode(), helper_threads.is_helper()

    t = helper_threads.Thread(target=helper, name="streamcoll-helper")
    t.start()
    t.join(10)
    assert out == {"mode": 0, "helper": True} and calls == [("set_device", 3), 1]


def test_streamcolls_cuda_threads_are_helper_threads():
    """The threads that call prepare() are started as helper_threads.Thread
    (else prepare() would now do nothing on them)."""
    import inspect
    from streamcoll.core import async_launch, work
    from streamcoll.diagnostics import watchdog as wd
    for mod, name in ((work, "streamcoll-reaper"), (wd, "streamcoll-watchdog"), (async_launch, "streamcoll-future")):
        src = inspect.getsource(mod)
        i = src.index(f'name="{name}"')
        assert "helper_threads.Thread(" in src[max(0, i - 120):i], name


class _StandInRuntime:
    """Pure logic stand-in for libcudart's last-error and device calls (the
    real runtime needs a GPU for a pending event)."""

    def __init__(self, current: int = 0) -> None:
        self.last, self.current, self.calls = 0, current, []

    def cudaEventQuery(self, h):
        self.calls.append("query")
        self.last = 600  # cudaErrorNotReady, kept as the thread's last error
        return 600

    def cudaPeekAtLastError(self):
        return self.last

    def cudaGetLastError(self):
        self.calls.append("clear")
        r, self.last = self.last, 0
        return r

    def cudaGetDevice(self, p):
        p[0] = self.current
        return 0

    def cudaSetDevice(self, d):
        self.calls.append(("set", d))
        self.current = d
        return 0

    def cudaEventRecord(self, ev, cs):
        self.calls.append(("record", self.current))
        return 0

    def cudaStreamIsCapturing(self, cs, status):
        status[0] = 0
        return 0


def _stand_in_events(current: int, device: int):
    from streamcoll.core.sync_events import SyncEvents
    _need_cudart()
    sev = SyncEvents(16, device)
    sev.lib = _StandInRuntime(current)
    return sev


def test_a_pending_query_leaves_no_last_error():
    """Issue 27 (4): cudaEventQuery's not-ready stays the thread's last
    error, and torch's next launch check would raise it as its own; the
    query clears it (as torch's CUDAEvent::query does)."""
    from streamcoll.core.sync_events import SlotEvent
    sev = _stand_in_events(0, 0)
    sev.not_ready = 600
    assert SlotEvent("h", sev).query() is False
    assert sev.lib.last == 0 and sev.lib.calls == ["query", "clear"]
    sev.lib.last = 700  # someone else's error is not ours to clear
    sev.clear_last_error(1)
    assert sev.lib.last == 700


def test_legacy_stream_events_are_recorded_on_the_communicators_device():
    """Issue 27 (3): on the legacy stream (handle 0) the event is recorded
    with the communicator's device current, then the caller's device is
    restored; on another device's thread the record failed before."""
    sev = _stand_in_events(current=0, device=1)
    ev = types.SimpleNamespace(handle="h")
    assert sev.record_on_device(ev, 0) == 0
    assert sev.lib.calls == [("set", 1), ("record", 1), ("set", 0)] and sev.lib.current == 0
    # the statements the generated launchers inline, on the legacy stream from device 0's thread
    from streamcoll.core.sync_events import SlotEvent
    sev.lib.calls.clear()
    sev.slots[5 & sev.mask] = slot = SlotEvent("h", sev)
    e = recorder.FlightEntry(seq=5)
    sev.recorder()(e, 5, 0)
    assert e.event is slot and sev.lib.calls == [("set", 1), ("record", 1), ("set", 0)]
    sev.lib.calls.clear()
    sev.lib.current = 1  # already on the communicator's device: no switch
    sev.recorder()(e, 5, 0)
    assert sev.lib.calls == [("record", 1)]


def test_every_cuda_helper_thread_prepares_before_querying(monkeypatch):
    """The reaper and the watchdog go through prepare() (device and capture
    mode) before their CUDA calls; before the fix they only set the device."""
    seen = []
    monkeypatch.setattr(helper_threads, "prepare", lambda idx: seen.append((threading.current_thread().name, idx)))

    class Pending:
        def query(self) -> bool:
            return False

    from streamcoll.core.work import Reaper
    r = Reaper()
    r._thread = threading.current_thread()  # no thread of its own: reap() is called here
    r.add(Pending(), ["tensor"], device=3)
    t = threading.Thread(target=r.reap, name="reaper-pass")
    t.start()
    t.join(10)
    watchdog._use_device(5)
    assert seen == [("reaper-pass", 3), (threading.current_thread().name, 5)]
    assert len(r) == 1  # a pending event keeps its tensors


def test_reaper_keeps_tensors_when_a_query_fails():
    class Failing:
        def query(self) -> bool:
            raise RuntimeError("operation not permitted when stream is capturing")

    from streamcoll.core.work import Reaper
    r = Reaper()
    r._thread = threading.current_thread()
    entry = r.add(Failing(), ["tensor"], device=None)
    assert r.reap() == 1 and entry[1] == ["tensor"]


# ---- finding 6: completion events of synchronous GPU calls --------------------
class _Event:
    def __init__(self, fired: bool) -> None:
        self.fired = fired
        self.queries = 0

    def query(self) -> bool:
        self.queries += 1
        return self.fired


def _gpu_ring(n: int):
    """A real recorder holding sync entries 1..n that all returned (done = n)."""
    fr = recorder.FlightRecorder(16)
    for s in range(1, n + 1):
        e = fr.ring[s & fr.mask]
        e.seq, e.op, e.sync = s, "all_reduce", True
    fr.done = n
    comm = types.SimpleNamespace(_gpu=True, is_gpu=True)
    return fr, comm


def test_a_sync_gpu_call_whose_event_never_fires_is_overdue():
    fr, comm = _gpu_ring(3)
    now = recorder.now_ns()
    stuck = fr.at(2)
    stuck.event, stuck.t_enq = _Event(False), now - int(10e9)
    fine = fr.at(3)
    fine.event, fine.t_enq = _Event(True), now - int(10e9)
    cands = watchdog.watched(comm, fr, 3)
    assert stuck in cands and fine in cands and fr.at(1) not in cands  # no event: nothing to watch
    assert fr.state(comm, stuck) == recorder.LAUNCHED
    assert fr.state(comm, fine) == recorder.COMPLETED
    hit = watchdog.overdue(comm, fr, cands, now, 5.0)
    assert hit is not None and hit[0] is stuck and 9.9 < hit[1] < 10.1
    assert watchdog.overdue(comm, fr, cands, now, 15.0) is None  # within the timeout: not yet
    assert fine.event is not None  # a sync slot keeps its event (reused with the slot)
    # seen complete: not queried again on later passes, until the slot has a new occupant
    assert fine not in watchdog.watched(comm, fr, 3) and stuck in watchdog.watched(comm, fr, 3)
    q = fine.event.queries
    watchdog.overdue(comm, fr, watchdog.watched(comm, fr, 3), now, 15.0)
    assert fine.event.queries == q


def test_a_reused_slot_is_not_judged_by_its_previous_occupant():
    """The watchdog picked an entry that returned; before it reads the
    state, the launch thread reuses the slot for a new call (inside its host
    call, with the old occupant's t_enq still there): not a hang."""
    fr, comm = _gpu_ring(3)
    now = recorder.now_ns()
    e = fr.at(3)
    e.event, e.t_enq = _Event(True), now - int(100e9)
    cands = watchdog.watched(comm, fr, 3)
    assert e in cands
    e.seq = 3 + fr.capacity  # reused: the new call is inside its host call (seq > done)
    e.event = _Event(False)
    assert watchdog.overdue(comm, fr, cands, now, 5.0) is None


def test_a_sync_call_still_inside_its_host_call_is_not_judged_by_a_stale_event():
    """The slot's event belongs to the previous occupant until the call
    returns: an entry after ``done`` is left to the running-call check."""
    fr, comm = _gpu_ring(3)
    now = recorder.now_ns()
    e = fr.at(3)
    e.event, e.t_enq = _Event(False), now - int(100e9)  # the previous occupant's, long ago
    fr.done = 2
    assert e not in watchdog.watched(comm, fr, 3)
    assert watchdog.overdue(comm, fr, watchdog.watched(comm, fr, 3), now, 5.0) is None


def test_cpu_sync_entries_are_not_watched_for_events():
    fr, _ = _gpu_ring(2)
    cpu = types.SimpleNamespace(_gpu=False, is_gpu=False, _deadlines={})
    fr.at(2).event, fr.at(2).t_enq = _Event(False), recorder.now_ns() - int(10e9)
    assert watchdog.watched(cpu, fr, 2) == []
    assert fr.state(cpu, fr.at(2)) == recorder.COMPLETED


def test_sync_events_sample_and_never_fail_the_collective(monkeypatch, caplog):
    """The real runtime: every N-th call tries to record (here it fails for
    want of a driver: the call gets no event and one warning, nothing raises);
    the others make no C call at all."""
    _need_cudart()
    from streamcoll.core.sync_events import SyncEvents, every
    monkeypatch.setenv("STREAMCOLL_SYNC_EVENTS", "x")
    with pytest.raises(ValueError, match="STREAMCOLL_SYNC_EVENTS: expected an integer >= 0, got 'x'"):
        every()
    monkeypatch.setenv("STREAMCOLL_SYNC_EVENTS", "-2")
    with pytest.raises(ValueError, match="STREAMCOLL_SYNC_EVENTS"):
        every()
    monkeypatch.setenv("STREAMCOLL_SYNC_EVENTS", "4")
    ev = SyncEvents(16, 0)
    assert ev.every == 4
    if _gpu_driver():
        pytest.skip("the failure path needs a machine without a GPU driver; tests/core/test_cuda.py covers the GPU")
    record = ev.recorder()  # the statements the generated CUDA launchers inline
    entries = []
    with caplog.at_level(logging.WARNING, logger="streamcoll"):
        for s in range(1, 13):
            e = recorder.FlightEntry(seq=s)
            e.event = "stale"
            record(e, s, 0)
            entries.append(e)
    assert [e.event for e in entries] == [None] * 12  # unsampled ones too: no stale event stays
    assert [e.t_enq > 0 for e in entries] == [s % 4 == 0 for s in range(1, 13)]
    assert ev.failures == 3  # seq 4, 8, 12 tried; the rest were skipped without a C call
    msgs = [r.getMessage() for r in caplog.records if "completion event" in r.getMessage()]
    assert len(msgs) == 1 and "cudaStreamIsCapturing" in msgs[0] and "cudaErrorInsufficientDriver" in msgs[0]
    # sampling counts synchronous calls, not sequence numbers (async calls take those too):
    # seq 13, 17, 21, 25 (three async calls between each) still sample the 4th sync call
    ev2 = SyncEvents(16, 0)
    record2 = ev2.recorder()
    for s in (13, 17, 21, 25):
        record2(recorder.FlightEntry(seq=s), s, 0)
    assert ev2.failures == 1
    ev.close()
    assert ev.closed and ev.slot(4) is None  # no new events after close (destroy, abort)


def test_sync_events_are_off_for_cpu_communicators():
    from streamcoll.core.communicator import _sync_events_for
    comm = types.SimpleNamespace(_device=types.SimpleNamespace(type="cpu"))
    assert _sync_events_for(comm) is None


def test_the_generated_cuda_launcher_with_events_compiles():
    """The {record} statements inside the synchronous template (every op and
    sampled) form valid code: a syntax error would only show on a GPU."""
    _need_cudart()
    from streamcoll.core import launch
    from streamcoll.core.sync_events import SyncEvents
    for n in (1, 3):
        sev = SyncEvents(16, 0, n)
        body = launch._fill(  # the launcher's own filling: {record} lands inside the try
            ready="True", p2p="", name="'all_reduce'", keep="(t,)", call="_f(t, hs)", cname="'all_reduce'",
            post="", record=launch._indent(sev.source(), 8), ret="None", not_ready="_lock.release()",
            ticket="", enter="", leave="")
        src = "def f(t, hs):\n" + launch._indent(body, 4)
        compile(src, "<test>", "exec")
        assert "_sev_record(ev.handle, cs)" in src and ("k % _sev_every" in src) == (n != 1)


# ---- issue 27 (7): PREMUL_SUM on NCCL is NCCL's own (premultiplied) ------------
def _nccl_plan_context(size: int = 8):
    from streamcoll._ffi.nccl import NCCL
    from streamcoll.core.backends import get_backend
    from streamcoll.core.plans import PlanContext
    if not NCCL.is_available():
        pytest.skip("NCCL not loadable: " + "; ".join(getattr(NCCL, "tried", [])))
    comm = types.SimpleNamespace(_backend=get_backend("nccl"), _lib=NCCL.lib(), _rank=0, _size=size,
                                 _device=torch.device("cuda", 0), _gpu=True, _handle=None)
    return PlanContext(comm), NCCL


def test_premul_sum_on_nccl_is_the_librarys_own():
    """The reduction NCCL gets for premul_sum(f) is a PreMulSum op made per
    launch (ncclRedOpCreatePreMulSum, host-immediate scalar), not SUM
    followed by a multiplication (which overflows fp16 where torch's
    premultiplication does not); before, it was always (SUM, 'PREMUL_SUM')."""
    ctx, _ = _nccl_plan_context()
    for dt in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        assert ctx.reduction(streamcoll.premul_sum(0.125), dt, "all_reduce") == (None, "NATIVE_PREMUL", 0.125)
    with pytest.raises(TypeError, match="op: PREMUL_SUM needs a floating dtype"):
        ctx.reduction(streamcoll.premul_sum(0.5), torch.int32, "all_reduce")
    assert ctx.reduction(streamcoll.ReduceOp.AVG, torch.float16, "all_reduce")[1] is None  # NCCL's own AVG


def test_premul_launch_creates_calls_and_destroys_the_op():
    """plans._premul: create (scalar, dtype, host-immediate, comm), the
    collective with that op in its op argument, destroy, in that order; a
    failed creation returns its result without calling the collective. The
    real ncclRedOpCreatePreMulSum refuses a NULL communicator."""
    from streamcoll.core.plans import _premul
    ctx, nccl = _nccl_plan_context()
    calls = []

    def create(opp, scalar, dtype, residence, comm):
        calls.append(("create", scalar, dtype, residence, comm))
        opp[0] = 41
        return 0

    def coll(*args):
        calls.append(("call",) + args)
        return 0

    def destroy(op, comm):
        calls.append(("destroy", op, comm))
        return 0

    fn = _premul(coll, create, destroy, nccl.ffi, "S", 7, 1, "C", 4)
    assert fn("send", "recv", 16, 7, 0, "C", "stream") == 0
    assert calls == [("create", "S", 7, 1, "C"), ("call", "send", "recv", 16, 7, 41, "C", "stream"), ("destroy", 41, "C")]
    lib = nccl.lib()
    scalar = torch.tensor([0.5], dtype=torch.float32)
    ran = []
    fn = _premul(lambda *a: ran.append(a) or 0, lib.ncclRedOpCreatePreMulSum, lib.ncclRedOpDestroy, nccl.ffi,
                 nccl.ffi.cast("void *", scalar.data_ptr()), nccl.const("ncclFloat32"),
                 nccl.const("ncclScalarHostImmediate"), nccl.ffi.NULL, 4)
    rc = fn(None, None, 1, 0, 0, nccl.ffi.NULL, None)
    assert rc == nccl.const("ncclInvalidArgument") and ran == []


# ---- issue 27 (2): a non-blocking NCCL failure goes through the Communicator ---
class _PoisoningNccl:
    """Pure-logic stand-in for NCCL's non-blocking state calls: abort frees
    (poisons) the handle, and any later call on it is recorded as a use after
    free. The real thing needs a GPU (tests/diagnostics/test_reliability.py's cuda tests)."""

    def __init__(self, state: int) -> None:
        self.state, self.freed, self.uaf, self.calls = state, set(), [], []

    def ncclCommGetAsyncError(self, h, out):
        if h in self.freed:
            self.uaf.append("ncclCommGetAsyncError")
        out[0] = self.state
        return 0

    def ncclCommAbort(self, h):
        self.calls.append("abort")
        if h in self.freed:
            self.uaf.append("ncclCommAbort")
        self.freed.add(h)
        return 0


def _nonblocking_stand_in(state: int):
    from streamcoll._ffi.nccl import NCCL
    if not NCCL.is_available():
        pytest.skip("NCCL not loadable")
    lib = _PoisoningNccl(state)
    binding = types.SimpleNamespace(const=NCCL.const, error=lambda f, rc, comm=None: NCCL.error(f, rc))
    backend = types.SimpleNamespace(lib=lambda: lib, ffi=NCCL.ffi, binding=binding,
                                    abort=lambda h: lib.ncclCommAbort(h) == 0)
    order = []

    class Comm:  # what make_nonblocking reads of a Communicator
        _backend, _handle, timeout, rank, size = backend, 7, 0.05, 0, 1
        failure = None

        def register_rc_hook(self, h):
            self.hook = h

        def mark_failed(self, e):
            order.append("mark_failed")
            self.failure = e

        def abort(self):
            order.append("abort")
            lib.ncclCommAbort(self._handle)
            self._handle = None  # the Communicator drops the freed pointer

    c = Comm()
    backends.make_nonblocking(c)
    return c, lib, order


@pytest.mark.parametrize("case", ["error", "timeout"])
def test_nonblocking_failure_marks_the_communicator_failed_before_the_abort(case):
    """Before, nccl_wait_ready called ncclCommAbort itself and nothing marked
    the Communicator failed: its handle, fast paths and watchdog registration
    stayed live on the freed communicator. Now the hook goes through the
    Communicator (mark_failed, then its abort, once)."""
    from streamcoll._ffi.nccl import NCCL
    in_progress = NCCL.const("ncclInProgress")
    c, lib, order = _nonblocking_stand_in(NCCL.const("ncclSystemError") if case == "error" else in_progress)
    with pytest.raises(Exception) as ei:
        c.hook("all_reduce", in_progress)
    assert order == ["mark_failed", "abort"] and lib.calls == ["abort"] and lib.uaf == []
    assert c.failure is ei.value and c._handle is None
    if case == "timeout":
        assert isinstance(ei.value, streamcoll.CollectiveTimeout)
    # what the watchdog does next with this communicator: nothing on the freed handle
    assert watchdog._nccl_async_error(types.SimpleNamespace(
        _backend=types.SimpleNamespace(name="nccl"), destroyed=False, failure=c.failure, _handle=c._handle)) is None


def test_split_waits_for_a_nonblocking_child_before_a_communicator_holds_it():
    """The child of a non-blocking split is polled ready (or aborted and
    raised) before a Communicator is made for it, so the watchdog never
    registers a handle that the failed wait freed."""
    import inspect
    from streamcoll.core.communicator import Communicator
    src = inspect.getsource(Communicator.split)
    assert src.index("nccl_wait_ready(") < src.index("lambda: Communicator(")
