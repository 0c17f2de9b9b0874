"""Ctrl-C, SIGTERM and SIGHUP after ``init()``: Python's handling, not
oneCCL's, and a terminating signal ends the process wherever the main thread
stands.

Measured (oneCCL 2022.2, CPU): loading the library (the bootstrap does it
before the process's first ``onecclGetUniqueId`` or ``onecclCommInitRank``)
installs native handlers for SIGINT, SIGTERM, SIGSEGV, SIGBUS, SIGILL and
SIGABRT (``SigCgt`` in ``/proc/<pid>/status``). For SIGINT and SIGTERM its
handler ends the process with exit status 1 and no message: no
``KeyboardInterrupt``, no ``finally``, no ``atexit``, and a launcher cannot
tell a Ctrl-C from a crash. For the
fatal signals it prints ``<prog>:<pid> terminated with signal N at PC=...``
and a native backtrace, which is worth keeping for a crash inside the
library.

So :func:`native_entry` (around the load, then around each of those calls,
which may wait long for the peers: a rank's first init) puts back, after
it, the handlers Python had for SIGINT and SIGTERM before it (Ctrl-C raises
``KeyboardInterrupt``; a default SIGTERM becomes
:func:`streamcoll.diagnostics.shm_regions.disposition`'s stand-in, which removes this
process's ``/dev/shm`` regions, then dies of the signal), gives a default
SIGHUP the same stand-in (oneCCL leaves SIGHUP alone, but its default kill
would leave the regions behind just the same: a closed terminal or ssh
session, a launcher that hangs up), keeps oneCCL's handlers for the fatal
signals, and re-enables :mod:`faulthandler` if the program had it on (it
chains to the previous handler, so a crash prints the Python stacks, then
oneCCL's backtrace). Only the main thread can install Python signal
handlers; from another thread they stay oneCCL's (logged).

A Python-level handler, the stand-in included, runs only when the main
thread is back in the interpreter. A main thread inside a native call that
retries on EINTR (a gloo barrier, a TCPStore wait or connect, a oneCCL
collective on a dead peer) would hold the process alive until the call
returns: gloo's own timeout is 30 min, and launchers (torchrun's agent,
SLURM, Kubernetes) send SIGTERM and expect the process to end. Without
streamcoll the kernel would have ended it at once. So the interrupt watcher
(:func:`watch_interrupts`, a thread) sees each signal through
:func:`signal.set_wakeup_fd` (Python's C handler writes the signal number
there; no cost on the call path) and acts by whose handler the signal has:

- **the program's** (any handler it installed for SIGINT, SIGTERM or
  SIGHUP: a checkpoint-on-preemption handler under SLURM or Kubernetes):
  nothing, as before; when the main thread is inside streamcoll's call, a
  warning that the handler runs when the call returns (a call stuck for
  good ends by the watchdog at the communicator's timeout).
- **nobody's** (SIGINT with Python's ``default_int_handler``; SIGTERM or
  SIGHUP with the stand-in): the watcher asks whether the main thread gets
  back to the interpreter within a grace (:data:`TERMINATE_GRACE_S` for
  SIGTERM and SIGHUP, whose default dies anyway, so waiting only spares the
  message; :data:`INTERRUPT_GRACE_S` for SIGINT, time for a call about to
  return, after which Python raises ``KeyboardInterrupt`` with its
  ``finally`` and ``atexit``). Back means: the stand-in started, the main
  thread's frame moved, or a probe queued with ``Py_AddPendingCall`` ran
  (CPython runs pending calls in the main thread at the same eval-breaker
  check as signal handlers, after them); each look comes after a pause
  that gives the main thread the GIL (a main thread running Python holds
  it, and runs the handler at its next check). If not, or if a second
  terminating signal arrives first (at least :data:`_SECOND_AFTER_S` after
  the first: two sent at once, a terminal's Ctrl-C to the process group and
  torchrun's forwarded one, are two KeyboardInterrupts for a main thread in
  Python), it removes this process's regions, logs where the main thread
  stands (inside streamcoll's call: the call, and the peers as the likely
  cause; anywhere else: the file, line and function, blaming nobody) and
  ends the process **by the signal itself**: the C disposition is reset
  to the default through ``signal()`` (the C call, reached with cffi's ABI
  mode: Python's ``signal.signal`` works only in the main thread), then the
  signal is sent to the watcher's own thread.
  A parent sees what it would without streamcoll: killed by SIGTERM (-15
  in :mod:`subprocess`, 143 in a shell), by SIGINT (Python's own exit on an
  uncaught ``KeyboardInterrupt``), by SIGHUP, wherever the main thread was.
  One exception: a single SIGINT while the main thread is in someone
  else's native call (a gloo barrier, a long torch op) only warns: that
  call may still return, and a program may catch the KeyboardInterrupt then
  (a REPL, a notebook, a loop that saves and goes on); a second SIGINT
  while the main thread is still there ends the process. Inside
  streamcoll's own call (a collective that cannot be interrupted) one
  SIGINT ends it after the grace, as before. A launcher's SIGTERM always
  ends it.
  No ``finally`` or ``atexit`` runs: the teardown would crash under the
  stuck call. The end is armed before the message (:data:`END_BOUND_S`):
  a write to a full stderr pipe, or a logging lock the stuck main thread
  holds, cannot keep the process alive; so is it when the stand-in runs
  (its region removal may log to that stderr).

Where the watcher cannot run, the stand-ins are not installed: a default
SIGTERM or SIGHUP stays the kernel's, which ends the process at once
wherever the main thread stands (the regions are left for the next init's
sweep, :func:`streamcoll.diagnostics.shm_regions.sweep`). That is the case of a program
whose event loop owns the wakeup fd at init (asyncio's
``add_signal_handler``; :func:`asyncio.run` alone does not take it): the
loop keeps it and the watcher stays off. A loop that takes the fd after
init takes it from the watcher, which then sees no signal: SIGTERM's
stand-in runs when the main thread returns to the interpreter; and once
such a loop is closed (it sets the fd to -1), the watcher stays blind: a
SIGTERM while the main thread is in a native call then waits for that call
to return (a known limit: ``tests/diagnostics/test_signals.py``, a strict
xfail). A forked child (a
DataLoader worker) has no watcher thread: it gets the plain defaults back
(:func:`_after_fork_in_child`).
"""
from __future__ import annotations

import collections
import contextlib
import faulthandler
import logging
import os
import signal
import sys
import sysconfig
import threading
import time
from typing import Any, Deque, Dict, Iterator, List, Optional, Tuple

from . import shm_regions

__all__ = ["native_entry", "watch_interrupts", "INTERRUPT_GRACE_S", "TERMINATE_GRACE_S"]

log = logging.getLogger("streamcoll.diagnostics.signals")

INTERRUPT_GRACE_S = 1.0
TERMINATE_GRACE_S = 0.25
END_BOUND_S = 1.0   # once the end is decided (or the stand-in runs), the process is gone within this
_KEPT = (signal.SIGINT, signal.SIGTERM)          # oneCCL replaces these: put Python's back
_STAND_IN_TOO = (signal.SIGHUP,)                 # nobody replaces it; its default gets the stand-in
_TERMINATING = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
_POLL_S = 0.01
_SECOND_AFTER_S = 0.1   # a second signal ends a stuck call only this long after the first: two sent at
                        # once (a terminal's Ctrl-C to the process group, then torchrun's) to a main
                        # thread in Python are two KeyboardInterrupts, not a stuck call
_PKG_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the package's folder
_WATCH_LOCK = threading.Lock()
_WATCH: Dict[str, Any] = {}


def _in_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


@contextlib.contextmanager
def native_entry() -> Iterator[None]:
    """Around a native call that may install the library's signal handlers:
    afterwards SIGINT and SIGTERM are handled as before it (a default SIGTERM
    and SIGHUP by the stand-in, where the watcher runs), and faulthandler is
    on again if it was."""
    main = _in_main_thread()
    saved = {s: signal.getsignal(s) for s in _KEPT} if main else {}
    fh = faulthandler.is_enabled()
    try:
        yield
    finally:
        if main:
            watched = watch_interrupts()  # first: without the watcher, no stand-in
            for s, h in saved.items():
                if h is not None:  # None: installed outside Python; not ours to redo
                    _set(s, _disposition(s, h, watched))
            for s in _STAND_IN_TOO:
                h = signal.getsignal(s)
                if h is signal.SIG_DFL or shm_regions.stands_for_default(h):
                    _set(s, _disposition(s, h, watched))
            if fh:
                try:
                    faulthandler.enable(all_threads=True)
                except Exception as e:  # sys.stderr without a file descriptor
                    log.debug("could not re-enable faulthandler: %s", e)
        else:
            log.debug("communicator created outside the main thread: SIGINT/SIGTERM keep the native "
                      "library's handlers (only the main thread can install Python's)")


def _disposition(signum: int, handler: Any, watched: bool) -> Any:
    """The handler to put back: the stand-in for a default only where the
    watcher runs (a stand-in nobody watches waits for the main thread, where
    the kernel's default ends the process at once)."""
    if watched:
        return shm_regions.disposition(signum, handler)
    return signal.SIG_DFL if shm_regions.stands_for_default(handler) else handler


def _set(signum: int, handler: Any) -> None:
    try:
        signal.signal(signum, handler)
    except (OSError, ValueError) as e:
        log.debug("could not set the handler of %s: %s", signal.Signals(signum).name, e)


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
            log.debug("interrupt watcher off: the wakeup fd is in use (fd %d); a default SIGTERM/SIGHUP keeps "
                      "the kernel's action", old)
            return False
        native = _Native.load()
        main = threading.main_thread()
        t = threading.Thread(target=_watch, args=(rfd, main.ident), name="streamcoll-signals", daemon=True)
        _WATCH.update(pid=os.getpid(), rfd=rfd, wfd=wfd, thread=t, native=native)
        t.start()
        return True


class _Native:
    """The two C entry points the watcher needs, through cffi's ABI mode on
    the process's own symbols: ``Py_AddPendingCall`` (a probe that runs when
    the main thread is back in the interpreter) and libc's ``signal()`` (the
    default disposition back from any thread, so the process can die of the
    signal). Either may be missing (a build without the symbols, a system
    refusing cffi's callbacks): the watcher then judges by the frame alone,
    and exits with 128 + the signal number."""

    def __init__(self) -> None:
        import cffi
        self.ffi = cffi.FFI()
        self.ffi.cdef("typedef void (*sighandler_t)(int);"
                      "sighandler_t signal(int signum, sighandler_t handler);"
                      "int Py_AddPendingCall(int (*func)(void *), void *arg);")
        self.lib = self.ffi.dlopen(None)
        self.ran = 0.0          # monotonic time the probe last ran (main thread)
        self.queued = False
        self.callback: Any = None
        try:
            self.lib.Py_AddPendingCall  # resolve now, not at the signal
            self.callback = self.ffi.callback("int(void *)", self._probe)
        except Exception as e:
            log.debug("no pending-call probe (%s): the watcher judges by the main thread's frame", e)

    @classmethod
    def load(cls) -> "Optional[_Native]":
        try:
            return cls()
        except Exception as e:
            log.debug("no native helpers for the signal watcher: %s", e)
            return None

    def _probe(self, _arg: Any) -> int:
        self.ran = time.monotonic()
        self.queued = False
        return 0

    def ask(self) -> None:
        """Queue the probe (one at a time: one still queued answers as well)."""
        if self.callback is None or self.queued:
            return
        self.queued = True  # before the call: the probe may run (and clear it) before the call returns
        if self.lib.Py_AddPendingCall(self.callback, self.ffi.NULL) != 0:  # CPython's queue is full
            self.queued = False

    def default(self, signum: int) -> bool:
        """The default disposition back for ``signum`` (C ``signal()``)."""
        return self.lib.signal(signum, self.ffi.cast("sighandler_t", 0)) != self.ffi.cast("sighandler_t", -1)


def _after_fork_in_child() -> None:
    """A forked child (a DataLoader worker) has no watcher thread, so a
    stand-in there would wait for its main thread: the plain defaults come
    back (the regions are the parent's). And its signals must not reach the
    parent's watcher through the shared pipe, where Python's handler would
    write them."""
    for s in _TERMINATING:
        try:
            if shm_regions.stands_for_default(signal.getsignal(s)):
                signal.signal(s, signal.SIG_DFL)
        except (ValueError, OSError):  # not the child's main thread
            pass
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
    SIG_DFL's stand-in (:func:`streamcoll.diagnostics.shm_regions.disposition`) counts as
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
    backlog: Deque[int] = collections.deque()
    while True:
        if not backlog:
            try:
                data = os.read(rfd, 64)
            except OSError:
                return
            if not data:
                return
            backlog.extend(data)
        signum = backlog.popleft()
        if signum not in _TERMINATING:
            continue
        try:
            whose = _handler_of(signum)
            if whose == "user":
                _deferred(signum, main_ident)
            elif whose == "default":
                _on_signal(rfd, signum, main_ident, backlog)
        except Exception as e:  # the watcher outlives any one signal
            log.debug("signal watcher: %s", e)


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


def _on_signal(rfd: int, signum: int, main_ident: Optional[int], backlog: Deque[int]) -> None:
    """A signal with nobody's handler: wait a grace for the main thread to
    run Python's handler; if it does not, end the process by the signal."""
    frame = _main_frame(main_ident)
    where = (frame, frame.f_lasti if frame is not None else -1)
    seen = time.monotonic()
    certain = shm_regions.stands_for_default(signal.getsignal(signum))  # its handler only ends the process
    native = _WATCH.get("native")
    warned = _WATCH.pop("warned", None)
    if (signum == signal.SIGINT and warned is not None and warned[0] is frame and warned[1] == where[1]
            and (native is None or native.ran <= warned[2])):
        _end(signum, frame, INTERRUPT_GRACE_S, signum)  # Ctrl-C again, the main thread still in that call
        return
    if native is not None:
        try:
            native.ask()
        except Exception as e:
            log.debug("pending-call probe failed: %s", e)
    grace = INTERRUPT_GRACE_S if signum == signal.SIGINT else TERMINATE_GRACE_S
    deadline = seen + grace
    then: Optional[int] = None
    os.set_blocking(rfd, False)
    try:
        while True:
            # First the main thread's turn: it holds the GIL while it runs Python, and runs the
            # handler (and the probe) at its next check; a look before that sees it "stuck".
            time.sleep(_POLL_S)
            try:
                more = os.read(rfd, 64)
            except BlockingIOError:
                more = b""
            for s in more:
                if then is None and s in _TERMINATING and _handler_of(s) == "default":
                    then = s
                else:
                    backlog.append(s)
            back = shm_regions.ending(signum)  # the stand-in runs in the main thread: it ends the process
            f = _main_frame(main_ident)
            back = back or f is not where[0] or (f is not None and f.f_lasti != where[1])  # it moved
            back = back or (native is not None and native.ran > seen)  # back in the interpreter, after the handler
            if back:
                if then is not None:
                    backlog.appendleft(then)  # a signal of its own, for Python's handler as well
                if certain:  # the stand-in ends the process: even if its removal's log line blocks
                    _end_anyway(signum)
                return
            now = time.monotonic()
            if (then is not None and now >= seen + _SECOND_AFTER_S) or now >= deadline:
                break
    finally:
        os.set_blocking(rfd, True)
    if signum == signal.SIGINT and then is None and not _in_streamcoll(frame):
        # Someone else's native call (a gloo barrier, a long torch op): it may still return, and
        # a program may catch the KeyboardInterrupt Python raises then (a REPL, a notebook, a
        # loop that saves and goes on). Not ended on one Ctrl-C: a second one ends it.
        _WATCH["warned"] = (where[0], where[1], time.monotonic())
        try:
            log.warning("streamcoll: SIGINT received while the main thread is inside a native call that has not "
                        "returned within %g s: %s. Python raises KeyboardInterrupt when it returns; press Ctrl-C "
                        "again (SIGINT) to end the process now.", grace, _where(frame))
        except Exception:
            pass
        return
    _end(signum, frame, grace, then)


def _stuck_calls() -> List[str]:
    """What the communicators of this process are inside now, for the message."""
    try:
        from .watchdog import running_calls
        return running_calls()
    except Exception:
        return []


_LIBRARY_DIRS: Tuple[str, ...] = tuple(
    os.path.join(os.path.abspath(p), "") for k, p in sysconfig.get_paths().items()
    if k in ("stdlib", "platstdlib", "purelib", "platlib") and p)


def _at(frame: Any) -> str:
    return f"{frame.f_code.co_name} ({frame.f_code.co_filename}:{frame.f_lineno})"


def _where(frame: Any) -> str:
    """Where the main thread stands, for the message: its innermost frame
    (the caller of the native call) and the program's nearest frame, outside
    the standard library and installed packages."""
    if frame is None:
        return "no Python frame (interpreter start-up or shutdown)"
    text = _at(frame)
    f = frame
    while f is not None and os.path.abspath(f.f_code.co_filename).startswith(_LIBRARY_DIRS):
        f = f.f_back
    if f is not None and f is not frame:
        text += f", called from {_at(f)}"
    return text


def _end(signum: int, frame: Any, grace: float, then: Optional[int]) -> None:
    """Say where the main thread stands, remove the regions, die of ``signum``
    (whatever the message does: a write to a full stderr pipe, or a logging
    lock the stuck main thread holds, blocks it, so the end is armed first)."""
    name = signal.Signals(signum).name
    _end_anyway(signum)
    shm_regions.remove_own(f"on {name}")  # first: no write to stderr at the default log level
    try:
        _tell(signum, name, frame, grace, then)
    except Exception:
        pass
    for s in (sys.stdout, sys.stderr):
        try:
            s.flush()
        except Exception:
            pass
    _die_of(signum)


def _end_anyway(signum: int) -> None:
    """Die of ``signum`` :data:`END_BOUND_S` from now, whatever this thread
    (or the main thread, in the stand-in) is blocked in by then."""
    t = threading.Timer(END_BOUND_S, _die_of, (signum,))
    t.daemon = True
    t.name = "streamcoll-signals-end"
    t.start()


def _tell(signum: int, name: str, frame: Any, grace: float, then: Optional[int]) -> None:
    how = ("a second time" if then == signum else f"then {signal.Signals(then).name}" if then is not None
           else f"and the call did not return within {grace:g} s")
    if _in_streamcoll(frame):
        calls = _stuck_calls()
        what = "; ".join(calls) if calls else _where(frame)
        log.error(
            "streamcoll: %s received %s while the main thread is inside a native call that cannot be "
            "interrupted: %s. Likely cause: another rank died, hung or is not calling this collective. "
            "No handler of yours is installed for %s, so its default would end the process: ending it now, "
            "by %s (no finally/atexit: the native call still runs; a handler you install runs instead "
            "when the call returns).", name, how, what, name, name)
    else:
        late = ("Python raises KeyboardInterrupt only when the call returns" if signum == signal.SIGINT
                else "its default ends the process, but streamcoll's stand-in for it runs only when the call "
                     "returns")
        when = (f"that did not return within {grace:g} s" if then is None
                else f"(a second {name} came before it returned)" if then == signum
                else f"({signal.Signals(then).name} came too before it returned)")
        log.error(
            "streamcoll: %s received while the main thread is inside a native call %s: %s. No handler of yours "
            "is installed for %s; %s: ending the process now, by %s, after removing its /dev/shm regions "
            "(no finally/atexit; a handler you install runs instead when the call returns).",
            name, when, _where(frame), name, late, name)


def _die_of(signum: int) -> None:
    """End the process as ``signum``'s default does (killed by it): its C
    disposition back to the default, then sent to this thread with the
    signal unblocked here. Never returns; ``os._exit(128 + signum)`` if that
    could not be done."""
    native = _WATCH.get("native")
    try:
        if native is not None and native.default(signum):
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signum})
            signal.pthread_kill(threading.get_ident(), signum)
            time.sleep(1.0)  # the default action ends the process before this returns
    except Exception as e:
        log.debug("could not end the process by %s: %s", signal.Signals(signum).name, e)
    os._exit(128 + signum)
