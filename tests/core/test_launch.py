"""The declaration table and what derives from it (issue 11).

Tiers: unit tests on the table (no library); world-size-1 tests on the real
oneCCL (fast paths, hooks, sequence numbers, Python frames on the call path);
and a multi-process test that runs every collective that has a reference
implementation with inputs built from its ParamSpecs, on 2 and 3 ranks, and
compares with the reference: a collective added to the table is covered
without new test code.
"""
from __future__ import annotations

import inspect
import sys
import threading
import time
from typing import Any, Dict, List

import numpy as np
import pytest
import torch
import torch.distributed as dist

import streamcoll
from streamcoll.core import source_text, spec
from streamcoll.core.backends import get_backend

from conftest import needs_oneccl


# ----------------------------------------------------------------- the table
def test_every_collective_is_declared_once_and_everything_derives_from_it():
    from streamcoll.core import checks as debug
    from streamcoll.diagnostics import flight
    from streamcoll.core.communicator import Communicator
    names = set(spec.TABLE)
    assert names >= {"all_reduce", "broadcast", "reduce", "all_gather_into_tensor", "all_gather",
                     "reduce_scatter_tensor", "reduce_scatter", "all_to_all_single", "all_to_all", "gather",
                     "scatter", "send", "recv", "isend", "irecv", "batch_isend_irecv", "barrier"}
    for name, s in spec.TABLE.items():
        m = getattr(Communicator, name)
        f = getattr(streamcoll, name)
        assert m.__doc__ == source_text.doc_text(s) and f.__doc__.startswith(source_text.doc_text(s))
        mp = [p for p in inspect.signature(m).parameters if p != "self"]
        fp = [p for p in inspect.signature(f).parameters if p != "group"]
        assert mp == fp, name  # the method and the module function take the same arguments
        assert tuple(mp[:len(s.params)]) == s.param_names, name
        for a in s.aliases:
            assert getattr(Communicator, a) is m
        for lib, cname in s.c.items():
            assert get_backend(lib).funcs[name] == cname
    assert flight.P2P_OPS == {n for n, s in spec.TABLE.items() if s.p2p}
    assert set(debug.CHECKED) == {n for n, s in spec.TABLE.items() if not s.p2p} | {"split"}
    # torch.distributed's argument order and defaults
    assert str(inspect.signature(streamcoll.all_reduce)) == \
        "(tensor, op=ReduceOp.SUM, group=None, async_op=False, *, stream=None, timeout=None)"
    assert str(inspect.signature(streamcoll.send)) == "(tensor, dst, group=None, tag=0, *, stream=None, timeout=None)"
    assert str(inspect.signature(streamcoll.gather)) == \
        "(tensor, gather_list=None, dst=0, group=None, async_op=False, *, stream=None, timeout=None)"
    assert str(inspect.signature(streamcoll.barrier)) == "(group=None, async_op=False, device_ids=None, *, timeout=None)"


@pytest.mark.parametrize("lib", ["nccl", "oneccl"])
def test_c_argument_order_is_read_from_the_headers(lib):
    from streamcoll._ffi._common import read_declarations
    text = read_declarations(get_backend(lib).binding.declarations)
    assert source_text.c_roles(text, f"{lib}AllReduce") == ("send", "recv", "count", "dtype", "op", "comm", "stream")
    assert source_text.c_roles(text, f"{lib}Reduce") == ("send", "recv", "count", "dtype", "op", "root", "comm", "stream")
    assert source_text.c_roles(text, f"{lib}Send") == ("send", "count", "dtype", "peer", "comm", "stream")
    for s in spec.TABLE.values():
        if lib in s.c:
            roles = source_text.c_roles(text, s.c[lib])
            assert roles[-2:] == ("comm", "stream"), s.name
    with pytest.raises(KeyError):
        source_text.c_roles(text, f"{lib}NoSuchCollective")


# ------------------------------------------------------------ world size 1
def _comm(**kw):
    return streamcoll.new_communicator(backend="oneccl", device="cpu", rank=0, world_size=1,
                                       store=dist.HashStore(), **kw)


from streamcoll.bench.overhead import count_frames as _frames  # noqa: E402


@needs_oneccl
def test_synchronous_calls_enter_one_python_frame(monkeypatch):
    """The deterministic proxy for the fast path's cost: a synchronous
    method call runs exactly one Python frame (its generated fast path), the
    module-level function four (itself, torch.compiler.is_compiling and its
    torch.jit.is_scripting, the method); a numpy input takes the general path."""
    monkeypatch.setenv("STREAMCOLL_WATCHDOG", "off")
    c = _comm(name="frames")
    try:
        from streamcoll.bench.cases import benchmarkable
        from streamcoll.bench.overhead import _cases
        fast = [n for n, s in spec.TABLE.items() if s.fast]
        # every fast collective but send/recv (a pair: two ranks) has a benchmark case, whose
        # arguments (derived from the table) are the ones timed: a new fast entry is covered here
        assert set(fast) - {"send", "recv"} <= {n for n, s in spec.TABLE.items() if benchmarkable(s)}
        cases = _cases(c, [n for n in fast if n not in ("send", "recv")])
        assert len(cases) >= 6
        for name, case in cases.items():
            assert _frames(getattr(c, name), *case.args) == 1, name
            assert _frames(lambda *x: getattr(streamcoll, name)(*x, group=c), *case.args) <= 5, name
            assert case.check(4) is None, name  # the four calls computed the right values
        general = _frames(c.all_reduce, np.ones(4, dtype=np.float32))
        assert general > 3
        # AVG the library lacks (oneCCL): floats take the fast path (SUM, then the division
        # inline), integers the general path (truncating division)
        import torch.distributed as dist
        t = torch.ones(4)
        for avg in (streamcoll.ReduceOp.AVG, dist.ReduceOp.AVG):
            assert _frames(c.all_reduce, t, avg) == 1
            assert _frames(c.reduce_scatter_tensor, t, torch.ones(4), avg) == 1
        assert _frames(c.all_reduce, torch.ones(4, dtype=torch.int32), streamcoll.ReduceOp.AVG) > 3
        # bf16 reduced through float32 (oneCCL CPU, backends._WIDENED) has a fast path of its own
        # (issue 25): float32 scratch owned by the fast path, one frame, grown then reused
        b = torch.arange(6, dtype=torch.bfloat16)
        for op in (streamcoll.ReduceOp.SUM, streamcoll.ReduceOp.AVG, dist.ReduceOp.MAX):
            assert _frames(c.all_reduce, b, op) == 1
            assert torch.equal(b, torch.arange(6, dtype=torch.bfloat16))  # one rank: unchanged, after rounding
        out = torch.empty(6, dtype=torch.bfloat16)
        assert _frames(c.reduce_scatter_tensor, out, b) == 1 and torch.equal(out, b)
        assert _frames(c.reduce, b, 0) == 1
        sc = c.all_reduce.__globals__["_sc"]
        big = torch.ones(1 << 12, dtype=torch.bfloat16)
        c.all_reduce(big)
        grown = sc[0]
        assert grown.numel() >= 1 << 12 and grown.dtype == torch.float32
        views = c.all_reduce.__globals__["_wv"]
        entry = views[big.shape]
        c.all_reduce(big)
        assert sc[0] is grown  # reused, not reallocated per call
        assert views[big.shape] is entry  # and its view of that shape, not re-sliced (issue 35)
        # each shape its own view of the same scratch, in that shape (no view(-1) per call)
        m = torch.arange(12, dtype=torch.bfloat16).view(3, 4)
        c.all_reduce(m, streamcoll.ReduceOp.AVG)
        assert torch.equal(m, torch.arange(12, dtype=torch.bfloat16).view(3, 4))
        w, p = views[m.shape]
        assert w.shape == m.shape and w.data_ptr() == grown.data_ptr()
        assert int(c._cx.ffi.cast("uintptr_t", p)) == w.data_ptr()
        # growing the scratch drops the views of the old one
        c.all_reduce(torch.ones(1 << 14, dtype=torch.bfloat16))
        assert sc[0] is not grown and list(views) == [torch.Size([1 << 14])]
    finally:
        c.destroy()


@needs_oneccl
def test_process_group_calls_take_the_fast_path(monkeypatch):
    """Issue 25: ``ProcessGroupStreamcoll.allreduce`` (what ``dist.all_reduce``
    on the "streamcoll" backend calls) reaches the communicator's generated
    fast path: two frames of streamcoll's for SUM (the generated method and
    the fast path; issue 35: the op compared inline, the Work made by
    torch's constructor alone), three for another op (``_op`` canonicalises
    it). Before issue 25 every call took the general planner (about 25
    frames): ``AllreduceOptions.reduceOp`` is a new unhashable object on
    every access, which no fast path recognised."""
    monkeypatch.setenv("STREAMCOLL_WATCHDOG", "off")
    from streamcoll.integrations.process_group import ProcessGroupStreamcoll, StreamcollWork
    pg = ProcessGroupStreamcoll(dist.HashStore(), 0, 1)
    try:
        x = torch.ones(4)
        for name in ("SUM", "MAX", "AVG"):
            o = dist.AllreduceOptions()
            o.reduceOp = getattr(dist.ReduceOp, name)
            o.asyncOp = False
            pg.allreduce([x], o).wait()  # the first call makes the communicator
            assert _frames(pg.allreduce, [x], o) == (2 if name == "SUM" else 3), name
            assert torch.equal(x, torch.ones(4))
        w = pg.allreduce([x], o)
        assert isinstance(w, StreamcollWork) and w.wait() and w.result() == [x]
        b = dist.BroadcastOptions()
        b.asyncOp = False
        assert _frames(pg.broadcast, [x], b) == 2
        o.asyncOp = True
        w = pg.allreduce([x], o)
        assert w.wait() and torch.equal(x, torch.ones(4))
        # a PREMUL_SUM carries its factor: the general path, the right value
        o = dist.AllreduceOptions()
        o.reduceOp = dist._make_nccl_premul_sum(0.5)
        o.asyncOp = False
        pg.allreduce([x], o).wait()
        assert torch.equal(x, torch.full((4,), 0.5))
    finally:
        pg.shutdown() if hasattr(pg, "shutdown") else None
        for c in list(pg._comms.values()):
            c.destroy()


@needs_oneccl
def test_small_async_calls_are_queued_quietly_and_run_by_wait(monkeypatch):
    """Issue 33 (the async contract; issue 25's inline strategy before): a
    CPU ``async_op=True`` call up to ``inline_async_bytes`` is queued by the
    generated fast path without waking the comm thread and returns a pending
    Work; ``wait()`` without a timeout runs it on the calling thread. The
    frame-count proxy of that hot path: issue, wait and drop in 22 frames (the
    general path, which the comm thread's hand-off takes, enters about 50 and
    pays two thread switches). Above the threshold, for dtypes reduced
    through a wider one, and with the threshold 0, the call takes the general
    path to the comm thread; a ProcessGroup async call takes the fast path."""
    monkeypatch.setenv("STREAMCOLL_WATCHDOG", "off")
    monkeypatch.delenv("STREAMCOLL_INLINE_ASYNC_BYTES", raising=False)
    from streamcoll.core.communicator import INLINE_ASYNC_BYTES
    from streamcoll.core.work import Work
    c = _comm(name="inline-async")
    SUM = streamcoll.ReduceOp.SUM
    try:
        assert c.inline_async_bytes == INLINE_ASYNC_BYTES > 0
        small = torch.ones(INLINE_ASYNC_BYTES // 4)
        ran: List[bool] = []
        run_here = c._rt.run_here
        monkeypatch.setattr(c._rt, "run_here", lambda ev: ran.append(run_here(ev)) or ran[-1])
        for t in (torch.ones(1), small):
            time.sleep(0.05)  # the comm thread, woken by the queries below, has gone back to sleep
            # the lambda's own frame, then the fast path's and the wait's (and the run_here recorder's);
            # 3 of them are _enqueue's notify_all, which a quiet item does not need
            assert _frames(lambda: c.all_reduce(t, SUM, True).wait()) <= 24, t.shape
            w = c.all_reduce(t, async_op=True)
            assert type(w) is Work and w._here and w._event.item is not None
            del ran[:]
            assert w.wait() and ran == [True]  # run on this thread
            assert w.is_completed() and w.is_success() and w.exception() is None
            assert w.result() == [t] and w.get_future().wait() == [t]
        out, inp = torch.empty(8), torch.ones(8)
        time.sleep(0.05)
        assert _frames(lambda: c.all_gather_into_tensor(out, inp, True).wait()) <= 24
        general = _frames(lambda: c.all_reduce(torch.ones(8, dtype=torch.bfloat16), SUM, True).wait())
        assert general > 30  # bf16 (reduced through float32): the general path, still run by wait()
        big = torch.ones(INLINE_ASYNC_BYTES // 4 + 1)
        assert _frames(c.all_reduce, big, SUM, True) > 20
        w = c.all_reduce(big, async_op=True)
        assert not w._here and w.wait()
        c.inline_async_bytes = 0
        w = c.all_reduce(torch.ones(1), async_op=True)
        assert c.fast_path and not w._here and w.wait()
        with pytest.raises(ValueError, match="inline_async_bytes: expected an int >= 0"):
            c.inline_async_bytes = -1
    finally:
        c.destroy()
    from streamcoll.integrations.process_group import ProcessGroupStreamcoll
    pg = ProcessGroupStreamcoll(dist.HashStore(), 0, 1)
    try:
        x = torch.ones(4)
        o = dist.AllreduceOptions()
        o.asyncOp = True
        pg.allreduce([x], o).wait()  # the first call makes the communicator
        assert _frames(lambda: pg.allreduce([x], o).wait()) <= 30  # the communicator's fast path inside
        w = pg.allreduce([x], o)
        assert w.wait() and w.is_completed() and torch.equal(x, torch.ones(4))
    finally:
        for c in list(pg._comms.values()):
            c.destroy()


@needs_oneccl
def test_fast_paths_follow_hooks_coalescing_failure_and_destroy(monkeypatch):
    monkeypatch.setenv("STREAMCOLL_WATCHDOG", "off")
    c = _comm(name="elig")
    try:
        assert c.fast_path
        seen: List[str] = []
        h = c.register_pre_hook(lambda rec: seen.append(f"{rec.name}:{rec.args['tensor'].numel()}"))
        assert not c.fast_path
        c.all_reduce(torch.ones(3))
        assert seen == ["all_reduce:3"]
        h.remove()
        assert c.fast_path
        c.all_reduce(torch.ones(3))
        assert seen == ["all_reduce:3"]
        with c.coalescing():
            assert not c.fast_path
        assert c.fast_path
        c.mark_failed(RuntimeError("injected"))
        assert not c.fast_path
        with pytest.raises(streamcoll.CommunicatorError, match="injected"):
            c.all_reduce(torch.ones(3))
    finally:
        c.destroy()
    assert not c.fast_path


@needs_oneccl
def test_sequence_numbers_are_issue_order_across_threads(monkeypatch):
    """4 threads issue sync and async collectives at once: every sequence
    number is taken once, with no hole, and each C call ran under its own."""
    monkeypatch.setenv("STREAMCOLL_WATCHDOG", "off")
    monkeypatch.setenv("STREAMCOLL_FLIGHT_SIZE", "4096")
    monkeypatch.setenv("STREAMCOLL_INLINE_ASYNC_BYTES", "0")  # async: the comm thread's sequence numbers
    c = _comm(name="threads")
    errors: List[BaseException] = []
    per = 150

    def work(k: int) -> None:
        try:
            t = torch.ones(2)
            for i in range(per):
                if (i + k) % 5 == 0:
                    c.all_reduce(t, async_op=True).wait()
                else:
                    c.all_reduce(t)
        except BaseException as e:  # re-raised below
            errors.append(e)

    try:
        ts = [threading.Thread(target=work, args=(k,)) for k in range(4)]
        for x in ts:
            x.start()
        for x in ts:
            x.join(60)
        assert not errors, errors
        assert c.seq == 4 * per
        es = c.flight.entries()
        assert [e.seq for e in es] == list(range(1, 4 * per + 1))
        # async calls, and sync calls that went behind queued async work, run on the comm thread
        assert sum(1 for e in es if not e.sync) >= sum(1 for k in range(4) for i in range(per) if (i + k) % 5 == 0)
        assert {e.op for e in es} == {"all_reduce"} and all(e.state == "completed" for e in es if not e.sync)
    finally:
        c.destroy()


@needs_oneccl
def test_coalesced_group_takes_one_sequence_number(monkeypatch):
    monkeypatch.setenv("STREAMCOLL_WATCHDOG", "off")
    c = _comm(name="coal")
    try:
        t = torch.ones(3)
        c.all_reduce(t)
        with c.coalescing():
            c.all_reduce(t)
            c.broadcast(t, 0)
        c.all_reduce(t)
        es = c.flight.entries()
        assert [(e.seq, e.op) for e in es] == [(1, "all_reduce"), (2, "coalesced"), (3, "all_reduce")]
        assert c.seq == 3
    finally:
        c.destroy()


@needs_oneccl
def test_refused_call_takes_no_sequence_number(monkeypatch):
    monkeypatch.setenv("STREAMCOLL_WATCHDOG", "off")
    c = _comm(name="refuse")
    try:
        with pytest.raises(TypeError, match="async_op"):
            c.all_reduce(torch.ones(1), async_op="yes")
        with pytest.raises(ValueError, match="stream"):
            c.all_reduce(torch.ones(1), async_op=True, stream=object())
        assert c.seq == 0 and c.flight.entries() == []
    finally:
        c.destroy()


# ---------------------------------------------------- every collective, by table
def _value(rank: int, param: int, index: int, n: int) -> np.ndarray:
    return (np.arange(n, dtype=np.float32) % 5 + 1 + 10 * rank + 3 * param + index).astype(np.float32)


def _case(s: spec.CollectiveSpec, size: int, rank: int, op: str):
    """Arguments for ``s`` on ``rank`` built from its ParamSpecs, and what every
    rank passed (for the reference). Buffers of ``n`` elements; size
    relations from the declaration; roots the last rank; lists one per rank."""
    n = 2 * size
    numel: Dict[str, int] = {p.name: n for p in s.buffers}
    for buf, rel, other in s.sizes:
        numel[buf] = numel[other] * (size if rel == "size*" else 1)
    root = size - 1

    def build(r: int):
        args: Dict[str, Any] = {}
        refs: Dict[str, Any] = {}
        kw: Dict[str, Any] = {}
        for i, p in enumerate(s.params):
            if p.kind == spec.TENSOR:
                x = _value(r, i, 0, numel[p.name]) if p.role in ("in", "inout") else np.zeros(numel[p.name], np.float32)
                refs[p.name] = x
                args[p.name] = torch.from_numpy(x.copy())
            elif p.kind == spec.TENSOR_LIST:
                if p.root_only and r != root:
                    args[p.name] = None
                    continue
                xs = [_value(r, i, j, n) if p.role == "in" else np.zeros(n, np.float32) for j in range(size)]
                refs[p.name] = xs
                args[p.name] = [torch.from_numpy(x.copy()) for x in xs]
            elif p.kind == spec.RANK:
                args[p.name] = kw[p.name] = root
            elif p.kind == spec.OP:
                args[p.name] = streamcoll.ReduceOp[op]
                kw["op"] = op
            else:
                args[p.name] = p.default
        return args, refs, kw

    mine, _, kw = build(rank)
    ins = [build(r)[1] for r in range(size)]
    return mine, ins, kw


def w_table(comm, async_op: bool) -> List[str]:
    done = []
    for name, s in spec.TABLE.items():
        if s.reference is None:
            continue
        for op in (["SUM", "MAX", "AVG"] if s.reduces else ["SUM"]):
            args, ins, kw = _case(s, comm.size, comm.rank, op)
            call_args = [args[p] for p in s.param_names]
            w = getattr(comm, name)(*call_args, async_op=async_op) if s.async_mode == "param" \
                else getattr(comm, name)(*call_args)
            if async_op and w is not None:
                w.wait()
            want = s.reference(comm.size, comm.rank, ins, **kw)
            for pname, exp in want.items():
                got = args[pname]
                if isinstance(exp, list):
                    for j, e in enumerate(exp):
                        np.testing.assert_allclose(got[j].numpy().reshape(-1), np.asarray(e).reshape(-1),
                                                   rtol=1e-6, err_msg=f"{name} {op} {pname}[{j}]")
                else:
                    np.testing.assert_allclose(got.numpy().reshape(-1), np.asarray(exp).reshape(-1), rtol=1e-6,
                                               err_msg=f"{name} {op} {pname}")
            done.append(f"{name}/{op}")
    return done


@pytest.mark.parametrize("async_op", [False, True], ids=["sync", "async"])
def test_every_collective_of_the_table_matches_its_reference(world, async_op):
    res = world.run(w_table, async_op)
    want = {f"{n}/{op}" for n, s in spec.TABLE.items() if s.reference is not None
            for op in (["SUM", "MAX", "AVG"] if s.reduces else ["SUM"])}
    for r in res:
        assert set(r) == want


@needs_oneccl
def test_watchdog_sees_a_stuck_sync_call_after_many_async_ops(monkeypatch, capfd):
    """Issue 12 (11): after more than 256 async operations the watchdog must
    still see a synchronous call that does not return (it scans newest first)."""
    import time
    from streamcoll.core.spec import Plan
    monkeypatch.setenv("STREAMCOLL_WATCHDOG", "fail")
    c = _comm(name="wd-scan", timeout=1.0)
    try:
        t = torch.ones(2)
        for _ in range(300):
            c.all_reduce(t, async_op=True)
        c.all_reduce(t, async_op=True).wait()

        def stuck(h):  # where the C call would hang
            time.sleep(3.5)
            return 0

        c._launch("broadcast", Plan(stuck, (), None, (t,), (t,), "broadcast"), False, None)
        assert isinstance(c.failure, streamcoll.CollectiveTimeout), c.failure
        assert "broadcast" in str(c.failure) and "302" in str(c.failure)
        from streamcoll.diagnostics import watchdog
        # reported through the streamcoll.diagnostics.watchdog logger (issue 15)
        assert any("streamcoll watchdog: broadcast (sequence number 302)" in m for m in watchdog.WATCHDOG.fired)
    finally:
        c.destroy()


@needs_oneccl
def test_work_in_flight_when_the_communicator_failed_raises_after_it_completes(monkeypatch):
    """Issue 12 (2): a Work unfinished when its communicator failed raises on
    wait() even once its call ran to the end (as after ncclCommAbort and a
    synchronize on a GPU); one that had completed before does not."""
    import time
    from streamcoll.core.spec import Plan
    monkeypatch.setenv("STREAMCOLL_WATCHDOG", "off")
    monkeypatch.setenv("STREAMCOLL_INLINE_ASYNC_BYTES", "0")  # work in flight: the comm thread's
    c = _comm(name="failed-inflight")
    try:
        t = torch.ones(2)
        done = c.all_reduce(t, async_op=True)
        done.synchronize()

        def slow(h):
            time.sleep(1.0)
            return 0

        w = c._launch("broadcast", Plan(slow, (), None, (t,), (t,), "broadcast"), True, None)
        time.sleep(0.2)
        c.mark_failed(RuntimeError("injected failure"))
        time.sleep(1.5)  # the call has ended by now
        assert w.is_completed()
        with pytest.raises(streamcoll.CommunicatorError, match="injected failure"):
            w.wait()
        assert done.wait()  # finished before the failure
        assert c.flight.at(w.seq).state == "failed"
    finally:
        c.destroy()


# ------------------------------------------------ bad input, derived from the table
def _buildable(s: spec.CollectiveSpec) -> bool:
    """Whether ``_case`` can build valid arguments from the declaration alone
    (an untyped required parameter, a list of lists, cannot be)."""
    return all(not (p.kind == spec.ANY and p.default is spec.REQUIRED) for p in s.params)


def _faults(s: spec.CollectiveSpec, size: int):
    """(label, parameter, bad value factory, exception, words) for every
    parameter the declaration has: the error must name the parameter. Root-
    only lists are left out (only the root checks them: broken there alone
    the others would enter the collective; see tests/core/test_fuzz.py)."""
    out = []
    first = s.send or s.recv  # a native collective checks its other buffers against this one
    for p in s.params:
        if p.kind == spec.TENSOR:
            out += [(f"{p.name} non-contiguous", p.name, lambda x: torch.ones(x.numel(), 2).t()[0], ValueError,
                     [p.name, "contiguous"]),
                    (f"{p.name} on meta", p.name, lambda x: torch.empty(x.shape, device="meta"), ValueError,
                     [p.name, "meta", "cpu"]),
                    (f"{p.name} a list", p.name, lambda x: x.tolist(), TypeError, [p.name, "list", "torch.Tensor"])]
            if first is not None and p.name != first:
                out.append((f"{p.name} dtype", p.name, lambda x: x.to(torch.float64), TypeError,
                            [p.name, "float32"]))
        elif p.kind == spec.TENSOR_LIST and not p.root_only:
            out.append((f"{p.name} length", p.name, lambda x: list(x) + [x[0]], ValueError, [p.name, str(size)]))
        elif p.kind == spec.RANK:
            out += [(f"{p.name} range", p.name, lambda x: size + 1, ValueError, [p.name, f"[0, {size})"]),
                    (f"{p.name} negative", p.name, lambda x: -1, ValueError, [p.name, f"[0, {size})"]),
                    (f"{p.name} type", p.name, lambda x: "0", TypeError, [p.name, "int"]),
                    (f"{p.name} float", p.name, lambda x: 0.0, TypeError, [p.name, "int"]),
                    (f"{p.name} bool", p.name, lambda x: True, TypeError, [p.name])]
        elif p.kind == spec.SPLITS:
            out.append((f"{p.name} length", p.name, lambda x: [1] * (size + 1), ValueError, [p.name, str(size)]))
        elif p.kind == spec.OP:
            out.append(("op unknown", p.name, lambda x: "XOR", TypeError, ["op"]))
    for buf, rel, other in s.sizes:  # a declared size relation, off by one: names the buffer and the size
        if rel == "size*":
            out.append((f"{buf} size", buf, lambda x: torch.empty(x.numel() + 1, dtype=x.dtype), ValueError,
                        [buf, str(2 * size * size)]))
    return out


def w_table_bad_input(comm) -> List[str]:
    failures, n = [], 0
    for name, s in spec.TABLE.items():
        if s.returns == "work_list" or not s.params or not _buildable(s):
            continue
        for label, pname, bad, exc, words in _faults(s, comm.size):
            args, _, _ = _case(s, comm.size, comm.rank, "SUM")
            if pname in args and args[pname] is None:
                continue
            args[pname] = bad(args[pname])
            seq = comm.seq
            try:
                getattr(comm, name)(*[args[p] for p in s.param_names])
            except exc as e:
                missing = [w for w in words if w not in str(e)]
                if missing:
                    failures.append(f"{name} {label}: {e!r} lacks {missing}")
                if comm.seq != seq:
                    failures.append(f"{name} {label}: raised after a launch")
            except Exception as e:  # noqa: BLE001
                failures.append(f"{name} {label}: expected {exc.__name__}, got {type(e).__name__}: {e}")
            else:
                failures.append(f"{name} {label}: no exception")
            n += 1
    t = torch.full((3,), float(comm.rank))
    comm.all_reduce(t)  # nothing was half issued
    assert t.tolist() == [float(sum(range(comm.size)))] * 3
    assert n > 60, n
    return failures


def test_bad_input_of_every_declared_parameter_is_named(world2):
    for r, failures in enumerate(world2.run(w_table_bad_input)):
        assert failures == [], f"rank {r}:\n" + "\n".join(failures)


def test_the_fuzz_covers_every_declared_collective():
    """tests/core/test_fuzz.py derives its calls from the table: every collective
    is fuzzed (point-to-point ones in sender/receiver pairs) unless listed as
    not buildable, with the reason."""
    import test_fuzz
    covered = set(test_fuzz.NOT_FUZZED)
    for fn in test_fuzz.FNS:
        covered |= set(test_fuzz.PAIRS.get(fn, (fn,)))
    assert covered == set(spec.TABLE)
    assert set(test_fuzz.NOT_FUZZED) <= {n for n, s in spec.TABLE.items()
                                         if any(p.kind == spec.ANY and p.default is spec.REQUIRED for p in s.params)}

