"""streamcoll's messages go through :mod:`logging`, and the native
libraries print nothing on stdout.

The logger is ``logging.getLogger("streamcoll")`` (modules log to children
such as ``streamcoll.diagnostics.watchdog``). streamcoll adds no handler: an application
that configured logging gets the messages its way; one that did not still
sees warnings and errors on stderr through Python's last-resort handler,
which is what a hang report or a rendezvous progress line needs. (A
``NullHandler`` would silence the watchdog's report in such a program.)

oneCCL's own lines: streamcoll applies ``CCL_LOG_LEVEL=error``, so oneCCL
prints only errors, on stderr. Measured (oneCCL 2022.2): the very setting
that silences the warnings produces one line on **stdout**, ``|CCL_WARN|
value of CCL_LOG_LEVEL changed to be error (default:warn)``, whoever set the
variable (the user's own ``CCL_LOG_LEVEL=error`` prints it too): oneCCL
parses its environment, warns about every variable that differs from its
default while the level is still ``warn``, and applies the new level after.
That happens once per process, inside the first ``onecclGetUniqueId`` (rank
0) or ``onecclCommInitRank`` (the others); ``onecclGetVersion`` and empty
groups do not trigger it. :func:`quiet_oneccl_startup` therefore points fd 1
at a pipe for that first call only and forwards what arrives: that line is
dropped (logged at debug level), any other oneCCL line goes to the logger as
a warning, and everything else (another thread's output) to the real stdout,
as it arrives. The records are logged only once fd 1 is stdout again (a
handler writing to stdout would otherwise feed the pipe it filters, without
end). A child process started during the call inherits the pipe as its
stdout (marking it close-on-exec instead would leave such a child no stdout
at all): the pump, with its own duplicate of stdout, keeps forwarding that
child's output until the child closes it, so it is neither lost nor blocked;
stdout itself is given back at once. With ``CCL_LOG_LEVEL`` set to anything but ``error`` (a user
debugging oneCCL) nothing is captured: oneCCL's output is what they asked for.

The grouped Send/Recv line: each Send or Recv issued inside a oneCCL group
prints ``|CCL_ERROR| host_event.cpp:58 ~host_event_impl: not completed event
is destroyed`` on stderr (gather: one per peer; all_to_all at 2 ranks: two per
call and rank) although the transfer completed and the results are right
(the tests check them). Measured at 2 ranks: ``CCL_WORKER_OFFLOAD=1``,
``CCL_WORKER_WAIT=0``, ``CCL_ATL_SYNC_COLL=1`` and ``FI_PROVIDER=tcp`` keep
it; ``CCL_ATL_SHM=0`` with the shm provider fails init; an ungrouped
Send/Recv prints nothing. It is printed at error level, the level streamcoll
keeps, and filtering it would mean routing the process's stderr through a
pipe for good (lost output when a process is killed, a thread between every
Python traceback and the terminal), so it is left as oneCCL prints it.
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
