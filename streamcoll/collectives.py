"""Module-level collectives with torch.distributed's names, argument order and
defaults: swap ``torch.distributed`` for ``streamcoll`` in a training loop.

``group`` takes a :class:`~streamcoll.Communicator` (default: the one
:func:`streamcoll.init` made). Ranks (``src``, ``dst``, peers) are ranks in
that communicator. ``stream=`` (keyword only) launches on an explicit stream;
``timeout=`` (keyword only) is the call's own deadline (each function's
docstring, and docs/api.md, say what it does).

Every function here is generated from its declaration in
:mod:`streamcoll.core.spec` (same parameters, defaults and docstring as the
Communicator method, plus ``group``). Collectives declared ``compiled``
switch to streamcoll's custom ops while torch.compile traces
(:mod:`streamcoll.integrations.custom_ops`; ``torch.compiler.is_compiling()`` costs about
0.1 us in eager); eager calls go straight to the communicator's method (its
generated fast path where it applies).
"""
from __future__ import annotations

import linecache
from typing import Any, Dict, Optional

from torch.compiler import is_compiling as _compiling

from .startup import bootstrap
from .integrations import custom_ops as _traced
from .core import source_text as _text
from .core import spec as _spec
from .core.communicator import Communicator
from .core.ops import ReduceOp

_SUM = ReduceOp.SUM

__all__ = [n for s in _spec.TABLE.values() for n in (s.name, *s.aliases) if not n.startswith("_")]


def _g(group: Optional[Communicator]) -> Communicator:
    if group is None:
        return bootstrap.default_communicator()
    if not isinstance(group, Communicator):
        raise TypeError(f"group: expected a streamcoll.Communicator or None, got {type(group).__name__}")
    return group


def _source(s: _spec.CollectiveSpec) -> str:
    sig = _text.signature_text(s, group=s.returns != "work_list")
    call = _text.call_text(s)
    lines = [f"def {s.name}({sig}):"]
    if s.compiled:
        traced = ", ".join([*s.param_names, "group", "async_op",
                            "device_ids" if s.name == "barrier" else "stream", "timeout"])
        lines += ["    if _compiling():", f"        return _traced.{s.name}({traced})"]
    if s.returns == "work_list":
        lines += ["    if not p2p_op_list:",
                  "        raise ValueError('p2p_op_list: expected a non-empty list of P2POp')",
                  "    return _g(getattr(p2p_op_list[0], 'group', None)).batch_isend_irecv(p2p_op_list, timeout=timeout)"]
    else:
        lines += ["    c = group if type(group) is Communicator else (bootstrap._DEFAULT if group is None else None)",
                  "    if c is None:",
                  "        c = _g(group)",
                  f"    return c.{s.name}({call})"]
    return "\n".join(lines) + "\n"


def _install() -> None:
    g = globals()
    for name, s in _spec.TABLE.items():
        src = _source(s)
        filename = f"<streamcoll generated streamcoll.{name}>"
        linecache.cache[filename] = (len(src), None, src.splitlines(True), filename)
        ns: Dict[str, Any] = {"_compiling": _compiling, "_traced": _traced, "bootstrap": bootstrap,
                              "Communicator": Communicator, "_g": _g, "_SUM": _SUM, "_ReduceOp": ReduceOp}
        exec(compile(src, filename, "exec"), ns)
        fn = ns[name]
        fn.__doc__ = _text.doc_text(s) + ("" if s.returns == "work_list" else
                                          "\n\n``group``: a Communicator (default: the one streamcoll.init() made).")
        fn.__module__ = __name__
        g[name] = fn
        for a in s.aliases:
            if not a.startswith("_"):
                g[a] = fn


_install()
