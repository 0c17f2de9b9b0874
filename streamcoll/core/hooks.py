"""Where the diagnostics attach to the core: slots the core calls and the
observers fill when they are imported.

The core (the communicator and what launches its collectives) never
imports the modules that observe it: :mod:`streamcoll.diagnostics.watchdog` and
:mod:`streamcoll.diagnostics.fr_torch` put their functions here at import time, as
torchcomms' hooks attach its flight recorder to a communicator. The
package's ``__init__`` imports them, and importing any module of the
package runs that ``__init__`` first, so every way in
(``import streamcoll``, ``streamcoll.Communicator``, the process group
backend, ``python -m streamcoll``, torch's entry point
``streamcoll_autoload``) finds the slots filled before a communicator
exists (``tests/repo/test_layout.py`` checks it from a fresh interpreter).

None of this is on a call's path: the slots are read when a communicator
is created, times out, fails for good or dumps its flight record, and
when a call is given its own ``timeout=`` (the general path).

- :data:`on_create`: called with each new Communicator at the end of its
  construction (the watchdog watches it: the hang detection, and the start
  of small CPU async calls queued quietly).
- :data:`on_timeout`: what a timeout reported to the caller does
  (``Work.wait``, ``synchronize``, ``destroy``): marks the communicator
  failed, dumps its flight record, aborts it where the library can;
  returns the :class:`~streamcoll.CollectiveTimeout` to raise
  (:func:`streamcoll.diagnostics.watchdog.handle_timeout`).
- :data:`teardown_guard`: called once a native call can never return (a
  oneCCL communicator that cannot abort): the process's exit then skips
  the native teardown (:func:`streamcoll.diagnostics.watchdog.skip_native_teardown`).
- :data:`on_deadline`: called with ``(communicator, seconds)`` when a
  call is issued with its own ``timeout=`` (the watchdog shortens its
  pass interval for it at once, instead of after the pass it sleeps in).
- :data:`on_dump`: called with ``(communicator, reason)`` after its flight
  record was written (:func:`streamcoll.core.recorder.dump`): torch's format
  too where torch's variables ask for it (:mod:`streamcoll.diagnostics.fr_torch`).
- :data:`on_snapshot`: called with ``(communicator, record)`` when its flight
  record is taken (:func:`streamcoll.core.recorder.snapshot`, behind every
  dump); an observer may add fields to ``record``: the hang report's answer,
  thread stacks and report (:mod:`streamcoll.diagnostics.hang_report`).
"""
from __future__ import annotations

from typing import Any, Callable, List

from .._ffi.errors import CollectiveTimeout

__all__ = ["on_create", "on_timeout", "teardown_guard", "on_deadline", "on_dump", "on_snapshot"]


def _unattached(slot: str) -> Callable[..., Any]:
    def missing(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(f"streamcoll.core.hooks.{slot}: no observer attached (streamcoll.diagnostics.watchdog fills it when "
                           "imported, which importing streamcoll does)")
    return missing


on_create: List[Callable[[Any], None]] = []
on_timeout: Callable[..., CollectiveTimeout] = _unattached("on_timeout")
teardown_guard: Callable[[], Any] = _unattached("teardown_guard")
on_deadline: List[Callable[[Any, float], None]] = []
on_dump: List[Callable[[Any, str], None]] = []
on_snapshot: List[Callable[[Any, dict], None]] = []
