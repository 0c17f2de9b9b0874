"""Point-to-point ops with torch's semantics: :class:`P2POp`, and the
posted ops of a :class:`~streamcoll.Communicator` (:class:`PostedOps`, one
of its bases: its methods are the Communicator's own, found on the class,
so having them here adds no Python frame to any call path).

``isend``/``irecv``/``batch_isend_irecv`` are *posted* (planned and
validated, nothing issued), and a communicator's posted ops go out as one
group launch (GroupStart/GroupEnd) on its comm stream (CPU: comm thread),
through :meth:`~streamcoll.core.async_launch.AsyncLaunch._launch_async`:
oneCCL's CPU calls block until the peers took part, so a launched op
occupies its communicator, and posting lets sends and receives progress
together, as torch's do, with no thread per op. They go out:

- before anything in the process blocks on other ranks
  (:func:`streamcoll.core.work.launch_posted`): a synchronous call, creating
  a communicator, a wait, destroy;
- before another operation on the same communicator, and when a coalescing
  block opens;
- by a status query only when they include a send, never a lone receive.

A group of them is one plan (:meth:`PostedOps._group_plan`), as is a
coalescing block (:meth:`PostedOps.coalescing`). The rule in full, why, and
what still differs from torch (launch order, eager sizes, tags):
docs/design.md, section 'Point-to-point: when posted ops go out'.
"""
from __future__ import annotations

import contextlib
import threading
from typing import TYPE_CHECKING, Any, Callable, Iterator, List, Optional, Sequence

import torch

from . import recorder as _recorder
from . import spec as _spec
from .async_launch import AsyncLaunch
from .._ffi.errors import UsageError
from .spec import Plan
from .work import PostedWork, Work

if TYPE_CHECKING:  # pragma: no cover
    from .plans import PlanContext

__all__ = ["P2POp", "PostedOps"]


# Point-to-point ops that are posted rather than launched (always
# asynchronous: isend, irecv, batch_isend_irecv) and the synchronous ones
# (send, recv), which join the posted ones' group; from the table.
_POSTED = frozenset(n for n, s in _spec.TABLE.items() if s.p2p and s.async_mode == "always")
_P2P_SYNC = frozenset(n for n, s in _spec.TABLE.items() if s.p2p and s.async_mode == "never")
# Point-to-point ops that only receive (irecv, recv): posted alone, a status query leaves them posted.
_RECEIVES = frozenset(n for n, s in _spec.TABLE.items() if s.p2p and s.send is None and s.recv is not None)


class P2POp:
    """A point-to-point operation for :meth:`Communicator.batch_isend_irecv`
    (the fields of torch.distributed.P2POp: ``op`` is ``isend``/``irecv``
    (streamcoll's or torch's), ``tensor``, ``peer``, ``group``, ``tag``)."""

    __slots__ = ("op", "tensor", "peer", "group", "tag")

    def __init__(self, op: Callable, tensor: torch.Tensor, peer: int, group: Any = None, tag: int = 0) -> None:
        self.op = op
        self.tensor = tensor
        self.peer = peer
        self.group = group
        self.tag = tag


class PostedOps(AsyncLaunch):
    """Posting point-to-point ops and launching them as one group, and the
    other group launch, coalescing blocks (a base of
    :class:`~streamcoll.Communicator`)."""

    if TYPE_CHECKING:  # what these methods use of the Communicator (set by its __init__)
        _cx: PlanContext
        _posted: List[tuple]
        _posted_key: Any
        _posted_stream: Any
        _post_lock: threading.Lock
        _coalescing: Optional[list]
        _coalescing_thread: Optional[int]
        timeout: float

        def _posting_changed(self) -> None: ...
        def _refresh_fast_paths(self) -> None: ...
        def _launch(self, name: str, plan: Plan, async_op: Any, stream: Any,
                    limit: Optional[float] = None) -> Optional[Work]: ...

    def _post(self, name: str, plan: Plan, limit: Optional[float] = None) -> PostedWork:
        """Post a p2p op: kept (validated, planned, nothing issued) until
        :meth:`_flush_posted` launches every posted op as one group. Ops
        posted under another current stream (GPU) first launch the ones
        posted before, so each group's comm stream waits on the stream its
        ops were posted under. ``limit``: the op's own timeout (its Work's
        wait; the group's limit is the strictest of its ops')."""
        rt = self._rt
        key = rt.current_key()
        if self._posted and key != self._posted_key:
            self._flush_posted()
        w = PostedWork(self, name, plan.outputs)
        w._limit = limit
        with self._post_lock:
            first = not self._posted
            self._posted.append((plan, w))
            if first or self._posted_stream is None:
                # the stream the ops are posted under, kept now: a lane made at
                # flush time (maybe from another stream) must wait on this one
                self._posted_stream = rt.current_stream()
            self._posted_key = key
        if first:
            self._posting_changed()
        return w

    def _posted_sends(self) -> bool:
        """Whether the posted ops include more than receives (what a status query may launch)."""
        return any(w.op not in _RECEIVES for _, w in self._posted)


    def _flush_posted(self) -> None:
        """Launch the posted p2p ops, all in one group (one Work, one
        sequence number; a lone op as itself). Called before anything in the
        process blocks on other ranks (:func:`streamcoll.core.work.launch_posted`:
        a wait, a synchronous call, destroy), before another operation is
        issued on this communicator, when a coalescing block opens. A launch
        error is delivered to the posted ops' Works, not raised here (the
        caller may be an unrelated collective)."""
        with self._post_lock:
            posted, self._posted = self._posted, []
            key, current, self._posted_stream = self._posted_key, self._posted_stream, None
        if not posted:
            return
        self._posting_changed()
        limit = self._strictest([w._limit for _, w in posted])
        try:
            if len(posted) == 1:
                plan, w = posted[0]
                work = self._launch_async(w.op, plan, key, current, limit=limit)
            else:
                work = self._launch_async(_recorder.P2P_GROUP, self._group_plan([p for p, _ in posted]), key, current,
                                          limit=limit)
        except BaseException as e:  # noqa: BLE001 - handed to the Works, raised by their wait()
            for _, w in posted:
                w._exc = e
            return
        for _, w in posted:
            w._group = work
            w.seq = work.seq

    def _strictest(self, limits: Sequence[Optional[float]]) -> Optional[float]:
        """The limit of a group launch whose ops were given ``limits`` (their
        own timeouts, None: the communicator's): the shortest of them, the
        communicator's counted for ops given none; None where no op was
        given one (the communicator's applies)."""
        own = [x for x in limits if x is not None]
        if not own:
            return None
        return min(own + ([self.timeout] if len(own) < len(limits) else []))

    def _group_plan(self, plans: Sequence[Plan], cname: str = "group_end") -> Plan:
        """One plan launching ``plans`` between GroupStart and GroupEnd, their
        post-ops after it (coalescing blocks, posted p2p ops)."""
        posts = [p.post for p in plans if p.post is not None]
        calls = [(p.fn, p.args, p.cname) for p in plans]
        fn, args = self._cx.group(calls)
        return Plan(fn, args, (lambda: [p() for p in posts]) if posts else None,
                    tuple(t for p in plans for t in p.keep), tuple(t for p in plans for t in p.outputs),
                    cname, any(p.p2p for p in plans))

    @contextlib.contextmanager
    def coalescing(self, async_op: bool = False) -> Iterator["_Coalesced"]:
        """Batch the collectives issued in the block into one group launch
        (GroupStart/GroupEnd) with one Work and one sequence number. Yields a
        handle whose ``work`` is the Work (``async_op=True``) once the block
        exits, and whose ``wait()`` waits for it."""
        if self._coalescing is not None:
            raise UsageError("coalescing() blocks do not nest")
        if self._posted:
            self._flush_posted()  # ops posted before the block go first, as issued
        handle = _Coalesced()
        ops: List[tuple] = []
        self._coalescing = ops
        self._coalescing_thread = threading.get_ident()
        self._refresh_fast_paths()
        try:
            yield handle
        finally:
            self._coalescing = None
            self._coalescing_thread = None
            self._refresh_fast_paths()
        if ops:
            plan = self._group_plan([p for _, p, _ in ops])
            # a block holding p2p ops is point to point for the flight analysis (it advances the p2p count)
            handle.work = self._launch(_recorder.COALESCED_P2P if plan.p2p else "coalesced", plan, async_op, None,
                                       self._strictest([lim for _, _, lim in ops]))


class _Coalesced:
    """What ``Communicator.coalescing()`` yields: ``work`` after the block."""

    __slots__ = ("work",)

    def __init__(self) -> None:
        self.work: Optional[Work] = None

    def wait(self, timeout: Optional[float] = None) -> bool:
        return True if self.work is None else self.work.wait(timeout)
