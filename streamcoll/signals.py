"""Ctrl-C and SIGTERM after ``init()``: Python's handling, not oneCCL's.

Measured (oneCCL 2022.2, CPU): the first ``onecclGetUniqueId`` or
``onecclCommInitRank`` of a process installs native handlers for SIGINT,
SIGTERM, SIGSEGV, SIGBUS, SIGILL and SIGABRT (``SigCgt`` in
``/proc/<pid>/status``). For SIGINT and SIGTERM its handler ends the process
with exit status 1 and no message: no ``KeyboardInterrupt``, no ``finally``,
no ``atexit``, and a launcher cannot tell a Ctrl-C from a crash. For the
fatal signals it prints ``<prog>:<pid> terminated with signal N at PC=...``
and a native backtrace, which is worth keeping for a crash inside the
library.

So :func:`native_entry` (around those calls) puts back, after the call, the
handlers Python had for SIGINT and SIGTERM before it (the default: Ctrl-C
raises ``KeyboardInterrupt``, SIGTERM kills with status -15), keeps oneCCL's
handlers for the fatal signals, and re-enables :mod:`faulthandler` if the
program had it on (it chains to the previous handler, so a crash prints the
Python stacks, then oneCCL's backtrace). Only the main thread can install
Python signal handlers; from another thread they stay oneCCL's (logged).

A Ctrl-C that lands while the main thread is inside a synchronous native
call is only a flag to Python: its handler runs when the call returns, and a
call stuck on a dead or absent peer never does (oneCCL has no abort). The
interrupt watcher (:func:`watch_interrupts`) sees each signal through
:func:`signal.set_wakeup_fd` (Python's C handler writes the signal number
there; no cost on the call path). What it does depends on whose handler the
signal has:

- **the user's** (any handler the program installed, for SIGINT or
  SIGTERM: a checkpoint-on-preemption handler under SLURM or Kubernetes):
  nothing but a warning that the handler runs when the call returns. The
  call may be a healthy collective waiting for a slower peer; a call stuck
  for good ends by the watchdog at the communicator's timeout.
- **nobody's** (SIGINT with Python's default, which raises
  ``KeyboardInterrupt`` and so would end the process anyway, or SIGTERM with
  its default action, which after a native init is
  :func:`streamcoll.shm_regions.disposition`'s stand-in: it removes this
  process's ``/dev/shm`` regions, then dies of the signal): when the main
  thread stands in streamcoll code, the watcher gives the call
  :data:`INTERRUPT_GRACE_S` to return (then Python raises
  ``KeyboardInterrupt`` as usual); if the main thread has not moved by then,
  or a second such signal arrives first, it logs what the main thread is
  stuck in and ends the process with ``os._exit(128 + signum)`` (130 for
  Ctrl-C, 143 for SIGTERM), without teardown, which would crash under the
  stuck call.

A program that owns the wakeup fd itself (asyncio's loop) keeps it, and
this watcher stays off.
"""
from __future__ import annotations

import contextlib
import faulthandler
import logging
import os
import signal
import sys
import threading
import time
from typing import Any, Dict, Iterator, List, Optional

from . import shm_regions

__all__ = ["native_entry", "watch_interrupts", "INTERRUPT_GRACE_S"]

log = logging.getLogger("streamcoll.signals")

INTERRUPT_GRACE_S = 1.0
_KEPT = (signal.SIGINT, signal.SIGTERM)
_PKG_DIR = os.path.dirname(os.path.abspath(__file__))
_WATCH_LOCK = threading.Lock()
_WATCH: Dict[str, Any] = {}


def _in_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


@contextlib.contextmanager
def native_entry() -> Iterator[None]:
    """Around a native call that may install the library's signal handlers:
    afterwards SIGINT and SIGTERM are handled as before it, and faulthandler
    is on again if it was."""
    main = _in_main_thread()
    saved = {s: signal.getsignal(s) for s in _KEPT} if main else {}
    fh = faulthandler.is_enabled()
    try:
        yield
    finally:
        if main:
            for s, h in saved.items():
                if h is not None:  # None: installed outside Python; not ours to redo
                    try:
                        signal.signal(s, shm_regions.disposition(s, h))  # SIG_DFL: removes /dev/shm regions first
                    except (OSError, ValueError) as e:
                        log.debug("could not restore the handler of %s: %s", s.name, e)
            if fh:
                try:
                    faulthandler.enable(all_threads=True)
                except Exception as e:  # sys.stderr without a file descriptor
                    log.debug("could not re-enable faulthandler: %s", e)
            watch_interrupts()
        else:
            log.debug("communicator created outside the main thread: SIGINT/SIGTERM keep the native "
                      "library's handlers (only the main thread can install Python's)")


def watch_interrupts() -> bool:
    """Start the interrupt watcher (main thread only; idempotent). Returns
    whether it runs."""
    with _WATCH_LOCK:
        if _WATCH.get("pid") == os.getpid():
            return True
        if not _in_main_thread():
            return False
        rfd, wfd = os.pipe()
        os.set_blocking(wfd, False)
        try:
            old = signal.set_wakeup_fd(wfd, warn_on_full_buffer=False)
        except (ValueError, OSError) as e:
            os.close(rfd)
            os.close(wfd)
            log.debug("interrupt watcher off: %s", e)
            return False
        if old != -1:  # someone else's (asyncio): give it back, stay off
            signal.set_wakeup_fd(old)
            os.close(rfd)
            os.close(wfd)
            log.debug("interrupt watcher off: the wakeup fd is in use (fd %d)", old)
            return False
        main = threading.main_thread()
        t = threading.Thread(target=_watch, args=(rfd, main.ident), name="streamcoll-signals", daemon=True)
        _WATCH.update(pid=os.getpid(), rfd=rfd, wfd=wfd, thread=t)
        t.start()
        return True


def _after_fork_in_child() -> None:
    """A forked child (a DataLoader worker) has no watcher thread, and its
    signals must not reach the parent's through the shared pipe: Python's
    handler would write them there."""
    if _WATCH.get("pid") is None:
        return
    try:
        signal.set_wakeup_fd(-1)
    except (ValueError, OSError):  # not the child's main thread
        pass
    for k in ("rfd", "wfd"):
        try:
            os.close(_WATCH[k])
        except (KeyError, OSError):
            pass
    _WATCH.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def _handler_of(signum: int) -> str:
    """``"user"``: a handler the program installed; ``"default"``: Python's
    own (SIGINT's ``default_int_handler``, which raises KeyboardInterrupt);
    ``"none"``: no Python handler (the signal never reaches the watcher).
    SIG_DFL's stand-in (:func:`streamcoll.shm_regions.disposition`) counts as
    the default."""
    try:
        h = signal.getsignal(signum)
    except (ValueError, OSError):
        return "none"
    if h is signal.default_int_handler or shm_regions.stands_for_default(h):
        return "default"  # Python's SIGINT handler, or SIG_DFL's stand-in (regions removed, then the default)
    return "user" if callable(h) else "none"


def _main_frame(main_ident: Optional[int]) -> Any:
    return sys._current_frames().get(main_ident) if main_ident is not None else None


def _in_streamcoll(frame: Any) -> bool:
    if frame is None:
        return False
    fn = frame.f_code.co_filename
    return fn.startswith("<streamcoll generated") or fn.startswith(_PKG_DIR + os.sep)


def _watch(rfd: int, main_ident: Optional[int]) -> None:
    while True:
        try:
            data = os.read(rfd, 64)
        except OSError:
            return
        if not data:
            return
        for signum in data:
            if signum in (signal.SIGINT, signal.SIGTERM):
                whose = _handler_of(signum)
                if whose == "user":
                    _deferred(signum, main_ident)
                elif whose == "default":
                    _on_signal(rfd, signum, main_ident)


def _deferred(signum: int, main_ident: Optional[int]) -> None:
    """The user's handler runs when the main thread's call returns: say so
    when that call is streamcoll's (a collective waiting for its peers)."""
    frame = _main_frame(main_ident)
    if not _in_streamcoll(frame):
        return
    calls = _stuck_calls()
    what = "; ".join(calls) if calls else f"{frame.f_code.co_name} ({frame.f_code.co_filename})"
    log.warning("streamcoll: %s received while the main thread is inside a native call (%s): your handler runs "
                "when the call returns (a call stuck for good ends by the watchdog at the communicator's "
                "timeout)", signal.Signals(signum).name, what)


def _on_signal(rfd: int, signum: int, main_ident: Optional[int]) -> None:
    frame = _main_frame(main_ident)
    if not _in_streamcoll(frame):
        return  # Python code or someone else's C call: Python's handler does its job
    where = (frame, frame.f_lasti)
    deadline = time.monotonic() + INTERRUPT_GRACE_S
    os.set_blocking(rfd, False)
    try:
        second = False
        while time.monotonic() < deadline:
            f = _main_frame(main_ident)
            if f is not where[0] or f.f_lasti != where[1]:
                return  # the call returned: Python raises KeyboardInterrupt (or runs the handler)
            try:
                more = os.read(rfd, 64)
            except BlockingIOError:
                more = b""
            if any(s == signum for s in more):
                second = True
                break
            time.sleep(0.02)
    finally:
        os.set_blocking(rfd, True)
    _end(signum, frame, second)


def _stuck_calls() -> List[str]:
    """What the communicators of this process are inside now, for the message."""
    try:
        from .watchdog import running_calls
        return running_calls()
    except Exception:
        return []


def _end(signum: int, frame: Any, second: bool) -> None:
    name = signal.Signals(signum).name
    calls = _stuck_calls()
    what = "; ".join(calls) if calls else f"{frame.f_code.co_name} ({frame.f_code.co_filename})"
    code = 128 + signum
    how = "a second time" if second else f"and the call did not return within {INTERRUPT_GRACE_S:g} s"
    log.error(
        "streamcoll: %s received %s while the main thread is inside a native call that cannot be "
        "interrupted: %s. Likely cause: another rank died, hung or is not calling this collective. "
        "No handler of yours is installed for %s, so its default would end the process: ending it now with "
        "exit code %d (no finally/atexit: the native call still runs; a handler you install runs instead "
        "when the call returns).", name, how, what, name, code)
    shm_regions.remove_own(f"on {name}")
    for s in (sys.stdout, sys.stderr):
        try:
            s.flush()
        except Exception:
            pass
    os._exit(code)
