"""Flight recorder: what a communicator records, the JSON dump, and the
analysis that names the first operation where ranks disagree or some rank
never arrived (issue 7).

Recording is checked on real one-rank oneCCL communicators in this process;
the analysis on dumps built here (mismatches that real ranks could only
produce by hanging or corrupting memory) and, with real ranks, in
test_reliability.py (a collective one rank skips, dumped on the timeout and
on request, named by ``python -m streamcoll.flight analyze``).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import weakref

import pytest
import torch

from streamcoll.core.spec import Plan
import torch.distributed as dist

import streamcoll
from streamcoll.diagnostics import flight

from conftest import needs_oneccl


# ------------------------------------------------------------ synthetic dumps
def _entry(seq, op, shapes=((4,),), dtype="float32", state="completed", strategy="sync", p2p=0):
    return {"seq": seq, "collective_seq": None if op in flight.P2P_OPS else seq - p2p, "op": op,
            "shapes": [list(s) if s is not None else None for s in shapes], "dtypes": [dtype] * len(shapes),
            "strategy": strategy, "state": state, "enqueued": 0.0, "started": 0.0, "ended": None,
            "ended_before": None, "duration_s": None, "age_s": 0.0}


def _dump(rank, entries, size=3, name="default", issued=None, p2p_issued=0, dumped_at=1.0):
    return {"format": "streamcoll-flight", "version": 1, "communicator": name, "backend": "oneccl",
            "device": "cpu", "rank": rank, "size": size, "pid": 1, "host": "h", "timeout_s": 5.0,
            "issued": issued if issued is not None else (entries[-1]["seq"] if entries else 0),
            "p2p_issued": p2p_issued, "state": "live", "failure": None, "reason": "", "dumped_at": dumped_at,
            "capacity": 1024, "entries": entries}


def _common(n):
    return [_entry(s, "all_reduce") for s in range(1, n + 1)]


def test_analysis_agreeing_ranks_find_nothing():
    dumps = [_dump(r, _common(6)) for r in range(3)]
    assert flight.analyze(dumps) == []


def test_analysis_names_rank_that_never_arrived():
    d0 = _dump(0, _common(4) + [_entry(5, "broadcast", state="running", strategy="async")])
    d1 = _dump(1, _common(4) + [_entry(5, "broadcast", state="running", strategy="async")])
    d2 = _dump(2, _common(4))
    (f,) = flight.analyze([d0, d1, d2])
    assert (f.kind, f.seq, f.collective_seq, f.ranks) == ("never_arrived", 5, 5, [2])
    assert "first problem at sequence number 5 (collective #5): rank 2 never arrived" in f.message
    assert "last issued: rank 2: #4 all_reduce" in f.message
    assert "ranks 0, 1 called broadcast(shapes [(4,)], float32; async), state running" in f.message


def test_analysis_names_shape_mismatch_and_the_odd_rank():
    es = [_common(2) + [_entry(3, "all_reduce", shapes=((8,),) if r == 1 else ((4,),))] + [_entry(4, "barrier")]
          for r in range(3)]
    (f,) = flight.analyze([_dump(r, e) for r, e in enumerate(es)])
    assert (f.kind, f.seq, f.ranks) == ("mismatch", 3, [1])
    assert "ranks disagree in shapes: ranks 0, 2 called all_reduce(shapes [(4,)]" in f.message
    assert "rank 1 called all_reduce(shapes [(8,)]" in f.message


def test_analysis_names_op_mismatch():
    es = [_common(2) + [_entry(3, "broadcast" if r == 2 else "all_reduce")] for r in range(3)]
    (f,) = flight.analyze([_dump(r, e) for r, e in enumerate(es)])
    assert (f.kind, f.seq, f.ranks) == ("mismatch", 3, [2])
    assert "disagree in op" in f.message and "rank 2 called broadcast(" in f.message


def test_analysis_dtype_mismatch_and_unknown_shapes_match_anything():
    es = []
    for r in range(2):
        e2 = _entry(2, "all_reduce", shapes=(None,) if r == 0 else ((4,),))  # freed before it was read
        e2["dtypes"] = [None] if r == 0 else ["float32"]
        e3 = _entry(3, "all_reduce", dtype="float16" if r == 1 else "float32")
        es.append([_entry(1, "all_reduce"), e2, e3])
    (f,) = flight.analyze([_dump(r, e, size=2) for r, e in enumerate(es)])
    assert (f.kind, f.seq) == ("mismatch", 3)  # not 2: an unknown shape matches
    assert "disagree in dtypes" in f.message


def test_analysis_aligns_collectives_across_point_to_point():
    """Ranks 0 and 1 exchange a send/recv that rank 2 takes no part in: its
    sequence numbers are one behind afterwards, its collectives are not."""
    d0 = _dump(0, [_entry(1, "all_reduce"), _entry(2, "send"),
                   _entry(3, "all_reduce", p2p=1), _entry(4, "broadcast", p2p=1, state="running")], p2p_issued=1)
    d1 = _dump(1, [_entry(1, "all_reduce"), _entry(2, "recv"),
                   _entry(3, "all_reduce", p2p=1), _entry(4, "broadcast", p2p=1, state="running")], p2p_issued=1)
    d2 = _dump(2, [_entry(1, "all_reduce"), _entry(2, "all_reduce")])
    (f,) = flight.analyze([d0, d1, d2])
    assert (f.kind, f.collective_seq, f.ranks) == ("never_arrived", 3, [2])
    assert f.seqs == {0: 4, 1: 4}


def test_analysis_compares_only_the_window_every_rank_still_holds():
    """Bounded rings: rank 1's ring starts later; older entries are not compared."""
    d0 = _dump(0, [_entry(s, "all_reduce" if s != 2 else "broadcast") for s in range(1, 9)])
    d1 = _dump(1, [_entry(s, "all_reduce") for s in range(5, 9)], issued=8)
    d0["size"] = d1["size"] = 2
    assert flight.analyze([d0, d1]) == []


def test_analysis_reports_missing_dumps_and_a_stuck_operation():
    d0 = _dump(0, _common(3) + [_entry(4, "all_reduce", state="running")])
    d1 = _dump(1, _common(3) + [_entry(4, "all_reduce", state="running")])
    fs = flight.analyze([d0, d1])
    assert [f.kind for f in fs] == ["missing_dump", "stuck"]
    assert fs[0].ranks == [2] and "no dump from rank 2" in fs[0].message
    assert (fs[1].seq, fs[1].ranks) == (4, [2]) and "did not complete on ranks 0, 1" in fs[1].message


def test_analysis_latest_dump_of_a_rank_wins_and_communicators_are_separate():
    old = _dump(2, _common(3), dumped_at=1.0)
    new = _dump(2, _common(5), dumped_at=2.0)
    other = [_dump(r, [_entry(1, "all_reduce", shapes=((r + 1,),))], size=2, name="default/split0")
             for r in range(2)]
    fs = flight.analyze([_dump(0, _common(5)), _dump(1, _common(5)), old, new] + other)
    assert [(f.communicator, f.kind, f.seq) for f in fs] == [("default/split0", "mismatch", 1)]


def test_cli_exit_status_text_and_json(tmp_path):
    for r in range(3):
        e = _common(4) + ([] if r == 2 else [_entry(5, "all_reduce", state="running")])
        (tmp_path / f"default.rank{r}.json").write_text(json.dumps(_dump(r, e)))
    (tmp_path / "unrelated.json").write_text(json.dumps({"something": "else"}))
    cmd = [sys.executable, "-m", "streamcoll.flight", "analyze", str(tmp_path)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert p.returncode == 1, p.stderr
    assert "communicator 'default': 3 ranks, dumps from ranks 0, 1, 2" in p.stdout
    assert "first problem at sequence number 5 (collective #5): rank 2 never arrived" in p.stdout
    assert p.stderr == ""  # no runpy double-import warning
    pj = subprocess.run(cmd + ["--json"], capture_output=True, text=True, timeout=60)
    (f,) = json.loads(pj.stdout)
    assert (f["kind"], f["seq"], f["ranks"]) == ("never_arrived", 5, [2])
    ok = tmp_path / "ok"
    ok.mkdir()
    for r in range(2):
        (ok / f"c.rank{r}.json").write_text(json.dumps(_dump(r, _common(3), size=2)))
    p = subprocess.run([sys.executable, "-m", "streamcoll.flight", "analyze", str(ok)],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0 and "no disagreement found" in p.stdout, p.stdout + p.stderr
    empty = tmp_path / "empty"
    empty.mkdir()
    p = subprocess.run([sys.executable, "-m", "streamcoll.flight", "analyze", str(empty)],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "no streamcoll flight dumps" in p.stderr


# -------------------------------------------------- recording on a real comm
def _comm(**kw):
    return streamcoll.new_communicator(backend="oneccl", device="cpu", rank=0, world_size=1,
                                       store=dist.HashStore(), **kw)


@needs_oneccl
def test_records_ops_shapes_dtypes_strategy_state(tmp_path, monkeypatch):
    monkeypatch.setenv("STREAMCOLL_INLINE_ASYNC_BYTES", "0")  # the async entries are the comm thread's
    c = _comm(name="rec")
    try:
        t = torch.ones(4)
        c.all_reduce(t)
        c.broadcast(t, 0)
        w = c.all_reduce(torch.ones(2, 3, dtype=torch.float64), async_op=True)
        w.wait()
        out, inp = torch.empty(4, dtype=torch.int32), torch.ones(4, dtype=torch.int32)
        c.all_gather_into_tensor(out, inp)
        with pytest.raises(TypeError):
            c.all_reduce(t, op="bogus")  # rejected before the launch: not recorded
        path = c.dump_flight_record(str(tmp_path))
        assert path == os.path.join(str(tmp_path), "rec.rank0.json")
        d = json.loads(open(path).read())
        assert (d["communicator"], d["rank"], d["size"], d["issued"], d["state"]) == ("rec", 0, 1, 4, "live")
        got = [(e["seq"], e["op"], e["shapes"], e["dtypes"], e["strategy"], e["state"]) for e in d["entries"]]
        # Completed synchronous calls keep op and sequence number only (the cheap record);
        # asynchronous ones keep shapes, dtypes and times.
        assert got == [
            (1, "all_reduce", None, None, "sync", "completed"),
            (2, "broadcast", None, None, "sync", "completed"),
            (3, "all_reduce", [[2, 3]], ["float64"], "async", "completed"),
            (4, "all_gather_into_tensor", None, None, "sync", "completed"),
        ]
        e3 = d["entries"][2]
        assert e3["started"] >= e3["enqueued"] and e3["ended"] >= e3["started"] and e3["duration_s"] > 0
        assert abs(e3["enqueued"] - time.time()) < 60  # wall clock
    finally:
        c.destroy()


@needs_oneccl
def test_ring_is_bounded_and_does_not_keep_tensors_alive(monkeypatch, tmp_path):
    monkeypatch.setenv("STREAMCOLL_FLIGHT_SIZE", "5")  # rounded up to 8
    monkeypatch.setenv("STREAMCOLL_WATCHDOG", "off")  # no background pass reading live tensors
    monkeypatch.setenv("STREAMCOLL_INLINE_ASYNC_BYTES", "0")  # the async entries are the comm thread's
    c = _comm(name="ring")
    try:
        assert c._flight.capacity == 8
        live = [torch.ones(i + 1) for i in range(20)]
        for x in live:
            c.all_reduce(x, async_op=True).wait()
        t = torch.ones(1000)
        ref = weakref.ref(t)
        c.all_reduce(t)
        c.all_reduce(t, async_op=True).wait()
        del t
        assert ref() is None  # the ring holds weak references only (and no in-flight marker is left)
        d = json.loads(open(c.dump_flight_record(str(tmp_path / "x.json"))).read())
        assert [e["seq"] for e in d["entries"]] == list(range(15, 23))
        assert d["entries"][0]["shapes"] == [[15]]
        assert d["entries"][-2]["shapes"] is None  # sync: not recorded
        assert d["entries"][-1]["shapes"] == [None]  # async, freed before anyone read it: unknown
    finally:
        c.destroy()


@needs_oneccl
def test_watchdog_pass_reads_shapes_while_tensors_live(monkeypatch):
    monkeypatch.setenv("STREAMCOLL_WATCHDOG", "off")  # this test makes the pass itself
    monkeypatch.setenv("STREAMCOLL_INLINE_ASYNC_BYTES", "0")  # the async entries are the comm thread's
    c = _comm(name="resolve")
    try:
        c.all_reduce(torch.ones(3, 2), async_op=True).wait()  # a temporary, freed with its Work...
        from streamcoll.diagnostics.watchdog import WATCHDOG
        # ... unless the watchdog's pass read it first; do what it does, with a live tensor:
        t = torch.ones(5)
        c.all_reduce(t, async_op=True).wait()
        WATCHDOG.check([c])
        del t
        d = flight.snapshot(c)
        assert d["entries"][1]["shapes"] == [[5]]
        assert d["entries"][0]["shapes"] == [None]
    finally:
        c.destroy()


@needs_oneccl
def test_failed_call_is_recorded_with_its_error(tmp_path):
    c = _comm(name="fail")
    try:
        t = torch.ones(2)

        def boom(h):
            raise RuntimeError("injected library failure")

        with pytest.raises(RuntimeError, match="injected"):
            c._launch("all_reduce", Plan(boom, (), None, (t,), (t,), "all_reduce"), False, None)
        c.all_reduce(t)
        d = flight.snapshot(c)
        (e1, e2) = d["entries"]
        assert (e1["state"], e1["error"]) == ("failed", "RuntimeError: injected library failure")
        assert e2["state"] == "completed" and "error" not in e2
    finally:
        c.destroy()


@needs_oneccl
def test_call_in_flight_shows_its_shapes_and_state(monkeypatch):
    """While a synchronous call is inside the library its entry is running
    and names its tensors (what a watchdog message and a dump show)."""
    monkeypatch.setenv("STREAMCOLL_WATCHDOG", "off")
    c = _comm(name="inflight")
    try:
        t = torch.ones(7, 2, dtype=torch.float16)
        c.all_reduce(t)
        seen = {}

        def inside(h):  # runs where the C call would
            seen.update(flight.snapshot(c)["entries"][-1])
            return 0

        c._launch("broadcast", Plan(inside, (), None, (t,), (t,), "broadcast"), False, None)
        assert (seen["seq"], seen["op"], seen["state"], seen["shapes"], seen["dtypes"]) == \
            (2, "broadcast", "running", [[7, 2]], ["float16"])
        assert seen["started"] is None and "start time not recorded" in seen["started_note"]
        after = flight.snapshot(c)["entries"][-1]
        assert (after["state"], after["shapes"]) == ("completed", [[7, 2]])  # read while it ran: kept
    finally:
        c.destroy()


def test_flight_size_setting_is_validated(monkeypatch):
    monkeypatch.setenv("STREAMCOLL_FLIGHT_SIZE", "lots")
    with pytest.raises(ValueError, match="STREAMCOLL_FLIGHT_SIZE"):
        flight.capacity()
    monkeypatch.setenv("STREAMCOLL_FLIGHT_SIZE", "-1")
    with pytest.raises(ValueError, match="STREAMCOLL_FLIGHT_SIZE"):
        flight.capacity()


def test_default_dir_follows_the_setting(monkeypatch, tmp_path):
    monkeypatch.setenv("STREAMCOLL_FLIGHT_DIR", str(tmp_path))
    assert flight.default_dir() == str(tmp_path)
