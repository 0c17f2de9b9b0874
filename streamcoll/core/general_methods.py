"""The general method of each collective of :class:`~streamcoll.Communicator`,
generated from its declaration in :mod:`streamcoll.core.spec` (any argument; bad
input raises before any C call, so nothing is half issued): the pre-launch
hooks, the planner, the first-call check (:class:`streamcoll.core.checks.Signatures`),
the launch through ``Communicator._launch``, the torch.profiler event. Each
is compiled once, when :mod:`streamcoll.core.communicator` is imported
(:func:`install`), under the file name ``<streamcoll generated
Communicator.NAME>``; the per-communicator fast paths are
:mod:`streamcoll.core.launch`'s.
"""
from __future__ import annotations

import linecache
from typing import Any, Dict

import torch

from . import profiling as _profiling
from . import source_text as _text
from . import spec as _spec
from .ops import ReduceOp
from .timeouts import per_call as _per_call

__all__ = ["install", "method_source"]

_SUM = ReduceOp.SUM


def method_source(s: _spec.CollectiveSpec) -> str:
    """The source of the general method of ``s`` (what :func:`install` compiles)."""
    sig = _text.signature_text(s, self_=True)
    args = ", ".join(s.param_names)
    tup = f"({args},)" if s.params else "()"
    a = {"param": "async_op", "never": "False", "always": "True"}[s.async_mode]
    stream = "None" if s.returns == "work_list" or s.name == "barrier" else "stream"
    launch = f"self._launch({s.name!r}, _planner(self._cx{', ' if args else ''}{args}), {a}, {stream}, timeout)"
    lines = [f"def {s.name}({sig}):",
             "    if self._pre_hooks:",
             f"        self._pre(_S, {tup}, {a})"]
    if not s.p2p:  # the first-call check (debug.Signatures), after the planner validated the arguments
        # a CPU call given timeout= runs on the comm thread (Communicator._launch_limited): its
        # check is deferred there, as an async call's, so that the caller's deadline bounds it too
        check_a = a if a == "True" else f"{a} if timeout is None else ({a} or not self._gpu)"
        lines += [f"    _p = _planner(self._cx{', ' if args else ''}{args})",
                  "    if self._sig is not None:",
                  f"        self._sig.first(_S, {tup}, _p, {check_a}, timeout)"]
        launch = f"self._launch({s.name!r}, _p, {a}, {stream}, timeout)"
    if s.returns == "src":
        peer = s.params[1].name
        lines += [f"    {launch}", f"    return int({peer})"]
    elif s.returns == "none":
        lines += [f"    {launch}", "    return None"]
    elif s.returns == "work_list":
        lines += [f"    return [{launch}]"]
    elif s.name == "barrier":
        lines += [f"    w = {launch}",
                  "    if not async_op and self._gpu and self._dev_type == 'cuda':",
                  "        torch.cuda.current_stream(self._device).synchronize()",
                  "    return w"]
    else:
        lines += [f"    return {launch}"]
    # torch.profiler: a streamcoll:<op> event around the call while a profiler records
    # (streamcoll.core.profiling; one attribute read otherwise, no frame)
    body = "".join("    " + x + "\n" for x in lines[1:])
    return (f"{lines[0]}\n"
            # the call's own timeout, checked before anything (the pre-hooks may exchange through the store)
            f"    if timeout is not None:\n"
            f"        timeout = _per_call(timeout)\n"
            f"    _ev = _prof(self, _S, {tup}, {a}) if _ap._is_profiler_enabled else None\n"
            f"    try:\n{body}"
            f"    finally:\n"
            f"        if _ev is not None:\n"
            f"            _ev.__exit__(None, None, None)\n")


def install(cls: type) -> None:
    """Compile each collective's general method and set it (and its
    aliases) on ``cls``, the Communicator; its ``__module__`` is the class's."""
    for name, s in _spec.TABLE.items():
        src = method_source(s)
        filename = f"<streamcoll generated Communicator.{name}>"
        linecache.cache[filename] = (len(src), None, src.splitlines(True), filename)
        ns: Dict[str, Any] = {"_S": s, "_planner": s.planner, "_SUM": _SUM, "_ReduceOp": ReduceOp, "torch": torch,
                              "_ap": _profiling._ap, "_prof": _profiling.begin, "_per_call": _per_call}
        exec(compile(src, filename, "exec"), ns)
        fn = ns[name]
        fn.__doc__ = _text.doc_text(s)
        fn.__qualname__ = f"Communicator.{name}"
        fn.__module__ = cls.__module__
        setattr(cls, name, fn)
        for a in s.aliases:
            setattr(cls, a, fn)
