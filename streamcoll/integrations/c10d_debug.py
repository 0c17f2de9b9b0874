"""Where torch's debugging switches reach a streamcoll process group.

torch handles these only for its own C++ backends (``isinstance`` checks on
ProcessGroupGloo/ProcessGroupNCCL), and a Python backend cannot be one (the
C++ ``Backend`` class has no constructor a Python subclass can call: "No
constructor defined", torch 2.13). So:

- ``dist.breakpoint()`` raises every group's timeout to an hour through
  ``distributed_c10d._set_pg_timeout``, which, for any other backend, only
  warns "Set timeout is now only supported for either nccl or gloo": the
  waiting ranks' watchdog then ended them at the group's timeout (exit 86).
  :func:`install` wraps that function (looked up by name at each call, by
  ``dist.breakpoint`` too): a streamcoll group gets
  :func:`set_group_timeout`, every other group torch's own.
- ``group._get_backend(device)`` (torch's route to "the backend object")
  returns the streamcoll process group itself: it is its own backend, and
  it answers the capability questions torch asks of one
  (``supports_splitting``, ``supports_coalescing``, ...: False).
- ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` turns on :mod:`streamcoll.core.checks`'s
  per-call checks, ``TORCH_NCCL_ASYNC_ERROR_HANDLING`` the watchdog's modes
  (:func:`streamcoll.diagnostics.watchdog.mode`).
"""
from __future__ import annotations

from datetime import timedelta
from typing import Any

from ..core.timeouts import seconds

__all__ = ["install", "set_group_timeout"]


def set_group_timeout(pg: Any, timeout: Any) -> None:
    """The timeout of ``pg`` (a ProcessGroupStreamcoll) and of its
    communicators from now on: the communicators created later, the
    watchdog's limit for calls running now and later, waits without their
    own timeout. A timedelta or seconds."""
    if timeout is None:
        raise ValueError("timeout: expected a positive timedelta or number of seconds, got None")
    s = seconds(timeout)
    pg._timeout = timedelta(seconds=s)
    for c in list(pg._comms.values()):
        c.timeout = s


def install(group_class: type) -> None:
    """Wrap ``torch.distributed.distributed_c10d._set_pg_timeout`` (idempotent):
    a group of ``group_class`` (ProcessGroupStreamcoll, passed in by
    :func:`streamcoll.integrations.process_group.register_backend`: this module is below
    it) gets :func:`set_group_timeout`, every other group torch's own."""
    import torch.distributed.distributed_c10d as c10d
    orig = getattr(c10d, "_set_pg_timeout", None)
    if orig is None or getattr(orig, "_streamcoll", False):
        return

    def _set_pg_timeout(timeout: timedelta, group: Any = None) -> None:
        g = c10d._get_default_group() if group is None else group
        if isinstance(g, group_class):
            set_group_timeout(g, timeout)
            return
        orig(timeout, group)

    _set_pg_timeout.__doc__ = orig.__doc__
    _set_pg_timeout.__wrapped__ = orig  # type: ignore[attr-defined]
    _set_pg_timeout._streamcoll = True  # type: ignore[attr-defined]
    c10d._set_pg_timeout = _set_pg_timeout
