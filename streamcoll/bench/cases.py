"""One benchmark case per collective: buffers, the three ways to run it
(streamcoll, the raw C call through streamcoll's binding, torch.distributed)
and the closed-form result that checks what was timed.

Inputs are small integers (``base + i % 5``), so every sum is exact in every
dtype and the expected outputs have closed forms. Every timed batch starts
from freshly filled buffers; the outputs of the last timed batch of each
library are checked element by element (the timed calls themselves, not a
separate verification call). all_reduce is in place, so after ``k`` calls the
buffer holds ``S * n**(k-1)``; batches are capped so that stays exact
(:attr:`Case.cap`).

Message size follows nccl-tests (doc/PERFORMANCE.md): all_gather and
reduce_scatter count the full array (``n`` blocks), all_to_all one rank's
whole send buffer; counts are rounded down to a multiple of ``n`` (at least
``n``) where the collective splits the buffer into ``n`` blocks.
"""
from __future__ import annotations

import functools

import math
from typing import Any, Callable, Dict, Optional, Tuple

import torch

__all__ = ["Context", "CASES", "make_case", "exact_limit"]

# Largest integer each dtype holds exactly (and every smaller one).
_EXACT = {
    torch.float32: 2 ** 24, torch.float64: 2 ** 53, torch.float16: 2 ** 11, torch.bfloat16: 2 ** 8,
    torch.int8: 127, torch.uint8: 255, torch.int32: 2 ** 31 - 1, torch.int64: 2 ** 62,
}


def exact_limit(dtype: torch.dtype) -> int:
    try:
        return _EXACT[dtype]
    except KeyError:
        raise ValueError(f"dtype: {dtype} is not benchmarked (choose from "
                         f"{', '.join(str(d).replace('torch.', '') for d in _EXACT)})") from None


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
        self.csum = b.ops["SUM"]
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

    def raw_call(self, coll: str, *args) -> Optional[Callable[[], None]]:
        """The C function of ``coll`` bound to ``args`` (a C-level partial,
        so the raw baseline pays no Python argument handling), checked; None
        where the library lacks it."""
        f = self.cfn(coll)
        if f is None:
            return None
        call = functools.partial(f, *args)

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


def _wait(w) -> None:
    if w is not None:
        w.wait()


class Case:
    """One (collective, size) row. Subclasses set up ``self.inputs`` templates
    and implement the three runners plus ``expected``."""

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

    def output(self) -> torch.Tensor:
        raise NotImplementedError

    def expected(self, k: int) -> torch.Tensor:
        raise NotImplementedError

    def streamcoll(self) -> Callable[[], None]:
        raise NotImplementedError

    def torch(self) -> Callable[[], None]:
        raise NotImplementedError

    def raw(self) -> Optional[Callable[[], None]]:
        return None

    # -- shared ---------------------------------------------------------------
    def compare(self, k: int) -> Tuple[int, Optional[str]]:
        """(wrong elements, None or a description) of the output after ``k``
        calls; the count is nccl-tests' ``#wrong``."""
        out = self.output()
        exp = self.expected(k)
        if torch.equal(out, exp):
            return 0, None
        bad = (out != exp).nonzero()
        i = int(bad[0]) if bad.numel() else -1
        return bad.numel(), (f"{self.name} {self.nbytes} B rank {self.ctx.rank}: {bad.numel()} of {out.numel()} "
                             f"elements wrong; first at [{i}]: got {out.view(-1)[i].item()}, "
                             f"expected {exp.view(-1)[i].item()}")

    def check(self, k: int) -> Optional[str]:
        """None if the output after ``k`` calls is right, else a description."""
        return self.compare(k)[1]

    def corrupt(self) -> None:
        """Testing aid (--inject-error): make the last result wrong."""
        o = self.output()
        o.view(-1)[0] = o.view(-1)[0] + 1


class AllReduce(Case):
    name = "all_reduce"

    def setup(self) -> None:
        c = self.ctx
        n = c.n
        self.buf = c.empty(self.count)
        self.template = c.pattern(self.count, c.rank + 1)
        smax = n * (n + 1) // 2 + 4 * n
        lim = exact_limit(c.dtype)
        if smax > lim:
            raise ValueError(f"all_reduce: {n} ranks overflow {c.dtype}'s exact range in the check")
        k = 1
        while smax * n ** k <= lim and k < 10 ** 6:
            k += 1
        self.cap = k

    def fill(self) -> None:
        self.buf.copy_(self.template)

    def output(self) -> torch.Tensor:
        return self.buf

    def expected(self, k: int) -> torch.Tensor:
        n = self.ctx.n
        mult = n ** (k - 1)
        # S_i * n**(k-1), S_i = sum over ranks of (r + 1 + i % 5).
        return self.ctx.pattern(self.count, n * (n + 1) // 2 * mult, n * mult)

    def streamcoll(self):
        import streamcoll
        buf = self.buf
        ar = streamcoll.all_reduce
        return self.timed(ar, buf)

    def torch(self):
        import torch.distributed as dist
        buf = self.buf
        ar = dist.all_reduce
        return self.timed(ar, buf)

    def raw(self):
        c = self.ctx
        p, cnt, dt, op, h, s = c.ptr(self.buf), self.count, c.cdt, c.csum, c.handle, c.stream
        return c.raw_call("all_reduce", p, p, cnt, dt, op, h, s)


class AllGather(Case):
    name = "all_gather_into_tensor"
    split = True

    def setup(self) -> None:
        c = self.ctx
        self.chunk = self.count // c.n
        self.inp = c.pattern(self.chunk, c.rank + 1)
        self.out = c.empty(self.count)

    def fill(self) -> None:
        self.out.zero_()

    def output(self):
        return self.out

    def expected(self, k):
        c = self.ctx
        return torch.cat([c.pattern(self.chunk, j + 1) for j in range(c.n)])

    def streamcoll(self):
        import streamcoll
        o, i = self.out, self.inp
        f = streamcoll.all_gather_into_tensor
        return self.timed(f, o, i)

    def torch(self):
        import torch.distributed as dist
        o, i = self.out, self.inp
        f = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)  # the 2.13 name
        return self.timed(f, o, i)

    def raw(self):
        c = self.ctx
        ip, op_, cnt, dt, h, s = c.ptr(self.inp), c.ptr(self.out), self.chunk, c.cdt, c.handle, c.stream
        return c.raw_call("all_gather_into_tensor", ip, op_, cnt, dt, h, s)


class ReduceScatter(Case):
    name = "reduce_scatter_tensor"
    split = True

    def setup(self) -> None:
        c = self.ctx
        self.chunk = self.count // c.n
        self.inp = c.pattern(self.count, c.rank + 1)
        self.out = c.empty(self.chunk)

    def fill(self) -> None:
        self.out.zero_()

    def output(self):
        return self.out

    def expected(self, k):
        c = self.ctx
        n, r, m = c.n, c.rank, self.chunk
        full = c.pattern(self.count, n * (n + 1) // 2, n)
        return full[r * m:(r + 1) * m]

    def streamcoll(self):
        import streamcoll
        o, i = self.out, self.inp
        f = streamcoll.reduce_scatter_tensor
        return self.timed(f, o, i)

    def torch(self):
        import torch.distributed as dist
        o, i = self.out, self.inp
        f = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)  # the 2.13 name
        return self.timed(f, o, i)

    def raw(self):
        c = self.ctx
        ip, op_, cnt, dt, red, h, s = c.ptr(self.inp), c.ptr(self.out), self.chunk, c.cdt, c.csum, c.handle, c.stream
        return c.raw_call("reduce_scatter_tensor", ip, op_, cnt, dt, red, h, s)


class Broadcast(Case):
    name = "broadcast"
    root = 0

    def setup(self) -> None:
        c = self.ctx
        self.buf = c.empty(self.count)
        self.template = c.pattern(self.count, 1) if c.rank == self.root else None

    def fill(self) -> None:
        if self.template is not None:
            self.buf.copy_(self.template)
        else:
            self.buf.zero_()

    def output(self):
        return self.buf

    def expected(self, k):
        return self.ctx.pattern(self.count, 1)

    def streamcoll(self):
        import streamcoll
        b, r = self.buf, self.root
        f = streamcoll.broadcast
        return self.timed(f, b, r)

    def torch(self):
        import torch.distributed as dist
        b, r = self.buf, self.root
        f = dist.broadcast
        return self.timed(f, b, r)

    def raw(self):
        c = self.ctx
        p, cnt, dt, root, h, s = c.ptr(self.buf), self.count, c.cdt, self.root, c.handle, c.stream
        return c.raw_call("broadcast", p, p, cnt, dt, root, h, s)


class AllToAll(Case):
    name = "all_to_all_single"
    split = True

    def setup(self) -> None:
        c = self.ctx
        n, r = c.n, c.rank
        self.chunk = self.count // n
        # block j goes to rank j: 1 + r + n*j + i % 5 identifies (sender, receiver).
        self.inp = torch.cat([c.pattern(self.chunk, 1 + r + n * j) for j in range(n)])
        self.out = c.empty(self.count)

    def fill(self) -> None:
        self.out.zero_()

    def output(self):
        return self.out

    def expected(self, k):
        c = self.ctx
        n, r = c.n, c.rank
        return torch.cat([c.pattern(self.chunk, 1 + s + n * r) for s in range(n)])

    def streamcoll(self):
        import streamcoll
        o, i = self.out, self.inp
        f = streamcoll.all_to_all_single
        return self.timed(f, o, i)

    def torch(self):
        import torch.distributed as dist
        o, i = self.out, self.inp
        f = dist.all_to_all_single
        return self.timed(f, o, i)

    def raw(self):
        c = self.ctx
        ip, op_, cnt, dt, h, s = c.ptr(self.inp), c.ptr(self.out), self.chunk, c.cdt, c.handle, c.stream
        return c.raw_call("all_to_all_single", ip, op_, cnt, dt, h, s)


class SendRecv(Case):
    """nccl-tests' sendrecv: every rank sends to rank+1 and receives from
    rank-1 at once (one group)."""

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

    def output(self):
        return self.rbuf

    def expected(self, k):
        return self.ctx.pattern(self.count, self.prv + 1)

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
        fs, fr, gs, ge = c.cfn("send"), c.cfn("recv"), c.cfn("group_start"), c.cfn("group_end")
        if None in (fs, fr, gs, ge):
            return None
        sp, rp, cnt, dt, h, st = c.ptr(self.sbuf), c.ptr(self.rbuf), self.count, c.cdt, c.handle, c.stream
        nxt, prv = self.nxt, self.prv

        def run():
            rc = gs()
            if rc:
                c.raise_rc("group_start", rc)
            rc1 = fs(sp, cnt, dt, nxt, h, st)
            rc2 = fr(rp, cnt, dt, prv, h, st)
            rc = ge()
            if rc1:
                c.raise_rc("send", rc1)
            if rc2:
                c.raise_rc("recv", rc2)
            if rc:
                c.raise_rc("group_end", rc)
        return run


CASES: Dict[str, Any] = {cls.name: cls for cls in (AllReduce, AllGather, ReduceScatter, Broadcast, AllToAll, SendRecv)}


def make_case(name: str, ctx: Context, nbytes: int) -> Case:
    try:
        cls = CASES[name]
    except KeyError:
        raise ValueError(f"collective: unknown {name!r} (choose from {', '.join(CASES)})") from None
    return cls(ctx, nbytes)


def batches(iters: int, cap: Optional[int], reps: int) -> tuple:
    """(calls per batch, number of batches) for ``iters`` calls split into
    about ``reps`` batches, no batch longer than ``cap``."""
    bs = max(1, math.ceil(iters / max(reps, 1)))
    if cap is not None:
        bs = max(1, min(bs, cap))
    return bs, max(1, math.ceil(iters / bs))


__all__ += ["batches", "Case"]
