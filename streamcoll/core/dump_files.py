"""Where flight dumps go, and how they are written: a dump can be written
into a place other users share. The default directory is this user's
(``$XDG_RUNTIME_DIR/streamcoll-flight``, else ``<tmp>/streamcoll-flight-<uid>``),
created 0700; an existing one that is a symbolic link, not a directory or
another user's is refused with a warning naming it, and the dump goes to a
new private directory (``mkdtemp``) that the warning names, rather than
failing: a dump is written when something already went wrong, and losing it
would hide the cause. Dump files are 0600, created with
``O_EXCL|O_NOFOLLOW`` relative to the directory checked, and renamed into
place."""
from __future__ import annotations

import errno
import logging
import os
import secrets
import stat
import tempfile
from typing import Any, Dict, Optional, Tuple, Union

__all__ = ["default_dir", "open_dump_dir", "write_private"]

log = logging.getLogger("streamcoll.flight")  # the flight recorder's messages: one logger


def _private_runtime_dir() -> Optional[str]:
    """``$XDG_RUNTIME_DIR`` where it is what the XDG spec says it is: a
    directory (not a link) of this user, closed to others. A value left by
    ``su``/``sudo -E`` names another user's directory: passed over."""
    d = os.environ.get("XDG_RUNTIME_DIR")
    if not d or not os.path.isabs(d):
        return None
    try:
        st = os.lstat(d)
    except OSError:
        return None
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
        return None
    return d


def default_dir() -> str:
    """Where dumps go unless a path is given: ``STREAMCOLL_FLIGHT_DIR``, else
    a directory of this user's own, ``$XDG_RUNTIME_DIR/streamcoll-flight``
    (a private runtime directory, see :func:`_private_runtime_dir`) or
    ``<tmp>/streamcoll-flight-<uid>``. Per user because ``<tmp>`` is shared:
    with one name for everybody, the first user to create it (or to plant a
    link there) would receive every other user's dumps."""
    d = os.environ.get("STREAMCOLL_FLIGHT_DIR")
    if d:
        return d
    run = _private_runtime_dir()
    if run:
        return os.path.join(run, "streamcoll-flight")
    return os.path.join(tempfile.gettempdir(), f"streamcoll-flight-{os.geteuid()}")


def _refusal(path: str, fd_or_err: Any) -> str:
    """Why the default directory ``path``, opened without following a link,
    may not take dumps ('' if it may)."""
    if isinstance(fd_or_err, OSError):
        try:
            mode = os.lstat(path).st_mode
        except OSError:
            mode = 0
        if stat.S_ISLNK(mode) or fd_or_err.errno == errno.ELOOP:
            return "is a symbolic link"
        if mode and not stat.S_ISDIR(mode) or fd_or_err.errno == errno.ENOTDIR:
            return "is not a directory"
        return f"cannot be opened ({fd_or_err.strerror})"
    st = os.fstat(fd_or_err)
    if st.st_uid != os.geteuid():
        return f"is owned by uid {st.st_uid}, not by this user (uid {os.geteuid()})"
    return ""


_FALLBACK: Dict[int, str] = {}  # pid -> the fresh private directory this process uses instead


def open_dump_dir(path: Optional[str] = None) -> Tuple[int, str]:
    """An open directory for dumps and its path: ``path`` as given, else
    :func:`default_dir`. The caller closes the descriptor (files are created
    relative to it, so the directory checked is the directory written).

    A directory the user named (``path``, ``STREAMCOLL_FLIGHT_DIR``) is
    created (0700) if missing and used as it is: it may be shared storage on
    purpose. The default one is created 0700, an own one with wider modes is
    closed to 0700, and one that is a symbolic link, not a directory or
    another user's is refused with a warning naming it: the dump then goes to
    a new private directory (``mkdtemp``: 0700, an unpredictable name; one
    per process, named in the warning). Refusing the dump instead would lose
    the record of a failure at the moment it happened.
    """
    chosen = path if path is not None else os.environ.get("STREAMCOLL_FLIGHT_DIR")
    if chosen:
        os.makedirs(chosen, mode=0o700, exist_ok=True)
        return os.open(chosen, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC), str(chosen)
    d = default_dir()
    try:
        os.mkdir(d, 0o700)
    except FileExistsError:
        pass
    opened: Any
    try:
        opened = os.open(d, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:
        opened = e
    why = _refusal(d, opened)
    if not why:
        fd = int(opened)
        if stat.S_IMODE(os.fstat(fd).st_mode) != 0o700:
            os.fchmod(fd, 0o700)
        return fd, d
    if isinstance(opened, int):
        os.close(opened)
    fresh = _FALLBACK.get(os.getpid())
    if fresh is None or not os.path.isdir(fresh):
        fresh = _FALLBACK[os.getpid()] = tempfile.mkdtemp(prefix=f"streamcoll-flight-{os.geteuid()}-")
    log.warning("streamcoll: flight dumps: %s %s; refused (its owner could read or replace the dumps); "
                "writing to %s instead, a new private directory", d, why, fresh)
    return os.open(fresh, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC), fresh


def write_private(dir_fd: int, name: str, text: Union[str, bytes]) -> None:
    """Write ``text`` as ``name`` in the directory ``dir_fd``: a new file of
    mode 0600 under a temporary name (``O_CREAT|O_EXCL|O_NOFOLLOW``: never an
    existing file, never through a link someone planted), then renamed over
    ``name`` (atomic: the analysis never reads half a dump; a link at
    ``name`` is replaced, not followed)."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    for _ in range(100):
        tmp = f".{name}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
        try:
            fd = os.open(tmp, flags, 0o600, dir_fd=dir_fd)
            break
        except FileExistsError:
            continue
    else:
        raise FileExistsError(f"no free temporary name for {name!r}")
    try:
        with os.fdopen(fd, "wb" if isinstance(text, bytes) else "w") as f:
            f.write(text)
        os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException:
        try:
            os.unlink(tmp, dir_fd=dir_fd)
        except OSError:
            pass
        raise
