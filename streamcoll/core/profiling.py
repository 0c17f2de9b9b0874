"""torch.profiler events for every collective and point-to-point op.

While a torch profiler is active (``torch.autograd.profiler._is_profiler_enabled``,
set by ``torch.profiler.profile`` and ``torch.autograd.profiler.profile``),
each call of a Communicator method, direct or through the ``streamcoll``
process group, is enclosed in a ``streamcoll:<op>`` event carrying the
arguments ProcessGroupNCCL's ``record_param_comms`` gives Kineto (what HTA
and torch's trace tools read): ``Collective name``, ``In msg nelems``,
``Out msg nelems``, ``dtype``, ``In split size``, ``Out split size``,
``Process Group Name``, ``Process Group Description``, ``Process Group
Ranks``, ``Group size``, ``Rank``, ``Seq``, plus ``async_op``. The event
encloses the launch (an async op's event ends when it is issued, as NCCL's
does), so on a GPU Kineto links the kernel launched inside it.

How: ``torch._C._profiler._RecordFunctionFast`` (a Python
``record_function("record_param_comms")`` makes the process die with SIGSEGV
when profiling ends: torch expects its C++ debug info there). Its
constructor ends the process (an uncaught C++ error) on an argument it does
not take, so every value here is an int or a str and the inputs are a list
of tensors.

Cost: with no profiler, one module attribute read per call on the
generated fast paths (their condition; while profiling they fall through to
the general methods, which record) and on the general methods; no frame.
With a profiler, see :func:`begin` (docs/integration.md, "torch.profiler").
"""
from __future__ import annotations

from typing import Any, List, Optional

import torch
import torch.autograd.profiler as _ap

__all__ = ["begin", "enabled", "ARG_NAMES"]

ARG_NAMES = ("Collective name", "In msg nelems", "Out msg nelems", "dtype", "In split size", "Out split size",
             "Process Group Name", "Process Group Description", "Process Group Ranks", "Group size", "Rank",
             "Seq", "async_op")

_RF = torch._C._profiler._RecordFunctionFast


def enabled() -> bool:
    """Whether a torch profiler is recording now."""
    return bool(_ap._is_profiler_enabled)


def _scalar(dtype: Any) -> str:
    """torch's C++ name of a dtype (``c10::toString``: ``Float``, ``BFloat16``), as NCCL's events give it."""
    try:
        return str(torch.empty(0, dtype=dtype).type()).split(".")[-1].replace("Tensor", "") or str(dtype)
    except Exception:
        return str(dtype).replace("torch.", "")


_NAMES: dict = {}


def dtype_name(dtype: Any) -> str:
    n = _NAMES.get(dtype)
    if n is None:
        n = _NAMES[dtype] = _scalar(dtype)
    return n


def _tensors(x: Any, out: List[torch.Tensor]) -> int:
    """Append the tensors of ``x`` (a tensor or a list of them) to ``out``; their elements."""
    if isinstance(x, torch.Tensor):
        out.append(x)
        return int(x.numel())
    if isinstance(x, (list, tuple)):
        n = 0
        for t in x:
            if isinstance(t, torch.Tensor):
                out.append(t)
                n += int(t.numel())
            elif isinstance(t, (list, tuple)):
                n += _tensors(t, out)
        return n
    return 0


def _splits(x: Any) -> str:
    if isinstance(x, (list, tuple)):
        return "[" + ", ".join(str(int(v)) for v in x) + "]"
    return "[]"


def begin(comm: Any, s: Any, args: tuple, async_op: Any) -> Optional[Any]:
    """The entered ``streamcoll:<op>`` event of ``s``'s call with ``args``
    on ``comm`` (its caller exits it after the launch), or None if the
    profiler stopped meanwhile."""
    if not _ap._is_profiler_enabled:
        return None
    a = dict(zip(s.param_names, args))
    ins: List[torch.Tensor] = []
    outs: List[torch.Tensor] = []
    n_in = n_out = 0
    for p in s.params:
        if p.role is None:
            continue
        v = a.get(p.name)
        if p.role == "in":
            n_in += _tensors(v, ins)
        elif p.role == "out":
            n_out += _tensors(v, outs)
        else:  # inout: what is read is what is written
            n = _tensors(v, ins)
            n_in += n
            n_out += n
    first = ins[0] if ins else (outs[0] if outs else None)
    dtype = first.dtype if first is not None else None
    size = int(comm._size)
    kw = {
        "Collective name": s.name,
        "In msg nelems": n_in,
        "Out msg nelems": n_out,
        "dtype": dtype_name(dtype) if dtype is not None else "",
        "In split size": _splits(a.get("input_split_sizes")),
        "Out split size": _splits(a.get("output_split_sizes")),
        "Process Group Name": str(comm.name),
        "Process Group Description": f"streamcoll {comm.backend} {comm.device}",
        "Process Group Ranks": "[" + ", ".join(str(r) for r in range(size)) + "]",
        "Group size": size,
        "Rank": int(comm._rank),
        "Seq": int(comm._seq) + 1,
        "async_op": int(bool(async_op)) if isinstance(async_op, bool) else 0,
    }
    ev = _RF(f"streamcoll:{s.name}", ins + outs, kw)
    ev.__enter__()
    return ev
