"""A communicator's first async call must not open a store connection each
time (the 5 s stall of test_checks_review's sync-behind-quiet scenario).

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
"""
from __future__ import annotations

import os
import time

import pytest
import torch

from conftest import needs_oneccl
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
