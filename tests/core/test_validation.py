"""Inputs that were accepted or failed obscurely (issue 15), on a one-rank
oneCCL communicator: each raises the documented exception, naming the
argument or variable, before any native call."""
from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

import streamcoll
from streamcoll.core.spec import Plan

from conftest import needs_oneccl

pytestmark = needs_oneccl


def _comm(**kw):
    return streamcoll.new_communicator(backend="oneccl", device="cpu", rank=0, world_size=1,
                                       store=dist.HashStore(), **kw)


@pytest.fixture(scope="module")
def comm():
    c = _comm(name="validation")
    yield c
    c.destroy()


def test_stream_on_the_cpu(comm):
    t = torch.ones(2)
    with pytest.raises(TypeError, match="stream: all_reduce on a cpu communicator expects a cpu stream"):
        comm.all_reduce(t, stream="s")
    with pytest.raises(TypeError, match="stream: broadcast"):
        comm.broadcast(t, 0, stream=object())
    # nothing was issued by the rejected calls: a real collective still works.
    # Out of place (a one-rank all_reduce in place returns its input whether
    # or not anything ran): the poisoned output must receive the input.
    out = torch.full((2,), -1.0)
    comm.all_gather_into_tensor(out, torch.tensor([1.0, 2.0]))
    assert comm.failure is None and out.tolist() == [1.0, 2.0]


@pytest.mark.parametrize("bad", [-1, 0, float("nan"), float("inf")])
def test_wait_timeout_must_be_positive(comm, bad):
    """Before: ``wait(timeout=-1)`` raised CollectiveTimeout "within -1 s" and
    failed the communicator for good."""
    w = comm.all_reduce(torch.ones(2), async_op=True)
    with pytest.raises(ValueError, match="timeout: expected a positive number of seconds"):
        w.wait(timeout=bad)
    assert w.wait() is True and comm.failure is None
    with pytest.raises(TypeError, match="timeout: expected a number of seconds"):
        w.wait(timeout="1")


@pytest.mark.parametrize("value", ["abc", "0", "-1", "nan"])
def test_streamcoll_timeout_variable(monkeypatch, value):
    """Before: ``could not convert string to float`` without the name; 0/-1 a store error."""
    monkeypatch.setenv("STREAMCOLL_TIMEOUT", value)
    with pytest.raises(ValueError, match=r"environment variable STREAMCOLL_TIMEOUT: expected a positive"):
        _comm()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only torch message")
def test_nccl_on_cpu_only_torch():
    """Before: ``AttributeError: ... _cuda_setDevice``."""
    with pytest.raises(streamcoll.BackendUnavailableError, match="needs a CUDA GPU: this torch build has no CUDA"):
        streamcoll.new_communicator(backend="nccl", rank=0, world_size=1, store=dist.HashStore())
    with pytest.raises(streamcoll.CollectiveError):
        streamcoll.new_communicator(device="cuda", rank=0, world_size=1, store=dist.HashStore())


def test_gradient_sync_without_trainable_parameters(comm):
    m = torch.nn.Linear(2, 2)
    for p in m.parameters():
        p.requires_grad_(False)
    with pytest.raises(ValueError, match="params: no trainable parameters"):
        streamcoll.GradientSync(m, group=comm)
    with pytest.raises(ValueError, match="params: no trainable parameters"):
        streamcoll.GradientSync([], group=comm)


def _slow_async(c, seconds: float):
    """An async call that takes ``seconds`` on the comm thread (small calls
    would run inline: the strategy is the comm thread's here)."""
    c.inline_async_bytes = 0
    t = torch.ones(2)

    def slow(h):  # where a C call takes its time
        time.sleep(seconds)
        return 0

    return c._launch("all_reduce", Plan(slow, (), None, (t,), (t,), "all_reduce"), True, None)


def test_short_wait_on_a_slow_call_does_not_fail_the_communicator():
    """A ``wait(timeout)`` shorter than the communicator's timeout that runs
    out leaves it usable, says so, and a second wait succeeds. Before: the
    communicator failed for good, the message saying the call never returns."""
    c = _comm(name="slow", timeout=30)
    try:
        w = _slow_async(c, 1.5)
        with pytest.raises(streamcoll.CollectiveTimeout) as ei:
            w.wait(timeout=0.3)
        e = ei.value
        assert e.stuck is False and c.failure is None, (e, c.failure)
        assert "still running (slow, not declared stuck)" in str(e) and "stays usable" in str(e), e
        assert "never returns" not in str(e)
        assert w.wait() is True
        out = torch.full((2,), -1.0)  # out of place: a one-rank in-place all_reduce proves nothing
        c.all_gather_into_tensor(out, torch.tensor([1.0, 2.0]))
        assert out.tolist() == [1.0, 2.0]
    finally:
        c.destroy()


def test_wait_for_the_communicators_timeout_declares_the_call_stuck(monkeypatch):
    monkeypatch.setenv("STREAMCOLL_WATCHDOG", "fail")
    c = _comm(name="stuck", timeout=1.0)
    try:
        w = _slow_async(c, 2.5)
        with pytest.raises(streamcoll.CollectiveTimeout) as ei:
            w.wait()
        e = ei.value
        assert e.stuck is True and c.failure is not None
        assert "declared stuck" in str(e), e
        with pytest.raises(streamcoll.CommunicatorError):
            c.all_reduce(torch.ones(2))
    finally:
        time.sleep(1.6)  # let the sleeping "call" finish before destroy
        c.destroy()


def test_one_exception_family(comm):
    """Argument errors are TypeError/ValueError; state errors are
    CollectiveError subclasses (before: plain RuntimeError escaped
    ``except CollectiveError``)."""
    with pytest.raises(TypeError, match="async_op: expected a bool"):
        comm.all_reduce(torch.ones(2), async_op="yes")
    with comm.coalescing():
        with pytest.raises(streamcoll.UsageError, match="do not nest"):
            with comm.coalescing():
                pass
    c = streamcoll.init(backend="oneccl", device="cpu", rank=0, world_size=1, store=dist.HashStore())
    try:
        with pytest.raises(streamcoll.CollectiveError, match="already called"):
            streamcoll.init(backend="oneccl", device="cpu", rank=0, world_size=1, store=dist.HashStore())
    finally:
        streamcoll.destroy()
    assert c.destroyed
    for name in ("RendezvousError", "BackendUnavailableError", "UsageError", "NotSupportedError",
                 "CollectiveTimeout", "LibraryError"):
        assert issubclass(getattr(streamcoll, name), streamcoll.CollectiveError), name
    assert issubclass(streamcoll.NotSupportedError, NotImplementedError)
    import pickle
    e = streamcoll.RendezvousError("m", [1], "127.0.0.1", 5, 2, "2")
    e2 = pickle.loads(pickle.dumps(e))
    assert (e2.missing, e2.port, str(e2)) == ([1], 5, "m")
    t = pickle.loads(pickle.dumps(streamcoll.CollectiveTimeout("x", 1, 2.0, stuck=False)))
    assert t.stuck is False
