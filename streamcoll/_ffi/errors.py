"""The streamcoll exception family.

Two kinds of exception leave streamcoll:

- **Argument errors** are ``TypeError`` (wrong type: ``async_op="yes"``, a
  list where a tensor is expected) and ``ValueError`` (right type, wrong
  value: a rank out of range, a negative timeout, ``STREAMCOLL_TIMEOUT=abc``,
  ``world_size`` disagreeing with ``WORLD_SIZE``), as in torch and the
  standard library. They are raised before any native call, so nothing is
  half issued, and retrying with a fixed argument is safe.
- **Everything else** (a library call failed, a timeout, a rendezvous that
  did not complete, a destroyed or failed communicator, a backend that
  cannot run here) derives from :class:`CollectiveError`, so one
  ``except streamcoll.CollectiveError`` catches every failure that is not
  the caller's argument. Errors of torch.distributed's store met during
  rendezvous are turned into :class:`RendezvousError`. Errors returned by a
native library carry the result code, its enum name, the library's error
string and its last-error text (:class:`LibraryError` and the per-library
subclasses). All of them pickle, because they cross process boundaries in
launchers and in the multi-process tests.

This module imports nothing but the standard library: the binding layer
(:mod:`streamcoll._ffi`) raises these without importing torch.
"""
from __future__ import annotations

from typing import Optional, Sequence

__all__ = [
    "CollectiveError",
    "LibraryError",
    "NcclError",
    "OnecclError",
    "CudaError",
    "LibraryNotFoundError",
    "FunctionNotFoundError",
    "CollectiveTimeout",
    "CommunicatorError",
    "MismatchError",
    "RendezvousError",
    "BackendUnavailableError",
    "UsageError",
    "NotSupportedError",
]


class CollectiveError(RuntimeError):
    """Base class of every error streamcoll raises on purpose."""


class LibraryError(CollectiveError):
    """A native library call returned a result other than success.

    Attributes: ``library`` ("nccl" or "oneccl"), ``function`` (the C function),
    ``code`` (the integer result), ``code_name`` (its enum name, e.g.
    ``ncclInvalidArgument``), ``error_string`` (the library's text for the
    code) and ``last_error`` (the communicator's last-error text, which for
    oneCCL is the only useful message).
    """

    def __init__(
        self,
        library: str,
        function: str,
        code: int,
        code_name: str,
        error_string: str = "",
        last_error: str = "",
    ) -> None:
        self.library = library
        self.function = function
        self.code = code
        self.code_name = code_name
        self.error_string = error_string
        self.last_error = last_error
        msg = f"{function} failed: {code_name} ({code})"
        if error_string:
            msg += f": {error_string}"
        if last_error and last_error != error_string:
            msg += f"; last error: {last_error}"
        super().__init__(msg)

    def __reduce__(self):
        return (
            type(self),
            (self.library, self.function, self.code, self.code_name, self.error_string, self.last_error),
        )


class NcclError(LibraryError):
    """An NCCL call failed."""


class CudaError(LibraryError):
    """A CUDA runtime call streamcoll makes itself failed (its helper threads'
    capture mode, the completion events of synchronous GPU collectives)."""


class OnecclError(LibraryError):
    """A oneCCL call failed."""


class LibraryNotFoundError(CollectiveError, OSError):
    """No usable copy of a native library was found.

    ``tried`` lists every place looked at, with why each was rejected;
    ``hint`` is the command that installs the library.
    """

    def __init__(self, library: str, tried: Sequence[str], hint: str = "") -> None:
        self.library = library
        self.tried = list(tried)
        self.hint = hint
        lines = [f"could not load the {library} library; tried, in order:"]
        lines += [f"  {i}. {t}" for i, t in enumerate(self.tried, 1)]
        if hint:
            lines.append(f"install it with: {hint}")
        CollectiveError.__init__(self, "\n".join(lines))

    def __reduce__(self):
        return (type(self), (self.library, self.tried, self.hint))


class FunctionNotFoundError(CollectiveError, AttributeError):
    """The loaded library lacks a function (it is older than the one needed)."""

    def __init__(self, library: str, function: str, loaded_version: str, needed_version: str) -> None:
        self.library = library
        self.function = function
        self.loaded_version = loaded_version
        self.needed_version = needed_version
        CollectiveError.__init__(
            self,
            f"{function} is not in the loaded {library} {loaded_version}; "
            f"it needs {library} {needed_version} or newer",
        )

    def __reduce__(self):
        return (type(self), (self.library, self.function, self.loaded_version, self.needed_version))


class CommunicatorError(CollectiveError):
    """A communicator cannot be used (destroyed, failed after a timeout, aborted)."""


class CollectiveTimeout(CommunicatorError, TimeoutError):
    """A collective (or init, barrier, wait) did not complete within its timeout.

    Names the op, its sequence number on the communicator, the tensor shapes
    and the ranks, so the rank that hung can be found from any rank's log.

    ``stuck``: True when the call was declared stuck (it outlived the
    communicator's timeout: the communicator is failed, later calls raise);
    False when only a shorter ``Work.wait(timeout)`` ran out while the call
    is still running (slow, not failed: waiting again may succeed).
    """

    def __init__(
        self,
        op: str,
        seq: int,
        timeout: float,
        shapes: Optional[Sequence] = None,
        rank: int = -1,
        size: int = -1,
        detail: str = "",
        stuck: bool = True,
    ) -> None:
        self.stuck = stuck
        self.op = op
        self.seq = seq
        self.timeout = timeout
        self.shapes = list(shapes or [])
        self.rank = rank
        self.size = size
        self.detail = detail
        msg = (
            f"{op} (sequence number {seq}) did not complete within {timeout:g} s "
            f"on rank {rank} of {size}; tensor shapes {self.shapes}"
        )
        if detail:
            msg += f"; {detail}"
        CollectiveError.__init__(self, msg)

    def __reduce__(self):
        return (
            type(self),
            (self.op, self.seq, self.timeout, self.shapes, self.rank, self.size, self.detail, self.stuck),
        )


class MismatchError(CollectiveError):
    """Ranks called different collectives (debug mode's cross-rank check).
    ``ranks``: the ranks that differ; ``calls``: every rank's call."""

    ranks: list = []
    calls: list = []


class RendezvousError(CollectiveError):
    """The ranks did not all meet before the timeout (or the store could not
    be reached). Names the ranks still missing, the store's address and
    port, and the world sizes (the one asked for and ``WORLD_SIZE``).

    ``timed_out``: False where nothing waited out a timeout (the store
    stopped answering: the rank hosting it left), so that no caller
    reports one."""

    def __init__(self, message: str, missing: Optional[Sequence[int]] = None, address: str = "",
                 port: int = -1, world_size: int = -1, env_world_size: Optional[str] = None,
                 timed_out: bool = True) -> None:
        self.message = message
        self.missing = list(missing or [])
        self.address = address
        self.port = port
        self.world_size = world_size
        self.env_world_size = env_world_size
        self.timed_out = timed_out
        CollectiveError.__init__(self, message)

    def __reduce__(self):
        return (type(self), (self.message, self.missing, self.address, self.port, self.world_size,
                             self.env_world_size, self.timed_out))


class BackendUnavailableError(CollectiveError):
    """The backend cannot run on this machine (``backend="nccl"`` with a torch
    build without CUDA, or no GPU)."""


class UsageError(CollectiveError):
    """A call made in a state where it cannot work (``init()`` twice, nested
    ``coalescing()``, ``GradientSync.finish()`` inside ``no_sync()``, ...).
    Subclass of RuntimeError (through CollectiveError), as before."""


class NotSupportedError(CollectiveError, NotImplementedError):
    """The operation exists but not on this backend, library version or
    device (also a NotImplementedError)."""
