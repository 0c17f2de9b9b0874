"""GradientSync: DDP's communication/computation overlap for custom loops.

Why: ``DistributedDataParallel`` overlaps gradient all-reduces with the rest
of backward, but it owns the module and its forward. A custom loop that only
wants the overlap registers this on its parameters instead::

    sync = streamcoll.GradientSync(model.parameters(), bucket_mb=25)
    for x, y in data:
        loss_fn(model(x), y).backward()   # buckets launch while backward runs
        sync.finish()                     # wait, copy averaged grads into .grad
        opt.step(); opt.zero_grad()

How, in DDP's way: a post-accumulate-grad hook copies each final gradient
into a flat bucket (one dtype and device, up to ``bucket_mb``); a full bucket
is all-reduced with ``async_op=True`` at once, buckets strictly in index
order; ``finish()`` launches the rest, waits and copies the results into
``.grad``. A synchronised step reduces every trainable parameter's standing
``.grad`` (DDP's rule with ``find_unused_parameters=True``); a parameter no
rank used keeps its ``.grad`` untouched.

Gradient accumulation: backward passes inside ``with sync.no_sync():`` only
accumulate into ``.grad``; the next backward outside it reduces the sum.
Call ``finish()`` exactly once per synchronised step, on every rank.
The bucket order, which gradients a step reduces and why: docs/design.md,
section 'GradientSync'.
"""
from __future__ import annotations

import contextlib
import time
from typing import Any, Dict, Iterable, Iterator, List, Optional, Union

import torch

from ..startup import bootstrap
from ..core.communicator import Communicator
from .._ffi.errors import UsageError
from ..core.ops import ReduceOp, canonical_op

__all__ = ["GradientSync"]


class _Bucket:
    """One flat buffer: the gradients of ``params`` then one used-flag each."""

    __slots__ = ("index", "params", "views", "flags", "flat", "pending", "work", "nbytes")

    def __init__(self, index: int, params: List[int], plist: List[torch.nn.Parameter]) -> None:
        self.index = index
        self.params = params
        first = plist[params[0]]
        numels = [plist[i].numel() for i in params]
        total = sum(numels)
        self.flat = torch.zeros(total + len(params), dtype=first.dtype, device=first.device)
        self.views: List[torch.Tensor] = []
        off = 0
        for i, n in zip(params, numels):
            self.views.append(self.flat[off:off + n].view(plist[i].shape))
            off += n
        self.flags = self.flat[total:]
        self.nbytes = self.flat.numel() * self.flat.element_size()
        self.pending = len(params)
        self.work: Any = None


class GradientSync:
    """All-reduce gradients in buckets while backward runs (see the module doc).

    ``params``: parameters (or a Module); those with ``requires_grad=False``
    are skipped. ``bucket_mb``: bucket capacity in MiB (a parameter larger
    than that gets a bucket of its own). ``op``: SUM, AVG (default, like DDP)
    or a ``premul_sum`` with a positive factor. ``group``: the Communicator
    (default: streamcoll's default one). ``record_timeline``: keep
    ``perf_counter`` times of gradient readiness, bucket launches and bucket
    completions since the last ``clear_timeline()`` (``timeline()``), for
    profiling the overlap. ``sync_initial_state`` (default True): broadcast
    rank 0's values of every given parameter (frozen ones too) and, for a
    Module, its buffers, at construction, as DDP does; pass False where the
    replicas are already equal (loaded from one checkpoint) to skip the
    broadcast. Construction is then collective: every rank constructs it.
    Raises ValueError when no parameter requires a gradient.
    """

    def __init__(
        self,
        params: Union[Iterable[torch.nn.Parameter], torch.nn.Module],
        bucket_mb: float = 25.0,
        op: Any = ReduceOp.AVG,
        group: Optional[Communicator] = None,
        record_timeline: bool = False,
        sync_initial_state: bool = True,
    ) -> None:
        buffers: List[torch.Tensor] = []
        if isinstance(params, torch.nn.Module):
            buffers = list(params.buffers())
            params = params.parameters()
        if isinstance(params, torch.Tensor):
            raise TypeError("params: expected an iterable of parameters (or a Module), got a single tensor")
        if not isinstance(sync_initial_state, bool):
            raise TypeError(f"sync_initial_state: expected a bool, got {sync_initial_state!r}")
        plist: List[torch.nn.Parameter] = []
        state: List[torch.Tensor] = []  # every tensor given (frozen ones too), then the buffers
        seen = set()
        for i, p in enumerate(params):
            if not isinstance(p, torch.Tensor):
                raise TypeError(f"params[{i}]: expected a torch.Tensor (nn.Parameter), got {type(p).__name__}")
            if id(p) not in seen:
                state.append(p)
            if not p.requires_grad or id(p) in seen:
                seen.add(id(p))
                continue
            if not p.is_leaf:
                raise ValueError(f"params[{i}]: expected a leaf tensor (a parameter); gradients of non-leaf tensors are not accumulated")
            if not p.dtype.is_floating_point:
                raise TypeError(f"params[{i}]: expected a floating-point parameter, got {p.dtype}")
            seen.add(id(p))
            plist.append(p)
        if not plist:
            raise ValueError("params: no trainable parameters (every one has requires_grad=False, or none was "
                             "given); GradientSync would synchronise nothing")
        if isinstance(bucket_mb, bool) or not isinstance(bucket_mb, (int, float)) or bucket_mb <= 0:
            raise ValueError(f"bucket_mb: expected a positive number of MiB, got {bucket_mb!r}")
        name, factor = canonical_op(op)
        if name not in ("SUM", "AVG", "PREMUL_SUM") or factor <= 0:
            raise ValueError(f"op: expected SUM, AVG or premul_sum(factor > 0) for gradients, got {op!r}")
        if group is not None and not isinstance(group, Communicator):
            raise TypeError(f"group: expected a streamcoll.Communicator or None, got {type(group).__name__}")
        self._comm = group if group is not None else bootstrap.default_communicator()
        self._op = op
        self._cap = int(bucket_mb * 1024 * 1024)
        self._params = plist
        self._index: Dict[int, int] = {id(p): i for i, p in enumerate(plist)}
        self._ready = [False] * len(plist)
        self._used = [False] * len(plist)  # a gradient produced since the last finish (no_sync included)
        self._no_sync = False
        self._record = bool(record_timeline)
        self._order: Optional[List[int]] = []  # ready order of the first step (None once rebuilt)
        self._buckets: List[_Bucket] = []
        self._where: List[tuple] = [(0, 0)] * len(plist)  # param -> (bucket, slot)
        self._next = 0
        self._launched_any = False
        self._ready_times: List[tuple] = []
        self._launch_times: List[float] = []
        self._done_times: Dict[int, float] = {}
        self.steps = 0
        self.buffer_allocations = 0
        self._build(list(range(len(plist)))[::-1])
        if sync_initial_state:
            self._broadcast_state(state + [b for b in buffers if id(b) not in seen])
        self._handles = [p.register_post_accumulate_grad_hook(self._hook) for p in plist]

    def _broadcast_state(self, tensors: List[torch.Tensor]) -> None:
        """Rank 0's values for ``tensors`` on every rank, as DDP's
        construction does (``_sync_module_states``): replicas initialised
        with different seeds would otherwise train apart silently, their
        averaged gradients applied to different weights. Flat buffers per
        dtype and device, up to ``bucket_mb`` each; a collective every rank
        must reach (constructing GradientSync is collective)."""
        groups: Dict[tuple, List[List[torch.Tensor]]] = {}
        for t in tensors:
            if t.numel() == 0:
                continue
            g = groups.setdefault((t.dtype, t.device), [[]])
            if g[-1] and sum(x.numel() * x.element_size() for x in g[-1]) + t.numel() * t.element_size() > self._cap:
                g.append([])
            g[-1].append(t)
        with torch.no_grad():
            for chunks in groups.values():
                for chunk in chunks:
                    flat = torch.cat([t.detach().reshape(-1) for t in chunk])
                    self._comm.broadcast(flat, 0)
                    off = 0
                    for t in chunk:
                        n = t.numel()
                        t.copy_(flat[off:off + n].view_as(t))
                        off += n

    # ------------------------------------------------------------ layout
    def _build(self, order: List[int]) -> None:
        """Buckets from ``order`` (param indices, first ready first): one open
        bucket per (dtype, device); a bucket closes when adding the next
        parameter would pass the cap; buckets are ordered by their first
        parameter's position in ``order``."""
        plist = self._params
        open_: Dict[tuple, List[int]] = {}
        sizes: Dict[tuple, int] = {}
        closed: List[List[int]] = []
        for i in order:
            p = plist[i]
            key = (p.dtype, p.device)
            nb = p.numel() * p.element_size()
            cur = open_.get(key)
            if cur is not None and sizes[key] + nb > self._cap:
                closed.append(cur)
                cur = None
            if cur is None:
                cur = open_[key] = []
                sizes[key] = 0
            cur.append(i)
            sizes[key] += nb
        closed.extend(open_.values())
        pos = {i: k for k, i in enumerate(order)}
        closed.sort(key=lambda b: pos[b[0]])
        self._buckets = [_Bucket(k, idx, plist) for k, idx in enumerate(closed)]
        self.buffer_allocations += len(self._buckets)
        for b in self._buckets:
            for slot, i in enumerate(b.params):
                self._where[i] = (b.index, slot)

    @property
    def bucket_params(self) -> List[List[torch.nn.Parameter]]:
        """The parameters of each bucket, in launch order."""
        return [[self._params[i] for i in b.params] for b in self._buckets]

    # ------------------------------------------------------------ hooks
    def _hook(self, p: torch.Tensor) -> None:
        i = self._index[id(p)]
        if self._no_sync:
            self._used[i] = True  # used in this synchronised step's accumulation (DDP counts it)
            return
        if self._ready[i]:
            raise UsageError(
                f"GradientSync: the gradient of parameter {i} (shape {tuple(p.shape)}) became ready twice "
                "before finish(); call finish() after every synchronised backward, and wrap "
                "accumulation-only backward passes in no_sync()"
            )
        g = p.grad
        if g is None or g.is_sparse:
            raise UsageError(f"GradientSync: parameter {i} has {'a sparse' if g is not None else 'no'} gradient; "
                               "dense gradients only")
        self._ready[i] = True
        self._used[i] = True
        if self._order is not None:
            self._order.append(i)
        if self._record:
            self._ready_times.append((i, time.perf_counter()))
        k, slot = self._where[i]
        b = self._buckets[k]
        b.views[slot].copy_(g)
        b.flags[slot] = 1
        b.pending -= 1
        if b.pending == 0 and k == self._next:
            self._launch_ready()

    def _launch_ready(self) -> None:
        buckets = self._buckets
        while self._next < len(buckets) and buckets[self._next].pending == 0:
            self._launch(buckets[self._next])
            self._next += 1

    def _launch(self, b: _Bucket) -> None:
        b.work = self._comm.all_reduce(b.flat, self._op, async_op=True)
        if self._record:
            self._launch_times.append(time.perf_counter())
            k = b.index
            b.work.get_future().add_done_callback(lambda _f, k=k: self._done_times.__setitem__(k, time.perf_counter()))

    # ------------------------------------------------------------ API
    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes in this block only accumulate into ``.grad``."""
        old = self._no_sync
        self._no_sync = True
        try:
            yield
        finally:
            self._no_sync = old

    def finish(self) -> None:
        """Launch the buckets still open, filling in the parameters whose
        hook did not fire in this backward with their standing ``.grad``
        (zeros where None) and their used flag (a gradient since the last
        finish, ``no_sync`` included), wait for all of them and write the
        reduced gradients into ``.grad`` of every parameter some rank used.
        Call it before ``optimizer.step()``."""
        if self._no_sync:
            raise UsageError("GradientSync.finish(): called inside no_sync(); call it after the synchronised backward")
        plist = self._params
        for b in self._buckets[self._next:]:
            if b.pending:
                for slot, i in enumerate(b.params):
                    if not self._ready[i]:
                        g = plist[i].grad
                        if g is None:
                            b.views[slot].zero_()
                        else:
                            b.views[slot].copy_(g)
                        if self._used[i]:
                            b.flags[slot] = 1
                b.pending = 0
        self._launch_ready()
        for b in self._buckets:
            b.work.wait()
            b.work = None
        for b in self._buckets:
            used = b.flags.tolist()
            for slot, i in enumerate(b.params):
                if not self._ready[i] and not used[slot] > 0:
                    continue  # no rank used it: leave .grad alone, as DDP does
                p = plist[i]
                if p.grad is None:
                    p.grad = b.views[slot].clone()
                else:
                    p.grad.copy_(b.views[slot])
        self._reset()
        self.steps += 1
        if self._order is not None:
            self._rebuild()

    def _reset(self) -> None:
        for b in self._buckets:
            b.flags.zero_()
            b.pending = len(b.params)
        self._ready = [False] * len(self._params)
        self._used = [False] * len(self._params)
        self._next = 0

    def _rebuild(self) -> None:
        """Once, after the first step: buckets in the ready order rank 0 saw."""
        order, self._order = self._order, None
        if order is None:  # rebuilt once, after the first step recorded the order
            raise RuntimeError("GradientSync: no ready order was recorded before the rebuild")
        seen = set(order)
        order = order + [i for i in range(len(self._params))[::-1] if i not in seen]
        t = torch.tensor(order, dtype=torch.int64, device=self._comm.device)
        self._comm.broadcast(t, 0)
        order = t.tolist()
        current = [i for b in self._buckets for i in b.params]
        if order != current:
            self._build(order)

    def timeline(self) -> Dict[str, Any]:
        """``perf_counter`` times since the last :meth:`clear_timeline`
        (``record_timeline=True``): ``ready`` [(param index, t)], ``launch``
        [t per bucket launch], ``done`` {bucket index: t}."""
        return {"ready": list(self._ready_times), "launch": list(self._launch_times),
                "done": dict(self._done_times)}

    def clear_timeline(self) -> None:
        """Forget the recorded times (``record_timeline=True``)."""
        self._ready_times.clear()
        self._launch_times.clear()
        self._done_times.clear()

    def remove(self) -> None:
        """Unregister the hooks (idempotent)."""
        for h in self._handles:
            h.remove()
        self._handles = []

    def __repr__(self) -> str:
        sizes = [b.nbytes for b in self._buckets]
        return (f"<streamcoll.GradientSync params={len(self._params)} buckets={len(sizes)} "
                f"bytes={sizes} op={self._op!r}>")
