"""The two launch strategies, written once, and the code generated from them.

``async_op=False`` (current stream): the plan's C call runs on the caller's
current stream (CPU: inline on the calling thread, under the communicator's
exec lock, unless async work is queued, which it then goes behind). No event,
no cross-stream wait.

``async_op=True`` (comm stream): the comm stream cached for the caller's
(device, current stream) waits on an event recorded on the current stream,
the plan runs there, a completion event is recorded and a Work comes back.
A small CPU one (``Communicator.inline_async_bytes``) is queued on the comm
thread without waking it, by the fast path too (:data:`ASYNC_TEMPLATE`);
when it starts is :mod:`streamcoll.core.work`'s rule.

Sequence numbers are taken in one place, under the exec lock, in the same
critical section that issues the call (inline) or queues it (CPU comm
thread), so sequence order is issue order with any number of threads.

Why generated code: a small collective's C call costs 6-10 us here and the
Python around it is most of what streamcoll adds. The synchronous strategy is
one source template (:data:`SYNC_TEMPLATE`); :func:`build_sync_launcher`
instantiates it for the general path (any plan) and :func:`build_fast_path`
for each collective declared ``fast`` in :mod:`streamcoll.core.spec`, specialised
per communicator (C function, handle, dtype table, argument order from the
header), with the argument checks of the common case inlined. Anything the
fast path does not take (a numpy array, a non-contiguous tensor, AVG of integers,
a large or widened ``async_op=True`` call, queued async work, a bad argument) falls through to the
general method, which validates and reports; so does every call while the
communicator may not take a fast path (one attribute, ``_fast_ok``, read
under the exec lock: a fast path saved as ``f = c.all_reduce`` before a
coalescing block, a failure or destroy decides as the method would). Both run the same template, so
they cannot drift; ``tests/core/test_launch.py`` counts the Python frames entered
on the synchronous call path.
"""
from __future__ import annotations

import linecache
import math
import time
import threading
import weakref
from typing import Any, Callable, Dict, List, Optional

import torch
import torch.autograd.profiler as _ap

from .ops import ReduceOp
from .plans import FLOATS
from .recorder import ENQUEUED, FlightEntry
from .work import Work
from .source_text import c_roles, doc_text, signature_text
from .spec import CollectiveSpec, Plan

__all__ = ["SYNC_TEMPLATE", "build_sync_launcher", "build_fast_path", "generated_source"]

_GENERATED: Dict[str, str] = {}

# The synchronous strategy. Placeholders: {ready} (whether the call may run
# inline now), {p2p} (count it as point to point), {name}, {keep} (the
# tensors a watchdog message shows), {call} (the C call; returns the result
# code), {cname}, {post}, {record} (CUDA: the completion event of the call,
# streamcoll.core.sync_events), {ret}, {not_ready} (what to do, after the lock,
# when it may not: the general path queues it behind the async work; a fast
# path falls through to the general path), {ticket}/{enter}/{leave} (the
# call's turn in the process, oneCCL: Backend.turnstile, its ticket taken
# under the exec lock, in issue order; nothing for NCCL), {limit} (a GPU call
# given its own timeout=: its entry's limit, FlightEntry.limit; empty on
# every other path, whose source is then what it was without deadlines).
#
# Exception-safe at every bytecode (a KeyboardInterrupt from a
# signal handler, a SIGALRM timeout): the lock is a ``with`` (released by the
# interpreter whatever is raised after it was taken), and everything after
# the sequence number, the ticket included, is inside the ``try``, whose
# ``finally`` passes the turn or cancels the ticket.
SYNC_TEMPLATE = """\
with _lock:
    if {ready}:
        seq = _comm._seq = _comm._seq + 1{p2p}
{ticket}        try:
            e = _ring[seq & _mask]
            if not e.sync:  # the ring is pre-filled: an async entry's slot gets a sync entry again
                e = _ring[seq & _mask] = _Entry()
            e.seq = seq
            e.op = {name}
            e.p2p = _comm._p2p
{limit}            _fr.cur = {keep}
{enter}            rc = {call}
            if rc:
                _comm._raise_rc({cname}, rc)
{post}{record}        except BaseException as x:
            _fr.failed(seq, x)
            raise
        finally:
{leave}            _fr.done = seq
            _fr.cur = None
        return {ret}
{not_ready}
"""


# The small CPU async call (Communicator.inline_async_bytes): queued on the
# comm thread like any async call (sequence number, flight entry and ticket
# in one critical section, under the exec lock) but without waking it, and
# a Work that wait() without a timeout runs on the caller's thread
# (streamcoll.core.work: the rule). Placeholders: {name}, {args} (the C call's
# arguments but the stream), {keep}, {outs}. No lane yet for the calling
# thread: the general path makes it.
ASYNC_TEMPLATE = """\
ln = _lanes.get(_ident())
if ln is not None:
    pl = _Plan(_f, ({args},), None, {keep}, {outs}, {name})
    w = None
    with _lock:  # the return after it: an interrupt after the Work's call lands inside the block
        if _comm._fast_ok:
            seq = _comm._seq = _comm._seq + 1
            e = _ring[seq & _mask] = _Entry(seq, {name}, _comm._p2p, False, _now(), {refs}, _ENQUEUED)
            it = _submit(ln, _exec, pl, e, True)
            w = _Work(_comm, _rt, ln, _event(ln, it), seq, {name}, {outs}, None, True)
    if w is not None:
        return w
"""


def _indent(text: str, n: int) -> str:
    pad = " " * n
    return "".join(pad + line if line.strip() else line for line in text.splitlines(True))


def _fill(post: str, record: str, limit: str = "", **parts: str) -> str:
    """:data:`SYNC_TEMPLATE` with its parts; {post} and {record} come
    written for a body at 8 spaces and land inside the try (12)."""
    return SYNC_TEMPLATE.format(post=_indent(post, 4), record=_indent(record, 4), limit=limit, **parts)


_CODE: Dict[str, Any] = {}


def _compile(src: str, fname: str, ns: Dict[str, Any], tag: str) -> Callable[..., Any]:
    """A function ``fname`` from ``src`` over the globals ``ns``. The source
    depends only on the declaration, the device type and the library (every
    per-communicator value is in ``ns``), so its code object is compiled once
    and shared: a communicator costs its namespace, not a compilation (1,000
    split communicators must not keep 1,000 copies of the text)."""
    code = _CODE.get(src)
    if code is None:
        filename = f"<streamcoll generated {tag} #{len(_CODE)}>"
        _GENERATED[tag] = src
        linecache.cache[filename] = (len(src), None, src.splitlines(True), filename)
        code = _CODE[src] = compile(src, filename, "exec")
    exec(code, ns)  # evaluates the def (its defaults) in this communicator's namespace
    return ns[fname]


def generated_source(tag: str) -> str:
    """The source of a generated function by tag (``launch_sync/cpu``, ``all_reduce/cpu/oneccl``)."""
    return _GENERATED[tag]


def _namespace(comm: Any) -> Dict[str, Any]:
    fr = comm._flight
    ns = {
        "_comm": comm, "_fr": fr, "_ring": fr.ring, "_mask": fr.mask, "_lock": comm._rt.exec_lock,
        "_rt": comm._rt, "_Entry": FlightEntry, "_Tensor": torch.Tensor,
        "_now": time.monotonic_ns, "_ap": _ap,
    }
    if comm._sync_events is not None:
        ns.update(comm._sync_events.namespace())
    if comm._backend.turnstile is not None:
        ns["_ts"] = comm._backend.turnstile
    return ns


def _serial(comm: Any) -> Dict[str, str]:
    """The {ticket}/{enter}/{leave} parts: the call's turn (``Backend.turnstile``:
    one C call at a time in the process, in issue order), where the library
    needs one. The ticket is taken under the exec lock, with the sequence
    number; a wait for the turn that raises cancels it (Turnstile.wait)."""
    if comm._backend.turnstile is None:
        return {"ticket": "", "enter": "", "leave": ""}
    # The ticket: read and advance Turnstile.issued in one line with no call
    # (Turnstile.take says why: no interrupt, no thread switch between them),
    # inside the try; the finally passes the turn or cancels it.
    return {"ticket": "        _t = -1\n",
            "enter": ("            _t = _ts.issued; _ts.issued = _t + 1\n"
                      "            if _ts.turn != _t:\n"
                      "                _ts.wait(_t, None, e)\n"),  # e: named as waiting, not running
            "leave": ("            if _t >= 0:\n"
                      "                if _ts.turn == _t:  # held: pass the turn\n"
                      "                    _ts.turn = _t + 1\n"
                      "                    if _ts.waiting or _ts.skipped:\n"
                      "                        _ts.wake()\n"
                      "                else:  # its turn never came to this call (interrupted): skip it\n"
                      "                    _ts.cancel(_t)\n")}


def _record(comm: Any) -> str:
    """The {record} part: a CUDA communicator with completion events puts
    one on the entry of each synchronous call (``hs``: the int stream),
    inline (:meth:`streamcoll.core.sync_events.SyncEvents.source`)."""
    sev = comm._sync_events
    if sev is None:
        return ""
    return _indent(sev.source(), 8)


def build_sync_launcher(comm: Any, limited: bool = False) -> Callable[..., Any]:
    """``launch_sync(name, plan, stream)``: the synchronous strategy for any
    plan. ``limited``: ``launch_sync_limit(name, plan, stream, limit)``, the
    same for a GPU call given its own ``timeout=`` (its flight entry carries
    ``limit``, which the watchdog applies to its completion event; a CPU call
    given one runs on the comm thread instead, ``Communicator._launch_limited``)."""
    cpu = not comm._gpu
    ns = _namespace(comm)
    ns["_queued"] = comm._run_queued_sync
    if cpu:
        ready = "not _rt._pending"
        head = "    h = _rt._null\n"
        post = "        if plan.post is not None:\n            plan.post()\n"
        not_ready = "return _queued(name, plan)"
    else:
        ready = "True"
        head = ("    hs = _rt.current_key() if stream is None else _rt.stream_handle(stream)\n"
                "    h = _rt.native(hs)\n")
        post = "        if plan.post is not None:\n            _rt.run_post(plan.post, stream)\n"
        not_ready = ""
    body = _fill(ready=ready, p2p="\n        if plan.p2p:\n            _comm._p2p += 1", name="name",
                                keep="plan.keep", call="plan.fn(*plan.args, h)", cname="plan.cname",
                                post=post, record="" if cpu else _record(comm), ret="None", not_ready=not_ready,
                                limit=("            e.limit = (seq, limit)\n"
                                       "            _comm._deadlines[seq] = limit\n") if limited else "",
                                **_serial(comm))
    fname = "launch_sync_limit" if limited else "launch_sync"
    src = f"def {fname}(name, plan, stream{', limit' if limited else ''}):\n" + head + _indent(body, 4)
    return _compile(src, fname, ns, f"{fname}/{comm._device.type}")


class _ScratchViews:
    """The widened fast path's float32 scratch (the pair form's gather
    scratch: the input dtype's, two regions a shape) and its views, cached per
    shape. ``views[key]`` (``key``: the buffers' shapes, one
    ``torch.Size`` or a tuple of them) is ``(w0, [w1,] p0, [p1])``: the
    float32 stand-in of each buffer, in that buffer's shape (its copies need
    no ``view(-1)``), consecutive regions of one flat scratch, and their
    ``void *``. A call of a shape seen before costs one dict lookup; slicing
    the scratch, two views and the pointer lookup cost 2-4 us a call.

    Interrupt-safe (a KeyboardInterrupt may land at any bytecode): every
    entry is one tuple stored in one step and holds its own views (they keep
    their storage alive), so whichever of the old and the grown scratch an
    entry points into, it is whole. Growing clears the cache first, then
    replaces the scratch; an interrupt in between leaves an empty cache,
    which the next call refills."""

    def __init__(self, vp: Callable[[torch.Tensor], Any], limit: int = 64, dtype: torch.dtype = torch.float32,
                 parts: int = 1) -> None:
        self.sc = [torch.empty(0, dtype=dtype)]  # the flat scratch, grown by doubling
        self.views: Dict[Any, tuple] = {}
        self._vp = vp
        self._limit = limit  # entries kept (then cleared: a workload of many shapes re-slices)
        self._parts = parts  # a key of one shape: that many regions of it (the pair form's gather: 2)

    def __call__(self, key: Any) -> tuple:
        """The entry for ``key`` (a miss: made and stored). Made outside
        inference mode whatever the caller's: a scratch or view made inside
        it is an inference tensor (or an inference-mode view), which every
        later call outside it would refuse to copy into."""
        with torch.inference_mode(False):
            return self._make(key)

    def _make(self, key: Any) -> tuple:
        shapes = (key,) * self._parts if isinstance(key, torch.Size) else key
        sizes = [math.prod(s) for s in shapes]
        q = self.sc[0]
        if q.numel() < sum(sizes):
            q = torch.empty(max(sum(sizes), 2 * q.numel()), dtype=q.dtype)
            self.views.clear()  # the old scratch's views: freed with it
            self.sc[0] = q
        ws, at = [], 0
        for s, z in zip(shapes, sizes):
            ws.append(q[at:at + z].view(s))
            at += z
        entry = (*ws, *(self._vp(w) for w in ws))
        if len(self.views) >= self._limit:
            self.views.clear()
        self.views[key] = entry
        return entry


def _general_args(spec: CollectiveSpec) -> str:
    """The arguments a fast path passes on to the general method."""
    argnames = [a.split("=")[0] for a in signature_text(spec).split(", ") if a != "*"]
    return ", ".join(a if a not in ("stream", "timeout") else f"{a}={a}" for a in argnames)


def build_fast_path(comm: Any, spec: CollectiveSpec, general: Callable[..., Any]) -> Optional[Callable[..., Any]]:
    """The generated synchronous fast path of ``spec`` for ``comm`` (None
    where the device or library has none: XPU, a missing C function)."""
    if comm._device.type not in ("cpu", "cuda"):
        return None
    cx = comm._cx
    f = cx.cfunc(spec.name)
    if f is None:
        return None
    gpu = comm._gpu
    ns = _namespace(comm)
    ns.update({
        "_general": general, "_f": f, "_h": comm._handle, "_size": comm._size, "_rank": comm._rank,
        # bool and (for reductions) dtypes reduced through a wider one take the general path
        "_dtypes": {k: v for k, v in cx.dtypes.items()
                    if k is not torch.bool and not (spec.reduces and k in cx.widened)},
        "_ptrs": cx.ptrs.get, "_vp": cx.vp, "_null": comm._rt._null if not gpu else None,
    })
    conds: List[str] = []
    # Small CPU async calls are queued here too (ASYNC_TEMPLATE;
    # Communicator.inline_async_bytes): ia says which. Reductions through a
    # wider dtype and AVG take the general path (their scratch and post-op).
    roles = c_roles(cx.declarations, comm._backend.funcs[spec.name])
    inline_async = bool(spec.async_mode == "param" and not gpu and not spec.p2p and comm._inline_async
                        and roles and roles[-1] == "stream")
    if inline_async:
        ns.update({"_imax": comm._inline_async, "_Work": Work, "_Plan": Plan, "_ENQUEUED": ENQUEUED,
                   "_lanes": comm._lanes, "_ident": threading.get_ident, "_submit": comm._rt.submit,
                   "_exec": comm._execute_host, "_event": comm._rt.completion_event, "_wref": weakref.ref})
        conds.append("((ia := async_op is True) or async_op is False)")
    elif spec.async_mode == "param":
        conds.append("async_op is False")
    conds.append("stream is None")
    conds.append("timeout is None")  # a call given its own deadline: the general path
    conds.append("not _ap._is_profiler_enabled")  # while a profiler records: the general method's event
    bufs = [p.name for p in spec.buffers]
    for b in bufs:
        conds.append(f"type({b}) is _Tensor")
    for b in bufs:
        conds.append(f"{b}.get_device() == _idx" if gpu else f"{b}.is_cpu")
        # a sparse COO tensor is not contiguous; CSR/CSC/BSR ones raise here: the
        # conditions run under try (free until it raises), so both go to the general path
        conds.append(f"{b}.is_contiguous()")
    send = spec.send or spec.recv
    assert send is not None
    # Reductions of a dtype the library rounds badly (oneCCL CPU bf16,
    # backends._WIDENED) run through the wider dtype here too: the inputs are
    # copied into float32 scratch this fast path owns (grown, reused; freed
    # with it), reduced there, and the result is rounded once into the
    # output. The copies run inside the exec lock (two threads' calls cannot
    # share the scratch) and only when nothing is queued (the sync strategy's
    # condition), so no queued work can still be reading it. The scratch's
    # views come cached per shape, with their pointers (_ScratchViews).
    wide = bool(spec.reduces and cx.widened and not gpu)
    if wide:
        ns["_wide"] = {k: cx.dtypes[v] for k, v in cx.widened.items()}
        wv = _ScratchViews(cx.vp)
        ns["_sc"], ns["_wv"], ns["_wview"] = wv.sc, wv.views, wv
        conds.append(f"((d := _dtypes.get(dt := {send}.dtype)) is not None or (d := _wide.get(dt)) is not None)")
        # a buffer that requires grad, an inference tensor's output: the general path (its copies
        # record no autograd history and may write an inference tensor; here w0.copy_() would record
        # the history into the cached scratch, handed on to later calls' outputs)
        rg = " or ".join([f"{p.name}.requires_grad" for p in spec.buffers] + [f"{spec.recv or send}.is_inference()"])
        conds.append(f"(dt not in _wide or not ({rg}))")
    else:
        conds.append(f"(d := _dtypes.get(dt := {send}.dtype)) is not None")
    # the pair form at two ranks (plans.PlanContext.pair_op, decided as the general path decides
    # it): the inputs gathered into a scratch of their own dtype, one local op into the output
    pair = bool(wide and spec.pair and cx.pair_ops and cx.cfunc(spec.pair) is not None)
    if pair:
        (pdt,) = cx.widened
        gv = _ScratchViews(cx.vp, dtype=pdt, parts=2)
        ns.update({"_ag": cx.cfunc(spec.pair), "_pair": cx.pair_ops, "_pd": cx.dtypes[pdt],
                   "_gsc": gv.sc, "_gv": gv.views, "_gview": gv})
    for b in bufs:
        if b != send:
            conds.append(f"{b}.dtype is {send}.dtype")
    if spec.reduces:
        ns["_SUM"] = next(k for k in cx.direct_reductions() if getattr(k, "name", "") == "SUM")
        ns["_SUMC"] = comm._backend.ops["SUM"]
        reds = cx.direct_reductions()
        # by identity: torch's RedOpType compares equal to plain ints, which must not pass as ops
        ns["_reds"] = {id(k): v for k, v in reds.items()}
        ns["_reds_alive"] = list(reds)
        conds.append("(r := (_SUMC if op is _SUM else _reds.get(id(op)))) is not None")
    # AVG the library lacks: SUM, then the division (what the general path's
    # post-op does), for floating dtypes (integers: the general path's
    # truncating division). Marked by r = -1.
    fast_avg = spec.reduces and "AVG" in cx.emulated
    if fast_avg:
        avg = cx.spellings(ReduceOp.AVG)
        ns["_reds"].update({id(a): -1 for a in avg})
        ns["_reds_alive"] += avg
        ns["_floats"] = FLOATS
        conds.append(f"(r >= 0 or {send}.dtype in _floats)")
    peer = spec.root or next((p.name for p in spec.params if p.kind == "rank"), None)
    if peer is not None:
        conds.append(f"type({peer}) is int and 0 <= {peer} < _size")
        if spec.p2p:
            conds.append(f"{peer} != _rank")
        if spec.post_on_root_only and comm._backend.nonroot_recv_scratch:
            conds.append(f"{peer} == _rank")  # non-roots need oneCCL's scratch buffer: general path
    if spec.p2p:
        conds.append("tag == 0")
    for p in spec.params:
        if p.kind == "splits":
            conds.append(f"{p.name} is None")  # uneven all-to-all: the general path
    cbuf, how = spec.count  # type: ignore[misc]
    # each numel() read once (walrus names: m_<buffer>)
    conds.append(f"(m_{cbuf} := {cbuf}.numel()) >= 0")
    if how == "numel/size":
        conds.append(f"m_{cbuf} % _size == 0")
    for buf, rel, other in spec.sizes:
        lhs = f"m_{buf}" if buf == cbuf else f"{buf}.numel()"
        rhs = f"m_{other}" if other == cbuf else f"{other}.numel()"
        conds.append(f"{lhs} == {rhs}" + (" * _size" if rel == "size*" else ""))
    if inline_async:
        each = [f"m_{b}" if b == cbuf else f"{b}.numel()" for b in bufs]
        biggest = each[0] if len(each) == 1 else f"max({', '.join(each)})"
        plain = [f"{send}.dtype not in _wide"] if wide else []
        plain += ["r >= 0"] if fast_avg else []
        conds.append(f"(not ia or ({' and '.join(plain + [f'{biggest} * {send}.element_size() <= _imax'])}))")
    lines = [f"n = m_{cbuf}" + (" // _size" if how == "numel/size" else "")]
    sig = comm._sig
    if sig is not None and not spec.p2p:
        # the first-call check (debug.Signatures): inline set lookup; a frame only for a new key
        ns.update({"_seen": sig.fast, "_first": sig.first_fast, "_S": spec})
        fk = ", ".join([repr(spec.name), f"m_{cbuf}", "dt"] + (["r"] if spec.reduces else []) + ([peer] if peer else []))
        args = ", ".join(spec.param_names)
        # False: an async call of a new signature, whose check runs right before its C call (the
        # general path defers it there): async_op=True never waits here for the peers
        lines = [f"if (fk := ({fk},)) not in _seen and not _first(fk, _S, ({args},), "
                 f"{'ia' if inline_async else 'False'}):",
                 f"    return _general(_comm, {_general_args(spec)})"] + lines
    post = ""
    if fast_avg:
        lines += ["a = r < 0", "if a:", "    r = _SUMC"]
        on_root = f" and {peer} == _rank" if spec.post_on_root_only and peer else ""
        post = f"        if a{on_root}:\n            {spec.recv or spec.send}.div_(_size)\n"
    ptr_of: Dict[str, str] = {}
    distinct = list(dict.fromkeys(x for x in (spec.send, spec.recv) if x))
    if wide:
        # w<i>, p<i>: the float32 stand-in of buffer i, in its shape, and its pointer (one flat
        # scratch, consecutive regions), cached per shape (_ScratchViews: one lookup, one tuple)
        key = f"{distinct[0]}.shape" if len(distinct) == 1 else f"({', '.join(b + '.shape' for b in distinct)})"
        ws = [f"w{i}" for i in range(len(distinct))] + [f"p{i}" for i in range(len(distinct))]
        lines.append("wd = dt in _wide")
        lines.append("if wd:")
        if pair:
            assert len(distinct) == 1, spec.name
            b0 = distinct[0]
            lines.append(f"    if {'not a and ' if fast_avg else ''}(pa := _pair.get(r)) is not None:")
            lines.append("        wd = 2  # the pair form")
            lines.append(f"        g0, g1, pg, _ = _gv.get(k := {b0}.shape) or _gview(k)")
            lines.append(f"        p0 = _ptrs({b0}.data_ptr()) or _vp({b0})")
            lines.append("    else:")
            lines.append(f"        {', '.join(ws)} = _wv.get(k := {key}) or _wview(k)")
        else:
            lines.append(f"    {', '.join(ws)} = _wv.get(k := {key}) or _wview(k)")
        lines.append("else:")
        for i, b in enumerate(distinct):
            lines.append(f"    p{i} = _ptrs({b}.data_ptr()) or _vp({b})")
            ptr_of[b] = f"p{i}"
    else:
        for i, b in enumerate(distinct):
            lines.append(f"p{i} = _ptrs({b}.data_ptr()) or _vp({b})")
            ptr_of[b] = f"p{i}"
    vals = {"send": ptr_of.get(spec.send or "", ""), "recv": ptr_of.get(spec.recv or "", ""), "count": "n",
            "dtype": "d", "op": "r", "root": peer or "", "peer": peer or "", "comm": "_h",
            "stream": "_native(hs)" if gpu else "_null"}
    if gpu:
        lines.append("hs = _raw(_idx)")
    call = "_f(" + ", ".join(vals[r] for r in roles) + ")"
    if wide:
        out_b = spec.recv or send  # the output buffer (send: the first buffer, checked above)
        oi = distinct.index(out_b)
        # the copy in, under the lock, right before the call; the result's one rounding in post
        call = f"(wd and w0.copy_({send}), {call})[1]"
        on_root = f" and {peer} == _rank" if spec.post_on_root_only and peer else ""
        post = f"        if wd{on_root}:\n"
        ind = "    " if pair else ""  # the widened form's lines: under the pair form's else
        if pair:
            pv = dict(vals, recv="pg", dtype="_pd")
            call = f"(_ag({', '.join(pv[r_] for r_ in c_roles(cx.declarations, comm._backend.funcs[spec.pair]))}) " \
                   f"if wd == 2 else {call})"
            post += f"            if wd == 2:\n                pa(g0, g1, out={out_b})\n            else:\n"
        if fast_avg:
            # a power-of-two size: the multiplication by its reciprocal, bit-identical to the
            # division (the same real number, correctly rounded) and half its time at 64 KB
            pow2 = comm._size & (comm._size - 1) == 0
            ns["_rsize"] = 1.0 / comm._size
            scale = f"w{oi}.mul_(_rsize)" if pow2 else f"w{oi}.div_(_size)"
            post += f"{ind}            if a:\n{ind}                {scale}\n"
        post += f"{ind}            {out_b}.copy_(w{oi})\n"
        if fast_avg:
            post += f"        elif a{on_root}:\n            {out_b}.div_(_size)\n"
    if gpu:
        ns["_idx"] = comm._rt.index
        ns["_raw"] = comm._rt.raw_current
        ns["_native"] = comm._rt.native
    keep = "(" + ", ".join(bufs) + ",)"
    ret = {"src": peer}.get(spec.returns) or "None"
    head = ""
    if inline_async:
        if ret != "None":
            raise ValueError(f"{spec.name}: a collective with an async_op parameter returns None or a Work")
        outs = f"({spec.recv or send},)"
        args = ", ".join(vals[r_] for r_ in roles[:-1])
        refs = "(" + ", ".join(f"_wref({b})" for b in bufs) + ",)"
        head = ("if ia:\n" + _indent(ASYNC_TEMPLATE.format(name=repr(spec.name), args=args, keep=keep, outs=outs,
                                                            refs=refs), 4)
                + f"    return _general(_comm, {{call_general}})\n")
    # _fast_ok: whether the communicator may take a fast path now
    # (Communicator._refresh_fast_paths decides), read under the exec lock:
    # a fast path saved before coalescing, a failure or destroy falls through
    # to the general path, which decides what happens instead.
    body = _fill(ready="_comm._fast_ok" if gpu else "_comm._fast_ok and not _rt._pending",
                                p2p="\n        _comm._p2p += 1" if spec.p2p else "",
                                name=repr(spec.name), keep=keep, call=call,
                                cname=f"{spec.pair!r} if wd == 2 else {spec.name!r}" if pair else repr(spec.name),
                                post=post,
                                record=_record(comm) if gpu else "", ret=ret,
                                not_ready="", **_serial(comm))
    sig = signature_text(spec)
    call_general = _general_args(spec)
    head = head.replace("{call_general}", call_general)
    src = (f"def {spec.name}({sig}):\n"
           f"    try:\n"
           f"        ok = ({(chr(10) + '              and ').join(conds)})\n"
           f"    except Exception:  # e.g. a sparse CSR tensor's is_contiguous(): the general path says why\n"
           f"        ok = False\n"
           f"    if ok:\n"
           + _indent("\n".join(lines) + "\n" + head + body, 8)
           + f"    return _general(_comm, {call_general})\n")
    fn = _compile(src, spec.name, ns, f"{spec.name}/{comm._device.type}/{comm._backend.name}")
    fn.__doc__ = doc_text(spec)
    return fn

