"""One benchmark case per collective, derived from its declaration in
:mod:`streamcoll.core.spec`: the buffers, the three ways to run it (streamcoll,
the raw C call through streamcoll's binding, torch.distributed) and the
result that checks what was timed.

A table entry is benchmarked when it declares nccl-tests' bus factor
(``bus_factor``), has a reference implementation and takes only tensors,
ranks, a reduction and split sizes (:func:`benchmarkable`); nothing here
names a collective but ``sendrecv`` (nccl-tests' pair of Send and Recv in
one group, not a collective of the table). From the declaration:

- buffers: one per tensor parameter; the message (nccl-tests' ``count``) is
  the largest of them, the others follow the size relations (``sizes``,
  ``count=(buffer, "numel/size")``); where the C call splits a buffer into
  ``n`` blocks the count is rounded down to a multiple of ``n`` (at least
  ``n``). So all_gather and reduce_scatter count the full array, all_to_all
  one rank's whole send buffer (doc/PERFORMANCE.md);
- ranks take their default (root 0), the reduction its default (SUM);
- the streamcoll call is the module function with the parameters up to the
  last buffer or rank, in the declared (torch.distributed's) order; the
  torch.distributed call is the same arguments to :func:`torch_function`;
- the raw call is the entry's C function with its arguments in the order
  the header declares them (:func:`streamcoll.core.source_text.c_roles`), bound once;
- the expected values are the entry's ``reference``, applied once per
  timed call to every rank's inputs.

Inputs are small integers, ``1 + rank + n * block + i % 5`` (block 0 where
the buffer is not split), so every sum is exact in every dtype and each
block says who sent it to whom. Every timed batch starts from freshly filled
buffers; the outputs of the last timed batch of each library are checked
element by element (the timed calls themselves, not a separate
verification call). An in-place reduction grows with every call
(all_reduce: ``S * n**(k-1)`` after ``k``), so batches are capped to keep
it exact (:attr:`Case.cap`); a result defined on the root only (reduce)
is timed one call per batch and checked on the root.
"""
from __future__ import annotations

import functools
import math
from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np
import torch

from ..core import source_text as _text
from ..core import spec as _spec
from .._ffi._common import read_declarations

__all__ = ["Context", "CASES", "Case", "make_case", "exact_limit", "batches", "benchmarkable", "torch_function"]

# Largest integer each dtype holds exactly (and every smaller one).
_EXACT = {
    torch.float32: 2 ** 24, torch.float64: 2 ** 53, torch.float16: 2 ** 11, torch.bfloat16: 2 ** 8,
    torch.int8: 127, torch.uint8: 255, torch.int32: 2 ** 31 - 1, torch.int64: 2 ** 62,
}
# Plain values for the benchmarked kinds; the rest must not appear in a benchmarked entry.
_KINDS = (_spec.TENSOR, _spec.RANK, _spec.OP, _spec.SPLITS)


def exact_limit(dtype: torch.dtype) -> int:
    try:
        return _EXACT[dtype]
    except KeyError:
        raise ValueError(f"dtype: {dtype} is not benchmarked (choose from "
                         f"{', '.join(str(d).replace('torch.', '') for d in _EXACT)})") from None


def benchmarkable(s: _spec.CollectiveSpec) -> bool:
    """Whether the table entry ``s`` gets a benchmark case (see the module docstring)."""
    return (s.bus_factor is not None and s.reference is not None and not s.p2p
            and any(p.kind == _spec.TENSOR for p in s.params) and all(p.kind in _KINDS for p in s.params))


def torch_function(s: _spec.CollectiveSpec) -> Optional[Callable[..., Any]]:
    """torch.distributed's function for ``s``: the first of its ProcessGroup
    method names (``pg``) that torch.distributed has as a function (torch
    2.13 named all_gather_single, reduce_scatter_single after them and
    deprecated the old names, which warn on every call), else its own name
    or an alias; None where torch.distributed has none."""
    import torch.distributed as dist
    for name in (*s.pg, s.name, *s.aliases):
        f = getattr(dist, name, None)
        if callable(f) and not isinstance(f, type):
            return f
    return None


class Context:
    """What every case needs: rank, size, device, dtype, async_op, and the
    binding objects for the raw calls."""

    def __init__(self, comm, rank: int, n: int, device: torch.device, dtype: torch.dtype, async_op: bool) -> None:
        self.comm = comm
        self.rank = rank
        self.n = n
        self.device = device
        self.dtype = dtype
        self.async_op = async_op
        self.esize = torch.empty((), dtype=dtype).element_size()
        b = comm._backend
        self.backend = b
        self.ffi = b.ffi
        self.lib = b.lib()
        self.handle = comm.handle
        self.cdt = b.dtypes[dtype]
        self.declarations = read_declarations(b.binding.declarations)
        self.gpu = device.type != "cpu"
        if device.type == "cuda":
            self.stream = self.ffi.cast("cudaStream_t", torch.cuda.current_stream(device).cuda_stream)
        else:
            self.stream = self.ffi.NULL

    def cfn(self, coll: str) -> Optional[Callable]:
        name = self.backend.funcs.get(coll)
        if name is None:
            return None
        try:
            return getattr(self.lib, name)
        except Exception:
            return None

    def ptr(self, t: torch.Tensor):
        return self.ffi.cast("void *", t.data_ptr())

    def raise_rc(self, coll: str, rc: int):
        raise self.backend.binding.error(self.backend.funcs[coll], rc, self.handle)

    def c_args(self, coll: str, vals: Dict[str, Any]) -> tuple:
        """The arguments of ``coll``'s C function in its header's order, from
        values by role (``send``, ``recv``, ``count``, ...; ``comm`` and
        ``stream`` are the context's)."""
        v = dict(vals, comm=self.handle, stream=self.stream, dtype=self.cdt)
        return tuple(v[r] for r in _text.c_roles(self.declarations, self.backend.funcs[coll]))

    def bound(self, coll: str, vals: Dict[str, Any]) -> Optional[Callable[[], int]]:
        """The C function of ``coll`` bound to its arguments (a C-level
        partial, so the raw baseline pays no Python argument handling); it
        returns the library's result code. None where the library lacks it."""
        f = self.cfn(coll)
        return None if f is None else functools.partial(f, *self.c_args(coll, vals))

    def raw_call(self, coll: str, vals: Dict[str, Any]) -> Optional[Callable[[], None]]:
        """:meth:`bound`, checked: raises the library's error on a failure."""
        call = self.bound(coll, vals)
        if call is None:
            return None

        def run():
            rc = call()
            if rc:
                self.raise_rc(coll, rc)
        return run

    def pattern(self, count: int, offset: int, step: int = 1) -> torch.Tensor:
        """``offset + step * (i % 5)`` for i < count, in the context's dtype (exact small ints)."""
        base = torch.tensor([offset + step * j for j in range(5)], dtype=torch.int64).to(self.dtype)
        reps = -(-count // 5)
        return base.repeat(reps)[:count].to(self.device).contiguous()

    def empty(self, count: int) -> torch.Tensor:
        return torch.empty(count, dtype=self.dtype, device=self.device)


class Case:
    """One (collective, size) row: ``setup`` makes the buffers, ``fill``
    refills them before a batch, the three runners return the callable to
    time (``raw`` and ``torch`` None where that counterpart does not exist),
    ``outputs``/``expected`` what the check compares."""

    name = ""
    split = False  # the buffer is n blocks: count rounded to a multiple of n

    def __init__(self, ctx: Context, nbytes: int) -> None:
        self.ctx = ctx
        n = ctx.n
        count = max(1, nbytes // ctx.esize)
        if self.split:
            count = max(1, count // n) * n
        self.count = count  # elements in the message, nccl-tests' "count"
        self.nbytes = count * ctx.esize
        self.cap: Optional[int] = None  # max calls per batch (None: unlimited)
        self.setup()

    def timed(self, f, *args):
        """The callable to time: ``f(*args)``, or with ``async_op=True`` plus ``wait()``."""
        if self.ctx.async_op:
            return lambda: f(*args, async_op=True).wait()
        return lambda: f(*args)

    # -- to implement -----------------------------------------------------
    def setup(self) -> None:
        raise NotImplementedError

    def fill(self) -> None:
        raise NotImplementedError

    def outputs(self) -> Dict[str, torch.Tensor]:
        raise NotImplementedError

    def expected(self, k: int) -> Dict[str, torch.Tensor]:
        raise NotImplementedError

    def streamcoll(self) -> Callable[[], None]:
        raise NotImplementedError

    def torch(self) -> Optional[Callable[[], None]]:
        raise NotImplementedError

    def raw(self) -> Optional[Callable[[], None]]:
        return None

    # -- shared ---------------------------------------------------------------
    def compare(self, k: int) -> Tuple[int, Optional[str]]:
        """(wrong elements, None or a description) of the outputs after ``k``
        calls; the count is nccl-tests' ``#wrong``."""
        outs, exp = self.outputs(), self.expected(k)
        wrong, first = 0, None
        for pname, out in outs.items():
            e = exp[pname]
            if torch.equal(out, e):
                continue
            bad = (out.reshape(-1) != e.reshape(-1)).nonzero()
            wrong += bad.numel()
            if first is None:
                i = int(bad[0]) if bad.numel() else -1
                first = (f"{self.name} {self.nbytes} B rank {self.ctx.rank}: {bad.numel()} of {out.numel()} "
                         f"elements of {pname} wrong; first at [{i}]: got {out.view(-1)[i].item()}, "
                         f"expected {e.view(-1)[i].item()}")
        return wrong, first

    def check(self, k: int) -> Optional[str]:
        """None if the output after ``k`` calls is right, else a description."""
        return self.compare(k)[1]

    def corrupt(self) -> None:
        """Testing aid (--inject-error): make the last result wrong."""
        for o in self.outputs().values():
            o.view(-1)[0] = o.view(-1)[0] + 1
            break


def _np_dtype(dtype: torch.dtype) -> Any:
    """The numpy dtype the reference runs in (bfloat16, which numpy lacks: float32, exact for the test values)."""
    return np.float32 if dtype == torch.bfloat16 else torch.empty((), dtype=dtype).numpy().dtype


class TableCase(Case):
    """The case of one table entry (see the module docstring)."""

    def __init__(self, s: _spec.CollectiveSpec, ctx: Context, nbytes: int) -> None:
        self.spec = s
        self.name = s.name
        self.split = bool(blocked(s))
        super().__init__(ctx, nbytes)

    def setup(self) -> None:
        c, s = self.ctx, self.spec
        n = c.n
        self.numel = _numels(s, self.count, n)
        self.root: Optional[int] = s.param(s.root).default if s.root else None
        self.kw = _reference_kw(s)
        # The arguments: everything up to the last buffer or rank; later defaults are left out.
        last = max(i for i, p in enumerate(s.params) if p.kind in (_spec.TENSOR, _spec.RANK))
        self.bufs: Dict[str, torch.Tensor] = {}
        self.templates: Dict[str, torch.Tensor] = {}
        args: List[Any] = []
        for p in s.params[:last + 1]:
            if p.kind == _spec.TENSOR:
                self.bufs[p.name] = b = _input(c.pattern, s, p.name, self.numel[p.name], c.rank, n) \
                    if p.role == "in" else c.empty(self.numel[p.name])
                if p.role == "inout":
                    self.templates[p.name] = _input(c.pattern, s, p.name, self.numel[p.name], c.rank, n)
                args.append(b)
            else:
                args.append(p.default)
        self.args = tuple(args)
        self.send = self.bufs[s.send] if s.send else None
        self.recv = self.bufs[s.recv] if s.recv else None
        self.cap = call_cap(s.name, n, c.dtype)
        # A result defined on the root only (reduce): torch.distributed's gloo leaves partial
        # results in the other ranks' buffers, which the next in-place call would reduce. So
        # each call starts from filled buffers (one call per batch) and only the root checks.
        self.root_only = s.post_on_root_only and self.root is not None
        if self.root_only:
            self.cap = 1
        self._expected: Dict[int, Dict[str, torch.Tensor]] = {}

    def fill(self) -> None:
        for name, b in self.bufs.items():
            t = self.templates.get(name)
            if t is not None:
                b.copy_(t)
            elif self.spec.param(name).role == "out":
                b.zero_()

    def outputs(self) -> Dict[str, torch.Tensor]:
        if self.root_only and self.ctx.rank != self.root:
            return {}
        return {p: b for p, b in self.bufs.items() if self.spec.param(p).mutable}

    def expected(self, k: int) -> Dict[str, torch.Tensor]:
        e = self._expected.get(k)
        if e is None:
            c, s = self.ctx, self.spec
            states = [{p: _input(_np_pattern(c.dtype), s, p, m, r, c.n) for p, m in self.numel.items()
                       if s.param(p).role != "out"} for r in range(c.n)]
            want = _reference(s, c.n, states, k, self.kw)[c.rank]
            e = {p: torch.from_numpy(np.ascontiguousarray(want[p]).reshape(-1)).to(c.dtype).to(c.device)
                 for p in self.outputs()}
            self._expected = {k: e}
        return e

    def streamcoll(self):
        import streamcoll
        return self.timed(getattr(streamcoll, self.name), *self.args)

    def torch(self):
        f = torch_function(self.spec)
        return None if f is None else self.timed(f, *self.args)

    def raw_vals(self) -> Optional[Dict[str, Any]]:
        """The raw C call's arguments by role, or None where the entry is not one C call."""
        c, s = self.ctx, self.spec
        if s.count is None or not (s.send or s.recv):
            return None
        send = self.send if self.send is not None else self.recv
        recv = self.recv if self.recv is not None else send
        assert send is not None and recv is not None  # the declaration names a send or a receive buffer
        if s.post_on_root_only and c.rank != self.root and c.backend.nonroot_recv_scratch:
            # oneCCL writes the receive buffer on every rank: non-roots give a scratch one.
            self._scratch = recv = torch.empty_like(recv)
        cbuf, how = s.count
        cnt = self.numel[cbuf] // (c.n if how == "numel/size" else 1)
        vals = {"send": c.ptr(send), "recv": c.ptr(recv), "count": cnt, "root": self.root}
        if s.reduces:
            vals["op"] = c.backend.ops[s.param("op").default.value]
        return vals

    def raw_bound(self) -> Optional[Callable[[], int]]:
        vals = self.raw_vals()
        return None if vals is None else self.ctx.bound(self.name, vals)

    def raw(self):
        vals = self.raw_vals()
        return None if vals is None else self.ctx.raw_call(self.name, vals)


# ------------------------------------------------------------- derivations
def blocked(s: _spec.CollectiveSpec) -> set:
    """The buffers the C call treats as ``n`` blocks (one per rank)."""
    out = {buf for buf, rel, _ in s.sizes if rel == "size*"}
    if s.count is not None and s.count[1] == "numel/size":
        out.add(s.count[0])
    out |= {buf for buf, rel, other in s.sizes if rel == "==" and other in out}
    return out


def _numels(s: _spec.CollectiveSpec, count: int, n: int) -> Dict[str, int]:
    """Elements of each buffer for a message of ``count``: the largest buffer
    holds the message, a buffer ``size*`` another makes that one ``count/n``."""
    numel = {p.name: count for p in s.buffers}
    for buf, rel, other in s.sizes:
        if rel == "size*":
            numel[other] = numel[buf] // n
    return numel


def _reference_kw(s: _spec.CollectiveSpec) -> Dict[str, Any]:
    kw: Dict[str, Any] = {}
    for p in s.params:
        if p.kind == _spec.RANK:
            kw[p.name] = p.default
        elif p.kind == _spec.OP:
            kw[p.name] = p.default.value
    return kw


def _input(pattern: Callable[[int, int], Any], s: _spec.CollectiveSpec, pname: str, numel: int, rank: int,
           n: int) -> Any:
    """Rank ``rank``'s input for buffer ``pname``: ``1 + rank + n * block + i % 5``."""
    if pname not in blocked(s):
        return pattern(numel, 1 + rank)
    m = numel // n
    parts = [pattern(m, 1 + rank + n * j) for j in range(n)]
    return torch.cat(parts) if isinstance(parts[0], torch.Tensor) else np.concatenate(parts)


def _np_pattern(dtype: torch.dtype) -> Callable[[int, int], np.ndarray]:
    nd = _np_dtype(dtype)

    def pattern(count: int, offset: int) -> np.ndarray:
        return (offset + np.arange(count) % 5).astype(nd)
    return pattern


def _reference(s: _spec.CollectiveSpec, n: int, states: List[Dict[str, Any]], k: int,
               kw: Dict[str, Any]) -> List[Dict[str, Any]]:
    """Every rank's outputs after ``k`` calls on ``states`` (each rank's
    buffers); in-place buffers carry one call's result into the next."""
    inout = [p.name for p in s.buffers if p.role == "inout"]
    res: List[Dict[str, Any]] = []
    for _ in range(k if inout else 1):
        res = [s.reference(n, r, states, **kw) for r in range(n)]  # type: ignore[misc]
        new = [dict(st, **{p: res[r][p] for p in inout if p in res[r]}) for r, st in enumerate(states)]
        if all(np.array_equal(a[p], b[p]) for a, b in zip(states, new) for p in inout):
            break  # a fixed point: more calls change nothing
        states = new
    return res


@functools.lru_cache(maxsize=None)
def call_cap(name: str, n: int, dtype: torch.dtype, limit: int = 1000) -> Optional[int]:
    """Most calls in a row whose results stay exact in ``dtype`` (None:
    any number, the values stop changing), at most ``limit``: the reference
    run on a buffer of each residue per block. Raises ValueError where even
    one call leaves the exact range."""
    s = _spec.TABLE[name]
    numel = _numels(s, 5 * n, n)
    states = [{p: _input(_np_pattern(torch.float64), s, p, m, r, n) for p, m in numel.items()
               if s.param(p).role != "out"} for r in range(n)]
    lim = exact_limit(dtype)
    kw = _reference_kw(s)
    inout = [p.name for p in s.buffers if p.role == "inout"]
    for k in range(1, limit + 1):
        res = _reference(s, n, states, 1, kw)
        top = max((float(np.max(np.abs(v))) for r in res for v in r.values() if np.size(v)), default=0.0)
        if top > lim:
            if k == 1:
                raise ValueError(f"{name}: {n} ranks overflow {dtype}'s exact range in the check")
            return k - 1
        new = [dict(st, **{p: res[r][p] for p in inout if p in res[r]}) for r, st in enumerate(states)]
        if not inout or all(np.array_equal(a[p], b[p]) for a, b in zip(states, new) for p in inout):
            return None
        states = new
    return limit


class SendRecv(Case):
    """nccl-tests' sendrecv: every rank sends to rank+1 and receives from
    rank-1 at once (one group of the table's send and recv)."""

    name = "sendrecv"

    def setup(self) -> None:
        c = self.ctx
        n, r = c.n, c.rank
        if n < 2:
            raise ValueError("sendrecv: needs at least 2 ranks")
        self.nxt, self.prv = (r + 1) % n, (r - 1) % n
        self.sbuf = c.pattern(self.count, r + 1)
        self.rbuf = c.empty(self.count)

    def fill(self) -> None:
        self.rbuf.zero_()

    def outputs(self):
        return {"tensor": self.rbuf}

    def expected(self, k):
        return {"tensor": self.ctx.pattern(self.count, self.prv + 1)}

    def streamcoll(self):
        # async_op=False: both in one coalescing() block, launched on the
        # current stream; async_op=True: batch_isend_irecv + wait, as torch.
        import streamcoll
        s, r, nxt, prv = self.sbuf, self.rbuf, self.nxt, self.prv
        if self.ctx.async_op:
            P, bi, isend, irecv = streamcoll.P2POp, streamcoll.batch_isend_irecv, streamcoll.isend, streamcoll.irecv

            def run():
                for w in bi([P(isend, s, nxt), P(irecv, r, prv)]):
                    w.wait()
            return run
        comm = streamcoll.default_communicator()

        def run_sync():
            with comm.coalescing():
                comm.send(s, nxt)
                comm.recv(r, prv)
        return run_sync

    def torch(self):
        # torch.distributed has no synchronous grouped send/recv: always
        # batch_isend_irecv + wait.
        import torch.distributed as dist
        s, r, nxt, prv = self.sbuf, self.rbuf, self.nxt, self.prv
        P, bi = dist.P2POp, dist.batch_isend_irecv

        def run():
            for w in bi([P(dist.isend, s, nxt), P(dist.irecv, r, prv)]):
                w.wait()
        return run

    def raw(self):
        c = self.ctx
        gs, ge = c.cfn("group_start"), c.cfn("group_end")
        fs = c.bound("send", {"send": c.ptr(self.sbuf), "count": self.count, "peer": self.nxt})
        fr = c.bound("recv", {"recv": c.ptr(self.rbuf), "count": self.count, "peer": self.prv})
        if None in (fs, fr, gs, ge):
            return None

        def run():
            rc = gs()
            if rc:
                c.raise_rc("group_start", rc)
            rc1 = fs()
            rc2 = fr()
            rc = ge()
            if rc1:
                c.raise_rc("send", rc1)
            if rc2:
                c.raise_rc("recv", rc2)
            if rc:
                c.raise_rc("group_end", rc)
        return run


CASES: Dict[str, Callable[[Context, int], Case]] = {
    **{name: functools.partial(TableCase, s) for name, s in _spec.TABLE.items() if benchmarkable(s)},
    "sendrecv": SendRecv,
}


def make_case(name: str, ctx: Context, nbytes: int) -> Case:
    try:
        make = CASES[name]
    except KeyError:
        raise ValueError(f"collective: unknown {name!r} (choose from {', '.join(CASES)})") from None
    return make(ctx, nbytes)


def batches(iters: int, cap: Optional[int], reps: int) -> tuple:
    """(calls per batch, number of batches) for ``iters`` calls split into
    about ``reps`` batches, no batch longer than ``cap``."""
    bs = max(1, math.ceil(iters / max(reps, 1)))
    if cap is not None:
        bs = max(1, min(bs, cap))
    return bs, max(1, math.ceil(iters / bs))
