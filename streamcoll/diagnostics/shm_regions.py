"""libfabric's shared-memory regions in ``/dev/shm``: this process's are
removed on every way out, stale ones at the first init.

libfabric's ``shm`` provider (oneCCL on one host) makes a region per
endpoint, ``/dev/shm/<pid>:<uid>:<ep_idx>``, unlinked only at endpoint close
(``onecclCommDestroy``): a rank killed, ended by the watchdog or whose exit
skips the native teardown leaves its region, and a later process that gets
the same pid fails its init ("failed to initialize ATL"). Unlinking is safe:
a process that has the region mapped keeps it.

- :func:`remove_own`: this process's regions (``/proc/self/maps``) are
  unlinked on every way out: ``atexit``, :func:`disposition` (SIGTERM's and
  SIGHUP's stand-in, :mod:`streamcoll.diagnostics.signals`), before the
  signal watcher or the watchdog ends the process.
- :func:`sweep`, before oneCCL's first init in a process
  (:func:`before_first_init`): a region is stale, and removed, when it is
  this user's, a plain file named like a region in the ``/dev/shm`` this
  process sees, and **no process on the machine has it open or mapped**
  (asked of the kernel with a write lease, held while unlinking; sweepers
  take turns under an exclusive ``flock`` on the directory). libfabric's
  short-lived ``<name>_<n>`` files are never touched.

Each removal is logged at INFO (``streamcoll.shm``) with the memory it frees.
What the files are (read in libfabric's source), why a lease and a lock:
docs/design.md, section 'libfabric's shared-memory regions'.
"""
from __future__ import annotations

import atexit
import errno
import fcntl
import logging
import os
import re
import signal
import stat
import threading
import time
from dataclasses import dataclass
from typing import Any, List, Optional, Tuple

__all__ = ["SHM_DIR", "Region", "region_pid", "sweep", "remove_own", "own_regions", "dead_peer_regions",
           "before_first_init", "disposition", "stands_for_default", "ending"]

log = logging.getLogger("streamcoll.shm")

SHM_DIR = "/dev/shm"
_NAME = re.compile(r"(\d+):\d+:\d+(?::\d+)?")   # <pid>:<uid>:<ep_idx> (1.14-2.5), <pid>:<uid>:<dom>:<ep> (1.10)
_LOCK = threading.Lock()
_PREPARED: List[int] = []   # the pid that registered the exit hook (a forked child registers its own)
_WAIT_FOR_OTHER_SWEEPER_S = 1.0
# Another process's sweep of the directory takes milliseconds per hundred regions. Past this, the
# sweep goes on without the lock: the lease's break notice (SIGURG) already makes two sweeps safe
# together; the lock only keeps them from each sparing a region the other had open. Any user can
# hold a flock on /dev/shm (and a forked child inherits one): a longer wait would let them stall
# every init on the host.
_SWEEP_LOCK_WAIT_S = 1.0
_BREAK_SIGNAL = signal.SIGURG   # the lease's break notice: ignored by default, where SIGIO's default kills


@dataclass(frozen=True)
class Region:
    """One region file: its path, the pid in its name, its nominal size
    (``st_size``) and the memory it holds (``st_blocks``: tmpfs pages)."""

    path: str
    pid: int
    nominal: int
    resident: int

    def describe(self) -> str:
        return f"{self.path} ({_mb(self.resident)} resident of {_mb(self.nominal)})"


def _mb(n: int) -> str:
    return f"{n / 1e6:.1f} MB"


def region_pid(name: str) -> Optional[int]:
    """The pid in a libfabric shm region name (``<pid>:<uid>:<ep>``), else None."""
    m = _NAME.fullmatch(name)
    return int(m.group(1)) if m else None


def _region(path: str, st: os.stat_result) -> Optional[Region]:
    pid = region_pid(os.path.basename(path))
    if pid is None or not stat.S_ISREG(st.st_mode):
        return None
    return Region(path, pid, st.st_size, st.st_blocks * 512)


# ------------------------------------------------------------------ the sweep
def _owner_here(pid: int, made: float) -> str:
    """What the pid in a name means in this PID namespace, for the log."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
    except (OSError, ValueError, IndexError):
        return f"pid {pid} not running here"
    # process start (CLOCK_BOOTTIME ticks) against the region's ctime (wall clock)
    started = start_ticks / os.sysconf("SC_CLK_TCK")
    made_boot = made - (time.clock_gettime(time.CLOCK_REALTIME) - time.clock_gettime(time.CLOCK_BOOTTIME))
    if started > made_boot:
        return f"pid {pid} reused since"
    return f"pid {pid} running here since before it was made: a region of another PID namespace"


def _remove_unused(path: str, uid: int) -> Tuple[Optional[Region], str]:
    """Unlink ``path`` if it is ``uid``'s region and nobody has it open or
    mapped; (the region removed or None, why kept or why removed)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except BlockingIOError:  # another sweeper holds a lease on it and is removing it
        deadline = time.monotonic() + _WAIT_FOR_OTHER_SWEEPER_S
        while os.path.lexists(path) and time.monotonic() < deadline:
            time.sleep(0.005)
        return None, "being removed by another process"
    except OSError as e:  # gone, a symlink (ELOOP), not readable
        return None, f"not opened: {e.strerror}"
    try:
        st = os.fstat(fd)
        reg = _region(path, st)
        if reg is None:
            return None, "not a regular file"
        if st.st_uid != uid:
            return None, f"owned by uid {st.st_uid}"
        try:
            fcntl.fcntl(fd, fcntl.F_SETSIG, _BREAK_SIGNAL)  # before the lease: its notice is never SIGIO
            fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_WRLCK)
        except OSError as e:
            if e.errno in (errno.EAGAIN, errno.EBUSY):
                return None, "open or mapped by a process"
            return None, f"cannot tell whether it is in use (no lease: {e.strerror})"
        try:
            try:
                if os.path.samestat(os.lstat(path), st):  # still the file leased
                    os.unlink(path)
                else:
                    return None, "replaced meanwhile"
            except FileNotFoundError:
                return None, "removed meanwhile"
        finally:
            fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_UNLCK)
        return reg, _owner_here(reg.pid, st.st_ctime)
    finally:
        os.close(fd)


def sweep(directory: str = SHM_DIR) -> List[Region]:
    """Remove the stale libfabric shm regions of this user in ``directory``
    (see the module docstring for which are stale); returns those removed,
    each logged at INFO."""
    try:
        names = os.listdir(directory)
    except OSError as e:
        log.debug("no shm sweep: %s: %s", directory, e.strerror)
        return []
    if not any(region_pid(name) is not None for name in names):
        return []
    try:
        lock = _lock_directory(directory)
    except OSError as e:
        log.debug("no shm sweep: cannot lock %s: %s", directory, e.strerror)
        return []
    if lock is None:
        log.debug("shm sweep of %s without its lock: another process held it for %g s", directory,
                  _SWEEP_LOCK_WAIT_S)
        return _sweep_locked(directory)
    try:
        return _sweep_locked(directory)
    finally:
        os.close(lock)  # releases the flock


def _lock_directory(directory: str) -> Optional[int]:
    """An fd of ``directory`` holding its exclusive flock, waited for up to
    ``_SWEEP_LOCK_WAIT_S``; None if another process held it all that time."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    deadline = time.monotonic() + _SWEEP_LOCK_WAIT_S
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return fd
        except BlockingIOError:
            if time.monotonic() >= deadline:
                os.close(fd)
                return None
            time.sleep(0.002)
        except BaseException:
            os.close(fd)
            raise


def _sweep_locked(directory: str) -> List[Region]:
    try:
        names = os.listdir(directory)  # again, under the lock: a sweep before ours removed some
    except OSError as e:
        log.debug("no shm sweep: %s: %s", directory, e.strerror)
        return []
    uid = os.geteuid()
    removed: List[Region] = []
    for name in names:
        if region_pid(name) is None:
            continue
        path = os.path.join(directory, name)
        reg, why = _remove_unused(path, uid)
        if reg is None:
            log.debug("kept %s: %s", path, why)
            continue
        removed.append(reg)
        log.info("removed stale libfabric shm region %s, open or mapped by no process (%s): %s freed",
                 path, why, _mb(reg.resident))
    return removed


# ------------------------------------------------------------ own regions
def _mapped_regions(dead_peers: bool) -> List[Region]:
    """The ``/dev/shm`` region files this process maps whose paths still
    name the mapped file (device and inode): its own (the pid in the name is
    its pid), or with ``dead_peers`` those of peers that have ended."""
    pid = os.getpid()
    seen = set()
    out: List[Region] = []
    try:
        with open("/proc/self/maps") as f:
            lines = f.readlines()
    except OSError:
        return out
    prefix = SHM_DIR + "/"
    for line in lines:
        parts = line.split(None, 5)
        if len(parts) < 6 or not parts[5].startswith(prefix) or parts[5].rstrip("\n").endswith("(deleted)"):
            continue
        path = parts[5].rstrip("\n")
        owner = region_pid(os.path.basename(path))
        if owner is None or (owner == pid) == dead_peers or path in seen:
            continue
        seen.add(path)
        try:
            major, minor = (int(x, 16) for x in parts[3].split(":"))
            st = os.lstat(path)
        except (OSError, ValueError):
            continue
        if (st.st_ino, os.major(st.st_dev), os.minor(st.st_dev)) != (int(parts[4]), major, minor):
            continue
        if dead_peers and not _gone(owner, st.st_ctime):
            continue
        reg = _region(path, st)
        if reg is not None:
            out.append(reg)
    return out


def own_regions() -> List[Region]:
    """This process's regions: the ``/dev/shm/<this pid>:...`` files it maps
    whose paths still name the mapped file (device and inode)."""
    return _mapped_regions(dead_peers=False)


def _gone(pid: int, made: float) -> bool:
    """Whether the process that made a region (pid ``pid`` in its name, made
    at ``made``) has ended: no process of this PID namespace has that pid,
    or it is a zombie. A live process with that pid counts as the owner even
    where it may be a reuse: comparing its start with the region's time
    mixes the wall clock with the boot clock, and a clock step made a live
    peer's region look stale; a reused pid's region
    waits for the next init's sweep."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        state, start_ticks = fields[0], int(fields[19])
    except FileNotFoundError:
        return True
    except (OSError, ValueError, IndexError):
        return False
    return state in ("Z", "X")


def dead_peer_regions() -> List[Region]:
    """The regions this process maps of peers that have ended (a SIGKILLed
    rank of the same host): see :func:`remove_own`."""
    return _mapped_regions(dead_peers=True)


def remove_own(when: str = "at exit") -> List[Region]:
    """Unlink this process's regions (the process is ending: ``when`` says
    how, for the log), then those it maps of peers that have already ended
    (a SIGKILLed rank's: once this process is gone no survivor maps it, and
    nobody would remove it before the next init on the host); returns them.
    Never raises.

    A peer's end is judged in this process's PID namespace, which is its
    shm peers' own under streamcoll's settings: oneCCL's shm transport joins
    the ranks of one hostname, and streamcoll turns it on only where each
    hostname is one host identity (network, IPC and PID namespace,
    ``/dev/shm``; :mod:`streamcoll.startup.topology`)."""
    removed: List[Region] = []
    try:
        for reg in own_regions():
            try:
                os.unlink(reg.path)
            except OSError:
                continue
            removed.append(reg)
            log.info("removed this process's libfabric shm region %s %s: %s freed when the process ends",
                     reg.path, when, _mb(reg.resident))
        for reg in dead_peer_regions():
            try:
                os.unlink(reg.path)
            except OSError:
                continue
            removed.append(reg)
            log.info("removed the libfabric shm region %s of pid %d, a peer that has ended, %s: %s freed when "
                     "the process ends", reg.path, reg.pid, when, _mb(reg.resident))
    except Exception as e:  # on the way out: never in the way of the exit
        try:
            log.debug("removing this process's shm regions failed: %s", e)
        except Exception:
            pass
    return removed


def before_first_init() -> None:
    """Before oneCCL's first init in this process (from the bootstrap): the
    exit hook, then the sweep. Idempotent per process."""
    with _LOCK:
        if os.getpid() in _PREPARED:
            return
        _PREPARED[:] = [os.getpid()]
        atexit.register(remove_own, "at interpreter exit")
    try:
        t0 = time.perf_counter()
        removed = sweep()
        log.debug("shm sweep: %d stale region(s) removed in %.2f ms", len(removed), (time.perf_counter() - t0) * 1e3)
    except Exception as e:  # the sweep is housekeeping: never fails an init
        log.debug("shm sweep failed: %s", e)


# ----------------------------------------------------------------- signals
_ENDING: List[Tuple[int, int]] = []   # (pid, signal) of each stand-in started


def disposition(signum: int, handler: Any) -> Any:
    """The handler :mod:`streamcoll.diagnostics.signals` puts back for SIGINT/SIGTERM
    after a native init (and gives a default SIGHUP): the program's own,
    except the default, which kills without any cleanup; it becomes
    :func:`_end_by_signal` (the same end, after removing this process's
    regions)."""
    return _end_by_signal if handler is signal.SIG_DFL else handler


def stands_for_default(handler: Any) -> bool:
    """Whether ``handler`` is the stand-in :func:`disposition` installs for a
    default disposition (so :mod:`streamcoll.diagnostics.signals` treats the signal as
    having no handler of the user's)."""
    return handler is _end_by_signal


def ending(signum: int) -> bool:
    """Whether the stand-in for ``signum`` has started in this process (the
    signal watcher then leaves the end to it)."""
    return (os.getpid(), signum) in _ENDING


def _end_by_signal(signum: int, frame: Any) -> None:
    """Remove this process's regions, then die of ``signum`` under its
    default disposition (the exit status stays ``-signum``)."""
    _ENDING.append((os.getpid(), signum))
    remove_own(f"on {signal.Signals(signum).name}")
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)
