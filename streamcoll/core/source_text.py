"""Source text derived from the table, for the code generated once per
communicator and for the stubs: a collective's Python parameter list and call
(torch.distributed's order), and the C argument order read from the headers'
parameter names (so no argument order is ever retyped)."""
from __future__ import annotations

import re
from typing import Any, Dict, List, Tuple

from .ops import ReduceOp
from .spec import REQUIRED, CollectiveSpec

__all__ = ["signature_text", "call_text", "doc_text", "TIMEOUT_DOC", "c_roles"]


def _default_text(d: Any) -> str:
    if d is REQUIRED:
        raise ValueError
    if isinstance(d, ReduceOp):
        return "_SUM" if d is ReduceOp.SUM else f"_ReduceOp.{d.name}"
    return repr(d)


def signature_text(spec: CollectiveSpec, group: bool = False, self_: bool = False) -> str:
    """The Python parameter list of the collective, torch.distributed's order:
    its parameters, then ``group`` (module functions), ``async_op`` where it is
    a parameter, and the keyword-only ``stream`` (not barrier's, nor
    batch_isend_irecv's) and ``timeout`` (the call's own deadline, every
    collective and point-to-point call)."""
    parts: List[str] = ["self"] if self_ else []
    for p in spec.params:
        parts.append(p.name if p.default is REQUIRED else f"{p.name}={_default_text(p.default)}")
    if group:
        # torch puts group before tag for p2p and before async_op elsewhere.
        idx = next((i for i, p in enumerate(parts) if p.startswith("tag=")), len(parts))
        parts.insert(idx, "group=None")
    if spec.async_mode == "param":
        parts.append("async_op=False")
    if spec.name == "barrier":
        parts += ["device_ids=None", "*", "timeout=None"]
    elif spec.returns != "work_list":
        parts += ["*", "stream=None", "timeout=None"]
    else:
        parts += ["*", "timeout=None"]
    return ", ".join(parts)


# What every collective's docstring says of ``timeout=`` (docs/api.md, "Per-call timeouts", says more).
TIMEOUT_DOC = """

``timeout`` (keyword only; seconds or a ``datetime.timedelta``; None: the
communicator's timeout): this call's own deadline, on this rank only (the
other ranks keep theirs). Past it the call fails with
:class:`~streamcoll.CollectiveTimeout` naming it and this timeout. A
synchronous call raises it (on the CPU such a call runs on the comm
thread while the caller waits up to the deadline; on CUDA it returns once
enqueued and the watchdog gives its kernel this limit instead of the
communicator's); with ``async_op=True`` the Work fails (``wait()`` without
a timeout waits this long; the watchdog, this long plus 1 s). As past the
communicator's timeout, the call is then declared stuck and the
communicator failed: NCCL's is aborted; oneCCL's cannot be aborted, so its
later calls raise at once while the stuck call stays inside the library
(end the process to recover). Zero, negative, NaN, infinite, a string or
a bool raise TypeError/ValueError naming ``timeout`` before any C call."""


def doc_text(spec: CollectiveSpec) -> str:
    """The docstring of a collective's methods and functions: its declared
    doc, then what ``timeout=`` does."""
    return spec.doc + TIMEOUT_DOC


def call_text(spec: CollectiveSpec) -> str:
    """The arguments to pass a Communicator method, by name where keyword."""
    parts = list(spec.param_names)
    if spec.async_mode == "param":
        parts.append("async_op")
    if spec.name == "barrier":
        parts.append("device_ids")
    elif spec.returns != "work_list":
        parts.append("stream=stream")
    parts.append("timeout=timeout")
    return ", ".join(parts)


# ------------------------------------------------- C argument order (headers)
_ROLE_OF_CPARAM = {
    "sendbuff": "send", "recvbuff": "recv", "buff": "send",
    "count": "count", "sendcount": "count", "recvcount": "count",
    "datatype": "dtype", "op": "op", "redop": "op", "reduction_op": "op",
    "root": "root", "peer": "peer", "comm": "comm", "stream": "stream",
    "send_counts": "send_counts", "recv_counts": "recv_counts",
}
_ROLES_CACHE: Dict[Tuple[str, str], Tuple[str, ...]] = {}


def c_roles(declarations: str, cname: str) -> Tuple[str, ...]:
    """The roles of ``cname``'s parameters, in the order the C declaration
    (``declarations``: the text of ``streamcoll/_native/<lib>.h``) has them, e.g.
    ``("send", "recv", "count", "dtype", "op", "comm", "stream")``. Read from
    the header's parameter names, so the order is never retyped here."""
    key = (declarations[:64] + str(len(declarations)), cname)
    r = _ROLES_CACHE.get(key)
    if r is not None:
        return r
    m = re.search(r"\b" + re.escape(cname) + r"\s*\(([^)]*)\)\s*;", declarations)
    if m is None:
        raise KeyError(f"{cname} is not declared")
    roles = []
    for arg in m.group(1).split(","):
        pname = re.sub(r"[^A-Za-z0-9_]", " ", arg).split()[-1]
        role = _ROLE_OF_CPARAM.get(pname)
        if role is None:
            raise ValueError(f"{cname}: parameter {pname!r} has no role in streamcoll.core.spec")
        roles.append(role)
    r = _ROLES_CACHE[key] = tuple(roles)
    return r
