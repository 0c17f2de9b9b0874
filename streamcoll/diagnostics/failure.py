"""What a collective's failure does to the process: the communicator is
marked failed (later calls raise at once), its flight record is written,
the failure is reported with what to do, the communicator is aborted where
the library can (NCCL: ``ncclCommAbort``), and then, by default, the process
ends with ``os._exit(EXIT_CODE)`` (86), so that a launcher such as torchrun
sees a failed rank and tears the job down. ``STREAMCOLL_WATCHDOG=fail``
keeps the process (a thread stuck inside oneCCL stays stuck);
``STREAMCOLL_WATCHDOG=off`` watches nothing (:func:`mode`). The watchdog's
thread (:mod:`streamcoll.diagnostics.watchdog`) finds the hangs; a timeout
reported to the caller (``Work.wait(timeout)``) arrives here through
:func:`handle_timeout` and is then left to the caller.

A normal exit while a oneCCL call is still running would crash in the
library's teardown (measured: SIGSEGV): :func:`skip_native_teardown`
registers a C ``on_exit`` handler that calls ``_exit(status)`` before the
libraries' destructors run, keeping the exit status. An MPI that
streamcoll's own rendezvous initialised (mpi4py, under ``mpiexec``) is
finalised at exit by :func:`finalize_mpi_unless_stuck`, which skips it
then: ``MPI_Finalize`` waits for every rank, and a hung one never comes.
"""
from __future__ import annotations

import logging
import os
import sys
import threading
from typing import Any, List

from ..core import recorder
from .._ffi.errors import CollectiveTimeout
from . import hang_report, shm_regions

__all__ = ["EXIT_CODE", "mode", "handle_timeout", "skip_native_teardown", "who_and_where", "defer_mpi_finalize"]

log = logging.getLogger("streamcoll.diagnostics.watchdog")  # the watchdog's reports: one logger

EXIT_CODE = 86


# torch's TORCH_NCCL_ASYNC_ERROR_HANDLING, where the meaning is the same: 1
# (tear down) and 3 (skip clean-up) end the process, 0 (no handling) and 2
# (clean up only) report and fail the communicator and keep the process.
_TORCH_MODES = {"0": "fail", "1": "exit", "2": "fail", "3": "exit"}


def mode() -> str:
    """``exit`` (default), ``fail`` or ``off`` (``STREAMCOLL_WATCHDOG``;
    unset: ``TORCH_NCCL_ASYNC_ERROR_HANDLING`` 1/3 exit, 0/2 fail)."""
    m = os.environ.get("STREAMCOLL_WATCHDOG", "").strip().lower()
    if not m:
        t = os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "").strip()
        m = _TORCH_MODES.get(t, "exit")
    if m in ("0", "false", "no"):
        m = "off"
    if m not in ("exit", "fail", "off"):
        raise ValueError(f"STREAMCOLL_WATCHDOG: expected exit, fail or off, got {m!r}")
    return m


def what_to_do(comm: Any) -> str:
    if comm._backend.name == "nccl":
        return ("the NCCL communicator was aborted (ncclCommAbort); create a new one "
                "(or restart the job) to continue")
    return ("oneCCL cannot abort a communicator, so the stuck call never returns: end the process "
            "(a normal exit works) and restart the job; look for a rank that died, hung or called a "
            "different collective")


def dump_quietly(comm: Any, reason: str) -> str:
    try:
        return recorder.dump(comm, None, reason)
    except Exception as e:  # a full disk must not hide the timeout itself
        return f"(could not be written: {e})"


def handle_timeout(comm: Any, op: str, seq: int, timeout: float, shapes: list,
                   detail: str = "", own: bool = False) -> CollectiveTimeout:
    """What a timeout reported to the caller does (``Work.wait``,
    ``synchronize``): mark ``comm`` failed, dump its flight record, abort it
    where the library can, and make a normal process exit safe. Returns the
    :class:`CollectiveTimeout` to raise (it names the dump). ``own``: the
    timeout is the call's own ``timeout=``, a deadline the caller set: the
    hang report is gathered in the background (logged, and dumped again)
    instead of inside the raise, which comes at the deadline."""
    first = comm.failure is None
    if first:
        # Mark first: the dump then says "failed", and other threads' calls raise at once.
        comm.mark_failed(CollectiveTimeout(op, seq, timeout, shapes, comm._rank, comm._size))
    report = None
    if first:
        try:
            report = who_and_where(comm, op, seq, wait=not own)  # before the dump, which holds it
        except BaseException:
            after_failure(comm)  # interrupted while it waited for the answers: the exit is made safe all the same
            raise
    path = dump_quietly(comm, f"timeout of {op} #{seq}") if first else None
    detail = (detail + "; " if detail else "") + what_to_do(comm)
    if path:
        detail += f"; flight record: {path} (python -m streamcoll.flight analyze {os.path.dirname(path)})"
    if report is not None:
        detail += "\n" + report.text("  ")
    elif first and own and hang_report.gathering(comm):  # queued (not: off, one rank, exiting, ...)
        detail += (f"; who and where: the other ranks are being asked (up to {hang_report.budget_s():g} s, "
                   "STREAMCOLL_HANG_REPORT_S), the report follows as a warning in the log and in the flight record")
    exc = CollectiveTimeout(op, seq, timeout, shapes, comm._rank, comm._size, detail)
    if first:
        comm.mark_failed(exc, replace=True)  # the detailed error replaces the placeholder set above
        after_failure(comm)
    return exc


def who_and_where(comm: Any, op: str, seq: int, wait: bool = True) -> Any:
    """The hang report of ``op`` #``seq`` timing out on ``comm``
    (:func:`streamcoll.diagnostics.hang_report.gather`: every rank asked
    through the store, a bounded wait), or None (off, one rank, or it
    failed: the timeout itself is what must be reported). Off with
    ``STREAMCOLL_WATCHDOG=off`` too: the answering threads are woken by the
    watchdog's passes, so nobody would answer and the raise would wait the
    whole budget for nothing."""
    if mode() == "off":
        return None
    try:
        return hang_report.gather(comm, op, seq, wait=wait)
    except Exception as e:  # noqa: BLE001
        log.debug("streamcoll watchdog: hang report of %r failed: %r", comm.name, e)
        return None


def after_failure(comm: Any) -> None:
    """The library's teardown after a failure: ``Communicator.abort`` (NCCL:
    ncclCommAbort; oneCCL, which cannot abort: a call still inside it makes
    the exit skip the native teardown)."""
    try:
        comm.abort()
    except Exception as e:  # the failure itself is what gets reported
        log.debug("streamcoll watchdog: abort of %r after its failure raised %r", comm.name, e)


# ------------------------------------------------------- exit without teardown
_SKIP_LOCK = threading.Lock()
_SKIP_REGISTERED = False
_KEEP: List[Any] = []


def skip_native_teardown() -> bool:
    """Make the process's exit skip the native libraries' teardown, keeping
    the exit status. Called once a native call can never return (oneCCL has
    no abort): their C++ destructors would run under the stuck call and crash.

    glibc's ``on_exit`` runs handlers newest first, before the destructors of
    libraries loaded earlier, and passes the exit status: registering
    ``_exit`` itself ends the process there, after Python's own finalisation
    (atexit handlers, flushed ``sys.stdout``/``sys.stderr``). Elsewhere, a
    Python ``atexit`` handler calls ``os._exit(1)``. Returns True if the C
    handler is in place.
    """
    global _SKIP_REGISTERED
    with _SKIP_LOCK:
        if _SKIP_REGISTERED:
            return True
        _SKIP_REGISTERED = True
        try:
            import cffi
            ffi = cffi.FFI()
            ffi.cdef("int on_exit(void (*function)(int, void *), void *arg); void _exit(int);")
            libc: Any = ffi.dlopen(None)  # declares on_exit/_exit (cdef above)
            fp = ffi.cast("void (*)(int, void *)", ffi.addressof(libc, "_exit"))
            if libc.on_exit(fp, ffi.NULL) == 0:
                _KEEP.append((ffi, libc, fp))
                return True
        except Exception:
            pass
        import atexit

        atexit.register(exit_now, 1)
        return False


def defer_mpi_finalize() -> None:
    """Called before streamcoll's rendezvous first imports mpi4py's ``MPI``
    (which initialises MPI): mpi4py would call ``MPI_Finalize`` at the very
    end of the interpreter's exit, where the status is unknown, and that
    waits for every rank of the job (MPICH: a PMI barrier). After a hang
    that is forever: with ``STREAMCOLL_WATCHDOG=fail`` a normal exit hung
    there under ``mpiexec`` (seen: ``sys.exit(3)`` after a CollectiveTimeout
    never ended the rank, so the launcher never tore the job down). So
    mpi4py's own finalize is turned off and an ``atexit`` handler finalises
    instead, unless a native call can never return; the exit then keeps its
    status (:func:`skip_native_teardown`). A program's own choice
    (``mpi4py.rc.initialize``/``finalize``, ``MPI4PY_RC_*``) is left alone."""
    try:
        import mpi4py
    except ImportError:
        return
    rc = mpi4py.rc
    if rc.finalize is not None or rc.initialize is not True or any(
            os.environ.get(f"MPI4PY_RC_{n}") for n in ("FINALIZE", "INITIALIZE")):
        return
    rc.finalize = False
    import atexit
    atexit.register(finalize_mpi_unless_stuck)


def finalize_mpi_unless_stuck() -> None:
    """At exit: ``MPI_Finalize``, as mpi4py would, unless a native call can
    never return (:func:`defer_mpi_finalize`). Where mpi4py would: after
    every ``atexit`` handler (a C ``Py_AtExit`` function, libmpi's
    ``MPI_Finalize`` itself), so that a handler the program registered
    before streamcoll's may still use MPI (one that did aborted under
    MPICH, "after finalizing MPICH", exit 1); here at once only where that
    cannot be registered."""
    MPI = sys.modules.get("mpi4py.MPI")
    if _SKIP_REGISTERED or MPI is None:
        return
    try:
        if not MPI.Is_initialized() or MPI.Is_finalized():
            return
        try:
            import ctypes
            fin = ctypes.CDLL(MPI.__file__).MPI_Finalize  # libmpi's, through the module's dependencies
            at_exit = ctypes.pythonapi.Py_AtExit
            at_exit.argtypes = [ctypes.c_void_p]
            at_exit.restype = ctypes.c_int
            if at_exit(ctypes.cast(fin, ctypes.c_void_p).value) == 0:
                _KEEP.append(fin)
                return
        except (OSError, AttributeError, ValueError) as e:
            log.debug("streamcoll: MPI_Finalize after the exit handlers not registered (%r): now", e)
        MPI.Finalize()
    except Exception as e:  # noqa: BLE001  (mpi4py's own exit hook reported nothing either)
        log.debug("streamcoll: MPI_Finalize at exit raised %r", e)


def exit_now(code: int = EXIT_CODE) -> None:
    """Flush Python's streams, then end the process without running teardown."""
    shm_regions.remove_own(f"on the watchdog's exit (code {code})")
    for s in (sys.stdout, sys.stderr):
        try:
            s.flush()
        except Exception:
            pass
    os._exit(code)
