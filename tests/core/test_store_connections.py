"""The first-call checks' store connections. A communicator's first async
call must not open a store connection each time (the 5 s stall of the
sync-behind-quiet scenario of test_signatures.py).

The first-call check of an async call runs on the comm thread through a
connection of its own (``Signatures._deferred_store``: ``store.clone()``).
Every TCPStore connection torch opens names both its ends by a reverse DNS
lookup (``getnameinfo`` of ``::ffff:127.0.0.1`` in the client's connect and
in the server's accept, on the store server's one thread; /etc/hosts lists
only ``127.0.0.1``). On these machines the resolver drops about one query in
25, and glibc retries after its 5 s timeout: one connect in about 25 took
5.0 s (plain torch: ``TCPStore.clone()`` in a loop), and with it the first
call of a fresh split on both ranks (the peer waits in the store). So a
destroyed communicator's connection serves the next one on the same store.

What is measured here does not depend on the resolver: the connections
opened to the store's port, counted by the TIME_WAIT entries their close
leaves in /proc/net/tcp{,6}; a control (one explicit clone per rank) shows
that the count sees a connection.

The adversarial review of the pool of spare store connections (the second
part of this file; streamcoll/core/checks.py ``_SPARE``, commits a6b0f53 and
a3a27bc): a destroyed communicator's deferred-check connection
(``Signatures._async_store``, a ``store.clone()``) is handed to the next
communicator on the same store.

Defects found (the first and the third fixed since; the second, the
reuse across communicators made one after another, is a strict xfail: not
done):

* the pool is keyed by ``comm._store``, a PrefixStore made per communicator
  by the rendezvous (``rendezvous.py``: ``dist.PrefixStore(prefix, store)``)
  and shared only by a split's children. So a communicator made by
  ``new_communicator`` (and every ``dist.new_group`` of the process-group
  backend, which makes one) never gets a spare: its first async call still
  opens a connection (the 5 s stall the pool is for), and its connection,
  pooled under its own PrefixStore at destroy, stays open for as long as the
  destroyed communicator object lives (``release``'s docstring: "closed now,
  not when the garbage collector gets to the communicator's reference
  cycle"): measured, 10 new communicators destroyed and kept: +30 fds on
  rank 0 (its own clients and the store server's accepted sockets), +10 on
  rank 1; with nothing handed on at destroy (the behaviour before a6b0f53): +0.
  Fixed: a spare is kept only while another live communicator holds its store.
  Connections counted at the store's port (TIME_WAIT, as in the first
  part of this file): 10 new_communicator()s with an async first
  call open 18 (sync only: 0); 8 ``dist.new_group`` + async all_reduce +
  ``destroy_process_group(g)`` open 14 at the group store's port.
* a deferred check that raised :class:`MismatchError` (its requests all done:
  the connection is between requests) leaves ``_async_busy`` set, so the
  connection is dropped at destroy and the next communicator opens a new one.
  Fixed: a MismatchError leaves the connection reusable.

Scenarios that found nothing are kept as passing checks (fork, two threads,
rank asymmetry, destroy racing a waiting check, an interrupt in the check,
the weak keys, more communicators than SPARE_MAX).
"""
from __future__ import annotations

import gc
import os
import threading
import time

import pytest
import torch

from conftest import get_world, needs_oneccl
from world import World

pytestmark = [needs_oneccl, pytest.mark.world]


def _port(comm):
    return int(os.environ["MASTER_PORT"])


def _closed_connections(port: int) -> int:
    """TIME_WAIT entries (state 06) with ``port`` at either end: connections
    to the store closed within the last minute."""
    n = 0
    for path in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(path) as f:
                lines = f.read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            p = line.split()
            if p[3] == "06" and port in (int(p[1].rsplit(":", 1)[1], 16), int(p[2].rsplit(":", 1)[1], 16)):
                n += 1
    return n


def _fresh_splits_first_async_call(comm, count):
    """``count`` times: a fresh split, an async all_reduce (its first-call
    check deferred to the comm thread), a synchronous one behind it, destroy.
    The slowest step's seconds."""
    worst = 0.0
    for _ in range(count):
        c = comm.split(0)
        try:
            t0 = time.monotonic()
            a, b = torch.ones(4), torch.ones(4)
            w = c.all_reduce(a, async_op=True)
            c.all_reduce(b)
            w.wait()
            worst = max(worst, time.monotonic() - t0)
            assert a[0].item() == b[0].item() == 2.0
        finally:
            c.destroy()
    return worst


def _one_clone(comm):
    c = comm._store.clone()
    c.set(f"stall-control/{comm.rank}", "x")
    del c
    return True


def test_fresh_communicators_reuse_the_deferred_checks_store_connection():
    w = World(2)
    try:
        port = w.run(_port)[0]
        before = _closed_connections(port)
        worst = w.run(_fresh_splits_first_async_call, 20, timeout=120)
        opened = _closed_connections(port) - before
        w.run(_one_clone)
        time.sleep(0.2)
        control = _closed_connections(port) - before - opened
    finally:
        w.close()
    assert control >= 2, f"the count does not see closed connections here (control: {control})"
    # Before the fix: one connection per communicator per rank (40); after: the first ones, kept.
    assert opened <= 2, (f"{opened} store connections opened and closed by 20 fresh communicators' first "
                         f"async calls on 2 ranks (slowest step {max(worst):.3f} s)")


# ======================================================== the pool of spare connections
# (its adversarial review: the module docstring's second part)


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _spares() -> int:
    from streamcoll.core import checks as debug
    return sum(len(v) for v in list(debug._SPARE.values()))


# ------------------------------------------------- new_communicator: kept open
def _hang_report_connected(limit: float = 5.0) -> None:
    """Until the hang report's thread has its connection to the world's store
    server (one per process and server, made on the watchdog's first passes:
    not a connection per communicator, so not counted as growth)."""
    from streamcoll.diagnostics import hang_report
    end = time.monotonic() + limit
    while not hang_report._SERVERS and time.monotonic() < end:
        time.sleep(0.05)
    assert hang_report._SERVERS, "the hang report made no connection within 5 s"


def _new_communicators_destroyed_and_kept(comm, n, pool):
    """``n`` times: new_communicator (a PrefixStore of its own), an async
    all_reduce (its check through a clone), destroy; the destroyed objects
    are kept (a user's list, a process group). Open fds added."""
    import streamcoll
    from streamcoll.core import checks as debug
    done_with = debug._done_with
    if not pool:
        debug._done_with = lambda store, conn: done_with(store, None)  # as before a6b0f53: closed at destroy
    kept = []
    try:
        comm.barrier()
        _hang_report_connected()
        gc.collect()
        f0 = _fds()
        for _ in range(n):
            c = streamcoll.new_communicator()
            a = torch.ones(4)
            c.all_reduce(a, async_op=True).wait()
            assert a[0].item() == 2.0
            c.destroy()
            kept.append(c)
        del c
        comm.barrier()
        grown = _fds() - f0
        del kept[:]
        gc.collect()
        comm.barrier()
        time.sleep(0.3)  # the store server closes its end when it reads the client's EOF
        after_free = _fds() - f0
    finally:
        debug._done_with = done_with
    return grown, after_free


def test_destroyed_new_communicators_keep_no_store_connection_open():
    w = get_world(2)
    res = w.run(_new_communicators_destroyed_and_kept, 10, True, timeout=120)
    # measured: [(30, 0), (10, 0)]
    assert all(grown <= 2 for grown, _ in res), res


def test_control_without_the_pool_destroy_closes_the_connection():
    """The control of the xfail above: with the pool off the fds stay flat;
    and with it on, the weak keys close the pooled clones once the destroyed
    communicators (their PrefixStores) are freed."""
    w = get_world(2)
    res = w.run(_new_communicators_destroyed_and_kept, 10, False, timeout=120)
    assert all(grown <= 2 for grown, _ in res), res
    res = w.run(_new_communicators_destroyed_and_kept, 6, True, timeout=120)
    # one connection may stay: the last communicator is still referenced a while (its last Work)
    assert all(after <= 3 for _, after in res), res


# ---------------------------------------- new_communicator: no reuse at all
def _second_new_communicator_takes_the_first_ones_connection(comm):
    import streamcoll
    c = streamcoll.new_communicator()
    c.all_reduce(torch.ones(4), async_op=True).wait()
    first = c._sig._async_store
    c.destroy()
    d = streamcoll.new_communicator()
    try:
        d.all_reduce(torch.ones(4), async_op=True).wait()
        return d._sig._async_store is first
    finally:
        d.destroy()
        del c, d
        gc.collect()


@pytest.mark.xfail(strict=True, reason="the pool is keyed by the per-communicator PrefixStore: communicators made "
                   "by new_communicator / dist.new_group on one store each open a new connection (the 5 s stall)")
def test_new_communicators_on_one_store_reuse_the_connection():
    w = get_world(2)
    assert w.run(_second_new_communicator_takes_the_first_ones_connection, timeout=60) == [True, True]


# ------------------------------------------------- a mismatch loses the spare
def _mismatch_then_destroy(comm):
    from streamcoll.core import checks as debug
    from streamcoll._ffi.errors import MismatchError
    debug._SPARE.clear()  # the spares only (_forget_spares would forget the live communicators too)
    c = comm.split(0)
    try:
        with pytest.raises(MismatchError):
            c.all_reduce(torch.ones(4 + comm.rank), async_op=True).wait()
        c.all_reduce(torch.ones(4))  # still usable (no rank issued the call)
    finally:
        c.destroy()
    return _spares()


def test_a_mismatch_in_a_deferred_check_keeps_the_connection_for_the_next():
    w = get_world(2)
    assert w.run(_mismatch_then_destroy, timeout=60) == [1, 1]


# ------------------------------------------------------ scenarios: nothing found
def _fork_child_and_parent(comm):
    from streamcoll.core import checks as debug
    debug._SPARE.clear()  # the spares only (_forget_spares would forget the live communicators too)
    c = comm.split(0)
    c.all_reduce(torch.ones(3), async_op=True).wait()
    conn = c._sig._async_store
    c.destroy()
    before = _spares()
    r, wfd = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: the parent's pool is not its own
        try:
            os.write(wfd, str(_spares()).encode())
            gc.collect()
        finally:
            os._exit(0)
    os.close(wfd)
    kid = os.read(r, 100).decode()
    os.close(r)
    deadline = time.monotonic() + 20
    while True:
        p, status = os.waitpid(pid, os.WNOHANG)
        if p:
            break
        if time.monotonic() > deadline:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            status = "hung"
            break
        time.sleep(0.05)
    d = comm.split(0)
    try:
        a = torch.ones(5)
        d.all_reduce(a, async_op=True).wait()  # through the parent's spare, after the child closed its copy
        return before, kid, status, a[0].item(), d._sig._async_store is conn
    finally:
        d.destroy()


def test_a_forked_child_neither_uses_nor_breaks_the_parents_spares():
    w = get_world(2)
    for res in w.run(_fork_child_and_parent, timeout=60):
        assert res == (1, "0", 0, 2.0, True), res


def _two_threads_take_spares(comm):
    """Two communicators take their deferred-check connection at once, from
    two threads (``_deferred_store``, what an async call's issue does; the
    calls themselves are issued in one order below: two threads issuing
    async calls on two communicators in an order that differs between ranks
    deadlock in the process-wide turnstile whatever the pool does)."""
    from streamcoll.core import checks as debug
    debug._SPARE.clear()  # the spares only (_forget_spares would forget the live communicators too)
    olds = [comm.split(0) for _ in range(2)]
    for c in olds:
        c.all_reduce(torch.ones(7), async_op=True).wait()
    conns = [c._sig._async_store for c in olds]
    for c in olds:
        c.destroy()
    assert _spares() == 2
    news = [comm.split(0) for _ in range(2)]
    bar = threading.Barrier(2)

    def go(i):
        bar.wait()
        news[i]._sig._deferred_store()

    ts = [threading.Thread(target=go, args=(i,)) for i in range(2)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(30)
    got = [c._sig._async_store for c in news]
    out = []
    for c in news:
        a = torch.ones(8)
        c.all_reduce(a, async_op=True).wait()
        out.append(a[0].item())
    for c in news:
        c.destroy()
    return out, got[0] is not got[1], all(any(g is o for o in conns) for g in got)


def test_two_threads_first_async_calls_take_distinct_spares():
    w = get_world(2)
    for res in w.run(_two_threads_take_spares, timeout=60):
        assert res == ([2.0, 2.0], True, True), res


def _one_rank_reuses_the_other_clones(comm):
    from streamcoll.core import checks as debug
    c = comm.split(0)
    c.all_reduce(torch.ones(3), async_op=True).wait()
    c.destroy()
    if comm.rank == 1:
        debug._SPARE.clear()  # the spares only (_forget_spares would forget the live communicators too)
    d = comm.split(0)
    try:
        a, b = torch.ones(6), torch.ones(6)
        d.all_reduce(a, async_op=True).wait()
        d.all_reduce(b.view(2, 3), async_op=True).wait()  # same signature: no second check
        d.all_reduce(torch.ones(6, dtype=torch.float64), async_op=True).wait()  # a second check
        return a[0].item(), b[0].item()
    finally:
        d.destroy()


def test_rank_asymmetry_reused_versus_cloned_connection():
    w = get_world(2)
    assert w.run(_one_rank_reuses_the_other_clones, timeout=60) == [(2.0, 2.0), (2.0, 2.0)]


def _destroy_while_the_check_waits(comm):
    from streamcoll.core import checks as debug
    debug._SPARE.clear()  # the spares only (_forget_spares would forget the live communicators too)
    c = comm.split(0)
    r = {}
    if comm.rank == 0:
        a = torch.ones(9)
        w = c.all_reduce(a, async_op=True)
        time.sleep(0.3)  # its check waits in the store for rank 1
        try:
            c.destroy(timeout=0.5)
            r["destroy"] = "returned"
        except Exception as e:  # CollectiveTimeout: the queued work did not finish
            r["destroy"] = type(e).__name__
        r["pooled"] = _spares()
        try:
            w.wait()
        except Exception:
            pass
    else:
        time.sleep(2.0)
        b = torch.ones(9)
        c.all_reduce(b)
        c.destroy()
        r["b"] = b[0].item()
    comm.barrier()
    r["end"] = _spares()
    return r


def test_destroy_racing_a_waiting_deferred_check_pools_nothing():
    w = get_world(2)
    r0, r1 = w.run(_destroy_while_the_check_waits, timeout=60)
    assert r0 == {"destroy": "CollectiveTimeout", "pooled": 0, "end": 0}, r0
    assert r1 == {"b": 2.0, "end": 0}, r1


def _interrupt_after_the_checks_wait(comm):
    """A KeyboardInterrupt at the check's last line (after its wait), on
    both ranks alike (so neither issues the call): the connection is not
    pooled; the next communicator's first async call works."""
    from streamcoll.core import checks as debug
    debug._SPARE.clear()  # the spares only (_forget_spares would forget the live communicators too)
    orig = debug._Checker.check

    def boom(self, *a, **k):
        orig(self, *a, **k)
        raise KeyboardInterrupt

    c = comm.split(0)
    debug._Checker.check = boom
    try:
        try:
            c.all_reduce(torch.ones(11), async_op=True).wait()
            got = "no error"
        except KeyboardInterrupt:
            got = "KeyboardInterrupt"
    finally:
        debug._Checker.check = orig
    busy = c._sig._async_busy
    c.destroy()
    pooled = _spares()
    d = comm.split(0)
    try:
        a = torch.ones(11)
        d.all_reduce(a, async_op=True).wait()
        return got, busy, pooled, a[0].item()
    finally:
        d.destroy()


def test_an_interrupt_in_a_deferred_check_keeps_its_connection_out_of_the_pool():
    w = get_world(2)
    assert w.run(_interrupt_after_the_checks_wait, timeout=60) == [("KeyboardInterrupt", True, 0, 2.0)] * 2


def _more_communicators_than_spare_max(comm):
    """SPARE_MAX + 2 children alive at once, each with its connection, all
    destroyed: SPARE_MAX kept, the rest closed; as many new children take
    the kept ones and open the rest."""
    from streamcoll.core import checks as debug
    debug._SPARE.clear()  # the spares only (_forget_spares would forget the live communicators too)
    n = debug.SPARE_MAX + 2
    olds = [comm.split(0) for _ in range(n)]
    for c in olds:
        c.all_reduce(torch.ones(5), async_op=True).wait()
    conns = [c._sig._async_store for c in olds]
    for c in olds:
        c.destroy()
    kept = _spares()
    news = [comm.split(0) for _ in range(n)]
    vals = []
    for c in news:
        a = torch.ones(5)
        c.all_reduce(a, async_op=True).wait()
        vals.append(a[0].item())
    reused = sum(any(c._sig._async_store is o for o in conns) for c in news)
    distinct = len({id(c._sig._async_store) for c in news})
    for c in news:
        c.destroy()
    return kept, reused, distinct, vals == [2.0] * n, _spares()


def test_more_communicators_than_spare_max():
    from streamcoll.core import checks as debug
    m = debug.SPARE_MAX
    w = get_world(2)
    assert w.run(_more_communicators_than_spare_max, timeout=90) == [(m, m, m + 2, True, m)] * 2
