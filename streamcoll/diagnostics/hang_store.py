"""The hang report's store connections (:mod:`streamcoll.diagnostics.hang_report`'s
own, never a call's): a clone per store server, asked whether its server is
gone before each request, counted, and marked busy while inside torch's C++
(the exit waits for it)."""
from __future__ import annotations

import logging
import os
import re
import select
import stat
import threading
from typing import Any, Optional

log = logging.getLogger("streamcoll.diagnostics.watchdog")  # the watchdog's reports: one logger

REQUEST_TIMEOUT_S = 10.0  # each request of the hang report's connections (a store that stopped answering)
_BUSY = threading.Event()  # the hang report's thread is inside a store request or a clone (a C++ call)


class _Conn:
    """A connection of the hang report's thread: a clone of one store.

    A connection that failed once is not used again (``broken`` says why).
    Before each request on a TCPStore client, its socket is asked (``poll``,
    no wait) whether the server closed it: the store's host process ended,
    typically rank 0's, first to exit at the end of a job. Only then is the
    request skipped: torch logs a C++ stack trace for every request that
    finds the connection closed. The socket is read from the client's
    ``repr`` (``SocketImpl(fd=N, ...)``); where that says nothing, requests
    go out unchecked. A server connection the server closed is made again
    from a client connected since (:func:`_back`: a restarted server)."""

    __slots__ = ("store", "broken", "fd", "closed", "tried", "__weakref__")

    def __init__(self, store: Any, broken: Optional[str] = None) -> None:
        self.store = store
        self.broken = broken
        self.fd = _socket_of(store) if store is not None else None
        self.closed = False  # broken because the server closed the connection
        self.tried: set = set()  # the clients (_client_of) this server's connections were cloned from

    def _closed(self) -> bool:
        if self.fd is None:
            return False
        try:
            p = select.poll()
            p.register(self.fd, select.POLLIN | select.POLLRDHUP | select.POLLHUP | select.POLLERR)
            return bool(p.poll(0))  # no request in flight: anything to read is the end of the connection
        except Exception:
            return False

    def call(self, name: str, *args: Any) -> Any:
        global _REQUESTS
        if self.broken is None and self._closed():
            self.closed = True
            self.broken = "the store closed the connection (its host process ended)"
            log.debug("streamcoll hang report: %s", self.broken)
        if self.broken is not None:
            raise ConnectionError(self.broken)  # not used again
        _REQUESTS += 1
        _BUSY.set()
        try:
            return getattr(self.store, name)(*args)
        except Exception as e:
            if self.broken is None:
                self.broken = f"the store did not answer ({type(e).__name__}: {e})"
                self.closed = _gone(self.store)  # reset or hung up under the request: made again if it restarts
                log.debug("streamcoll hang report: %s", self.broken)
            raise
        finally:
            _BUSY.clear()


def _socket_of(store: Any) -> Optional[int]:
    """The socket of a TCPStore client under ``store`` (from its ``repr``), or None."""
    try:
        base = getattr(store, "_underlying_non_prefix_store", store)
        m = re.search(r"client=TCPClient\(SocketImpl\(fd=(\d+)", repr(base))
        if m is None:
            return None
        fd = int(m.group(1))
        return fd if stat.S_ISSOCK(os.fstat(fd).st_mode) else None
    except Exception:
        return None


def _client_of(store: Any) -> Optional[str]:
    """Which connection a TCPStore client is (its ``repr``'s socket: fd and
    addresses), or None."""
    try:
        m = re.search(r"client=TCPClient\(SocketImpl\(([^)]*)\)", repr(store))
        return m.group(1) if m else None
    except Exception:
        return None


def _back(c: _Conn, base: Any) -> bool:
    """Whether server connection ``c``, which the server closed, is made
    again from ``base`` (a communicator's own client of that host and port):
    where ``base`` is another connection, not tried before, whose socket is
    open: it connected since, to a server restarted there. Never for a server
    that stopped answering (a clone would wait the store's whole timeout),
    and once per client: nothing is cloned again round after round."""
    if not c.closed:
        return False
    who = _client_of(base)
    if who is None or who in c.tried:
        return False
    return _socket_of(base) is not None and not _gone(base)  # (gone: its server too; a poll each time)


def _gone(store: Any) -> bool:
    """Whether the server hung up ``store``'s own TCPStore client (a poll for
    the peer's hang-up only, no request: another thread's reply may be
    waiting to be read). A clone of a server that is gone waits the store's
    whole timeout (the init's), then fails, torch logging C++ traces."""
    fd = _socket_of(store)
    if fd is None:
        return False
    try:
        p = select.poll()
        p.register(fd, select.POLLRDHUP | select.POLLHUP | select.POLLERR)
        return bool(p.poll(0))
    except Exception:
        return False


_REQUESTS = 0


def requests_made() -> int:
    """Store requests the hang report's thread made in this process (tests: none per call)."""
    return _REQUESTS


def _unsafe(store: Any) -> Optional[str]:
    """Why ``store`` is not cloned (None: it is): a store written in Python
    under a PrefixStore (its clone would not be kept alive by the PrefixStore)."""
    import torch.distributed as dist
    base = getattr(store, "_underlying_non_prefix_store", store)
    ok = tuple(getattr(dist, n) for n in ("TCPStore", "FileStore", "HashStore") if hasattr(dist, n))
    if type(base) not in ok:
        return f"its store ({type(base).__name__}) is not one the hang report clones"
    return None
