"""Turning a collective's arguments into a :class:`~streamcoll.core.spec.Plan`
for one communicator: the services the planners of :mod:`streamcoll.core.spec`
use (tensor and dtype checks, the reduction table, C pointers, the C
functions this library has) and the composers for what a library lacks
(grouped Send/Recv, AlltoAllV).

One :class:`PlanContext` per communicator, made once; nothing here launches
anything (that is :mod:`streamcoll.core.launch`).
"""
from __future__ import annotations

import functools
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from .._ffi._common import read_declarations
from .._ffi.errors import NotSupportedError
from .ops import ReduceOp, canonical_op, op_key
from .source_text import c_roles
from .spec import TABLE, CollectiveSpec, Plan
from .validation import as_tensor, check_list, check_rank, check_same

__all__ = ["PlanContext"]

_Tensor = torch.Tensor
_strided = torch.strided
# The floating dtypes AVG divides and PREMUL_SUM scales (also the fast paths' AVG).
FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


@functools.lru_cache(maxsize=None)
def _declarations(name: str) -> str:
    return read_declarations(name)


def _run_group(gs: Callable[[], int], ge: Callable[[], int], calls: Sequence[Tuple[Callable[..., int], tuple, str]],
               comm: Any, h: Any) -> int:
    """A composed C call: ``calls`` between GroupStart and GroupEnd on stream
    ``h``; the first failing call raises (after GroupEnd, which must pair)."""
    rc = gs()
    if rc:
        comm._raise_rc("group_start", rc)
    err = None
    try:
        for f, args, cname in calls:
            rc = f(*args, h)
            if rc and err is None:
                err = (cname, rc)
    finally:  # a member raising (its first-call check, an interrupt) still closes the group: left
        rc = ge()  # open, every later call of the communicator returned at once, unreduced
    if err is not None:
        comm._raise_rc(*err)
    if rc:
        comm._raise_rc("group_end", rc)
    return 0


def _after(pre: Callable[[], Any], f: Callable[..., int]) -> Callable[..., int]:
    """``f`` with ``pre()`` run first, at launch (a conversion into a wider buffer)."""
    def fn(*args: Any) -> int:
        pre()
        return f(*args)
    return fn


def _premul(f: Callable[..., int], create: Callable[..., int], destroy: Callable[..., int], ffi: Any,
            scalar: Any, dtype: int, residence: int, comm: Any, pos: int) -> Callable[..., int]:
    """``f`` with its reduction (argument ``pos``) a PreMulSum of the
    library's own, created at launch from the host scalar ``scalar`` and
    destroyed right after (as ProcessGroupNCCL does per collective: NCCL
    reads a host-immediate scalar at creation, and the op may be destroyed
    once the collective is enqueued)."""
    def fn(*args: Any) -> int:
        opp = ffi.new("ncclRedOp_t *")
        rc = create(opp, scalar, dtype, residence, comm)
        if rc:
            return int(rc)
        a = list(args)
        a[pos] = opp[0]
        try:
            return int(f(*a))
        finally:
            destroy(opp[0], comm)
    return fn


def _then(post: Optional[Callable[[], Any]], wide: torch.Tensor, out: torch.Tensor) -> Callable[[], Any]:
    """``post`` (on the wide result), then the one rounding into ``out``
    (``copy_`` rounds to nearest even)."""
    if post is None:
        return lambda: out.copy_(wide)

    def fn() -> None:
        post()
        out.copy_(wide)
    return fn


def _untracked(fn: Callable[[], Any]) -> Callable[[], Any]:
    """``fn`` run in inference mode: the widened path's copies and scaling
    record no autograd history and may write an inference tensor, as the C
    call's own writes into a buffer do (a tensor that requires grad, one
    made in inference mode, a plan made there and run on the comm thread)."""
    def run() -> Any:
        with torch.inference_mode():
            return fn()
    return run


class PlanContext:
    """What a planner sees of its communicator."""

    torch = torch

    def __init__(self, comm: Any) -> None:
        b = comm._backend
        self.comm = comm
        self.backend = b
        self.ffi = ffi = b.ffi
        self.lib = comm._lib
        self.rank: int = comm._rank
        self.size: int = comm._size
        self.device = comm._device
        self.gpu = comm._gpu
        self.dtypes = b.dtypes
        self.emulated = b.emulated(comm._device.type)
        # dtype -> the dtype its reductions run in (oneCCL CPU bf16: float32)
        # (STREAMCOLL_WIDEN_BF16 as agreed at the communicator's rendezvous: every rank's the same)
        own = getattr(comm, "_own", None)
        self.widened: Dict[torch.dtype, torch.dtype] = b.widened(
            comm._device.type, None if own is None else own["STREAMCOLL_WIDEN_BF16"] != "0")
        self.op_cache: Dict[Any, tuple] = {}
        # C op -> the local op of a widened reduction's pair form (pair_op):
        # two ranks and one widened dtype (the fast path's gather scratch is of it)
        self.pair_ops: Dict[int, Callable[..., Any]] = {}
        if self.size == 2 and len(self.widened) == 1:
            self.pair_ops = {b.ops["SUM"]: torch.add, b.ops["PRODUCT"]: torch.mul}
        # PREMUL_SUM as the library's own reduction (NCCL >= 2.11:
        # ncclRedOpCreatePreMulSum), which multiplies each input before the
        # sum as torch does; SUM then scaling the result instead can overflow
        # fp16 (8 ranks of 1e4 sum past 65504 before the 1/8) and rounds bf16
        # differently. oneCCL 2022.2 returns NotImplemented for it.
        self.premul_c: Optional[Tuple[Any, Any]] = None
        if b.name == "nccl" and "PREMUL_SUM" not in self.emulated:
            try:
                self.premul_c = (self.lib.ncclRedOpCreatePreMulSum, self.lib.ncclRedOpDestroy)
            except Exception:  # an NCCL older than 2.11 (lazy symbols raise): post-scaling
                self.premul_c = None
        self.declarations = _declarations(b.binding.declarations)
        # C functions, resolved once (functions the library lacks stay None).
        self.c: Dict[str, Any] = {}
        for name, fname in b.funcs.items():
            try:
                self.c[name] = getattr(self.lib, fname)
            except AttributeError:
                self.c[name] = None
        # data_ptr -> its ``void *`` cdata. ffi.cast costs ~0.6 us a call; the
        # cdata is only an address, owning nothing, so reusing it for the same
        # address is safe. Bounded: cleared when full.
        ptrs: Dict[int, Any] = {}
        self.ptrs = ptrs
        cast = ffi.cast
        voidp = ffi.typeof("void *")

        def vp(t: Any, _get: Callable = ptrs.get) -> Any:
            a = t.data_ptr()
            p = _get(a)
            if p is None:
                if len(ptrs) >= 4096:
                    ptrs.clear()
                p = ptrs[a] = cast(voidp, a)
            return p

        self.vp = vp
        self._barrier_buf: Optional[torch.Tensor] = None

    # ---------------------------------------------------------- accessors
    @property
    def handle(self) -> Any:
        return self.comm._handle

    def cfunc(self, name: str) -> Any:
        """The C function of collective ``name`` in this library, or None."""
        return self.c.get(name)

    def has(self, spec: CollectiveSpec) -> bool:
        return self.c.get(spec.name) is not None

    def need(self, name: str) -> Any:
        f = self.c.get(name)
        if f is None:
            fname = self.backend.funcs.get(name)
            if fname is None:
                raise NotSupportedError(f"{name} is not available on backend {self.backend.name!r}")
            getattr(self.lib, fname)  # raises FunctionNotFoundError naming the version
        return f

    def pair_op(self, spec: CollectiveSpec, red: Any, kind: Optional[str]) -> Optional[Callable[..., Any]]:
        """The local op of ``spec``'s widened reduction ``red`` run in its
        pair form, or None: at two ranks, SUM or PRODUCT of a collective that
        declares ``pair`` (all_reduce) gathers both ranks' inputs in their own
        dtype and each rank computes ``op(rank 0's, rank 1's)`` itself.

        The widened form's bits but a NaN's: at two ranks the float32
        reduction is one operation on two exact conversions, fl32(a + b)
        (fl32(a * b)), rounded once to bf16; torch's bf16 add and mul compute
        exactly that and round it once, to nearest even, as the widened
        form's copy back does, and both ranks compute it in the same order.
        A NaN is a NaN at the same places on every rank, but its sign and
        payload are torch's: its bf16 add/mul write 0xFFFF in their
        vectorized loop and 0x7FC0 in a chunk's scalar remainder, where the
        copy back always writes 0xFFFF. Making them the copy back's costs a
        pass over the output, 4.4 us at 4 KB, more than the form saves
        (tests/core/test_bf16_widened.py). Half the bytes move (the inputs in
        bf16) and no float32 copy goes in: 1.6-1.9x oneCCL's own bf16 at 4 KB
        where the widened form is 2.1-2.4x (docs/benchmarks.md). The fast
        path and the general path decide it alike (dtype, op, world size: the
        same on every rank), so a rank on either issues the same C call.
        """
        if kind is not None or not spec.pair or self.c.get(spec.pair) is None:
            return None
        return self.pair_ops.get(red)

    def pair_plan(self, spec: CollectiveSpec, ts: Dict[str, torch.Tensor], send: torch.Tensor, n: int, d: int,
                  op: Callable[..., Any], keep: tuple) -> Plan:
        """``spec``'s reduction of ``send`` in its pair form (:meth:`pair_op`):
        the inputs gathered into a buffer of this call's, then ``op`` of its
        two halves into the output, untracked (as the widened form's copy)."""
        assert spec.pair is not None
        recv = ts[spec.recv] if spec.recv else send
        g = torch.empty(2 * n, dtype=send.dtype, device=send.device)
        g0, g1 = g[:n].view(recv.shape), g[n:].view(recv.shape)
        vals = {"send": self.vp(send), "recv": self.vp(g), "count": n, "dtype": d, "comm": self.handle}
        roles = c_roles(self.declarations, self.backend.funcs[spec.pair])
        args = tuple(vals[r] for r in roles if r != "stream")
        outs = tuple(ts[p.name] for p in spec.buffers if p.mutable)
        post = _untracked(lambda: op(g0, g1, out=recv))
        return Plan(self.need(spec.pair), args, post, tuple(ts.values()) + keep + (g,), outs, spec.pair)

    # ---------------------------------------------------------- checks
    def t(self, t: Any, name: str) -> torch.Tensor:
        c = self.comm
        if type(t) is _Tensor and not self.gpu and t.is_cpu and t.layout is _strided and t.is_contiguous():
            return t
        return as_tensor(t, name, c._device, c._dev_type, c._dev_index)

    def tensor_list(self, lst: Any, name: str) -> Sequence[Any]:
        return check_list(lst, name, self.size)

    same_dtype = staticmethod(check_same)

    def check_rank(self, v: Any, name: str) -> int:
        return check_rank(v, name, self.size)

    def dtype(self, t: torch.Tensor, opname: str = "", name: str = "tensor") -> int:
        d = self.dtypes.get(t.dtype)
        if d is None:
            supported = ", ".join(str(x).replace("torch.", "") for x in self.dtypes)
            raise TypeError(
                f"{name}: dtype {t.dtype} is not supported by {opname or 'this collective'} "
                f"on backend {self.backend.name!r} (supported: {supported})"
            )
        return d

    def reduction(self, op: Any, dtype: torch.dtype, opname: str) -> tuple:
        """(C reduction, post kind, factor) for ``op`` on ``dtype``; cached."""
        key = (op_key(op), dtype)
        spec = self.op_cache.get(key)
        if spec is not None:
            return spec
        name, factor = canonical_op(op)
        b = self.backend
        if dtype == torch.bool:
            if name not in b.bool_ops:
                raise TypeError(f"op: {name} is not defined for dtype torch.bool in {opname} "
                                f"on backend {b.name!r} (SUM, PRODUCT, MIN, MAX are)")
            spec = (b.bool_ops[name], None, 1.0)
        elif name in ("AVG", "PREMUL_SUM") and (name in self.emulated or name == "PREMUL_SUM"):
            if name == "PREMUL_SUM" and dtype not in FLOATS:
                raise TypeError(f"op: PREMUL_SUM needs a floating dtype in {opname}, got {dtype} "
                                f"on backend {b.name!r}")
            if name == "PREMUL_SUM" and self.premul_c is not None:
                spec = (None, "NATIVE_PREMUL", factor)  # created per launch (plans._premul)
                self.op_cache[key] = spec
                return spec
            if name == "AVG" and dtype not in FLOATS and dtype not in self.dtypes:
                raise TypeError(f"op: AVG is not supported for {dtype} in {opname} on backend {b.name!r}")
            spec = (b.ops["SUM"], name, factor)  # SUM, then scale the result on the same stream
        else:
            spec = (b.ops[name], None, 1.0)
        self.op_cache[key] = spec
        return spec

    @staticmethod
    def spellings(m: ReduceOp) -> List[Any]:
        """``m`` as streamcoll and torch.distributed spell it (the hashable
        spellings: what a fast path can look up by identity)."""
        out: List[Any] = [m]
        try:
            import torch.distributed as dist
            t = getattr(dist.ReduceOp, m.name)
            hash(t)
            out.append(t)
        except Exception:  # torch without distributed, no such op, or an unhashable spelling
            pass
        return out

    def direct_reductions(self) -> Dict[Any, int]:
        """Hashable op spellings -> C reduction for ops this library runs
        as they are on non-bool dtypes (what the generated fast paths take;
        AVG/PREMUL emulation and bool go the general way)."""
        out: Dict[Any, int] = {}
        for m in ReduceOp:
            if m is ReduceOp.PREMUL_SUM or (m.value in self.emulated):
                continue
            for k in self.spellings(m):
                out[k] = self.backend.ops[m.value]
        return out

    def post(self, kind: Optional[str], factor: float, out: torch.Tensor,
             applies: bool = True) -> Optional[Callable[[], Any]]:
        if kind is None or not applies:
            return None
        if kind == "AVG":
            n = self.size
            if out.dtype in FLOATS:
                return lambda: out.div_(n)
            return lambda: out.copy_(torch.div(out, n, rounding_mode="trunc"))
        return lambda: out.mul_(factor)

    def read_first(self, plan: Plan, pre: Callable[[], Any]) -> Plan:
        """``plan`` with ``pre()`` (a composed collective's read of its
        inputs: packing a list into one flat buffer) run when the call runs,
        not when it is planned: on the CPU on the thread that runs the call
        (behind queued async work that may still write the inputs), on a GPU
        on the stream the call is launched on (the comm stream for
        ``async_op=True``, after its wait on the current stream). Reading at
        plan time read buffers that work queued before was still writing."""
        f = plan.fn
        if not self.gpu:
            fn = _after(pre, f)
        else:
            mod = getattr(torch, self.device.type)
            cast = self.ffi.cast
            attr = "cuda_stream" if self.device.type == "cuda" else "sycl_queue"

            def fn(*args: Any) -> int:
                hs = int(cast("uintptr_t", args[-1]))  # the stream handle the call is launched on
                if hs == getattr(mod.current_stream(self.device), attr):
                    pre()
                else:
                    with mod.stream(mod.ExternalStream(hs, device=self.device)):
                        pre()
                return f(*args)
        return Plan(fn, plan.args, plan.post, plan.keep, plan.outputs, plan.cname, plan.p2p)

    # ---------------------------------------------------------- planners
    def native(self, spec: CollectiveSpec, a: Dict[str, Any], names: Optional[Dict[str, str]] = None,
               keep: tuple = (), opname: Optional[str] = None) -> Plan:
        """The plan of a single-call collective, from its declaration."""
        nm = names or {}
        opname = opname or spec.name
        ts: Dict[str, torch.Tensor] = {}
        for p in spec.buffers:
            ts[p.name] = self.t(a[p.name], nm.get(p.name, p.name))
        send_name = spec.send or spec.recv
        assert send_name is not None, f"{spec.name}: a native collective declares its buffers"
        send = ts[send_name]
        for p in spec.buffers:
            if p.name != send_name:
                check_same(send, ts[p.name], nm.get(send_name, send_name), nm.get(p.name, p.name))
        d = self.dtype(send, opname, nm.get(send_name, send_name) if spec.send != spec.recv else "tensor")
        cbuf, how = spec.count  # type: ignore[misc]
        n = ts[cbuf].numel()
        size = self.size
        if how == "numel/size":
            if n % size:
                raise ValueError(f"{nm.get(cbuf, cbuf)}: expected a number of elements divisible by world "
                                 f"size {size}, got {n}")
            n //= size
        for buf, rel, other in spec.sizes:
            m = ts[other].numel()
            want = m * size if rel == "size*" else m
            if ts[buf].numel() != want:
                bn, on = nm.get(buf, buf), nm.get(other, other)
                how_ = f"(world size {size} x {on}'s {m})" if rel == "size*" else f"like {on}"
                raise ValueError(f"{bn}: expected {want} elements {how_}, got {ts[buf].numel()}")
        root = self.check_rank(a[spec.root], spec.root) if spec.root else None
        red = post = None
        recv = ts[spec.recv] if spec.recv else send
        f = self.need(spec.name)
        wide = self.widened.get(send.dtype) if spec.reduces else None
        if spec.reduces:
            red, kind, factor = self.reduction(a["op"], send.dtype, opname)
            applies = not spec.post_on_root_only or root == self.rank
            if wide is not None and (pa := self.pair_op(spec, red, kind)) is not None:
                return self.pair_plan(spec, ts, send, n, d, pa, keep)
            if wide is not None:
                # Reduce through ``wide`` where the library's own reduction of
                # this dtype rounds badly (backends._WIDENED): the input is
                # converted when the call runs (not now: queued work before it
                # may still write it), the reduction (and AVG/PREMUL's
                # scaling) runs in ``wide``, the result is rounded once.
                nsend, nrecv = send, recv
                send = torch.empty(nsend.shape, dtype=wide, device=nsend.device)
                recv = send if nrecv is nsend else torch.empty(nrecv.shape, dtype=wide, device=nrecv.device)
                d = self.dtypes[wide]
                keep = keep + (send, recv)
                f = _after(_untracked(lambda: send.copy_(nsend)), f)
                post = _untracked(_then(self.post(kind, factor, recv, applies), recv, nrecv)) if applies else None
            elif kind == "NATIVE_PREMUL":
                assert self.premul_c is not None
                scalar = torch.tensor([factor], dtype=send.dtype)  # host-immediate, of the op's dtype
                keep = keep + (scalar,)
                roles_ = [r for r in c_roles(self.declarations, self.backend.funcs[spec.name]) if r != "stream"]
                create, destroy = self.premul_c
                f = _premul(f, create, destroy, self.ffi, self.vp(scalar), d,
                            self.backend.binding.const("ncclScalarHostImmediate"), self.handle, roles_.index("op"))
                red = self.backend.ops["SUM"]  # a placeholder: replaced at launch
            else:
                post = self.post(kind, factor, recv, applies)
        vp = self.vp
        sp = vp(send)
        if spec.post_on_root_only and root != self.rank and self.backend.nonroot_recv_scratch:
            # oneCCL writes the receive buffer on every rank: non-roots get a scratch one.
            scratch = torch.empty_like(send)
            keep = keep + (scratch,)
            rp = vp(scratch)
        else:
            rp = sp if recv is send else vp(recv)
        vals = {"send": sp, "recv": rp, "count": n, "dtype": d, "op": red, "root": root, "comm": self.handle}
        roles = c_roles(self.declarations, self.backend.funcs[spec.name])
        args = tuple(vals[r] for r in roles if r != "stream")
        outs = tuple(ts[p.name] for p in spec.buffers if p.mutable)
        return Plan(f, args, post, tuple(ts.values()) + keep, outs, spec.name)

    @staticmethod
    def check_tag(tag: Any, name: str = "tag") -> None:
        """Only tag 0. NCCL and oneCCL match a pair's messages in issue order
        and carry no tag, so a tag cannot be honoured; rather than let
        ``recv(tag=2)`` silently take the message sent with ``tag=1``, a
        non-zero tag is refused (before any C call)."""
        if isinstance(tag, bool) or not isinstance(tag, (int, np.integer)):
            raise TypeError(f"{name}: expected an int, got {type(tag).__name__}")
        if tag != 0:
            raise ValueError(f"{name}: message tags are not supported (NCCL and oneCCL match a pair's messages "
                             f"in issue order and carry no tag); pass tag=0, got {int(tag)}")

    def p2p(self, kind: str, tensor: Any, peer: Any, name: str, tag: Any = 0) -> Plan:
        if peer is None and kind == "recv":
            raise ValueError("src: receiving from any source is not supported; pass the sender's rank")
        if tag != 0 or type(tag) is not int:
            self.check_tag(tag)
        t = self.t(tensor, "tensor")
        peer = self.check_rank(peer, name)
        if peer == self.rank:
            raise ValueError(f"{name}: expected a rank other than this one ({self.rank})")
        d = self.dtype(t, kind)
        f = self.c[kind]
        return Plan(f, (self.vp(t), t.numel(), d, peer, self.handle), None, (t,), (t,), kind, True)

    def group(self, calls: Sequence[Tuple[Callable[..., int], tuple, str]]) -> Tuple[Callable[..., int], tuple]:
        """``(fn, args)`` of one group launch (GroupStart/GroupEnd) of
        ``(fn, args, cname)`` calls, for a Plan: ``fn(*args, stream)``."""
        return _run_group, (self.c["group_start"], self.c["group_end"], tuple(calls), self.comm)

    def p2p_group(self, sends: Sequence[tuple], recvs: Sequence[tuple], post: Optional[Callable[[], Any]],
                  keep: tuple, outputs: tuple, name: str = "p2p_group") -> Plan:
        """Send/Recv in one group; entries are ``(ptr, count, peer, dtype)``.

        A rank with a single Send or Recv issues it without a group: the
        same transfer, and oneCCL 2022.2 prints ``|CCL_ERROR| ... not
        completed event is destroyed`` for every Send/Recv issued inside a
        group, never for one outside (measured: docs/design.md, section 'oneCCL's output'),
        so a gather's non-root ranks, and every rank of a 2-rank gather,
        stay quiet."""
        fs, fr, h = self.c["send"], self.c["recv"], self.handle
        calls = [(fs, (p, c, d, peer, h), "send") for p, c, peer, d in sends]
        calls += [(fr, (p, c, d, peer, h), "recv") for p, c, peer, d in recvs]
        if len(calls) == 1:
            f, a, cname = calls[0]
            return Plan(f, a, post, keep, outputs, cname)
        fn, args = self.group(calls)
        return Plan(fn, args, post, keep, outputs, name)

    def alltoallv(self, inp: torch.Tensor, out: torch.Tensor, send: List[int], recv: List[int], d: int) -> Plan:
        f = self.c.get("all_to_all_v")
        if f is not None:
            ffi = self.ffi
            sc = ffi.new("size_t[]", send)
            rc_ = ffi.new("size_t[]", recv)
            # the count arrays must live as long as the call: keep them in the args.
            return Plan(f, (self.vp(inp), sc, self.vp(out), rc_, d, self.handle), None, (inp, out), (out,),
                        "all_to_all_v")
        # NCCL has no AlltoAllV: grouped Send/Recv.
        esz = inp.element_size()
        so = np.concatenate(([0], np.cumsum(send)[:-1])).tolist()
        ro = np.concatenate(([0], np.cumsum(recv)[:-1])).tolist()
        ib, ob = inp.data_ptr(), out.data_ptr()
        cast = self.ffi.cast
        sends = [(cast("void *", ib + so[p] * esz), send[p], p, d) for p in range(self.size) if send[p]]
        recvs = [(cast("void *", ob + ro[p] * esz), recv[p], p, d) for p in range(self.size) if recv[p]]
        return self.p2p_group(sends, recvs, None, (inp, out), (out,))

    def batch(self, p2p_op_list: Any) -> Plan:
        if not isinstance(p2p_op_list, (list, tuple)) or not p2p_op_list:
            raise ValueError("p2p_op_list: expected a non-empty list of P2POp")
        sends: List[tuple] = []
        recvs: List[tuple] = []
        keep: List[torch.Tensor] = []
        for i, p in enumerate(p2p_op_list):
            opname = getattr(getattr(p, "op", None), "__name__", "")
            if opname in ("isend", "send"):
                kind = "send"
            elif opname in ("irecv", "recv"):
                kind = "recv"
            else:
                raise ValueError(f"p2p_op_list[{i}].op: expected isend or irecv, got {getattr(p, 'op', None)!r}")
            grp = getattr(p, "group", None)
            if grp is not None and grp is not self.comm:
                raise ValueError(f"p2p_op_list[{i}].group: expected this communicator or None")
            self.check_tag(getattr(p, "tag", 0) or 0, f"p2p_op_list[{i}].tag")
            t = self.t(p.tensor, "tensor")
            peer = self.check_rank(p.peer, f"p2p_op_list[{i}].peer")
            if peer == self.rank:
                raise ValueError(f"p2p_op_list[{i}].peer: expected a rank other than this one ({self.rank})")
            d = self.dtype(t, kind)
            (sends if kind == "send" else recvs).append((self.vp(t), t.numel(), peer, d))
            keep.append(t)
        plan = self.p2p_group(sends, recvs, None, tuple(keep), tuple(keep), "batch_isend_irecv")
        plan.p2p = True
        return plan

    def barrier(self) -> Plan:
        buf = self._barrier_buf
        if buf is None:
            buf = self._barrier_buf = torch.zeros(1, dtype=torch.int32, device=self.device)
        return self.native(TABLE["all_reduce"], {"tensor": buf, "op": ReduceOp.SUM}, opname="barrier")
