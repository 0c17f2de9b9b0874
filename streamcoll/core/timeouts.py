"""Timeout arguments, checked once for every caller.

One home for every timeout conversion: the communicator's timeout and
``destroy(timeout=)``, ``Work.wait(timeout)``, a collective's own
``timeout=`` (:func:`per_call`), torch's option objects and process-group
calls (:func:`torch_seconds`), ``_set_pg_timeout``.
"""
from __future__ import annotations

import os
from datetime import timedelta
from typing import Any, Optional, Union

import numpy as np

__all__ = ["DEFAULT_TIMEOUT", "MAX_SECONDS", "env_timeout", "seconds", "per_call", "torch_seconds"]

DEFAULT_TIMEOUT = 600.0  # seconds, as torch.distributed's default for NCCL

# The longest timeout, in seconds (about 31.7 years): a longer one counts as
# this. The waits a timeout reaches take no more: ``threading``'s lock and
# condition waits raise OverflowError past ``threading.TIMEOUT_MAX``
# (9.2e9 s), a store's ``wait`` of 1e10 s returns "Wait timeout" at once
# (its deadline overflows nanoseconds) and one of ``timedelta.max`` raises
# OverflowError; a call given such a timeout= raised only after it was
# issued (tests/core/test_call_deadlines_edges.py).
MAX_SECONDS = 1e9


def env_timeout() -> float:
    """``STREAMCOLL_TIMEOUT`` (seconds, default 600), checked: a bad value
    names the variable instead of failing later in a store."""
    v = os.environ.get("STREAMCOLL_TIMEOUT")
    if v is None or not v.strip():
        return DEFAULT_TIMEOUT
    try:
        t = float(v)
    except ValueError:
        raise ValueError(f"environment variable STREAMCOLL_TIMEOUT: expected a positive number of seconds, "
                         f"got {v!r}") from None
    if not t > 0 or t == float("inf"):
        raise ValueError(f"environment variable STREAMCOLL_TIMEOUT: expected a positive finite number of "
                         f"seconds, got {v!r}")
    return min(t, MAX_SECONDS)


def seconds(timeout: Union[None, float, timedelta], name: str = "timeout") -> float:
    """A timeout argument in seconds (positive, finite; past :data:`MAX_SECONDS`,
    that); None: ``STREAMCOLL_TIMEOUT``."""
    if timeout is None:
        return env_timeout()
    if isinstance(timeout, timedelta):
        t = timeout.total_seconds()
    elif isinstance(timeout, bool) or not isinstance(timeout, (int, float, np.integer, np.floating)):
        raise TypeError(f"{name}: expected a number of seconds or a timedelta, got {timeout!r}")
    else:
        t = float(timeout)
    if not t > 0 or t == float("inf"):
        raise ValueError(f"{name}: expected a positive number of seconds or a timedelta, got {timeout!r}")
    return t if t <= MAX_SECONDS else MAX_SECONDS


def per_call(timeout: Union[None, float, timedelta]) -> Optional[float]:
    """A collective's own ``timeout=`` in seconds (positive, finite: the
    checks of :func:`seconds`, naming ``timeout``); None: none given, the
    communicator's applies."""
    return None if timeout is None else seconds(timeout, "timeout")


def torch_seconds(timeout: Any) -> Optional[float]:
    """A timeout as torch passes it (a timedelta in its option objects and
    process-group calls) in seconds; None where torch means "unset" (None,
    zero or negative)."""
    if timeout is None:
        return None
    if isinstance(timeout, timedelta):
        s = timeout.total_seconds()
        return s if s > 0 else None
    return float(timeout) if timeout > 0 else None
