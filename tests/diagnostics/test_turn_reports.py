"""A call that waits for the process's turn is reported as waiting, behind
the call that holds it (issue 33, findings 8 and 9). Real oneCCL, 2 ranks.

oneCCL is entered by one call at a time per process, in issue order
(:mod:`streamcoll.core.turnstile`). A call queued behind another communicator's
call has not entered the library: the watchdog, ``running_calls()``, the
init guard and the flight record say so and name the holder, instead of a
dead-peer or firewall diagnosis.
"""
from __future__ import annotations

import threading
import time

import pytest
import torch

import streamcoll
from conftest import needs_oneccl
from world import World


def w_waiting_behind(comm):
    """Rank 1 reaches A's all_reduce 2 s late: on rank 0, A's call (a
    thread) holds the turn inside oneCCL, and B's call (another thread)
    waits for it. What rank 0 reports meanwhile."""
    from streamcoll.diagnostics import flight
    from streamcoll.diagnostics.watchdog import running_calls
    b = comm.split(0)
    b.name = "B"
    x, y = torch.ones(4), torch.full((4,), 2.0)
    # both signatures checked first (debug.Signatures): the calls below go
    # straight to the turn, whatever the pooled rank ran before
    comm.all_reduce(torch.zeros(4))
    b.all_reduce(torch.zeros(4))
    out = {}
    if comm.rank == 0:
        ta = threading.Thread(target=lambda: comm.all_reduce(x))
        ta.start()
        time.sleep(0.5)
        tb = threading.Thread(target=lambda: b.all_reduce(y))
        tb.start()
        time.sleep(0.5)
        out["calls"] = running_calls()
        out["snap"] = flight.snapshot(b, "test")
        ta.join(30)
        tb.join(30)
    else:
        time.sleep(2.0)
        comm.all_reduce(x)
        b.all_reduce(y)
        out["snap"] = None
    out["values"] = (x.tolist(), y.tolist())
    b.destroy()
    return out


@needs_oneccl
def test_a_call_waiting_for_its_turn_is_reported_as_waiting_behind_the_holder(world2):
    r0, r1 = world2.run(w_waiting_behind, timeout=60)
    assert r0["values"] == r1["values"] == ([2.0] * 4, [4.0] * 4)
    calls = r0["calls"]
    a_line = [c for c in calls if "'B'" not in c]
    b_line = [c for c in calls if "'B'" in c]
    assert a_line and "waiting" not in a_line[0], calls  # A's call is the one inside oneCCL
    assert len(b_line) == 1 and "waiting for its turn behind communicator" in b_line[0], calls
    assert "#" in b_line[0].split("behind", 1)[1] and "all_reduce" in b_line[0].split("behind", 1)[1], calls
    entry = [e for e in r0["snap"]["entries"] if e["op"] == "all_reduce"][-1]
    assert "waiting_behind" in entry and "all_reduce" in entry["waiting_behind"], entry
    # the analyzer points at the holder, not at the peer that "never arrived"
    from streamcoll.diagnostics.flight import analyze
    d1 = dict(r0["snap"], rank=1, entries=[e for e in r0["snap"]["entries"] if e["seq"] < entry["seq"]],
              issued=entry["seq"] - 1)
    found = analyze([r0["snap"], d1])
    assert found and "waited for its turn behind" in found[0].message, [f.message for f in found]


def w_two_threads_create_in_opposite_orders(comm, timeout):
    """Finding 8: two threads each create a communicator, X then Y on rank
    0 and Y then X on rank 1; Y's ranks are the processes' in reverse, so
    that each process makes one unique id (rank 0 makes it, under the turn:
    one process making both would order the inits through the store). By
    reading, each native init holds the turn for its whole rendezvous, so
    each process's second init would wait behind its first, which waits for
    the other process's second. Measured (oneCCL 2022.2, one host, 2
    cores): sometimes both are made, sometimes both processes hang. The rule
    (communicators are created like collectives, in one order on every
    rank) forbids this program; what must hold is that a hang is reported
    as a wait for the turn behind the other init, with the rule, and not as
    a dead or unreachable peer (watchdog._init_waits_behind)."""
    import os
    import torch.distributed as dist
    names = ["X", "Y"] if comm.rank == 0 else ["Y", "X"]
    made: dict = {}
    errors: list = []

    def make(name):
        try:
            # a store prefix per communicator: their store rendezvous cannot mix (issue 33, finding 4)
            base = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False)
            r = comm.rank if name == "X" else 1 - comm.rank
            made[name] = streamcoll.new_communicator(backend="oneccl", device="cpu", name=name, timeout=timeout,
                                                     store=dist.PrefixStore(f"t33/{name}", base), rank=r,
                                                     world_size=2)
        except BaseException as e:  # noqa: BLE001 - reported in the result
            errors.append(f"{name}: {type(e).__name__}: {e}")

    first = threading.Thread(target=make, args=(names[0],), daemon=True)
    first.start()
    time.sleep(1.0)
    second = threading.Thread(target=make, args=(names[1],), daemon=True)
    second.start()
    first.join(timeout + 10)
    second.join(timeout + 10)
    from streamcoll.diagnostics.watchdog import WATCHDOG
    if len(made) < 2:
        return sorted(made), errors, list(WATCHDOG.fired)
    sums = {}
    for n in ("X", "Y"):  # the same order on both ranks
        t = torch.full((3,), float(made[n].rank + 1))
        made[n].all_reduce(t)
        sums[n] = t.tolist()
        made[n].destroy()
    return sorted(made), errors, sums


@needs_oneccl
def test_two_communicators_created_at_once_in_opposite_orders():
    w = World(2, timeout=60, env={"STREAMCOLL_WATCHDOG": "fail"})
    try:
        res = w.run(w_two_threads_create_in_opposite_orders, 8.0, timeout=60)
    finally:
        w.close(kill=True)  # an init that hangs stays inside oneCCL (it cannot abort)
    hung = [r for r, (names, _, _) in enumerate(res) if names != ["X", "Y"]]
    for r, (names, errors, out) in enumerate(res):
        if not hung:  # both made everywhere: right sums on both
            assert not errors and out == {"X": [3.0] * 3, "Y": [3.0] * 3}, (r, out)
        elif r in hung:  # the rule broken and a hang: reported as a wait for the turn, with the rule
            text = "\n".join(out)
            assert "waits for its turn behind init of communicator" in text, (r, names, errors, text)
            assert "in one order on every rank" in text, (r, text)


def test_an_init_waiting_for_the_turn_is_reported_as_such(monkeypatch):
    """The init guard's report when the guarded init waits for the turn:
    behind whom, and the rule, instead of "another rank died"."""
    from streamcoll.diagnostics import watchdog
    from streamcoll.core.backends import get_backend
    ts = get_backend("oneccl").turnstile
    monkeypatch.setattr(watchdog, "exit_now", lambda *a: None)
    monkeypatch.setenv("STREAMCOLL_WATCHDOG", "fail")
    held = threading.Event()
    release = threading.Event()

    def holder():
        with ts.hold(what="init of communicator 'X' (rank 0 of 2)"):
            held.set()
            release.wait(10)

    th = threading.Thread(target=holder)
    th.start()
    assert held.wait(10)
    what = "init of communicator 'Y' (rank 1 of 2, oneccl on cpu)"
    waiter = threading.Thread(target=lambda: ts.hold(what=what).__enter__())
    waiter.start()
    deadline = time.monotonic() + 10
    while what not in ts.waiters.values() and time.monotonic() < deadline:
        time.sleep(0.01)
    n = len(watchdog.WATCHDOG.fired)
    watchdog.WATCHDOG._fire_guard(what, 1.0, "rank 0 is missing", 2.0)
    msg = watchdog.WATCHDOG.fired[n]
    release.set()
    th.join(10)
    waiter.join(10)
    assert "waits for its turn behind init of communicator 'X'" in msg, msg
    assert "in one order on every rank" in msg and "died" not in msg, msg
