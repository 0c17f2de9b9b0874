"""streamcoll's messages go through :mod:`logging`, and the native
libraries print nothing on stdout.

The logger is ``logging.getLogger("streamcoll")`` (modules log to children
such as ``streamcoll.watchdog``). streamcoll adds no handler: an application
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
as it arrives. With ``CCL_LOG_LEVEL`` set to anything but ``error`` (a user
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


def _route(line: bytes, real: int) -> None:
    if b"|CCL_" in line:
        text = line.decode("utf-8", "replace").rstrip("\n")
        if _LOG_LEVEL_LINE in line:
            logger.debug("oneCCL (dropped from stdout): %s", text)
        else:
            logger.warning("oneCCL: %s", text)
    else:
        os.write(real, line)


def _pump(rfd: int, real: int, partial: List[bytes]) -> None:
    """Forward what arrives on ``rfd`` line by line; ``partial[0]`` is the
    unfinished line (the caller waits for it before giving fd 1 back)."""
    buf = b""
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
            _route(line + b"\n", real)
    partial[0] = b""
    if buf:
        _route(buf, real)
    os.close(rfd)


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
    thread: Optional[threading.Thread] = None
    partial: List[bytes] = [b""]
    try:
        try:
            sys.stdout.flush()
        except Exception:
            pass
        _fflush()
        saved = os.dup(1)
        rfd, wfd = os.pipe()
        os.dup2(wfd, 1)
        os.close(wfd)
        thread = threading.Thread(target=_pump, args=(rfd, saved, partial), name="streamcoll-stdout", daemon=True)
        thread.start()
    except OSError as e:  # no fd 1 (a daemon): nothing to keep clean
        logger.debug("stdout not captured during oneCCL start-up: %s", e)
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
            os.dup2(saved, 1)  # the pipe's last write end is gone: the pump reads EOF
            if thread is not None:
                thread.join(2.0)
            os.close(saved)
