"""streamcoll's messages go through :mod:`logging`, and the native
libraries print nothing on stdout.

The logger is ``logging.getLogger("streamcoll")`` (modules log to children
such as ``streamcoll.diagnostics.watchdog``). streamcoll adds no handler: an
application that configured logging gets the messages its way; one that did
not still sees warnings and errors on stderr through Python's last-resort
handler, which a hang report or a rendezvous progress line needs (a
``NullHandler`` would silence the watchdog's report in such a program).

oneCCL's own lines: streamcoll applies ``CCL_LOG_LEVEL=error``, and that very
setting makes oneCCL print one warning on **stdout**, once per process,
inside its first ``onecclGetUniqueId``/``onecclCommInitRank``.
:func:`quiet_oneccl_startup` points fd 1 at a pipe for that first call only:
that line is dropped (logged at debug level), any other oneCCL line goes to
the logger as a warning, everything else to the real stdout. With
``CCL_LOG_LEVEL`` set to anything but ``error`` nothing is captured. The
"not completed event is destroyed" error oneCCL prints for grouped
Send/Recv is left on stderr as oneCCL prints it.

What was measured, the pipe's details and why the grouped Send/Recv line
stays: docs/design.md, section 'oneCCL's output'.
"""
from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
import time
from typing import Any, Iterator, List, Optional

__all__ = ["logger", "quiet_oneccl_startup"]

logger = logging.getLogger("streamcoll")

# oneCCL's line about its own log level (see the module doc).
_LOG_LEVEL_LINE = b"value of CCL_LOG_LEVEL changed to be"
_STARTED = False
_START_LOCK = threading.Lock()
_LIBC: List[Any] = []


def _fflush() -> None:
    """Flush C stdio (oneCCL writes through ``std::cout``, i.e. stdio's stdout)."""
    try:
        if not _LIBC:
            import cffi
            ffi = cffi.FFI()
            ffi.cdef("int fflush(void *stream);")
            _LIBC.extend((ffi, ffi.dlopen(None)))
        ffi, libc = _LIBC
        libc.fflush(ffi.NULL)
    except Exception:  # no libc symbol table: nothing buffered to lose either
        pass


class _Records:
    """oneCCL's lines seen by the pump, logged only once fd 1 is stdout
    again: a handler writing to stdout (``logging.basicConfig(stream=
    sys.stdout)``) would otherwise write each record into the pipe being
    filtered, and the pump would log it again, without end."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.restored = False
        self.pending: List[bytes] = []

    def add(self, line: bytes) -> None:
        with self.lock:
            if not self.restored:
                self.pending.append(line)
                return
        _log_line(line)

    def release(self) -> None:
        """fd 1 is stdout again: log what waited, and log later lines at once."""
        with self.lock:
            self.restored, pending, self.pending = True, self.pending, []
        for line in pending:
            _log_line(line)


def _log_line(line: bytes) -> None:
    text = line.decode("utf-8", "replace").rstrip("\n")
    if _LOG_LEVEL_LINE in line:
        logger.debug("oneCCL (dropped from stdout): %s", text)
    else:
        logger.warning("oneCCL: %s", text)


def _route(line: bytes, real: int, records: _Records) -> None:
    if b"|CCL_" in line:
        records.add(line)
    else:
        try:
            os.write(real, line)
        except OSError:  # stdout closed by the program: nothing to forward to
            pass


def _pump(rfd: int, real: int, partial: List[bytes], records: _Records) -> None:
    """Forward what arrives on ``rfd`` line by line to ``real`` (the pump's
    own duplicate of stdout, closed by it at the end, so its number is never
    reused under it); ``partial[0]`` is the unfinished line (the caller waits
    for it before giving fd 1 back). Runs until every write end is closed:
    a child process started during the call keeps its copy of the pipe, and
    its output keeps flowing to stdout."""
    buf = b""
    try:
        while True:
            try:
                chunk = os.read(rfd, 65536)
            except OSError:
                break
            if not chunk:
                break
            buf += chunk
            *lines, buf = buf.split(b"\n")
            partial[0] = buf
            for line in lines:
                _route(line + b"\n", real, records)
        partial[0] = b""
        if buf:
            _route(buf, real, records)
    finally:
        os.close(rfd)
        os.close(real)


@contextlib.contextmanager
def quiet_oneccl_startup() -> Iterator[None]:
    """Around a oneCCL call that may be the process's first (see the module
    doc): keep oneCCL's start-up line about ``CCL_LOG_LEVEL`` off stdout.
    Does nothing after the first time, or when ``CCL_LOG_LEVEL`` is not
    ``error``."""
    global _STARTED
    with _START_LOCK:
        first, _STARTED = not _STARTED, True
    if not first or os.environ.get("CCL_LOG_LEVEL", "").strip().lower() != "error":
        yield
        return
    saved: Optional[int] = None
    real: Optional[int] = None
    thread: Optional[threading.Thread] = None
    partial: List[bytes] = [b""]
    records = _Records()
    try:
        try:
            sys.stdout.flush()
        except Exception:
            pass
        _fflush()
        saved = os.dup(1)
        real = os.dup(1)  # the pump's own
        rfd, wfd = os.pipe()
        os.dup2(wfd, 1)
        os.close(wfd)
        thread = threading.Thread(target=_pump, args=(rfd, real, partial, records), name="streamcoll-stdout",
                                  daemon=True)
        thread.start()
    except OSError as e:  # no fd 1 (a daemon): nothing to keep clean
        logger.debug("stdout not captured during oneCCL start-up: %s", e)
        if real is not None:
            os.close(real)
        if saved is not None:
            os.dup2(saved, 1)
            os.close(saved)
            saved = None
    try:
        yield
    finally:
        if saved is not None:
            _fflush()
            try:
                sys.stdout.flush()
            except Exception:
                pass
            # A line still unfinished (its newline written after the text) is waited for, briefly:
            # given fd 1 back now, its newline would land on stdout as an empty line (seen once).
            deadline = time.monotonic() + 0.5
            while partial[0] and time.monotonic() < deadline:
                time.sleep(0.005)
                _fflush()
            os.dup2(saved, 1)  # our write end is gone: the pump reads EOF, unless a child holds the pipe
            os.close(saved)
            if thread is not None:
                thread.join(0.5)  # what the call wrote is forwarded before the caller writes more
            records.release()
