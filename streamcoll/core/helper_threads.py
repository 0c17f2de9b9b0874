"""What a streamcoll helper thread does before its CUDA calls.

streamcoll runs CUDA calls on threads of its own: the watchdog (event
queries, ``ncclCommGetAsyncError``), the reaper (event queries) and the
``get_future`` pollers (event synchronize). Two things go wrong on a thread
that just starts calling:

- **The device.** A thread that never set one works on GPU 0: on a host with
  several GPUs every rank's helper makes a context there (about 0.5 GiB each;
  torchcomms PR #777). :func:`prepare` sets the communicator's device.
- **CUDA graph capture.** Under ``torch.cuda.graph``'s default
  ``capture_error_mode="global"``, an event query from *any* thread while a
  capture is under way is a prohibited call: it fails and invalidates the
  user's capture (pytorch/pytorch#104487, #105182). A thread whose capture
  interaction mode is thread-local ignores other threads' captures, so
  :func:`prepare` switches each helper thread to
  ``cudaStreamCaptureModeThreadLocal`` once, as PyTorch's NCCL watchdog does
  since pytorch/pytorch#148594 (through streamcoll's CUDA runtime binding,
  :mod:`streamcoll._ffi.cudart`: torch has no Python call for it).

If the mode cannot be set (no CUDA runtime found, or the call fails), the
thread goes on and a warning says once per process why and what it means.

Both are the *calling thread's* state, so :func:`prepare` acts only on
streamcoll's own helper threads (started as :class:`Thread`). Called on any
other thread (a user's main thread running ``REAPER.reap()``, say) it does
nothing: switching a user's thread to thread-local capture mode, or its
current device, would change what the user's own code does next.
"""
from __future__ import annotations

import logging
import threading
from typing import Optional

import torch

__all__ = ["Thread", "is_helper", "prepare", "set_thread_local_capture_mode", "thread_mode"]

log = logging.getLogger("streamcoll")

_local = threading.local()
_warned = False


class Thread(threading.Thread):
    """A streamcoll helper thread (the watchdog, the reaper, the
    ``get_future`` pollers): :func:`prepare` acts on these only."""

    def run(self) -> None:
        _local.helper = True
        super().run()


def is_helper() -> bool:
    """Whether the calling thread is a streamcoll helper thread (:class:`Thread`)."""
    return getattr(_local, "helper", False)


def set_thread_local_capture_mode() -> int:
    """Switch the calling thread to ``cudaStreamCaptureModeThreadLocal``;
    returns the mode it had (0 global, 1 thread-local, 2 relaxed). Raises
    :class:`~streamcoll.CudaError` (or LibraryNotFoundError) on failure."""
    from .._ffi.cudart import CUDART

    lib = CUDART.lib()
    mode = CUDART.ffi.new("enum cudaStreamCaptureMode *", CUDART.const("cudaStreamCaptureModeThreadLocal"))
    rc = lib.cudaThreadExchangeStreamCaptureMode(mode)
    if rc:
        raise CUDART.error("cudaThreadExchangeStreamCaptureMode", rc)
    return int(mode[0])


def prepare(device_index: Optional[int]) -> None:
    """Before a helper thread's CUDA calls for a communicator on CUDA device
    ``device_index``: use that device, and (once per thread) thread-local
    capture mode. Cheap when already done: a comparison and an attribute read.
    A no-op on a thread that is not a helper thread (:func:`is_helper`)."""
    if not getattr(_local, "helper", False):
        return
    if device_index is not None and torch.cuda.current_device() != device_index:
        torch.cuda.set_device(device_index)
    if getattr(_local, "mode", None) is not None:
        return
    try:
        _local.mode = set_thread_local_capture_mode()
    except Exception as e:
        _local.mode = -1  # tried; not again on this thread
        global _warned
        if not _warned:
            _warned = True
            log.warning(
                "streamcoll: could not switch helper thread %r to thread-local CUDA graph capture mode (%s); "
                "its event queries can invalidate a torch.cuda.graph capture in the default global mode: "
                "capture with capture_error_mode='thread_local' (or 'relaxed')",
                threading.current_thread().name, e)


def thread_mode() -> Optional[int]:
    """The mode :func:`prepare` left this thread in: None (not prepared), -1
    (could not be set) or the previous mode it replaced."""
    return getattr(_local, "mode", None)
