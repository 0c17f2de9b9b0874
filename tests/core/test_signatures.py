"""The default first-call checks (issue 34): a mismatched collective raises
MismatchError on every rank instead of a partial sum on one and a hang on
the other, and a signature seen before costs nothing (no store request, no
Python frame on the fast path).

Before (no check by default): rank 0 all_reduces 4 floats, rank 1 8: rank
1 returned ``[2, 2, 2, 2, 1, 1, 1, 1]`` and rank 0 hung in oneCCL.

The review of issue 42's fixes (the second part of this file: the
rank-symmetric first-call checks, their store keys, the quiet call's 1 ms
deadline): the scenarios that found a defect, each on real oneCCL ranks. The
scenarios that found none (posted p2p and coalescing blocks behind pending
checks, the bound reached with calls in flight, debug mode switched with
async work queued, a failure and an interrupt while a synchronous first call
drains, two threads on one communicator, 600 quiet calls at random gaps,
quiet calls on two communicators and at destroy) are in the history of this
part's first file (the first commit of test_checks_review.py, folded here
since).
"""
from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import torch

import streamcoll
from streamcoll.core import checks as debug

from conftest import get_world, needs_oneccl
from world import free_port

pytestmark = [needs_oneccl, pytest.mark.world]


# ---------------------------------------------------------------- workers
def _mismatch(comm, case, n0):
    """Rank 1 deviates (``case``); returns what each rank saw, on a split
    of its own (the pooled communicator's bound of checked signatures fills
    up over a session's tests: past it nothing is checked, both ranks then
    hang in the library, as documented; seen in a CI run). ``n0``: a size
    no earlier call used (a new signature)."""
    c = comm.split(0)
    try:
        return _mismatch_on(c, case, n0)
    finally:
        c.destroy()


def _mismatch_on(comm, case, n0):
    r = comm.rank
    t = torch.ones(n0 + (4 if case == "shape" and r == 1 else 0))
    t0 = time.monotonic()
    try:
        if case == "op":
            comm.all_reduce(t, streamcoll.ReduceOp.MAX if r == 1 else streamcoll.ReduceOp.SUM)
        elif case == "collective":
            if r == 1:
                comm.broadcast(t, 0)
            else:
                comm.all_reduce(t)
        else:
            comm.all_reduce(t)
        res = {"raised": None, "value": t.tolist()[:10]}
    except Exception as e:  # noqa: BLE001 - compared in the parent
        res = {"raised": type(e).__name__, "message": str(e), "ranks": getattr(e, "ranks", None)}
    res["elapsed"] = time.monotonic() - t0
    # the communicator is still usable: no rank issued the C call
    u = torch.full((3,), float(r + 1))
    comm.all_reduce(u)
    res["after"] = u.tolist()
    return res


@needs_oneccl
@pytest.mark.parametrize("case", ["shape", "op", "collective", "async"])
def test_mismatch_raises_on_every_rank_by_default(case):
    w = get_world(2)
    n0 = {"shape": 1237, "op": 1239, "collective": 1241, "async": 1243}[case]
    if case == "async":
        res = w.run(_mismatch_async_shape, n0, timeout=60)
    else:
        res = w.run(_mismatch, case, n0, timeout=60)
    for r, x in enumerate(res):
        assert x["raised"] == "MismatchError", (r, x)
        assert x["ranks"] == [1] or x["ranks"] == [0] or x["ranks"] == [0, 1], x
        assert "first-call check" in x["message"] and "No rank issued the collective" in x["message"], x
        assert x["elapsed"] < 10.0, x
        assert x["after"] == [3.0] * 3, x
    if case == "shape":
        assert "float32[1241 elements]" in res[0]["message"] and "float32[1237 elements]" in res[0]["message"]
    if case == "op":
        assert "MAX" in res[0]["message"] and "SUM" in res[0]["message"]
    if case == "collective":
        assert "broadcast" in res[0]["message"] and "all_reduce" in res[0]["message"]


def _mismatch_async_shape(comm, n0):
    c = comm.split(0)  # its own signatures (see _mismatch)
    try:
        return _mismatch_async_shape_on(c, n0)
    finally:
        c.destroy()


def _mismatch_async_shape_on(comm, n0):
    r = comm.rank
    t = torch.ones(n0 + (4 if r == 1 else 0))
    old = comm.inline_async_bytes
    comm.inline_async_bytes = 0  # the general path: the comm thread's strategy
    t0 = time.monotonic()
    try:
        comm.all_reduce(t, async_op=True).wait()
        res = {"raised": None}
    except Exception as e:  # noqa: BLE001
        res = {"raised": type(e).__name__, "message": str(e), "ranks": getattr(e, "ranks", None)}
    finally:
        comm.inline_async_bytes = old
    res["elapsed"] = time.monotonic() - t0
    u = torch.full((3,), float(r + 1))
    comm.all_reduce(u)
    res["after"] = u.tolist()
    return res


def _steady_state(comm, calls):
    """Warm signatures: no store request, one frame on the fast path."""
    from streamcoll.bench.overhead import count_frames
    from streamcoll.bench.rendezvous import CountingStore
    sig = comm._sig
    r, n = comm.rank, comm.size
    x = torch.ones(1021)
    out = torch.empty(4 * n)
    big = torch.ones(1 << 16)
    steps = [lambda: comm.all_reduce(x), lambda: comm.broadcast(x, 0),
             lambda: comm.all_gather_into_tensor(out, torch.ones(4)),
             lambda: comm.all_reduce(big, async_op=True).wait(),  # above the inline size: the general path
             lambda: streamcoll.all_reduce(x, group=comm)]
    for s in steps:  # warm-up: each signature's first call is checked
        s()
    checks0 = sig.checks
    ch = sig._checker
    inner = ch.store
    ch.store = CountingStore(inner)
    try:
        for _ in range(calls):
            for s in steps:
                s()
        requests = ch.store.requests
        frames = count_frames(comm.all_reduce, x)
        entered = _entered(comm.all_reduce, x)
    finally:
        ch.store = inner
    return {"checks": sig.checks - checks0, "requests": requests, "frames": frames, "entered": entered,
            "fast": comm.fast_path, "x": x[0].item()}


def _entered(fn, *args):
    """The (file, function) of each Python frame one call of ``fn`` enters."""
    import sys
    fn(*args)
    out = []

    def prof(frame, event, arg):
        if event == "call":
            f = frame.f_code.co_filename
            out.append((f if f.startswith("<") else f.rsplit("/", 1)[-1], frame.f_code.co_name))
    sys.setprofile(prof)
    try:
        fn(*args)
    finally:
        sys.setprofile(None)
    return out


def test_warm_signatures_cost_no_store_request_and_no_frame(world2):
    res = world2.run(_steady_state, 50, timeout=120)
    for x in res:
        assert x["checks"] == 0 and x["requests"] == 0, x
        # the fast path's one frame; where an async entry held the flight ring's slot, the recorder
        # makes a sync entry for it (FlightEntry.__init__: the pooled world after the async steps)
        assert x["fast"] and x["entered"][0][1] == "all_reduce" and x["entered"][0][0].startswith("<streamcoll"), x
        assert x["entered"][1:] in ([], [("recorder.py", "__init__")]), x


def test_signature_checks_are_off_for_one_rank_and_by_variable(monkeypatch):
    import torch.distributed as dist
    c = streamcoll.new_communicator(backend="oneccl", device="cpu", rank=0, world_size=1, store=dist.HashStore())
    try:
        assert c._sig is None and "_seen" not in c.all_reduce.__globals__
    finally:
        c.destroy()
    with pytest.raises(ValueError, match="STREAMCOLL_SIGNATURE_CHECKS"):
        monkeypatch.setenv("STREAMCOLL_SIGNATURE_CHECKS", "-1")
        debug.signatures_for(type("C", (), {"_size": 2, "_store": object()})())
    monkeypatch.setenv("STREAMCOLL_SIGNATURE_CHECKS", "0")
    assert debug.signatures_for(type("C", (), {"_size": 2, "_store": object()})()) is None


# ------------------------------------------- through torch.distributed, against gloo
_SCRIPT = r"""
import json, os, sys, time, datetime, torch, torch.distributed as dist
import streamcoll
backend, case = sys.argv[1], sys.argv[2]
rank = int(os.environ["RANK"])
dist.init_process_group(backend, timeout=datetime.timedelta(seconds=20))
dist.all_reduce(torch.ones(2))  # the group's communicator exists
t = torch.ones(4 if rank == 0 or case != "shape" else 8)
op = dist.ReduceOp.MAX if (case == "op" and rank == 1) else dist.ReduceOp.SUM
t0 = time.monotonic()
try:
    dist.all_reduce(t, op=op)
    res = {"raised": None, "value": t.tolist()}
except Exception as e:
    res = {"raised": type(e).__name__, "message": str(e)[:2000]}
res["elapsed"] = time.monotonic() - t0
print("RES", json.dumps(res), flush=True)
store = dist.distributed_c10d._get_default_store()
store.set(f"done{rank}", "1")
if rank == 0:
    store.wait(["done1"])  # rank 0 hosts the store: the others must be done reading it
os._exit(0)  # a failed gloo pair cannot be destroyed cleanly
"""


def _run_pair(tmp_path, backend, case, env=None):
    port = free_port()
    procs = []
    for r in range(2):
        e = dict(os.environ, RANK=str(r), WORLD_SIZE="2", LOCAL_RANK=str(r), LOCAL_WORLD_SIZE="2",
                 MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), STREAMCOLL_WATCHDOG="off", **(env or {}))
        procs.append(subprocess.Popen([sys.executable, "-c", _SCRIPT, backend, case], env=e, cwd=str(tmp_path),
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    out = []
    try:
        for p in procs:
            o, err = p.communicate(timeout=90)
            line = [x for x in o.splitlines() if x.startswith("RES ")]
            assert line, (backend, case, p.returncode, o[-2000:], err[-3000:])
            import json
            out.append(json.loads(line[0][4:]))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return out


@pytest.mark.parametrize("case", ["shape", "op"])
def test_mismatch_through_torch_distributed_like_gloo_detail(tmp_path, case):
    """streamcoll by default and with DETAIL, gloo with DETAIL: both ranks
    raise within seconds on a shape mismatch (gloo's DETAIL wrapper:
    "Detected mismatch between collectives"); a SUM against a MAX, gloo
    (DETAIL or not) returns a mix silently, streamcoll raises."""
    gloo = _run_pair(tmp_path, "gloo", case, {"TORCH_DISTRIBUTED_DEBUG": "DETAIL"})
    sc = _run_pair(tmp_path, "streamcoll", case)
    detail = _run_pair(tmp_path, "streamcoll", case, {"TORCH_DISTRIBUTED_DEBUG": "DETAIL"})
    for g in gloo:
        if case == "op":  # measured: gloo's DETAIL wrapper does not compare reductions; a silent mix
            assert g["raised"] is None and g["value"][:2] == [2.0, 2.0], gloo
        else:
            assert g["raised"] is not None and g["elapsed"] < 10, gloo
    for x in sc:
        assert x["raised"] == "MismatchError" and "first-call check" in x["message"] and x["elapsed"] < 10, sc
    for x in detail:  # every call checked (debug mode), shapes compared
        assert x["raised"] == "MismatchError" and "debug check" in x["message"] and x["elapsed"] < 10, detail
    if case == "shape":
        assert "float32[4 elements]" in sc[0]["message"] and "float32[8 elements]" in sc[0]["message"]
        assert "float32[4]" in detail[0]["message"] and "float32[8]" in detail[0]["message"]


# ------------------------------- later calls of a signature whose check failed
def _second_call(comm, second, n0):
    """Rank 1's tensor is twice rank 0's (a new signature on both ranks).
    The first call is async (its check runs where its C call runs); the
    ``second`` one, issued before the first was waited, must be checked
    too: on today's code it was not (its key was 'seen' when the first was
    issued), and rank 1 returned a partial sum while rank 0 hung."""
    r = comm.rank
    # a communicator of its own: the pooled one may have reached its bound of checked signatures
    # (then nothing new is checked: seen in CI, where other modules' tests filled it)
    pooled, comm = comm, comm.split(0)
    x = torch.ones(n0 * (2 if r == 1 else 1))
    res = {}
    w1 = comm.all_reduce(x, async_op=True)
    w2 = None
    try:
        if second == "sync":
            comm.all_reduce(x)
        else:
            w2 = comm.all_reduce(x, async_op=True)
        res["second"] = None
    except Exception as e:  # noqa: BLE001 - compared in the parent
        res["second"] = type(e).__name__
    for k, w in (("first", w1), ("second", w2)):
        if w is None:
            continue
        try:
            w.wait()
            res[k] = None
        except Exception as e:  # noqa: BLE001
            res[k] = type(e).__name__
    # a retry of the same mismatched call is checked again (it raises again, on both ranks)
    try:
        comm.all_reduce(x)
        res["retry"] = None
    except Exception as e:  # noqa: BLE001
        res["retry"] = type(e).__name__
    res["x"] = sorted(set(x.tolist()))  # untouched: no C call was made
    u = torch.full((3,), float(r + 1))
    comm.all_reduce(u)  # still usable
    res["after"] = u.tolist()
    # the same size on both ranks now: rank 0's signature is new to rank 1 and checked, then reduced
    y = torch.ones(n0)
    comm.all_reduce(y, async_op=True).wait()
    res["y"] = sorted(set(y.tolist()))
    comm.destroy()
    pooled.barrier()
    return res


@pytest.mark.parametrize("second,n0", [("small_async", 2053), ("large_async", 40009), ("sync", 2063),
                                       ("sync_after_large", 40013)])
def test_a_second_call_of_a_failed_signature_is_checked_on_every_rank(second, n0):
    w = get_world(2)
    res = w.run(_second_call, "sync" if second == "sync_after_large" else second, n0, timeout=60)
    for r, x in enumerate(res):
        assert x["first"] == "MismatchError" and x["second"] == "MismatchError", (r, res)
        assert x["retry"] == "MismatchError", (r, res)
        assert x["x"] == [1.0] and x["after"] == [3.0] * 3 and x["y"] == [2.0], (r, res)


def _rank_symmetric_state(comm, n0):
    """After the same calls, whatever the timing, every rank keeps the same
    check state: the signatures it counts as checked and its check number."""
    r = comm.rank
    pooled, comm = comm, comm.split(0)  # its own bound (see _second_call)
    sig = comm._sig
    xs = [torch.ones(n0 + i) for i in range(3)]
    bad = torch.ones(n0 + 7 + (r * 3))
    if r == 0:
        time.sleep(0.05)  # rank 1's comm thread runs its checks first
    works = [comm.all_reduce(x, async_op=True) for x in xs]
    wb = comm.all_reduce(bad, async_op=True)
    works.append(comm.all_reduce(xs[0], async_op=True))
    if r == 1:
        time.sleep(0.05)
    errs = []
    for w in works + [wb]:
        try:
            w.wait()
            errs.append(None)
        except Exception as e:  # noqa: BLE001
            errs.append(type(e).__name__)
    ch = sig._checker
    mine = [("all_reduce", ("tensor", (torch.float32, n0 + i))) for i in range(3)]
    out = {"errs": errs, "n": ch.n, "seen": sorted(repr(k) for k in sig.seen if k[:2] in mine)}
    comm.destroy()
    pooled.barrier()
    return out


def test_check_state_is_the_same_on_every_rank_after_the_same_calls():
    w = get_world(2)
    res = w.run(_rank_symmetric_state, 3001, timeout=60)
    assert res[0]["errs"] == res[1]["errs"] == [None, None, None, None, "MismatchError"], res
    assert res[0]["n"] == res[1]["n"] and res[0]["seen"] == res[1]["seen"] and len(res[0]["seen"]) == 3, res


# -------------------------------------------------- all-to-all counts (finding 4)
def _a2a_mismatch(comm, case, n0):
    """On a new communicator (its first all-to-all: checked whatever the
    pooled one saw before)."""
    r = comm.rank
    size = comm.size
    res = {}
    pooled, comm = comm, comm.split(0)
    try:
        if case == "single_even":
            n = n0 * size * (2 if r == 1 else 1)
            inp, out = torch.ones(n), torch.zeros(n)
            comm.all_to_all_single(out, inp)
        elif case == "single_splits":
            # rank 1 says it sends 1 element to rank 0, rank 0 expects 2 from it
            ins = [n0] * size if r == 0 else [n0 - 1] + [n0] * (size - 1)
            inp, out = torch.ones(sum(ins)), torch.zeros(n0 * size)
            comm.all_to_all_single(out, inp, [n0] * size, ins)
        else:  # list form, rank 1's tensors longer
            m = n0 * (2 if r == 1 else 1)
            comm.all_to_all([torch.zeros(m) for _ in range(size)], [torch.ones(m) for _ in range(size)])
        res["raised"] = None
    except Exception as e:  # noqa: BLE001
        res["raised"] = type(e).__name__
        res["message"] = str(e)
    u = torch.full((3,), float(r + 1))
    comm.all_reduce(u)
    res["after"] = u.tolist()
    # the same uneven exchange, consistent now (counts differ between ranks by design): it goes through
    sends = [[1, 2], [3, 0]] if size == 2 else None
    if sends is not None:
        ins = sends[r]
        outs = [sends[j][r] for j in range(size)]
        inp = torch.full((sum(ins),), float(r + 1))
        out = torch.zeros(sum(outs))
        comm.all_to_all_single(out, inp, outs, ins)
        res["uneven"] = out.tolist()
    comm.destroy()
    pooled.barrier()
    return res


@pytest.mark.parametrize("case,n0", [("single_even", 211), ("single_splits", 223), ("list", 227)])
def test_all_to_all_count_mismatch_raises_on_every_rank(case, n0):
    w = get_world(2)
    res = w.run(_a2a_mismatch, case, n0, timeout=60)
    for r, x in enumerate(res):
        assert x["raised"] == "MismatchError" and "first-call check" in x["message"], (r, res)
        assert "counts disagree" in x["message"] or "instead of" in x["message"], (r, res)
        assert x["after"] == [3.0] * 3, (r, res)
    assert res[0]["uneven"] == [1.0, 2.0, 2.0, 2.0] and res[1]["uneven"] == [1.0, 1.0], res


# ------------------------------------------------ store keys (finding 6)
def _store_keys_after_cycles(comm, cycles):
    """Split, three new signatures, destroy, ``cycles`` times: the store
    holds no more keys afterwards than before (the keys of each check are
    removed once every rank has read them, the last ones at destroy)."""
    import torch.distributed as dist
    base = comm._store
    comm.barrier()
    k0 = base.num_keys()
    for i in range(cycles):
        c = comm.split(0)
        for j in range(3):
            c.all_reduce(torch.ones(5 + j + 10 * i))
        c.all_reduce(torch.ones(7 + 10 * i), async_op=True).wait()
        c.destroy()
    comm.barrier()
    dist  # noqa: B018
    return {"before": k0, "after": base.num_keys()}


def test_check_keys_are_removed_from_the_store():
    w = get_world(2)
    res = w.run(_store_keys_after_cycles, 12, timeout=120)
    # the split's own key (the all-gather of colors is a collective: no store key) and rendezvous
    # counters are not the checks': compared before and after on rank 0, which the barrier follows
    assert res[0]["after"] - res[0]["before"] <= 0, res


# ------------------------------- a store that cannot be cloned (finding 9)
class _NoCloneStore:
    """Made in the rank: a framework's own ``dist.Store`` subclass that
    delegates to one TCPStore client and has no ``clone()``. ``slow`` makes
    ``set`` from one kind of thread wait first, so that on rank 0 the main
    thread takes the shared client before the comm thread and on rank 1 the
    comm thread before the main thread: the order in which a server-side
    wait on a shared client deadlocks."""


def _make_noclone(inner, slow_thread):
    import threading
    import torch.distributed as dist

    class NoClone(dist.Store):
        def __init__(self):
            super().__init__()
            self.inner = inner

        def set(self, k, v):
            main = threading.current_thread() is threading.main_thread()
            if (slow_thread == "comm" and not main) or (slow_thread == "main" and main):
                time.sleep(0.3)
            return self.inner.set(k, v)

        def get(self, k):
            return self.inner.get(k)

        def add(self, k, n):
            return self.inner.add(k, n)

        def check(self, keys):
            return self.inner.check(keys)

        def wait(self, keys, timeout=None):
            return self.inner.wait(keys) if timeout is None else self.inner.wait(keys, timeout)

        def delete_key(self, k):
            return self.inner.delete_key(k)

        def compare_set(self, k, e, d):
            return self.inner.compare_set(k, e, d)

        def multi_get(self, keys):
            return [self.inner.get(k) for k in keys]

        def num_keys(self):
            return self.inner.num_keys()

    return NoClone()


def _noclone(comm, port, n0):
    """A communicator P on a store that cannot be cloned, and its split C
    (same store): P's async call of a new signature (its check on P's comm
    thread) and C's synchronous one (its check on the calling thread) at
    once. Before: the comm thread's check waited in the server on the shared
    client while the caller's blocked behind it, and the reverse on the
    other rank: both hung until the timeout."""
    from datetime import timedelta
    import torch.distributed as dist
    r = comm.rank
    tcp = dist.TCPStore("127.0.0.1", port, comm.size, r == 0, timeout=timedelta(seconds=30))
    store = _make_noclone(tcp, "comm" if r == 0 else "main")
    p = streamcoll.new_communicator(backend="oneccl", device="cpu", store=store, rank=r, world_size=comm.size,
                                    name="noclone", timeout=20)
    c = p.split(0)
    out = {}
    try:
        big = torch.ones(n0 * 64)  # above the quiet size: the comm thread starts at once
        small = torch.ones(n0)
        t0 = time.monotonic()
        w = p.all_reduce(big, async_op=True)
        c.all_reduce(small)
        w.wait()
        out = {"s": time.monotonic() - t0, "big": sorted(set(big.tolist())), "small": sorted(set(small.tolist())),
               "polled": p._sig._async_store is False}
    finally:
        c.destroy()
        p.destroy()
        tcp.set(f"left{r}", "1")
        if r == 0:
            tcp.wait([f"left{i}" for i in range(comm.size)])
    return out


def test_checks_on_a_store_without_clone_do_not_deadlock():
    w = get_world(2)
    res = w.run(_noclone, free_port(), 1031, timeout=90)
    for x in res:
        assert x["big"] == [2.0] and x["small"] == [2.0] and x["polled"], res
        assert x["s"] < 10, res


# ======================================================== the review of the checks
# (issue 42's fixes: the module docstring's second part)


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
