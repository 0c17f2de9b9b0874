"""streamcoll's collectives as ``torch.library`` custom ops, for ``torch.compile``.

Why a second entry point: Dynamo cannot trace into cffi calls, so without
these a collective inside a compiled function is a graph break. Each op here
is a thin shell whose implementation calls the very Communicator method eager
code calls (one code path for the launch); its fake implementation describes
the result's shape and dtype, so tracing needs no communication.

The module-level functions (``streamcoll.all_reduce`` and friends) switch to
these ops only while compiling (``torch.compiler.is_compiling()``); eager
calls never pass through the dispatcher, which would add several
microseconds to every collective.

What reaches the graph are integers and strings, never Python objects:

- a communicator by its id in a registry (:func:`comm_id`; id 0 is "the
  default communicator at run time"),
- a reduction as ``(op name, factor)``,
- a stream by its index in a lookup table (:func:`stream_index`), and an
  asynchronous collective's handle by an event slot (:func:`new_event_slot`):
  the async op stores its :class:`~streamcoll.Work` in the slot, the join op
  takes it out and waits on it.

``async_op=True`` is modelled as explicit ops, in the spirit of PyTorch's
user-stream fork/join ops: ``fork_`` (current stream -> comm stream), the
collective with an event slot, and ``join_`` (comm stream -> current stream;
what ``wait()`` becomes). fork and join are pass-through ops that declare a
mutation of every tensor the collective touches, so functionalization threads
those tensors through them and no pre/post-grad pass can move a read or write
of them across the boundary (nor free or reuse their memory while the
collective may still use it). At run time fork checks its table entries (the
Communicator's async launch makes the comm stream wait for the current one)
and join waits on the Work; where functionalization handed join a copy of a
buffer, join copies the finished result into it after the wait.

Limits: launch and ``wait()`` of one async collective belong in the same
compiled region (a traced Work that escapes the region can still be waited on
eagerly); one compiled function must not run concurrently in two threads (its
event slots are shared); ``stream=`` is not supported inside a compiled
region.
"""
from __future__ import annotations

import threading
import weakref
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from . import bootstrap
from .communicator import Communicator
from .ops import PreMulSum, ReduceOp, canonical_op

__all__ = [
    "comm_id", "lookup_comm", "stream_index", "lookup_stream", "new_event_slot",
    "TracedWork", "all_reduce", "broadcast", "reduce", "all_gather_into_tensor",
    "reduce_scatter_tensor", "all_to_all_single", "barrier",
    "functional_all_reduce", "functional_broadcast", "functional_reduce",
    "functional_all_gather_into_tensor", "functional_reduce_scatter_tensor",
    "functional_all_to_all_single",
]

_NS = "streamcoll"
_Tensor = torch.Tensor
_LOCK = threading.Lock()



def assume_constant_result(fn):
    """What ``torch.compiler.assume_constant_result`` does (mark the function
    so Dynamo calls it at trace time and bakes the result into the graph),
    without importing Dynamo when streamcoll is imported (~1 s here).
    tests/test_compile.py checks the marker still matches torch's."""
    fn._dynamo_marked_constant = True
    return fn


# ---------------------------------------------------------------- registries
DEFAULT_COMM = 0  # id resolved to bootstrap's default communicator at run time

_COMMS: Dict[int, "weakref.ref[Communicator]"] = {}
_COMM_IDS: "weakref.WeakKeyDictionary[Communicator, int]" = weakref.WeakKeyDictionary()


@assume_constant_result
def comm_id(group: Optional[Communicator]) -> int:
    """The registry id of ``group`` (0 for None: the default communicator,
    looked up when the op runs). Under Dynamo this runs at trace time and the
    id is baked into the graph (guarded on the group object's identity)."""
    if group is None:
        return DEFAULT_COMM
    if not isinstance(group, Communicator):
        raise TypeError(f"group: expected a streamcoll.Communicator or None, got {type(group).__name__}")
    with _LOCK:
        i = _COMM_IDS.get(group)
        if i is None:
            i = len(_COMMS) + 1
            _COMMS[i] = weakref.ref(group)
            _COMM_IDS[group] = i
        return i


def lookup_comm(cid: int) -> Communicator:
    """The communicator behind a registry id (raises if it is gone)."""
    if cid == DEFAULT_COMM:
        return bootstrap.default_communicator()
    ref = _COMMS.get(cid)
    c = None if ref is None else ref()
    if c is None:
        raise RuntimeError(f"comm: streamcoll communicator id {cid} is not registered or was garbage-collected")
    return c


@assume_constant_result
def _comm_size(group: Optional[Communicator]) -> int:
    """World size at trace time (the fake implementations need it for shapes)."""
    return (bootstrap.default_communicator() if group is None else group).size


class StreamRef:
    """A lookup-table entry: which stream an index names at run time.

    ``kind`` is ``"current"`` (the caller's current stream on the
    communicator's device when the op runs) or ``"comm"`` (the comm stream
    the communicator's async strategy uses for that current stream).
    """

    __slots__ = ("kind", "comm")

    def __init__(self, kind: str, comm: int) -> None:
        self.kind = kind
        self.comm = comm

    def __repr__(self) -> str:
        return f"StreamRef({self.kind!r}, comm={self.comm})"


_STREAMS: List[StreamRef] = []
_STREAM_IDX: Dict[Tuple[str, int], int] = {}


@assume_constant_result
def stream_index(kind: str, cid: int) -> int:
    """Index of the (``kind``, communicator) stream in the lookup table."""
    if kind not in ("current", "comm"):
        raise ValueError(f"kind: expected 'current' or 'comm', got {kind!r}")
    key = (kind, cid)
    with _LOCK:
        i = _STREAM_IDX.get(key)
        if i is None:
            i = _STREAM_IDX[key] = len(_STREAMS)
            _STREAMS.append(StreamRef(kind, cid))
        return i


def lookup_stream(index: int) -> StreamRef:
    if not 0 <= index < len(_STREAMS):
        raise IndexError(f"stream index {index} is not in streamcoll's stream table ({len(_STREAMS)} entries)")
    return _STREAMS[index]


_EVENTS: List[Any] = []  # slot -> pending Work (set by an async op, taken by join_)


@assume_constant_result
def new_event_slot() -> int:
    """A fresh event slot; one per async call site per trace."""
    with _LOCK:
        _EVENTS.append(None)
        return len(_EVENTS) - 1


def _put_event(slot: int, work: Any) -> None:
    if not 0 <= slot < len(_EVENTS):
        raise IndexError(f"event: slot {slot} was not allocated by streamcoll.custom_ops.new_event_slot()")
    _EVENTS[slot] = work


# ---------------------------------------------------------------- reductions
_OPS: Dict[Tuple[str, float], Any] = {}


@assume_constant_result
def _op_name(op: Any) -> str:
    return canonical_op(op)[0]


@assume_constant_result
def _op_factor(op: Any) -> float:
    return canonical_op(op)[1]


def _reduce_op(name: str, factor: float) -> Any:
    key = (name, factor)
    op = _OPS.get(key)
    if op is None:
        op = _OPS[key] = PreMulSum(factor) if name == "PREMUL_SUM" else ReduceOp(name)
    return op


# ---------------------------------------------------------------- the ops
def _launch(work: Any, event: int) -> None:
    if event >= 0:
        _put_event(event, work)


@torch.library.custom_op(f"{_NS}::all_reduce_", mutates_args=("tensor",))
def all_reduce_(tensor: _Tensor, comm: int, op: str, factor: float, event: int) -> None:
    """In place all_reduce; ``event >= 0``: async, Work stored in that slot."""
    _launch(lookup_comm(comm).all_reduce(tensor, _reduce_op(op, factor), event >= 0), event)


@all_reduce_.register_fake
def _(tensor, comm, op, factor, event):
    return None


@torch.library.custom_op(f"{_NS}::broadcast_", mutates_args=("tensor",))
def broadcast_(tensor: _Tensor, src: int, comm: int, event: int) -> None:
    _launch(lookup_comm(comm).broadcast(tensor, src, event >= 0), event)


@broadcast_.register_fake
def _(tensor, src, comm, event):
    return None


@torch.library.custom_op(f"{_NS}::reduce_", mutates_args=("tensor",))
def reduce_(tensor: _Tensor, dst: int, comm: int, op: str, factor: float, event: int) -> None:
    _launch(lookup_comm(comm).reduce(tensor, dst, _reduce_op(op, factor), event >= 0), event)


@reduce_.register_fake
def _(tensor, dst, comm, op, factor, event):
    return None


@torch.library.custom_op(f"{_NS}::all_gather_into_tensor_", mutates_args=("output",))
def all_gather_into_tensor_(output: _Tensor, input: _Tensor, comm: int, event: int) -> None:
    _launch(lookup_comm(comm).all_gather_into_tensor(output, input, event >= 0), event)


@all_gather_into_tensor_.register_fake
def _(output, input, comm, event):
    return None


@torch.library.custom_op(f"{_NS}::reduce_scatter_tensor_", mutates_args=("output",))
def reduce_scatter_tensor_(output: _Tensor, input: _Tensor, comm: int, op: str, factor: float, event: int) -> None:
    _launch(lookup_comm(comm).reduce_scatter_tensor(output, input, _reduce_op(op, factor), event >= 0), event)


@reduce_scatter_tensor_.register_fake
def _(output, input, comm, op, factor, event):
    return None


@torch.library.custom_op(f"{_NS}::all_to_all_single_", mutates_args=("output",))
def all_to_all_single_(output: _Tensor, input: _Tensor, output_split_sizes: Optional[List[int]],
                       input_split_sizes: Optional[List[int]], comm: int, event: int) -> None:
    _launch(lookup_comm(comm).all_to_all_single(output, input, output_split_sizes, input_split_sizes,
                                                event >= 0), event)


@all_to_all_single_.register_fake
def _(output, input, output_split_sizes, input_split_sizes, comm, event):
    return None


@torch.library.custom_op(f"{_NS}::barrier", mutates_args=())
def barrier_op(comm: int) -> None:
    lookup_comm(comm).barrier()


@barrier_op.register_fake
def _(comm):
    return None


# Functional variants: new tensors out, inputs untouched (synchronous).
@torch.library.custom_op(f"{_NS}::all_reduce", mutates_args=())
def all_reduce_functional(input: _Tensor, comm: int, op: str, factor: float) -> _Tensor:
    out = input.clone(memory_format=torch.contiguous_format)
    lookup_comm(comm).all_reduce(out, _reduce_op(op, factor))
    return out


@all_reduce_functional.register_fake
def _(input, comm, op, factor):
    return torch.empty_like(input, memory_format=torch.contiguous_format)


@torch.library.custom_op(f"{_NS}::broadcast", mutates_args=())
def broadcast_functional(input: _Tensor, src: int, comm: int) -> _Tensor:
    out = input.clone(memory_format=torch.contiguous_format)
    lookup_comm(comm).broadcast(out, src)
    return out


@broadcast_functional.register_fake
def _(input, src, comm):
    return torch.empty_like(input, memory_format=torch.contiguous_format)


@torch.library.custom_op(f"{_NS}::reduce", mutates_args=())
def reduce_functional(input: _Tensor, dst: int, comm: int, op: str, factor: float) -> _Tensor:
    out = input.clone(memory_format=torch.contiguous_format)
    lookup_comm(comm).reduce(out, dst, _reduce_op(op, factor))
    return out


@reduce_functional.register_fake
def _(input, dst, comm, op, factor):
    return torch.empty_like(input, memory_format=torch.contiguous_format)


def _gather_shape(input: _Tensor, world_size: int) -> List[int]:
    shape = list(input.shape)
    if not shape:
        return [world_size]
    shape[0] = shape[0] * world_size
    return shape


@torch.library.custom_op(f"{_NS}::all_gather_into_tensor", mutates_args=())
def all_gather_into_tensor_functional(input: _Tensor, comm: int, world_size: int) -> _Tensor:
    c = lookup_comm(comm)
    if c.size != world_size:
        raise RuntimeError(f"world_size: traced for {world_size} ranks, communicator has {c.size}")
    inp = input.contiguous()
    out = inp.new_empty(_gather_shape(inp, world_size))
    c.all_gather_into_tensor(out, inp)
    return out


@all_gather_into_tensor_functional.register_fake
def _(input, comm, world_size):
    return input.new_empty(_gather_shape(input, world_size))


def _scatter_shape(input: _Tensor, world_size: int) -> List[int]:
    shape = list(input.shape)
    if not shape or shape[0] % world_size:
        raise ValueError(f"input: dim 0 of shape {tuple(input.shape)} must divide by world size {world_size}")
    shape[0] //= world_size
    return shape


@torch.library.custom_op(f"{_NS}::reduce_scatter_tensor", mutates_args=())
def reduce_scatter_tensor_functional(input: _Tensor, comm: int, op: str, factor: float, world_size: int) -> _Tensor:
    c = lookup_comm(comm)
    if c.size != world_size:
        raise RuntimeError(f"world_size: traced for {world_size} ranks, communicator has {c.size}")
    inp = input.contiguous()
    out = inp.new_empty(_scatter_shape(inp, world_size))
    c.reduce_scatter_tensor(out, inp, _reduce_op(op, factor))
    return out


@reduce_scatter_tensor_functional.register_fake
def _(input, comm, op, factor, world_size):
    return input.new_empty(_scatter_shape(input, world_size))


def _a2a_shape(input: _Tensor, output_split_sizes: Optional[List[int]]) -> List[int]:
    shape = list(input.shape)
    if output_split_sizes is not None and shape:
        shape[0] = sum(output_split_sizes)
    return shape


@torch.library.custom_op(f"{_NS}::all_to_all_single", mutates_args=())
def all_to_all_single_functional(input: _Tensor, output_split_sizes: Optional[List[int]],
                                 input_split_sizes: Optional[List[int]], comm: int) -> _Tensor:
    inp = input.contiguous()
    out = inp.new_empty(_a2a_shape(inp, output_split_sizes))
    lookup_comm(comm).all_to_all_single(out, inp, output_split_sizes, input_split_sizes)
    return out


@all_to_all_single_functional.register_fake
def _(input, output_split_sizes, input_split_sizes, comm):
    return input.new_empty(_a2a_shape(input, output_split_sizes))


# Stream fork/join: pass-through ops that declare a mutation of everything
# the collective touches, so graph passes cannot move work across them.
@torch.library.custom_op(f"{_NS}::fork_", mutates_args=("tensors",))
def fork_(tensors: List[_Tensor], from_stream: int, to_stream: int) -> None:
    """Current stream -> comm stream. The comm-stream launch of the following
    collective makes the comm stream wait for the current one (Communicator's
    async strategy), so at run time this only checks its table entries."""
    lookup_stream(from_stream)
    lookup_stream(to_stream)


@fork_.register_fake
def _(tensors, from_stream, to_stream):
    return None


@torch.library.custom_op(f"{_NS}::join_", mutates_args=("tensors",))
def join_(tensors: List[_Tensor], event: int, from_stream: int, to_stream: int) -> None:
    """Comm stream -> current stream: ``Work.wait()`` on the event slot's Work
    (GPU: the current stream waits on the completion event; CPU: the thread
    blocks until the comm thread finished). ``tensors`` starts with the
    collective's outputs; where functionalization passed copies of them, the
    finished results are copied in after the wait."""
    lookup_stream(from_stream)
    lookup_stream(to_stream)
    if not 0 <= event < len(_EVENTS):
        raise IndexError(f"event: slot {event} was not allocated by streamcoll.custom_ops.new_event_slot()")
    work = _EVENTS[event]
    if work is None:
        raise RuntimeError(f"event: slot {event} holds no pending collective (waited twice, or never launched)")
    _EVENTS[event] = None
    work.wait()
    for dst, src in zip(tensors, work.result()):
        if dst.data_ptr() != src.data_ptr():
            dst.copy_(src)


@join_.register_fake
def _(tensors, event, from_stream, to_stream):
    return None


# Communication is a side effect: a collective whose result nobody reads (a
# barrier, a broadcast into a scratch buffer) must still run on every rank, so
# no graph pass may dead-code-eliminate these ops (for the mutating ones this
# also covers their auto_functionalized form).
for _op in (all_reduce_, broadcast_, reduce_, all_gather_into_tensor_, reduce_scatter_tensor_,
            all_to_all_single_, barrier_op, all_reduce_functional, broadcast_functional, reduce_functional,
            all_gather_into_tensor_functional, reduce_scatter_tensor_functional, all_to_all_single_functional,
            fork_, join_):
    torch.fx.node.has_side_effect(_op._opoverload)
del _op


# ---------------------------------------------------------------- traced API
class TracedWork:
    """What an ``async_op=True`` collective returns inside a compiled region.

    ``wait()`` emits the join op; it also works eagerly if the object escapes
    the region. ``is_completed()`` is not answerable inside a graph.
    """

    def __init__(self, tensors: List[_Tensor], event: int, comm_stream: int, current_stream: int) -> None:
        self._tensors = tensors
        self._event = event
        self._comm_stream = comm_stream
        self._current_stream = current_stream

    def wait(self, timeout: Any = None) -> bool:
        torch.ops.streamcoll.join_(self._tensors, self._event, self._comm_stream, self._current_stream)
        return True

    def result(self) -> List[_Tensor]:
        return self._tensors[:1]

    def get_future(self):
        raise NotImplementedError("Work.get_future() is not supported inside torch.compile; call wait()")

    def is_completed(self) -> bool:
        raise NotImplementedError("Work.is_completed() is not supported inside torch.compile; call wait()")


def _no_stream(stream: Any, name: str) -> None:
    if stream is not None:
        raise NotImplementedError(f"{name}(stream=...) is not supported inside torch.compile; "
                                  "use the current stream (stream=None)")


def _start(cid: int, tensors: List[_Tensor]) -> Tuple[int, int, int]:
    """fork: returns (event slot, current stream index, comm stream index)."""
    cur = stream_index("current", cid)
    cs = stream_index("comm", cid)
    torch.ops.streamcoll.fork_(tensors, cur, cs)
    return new_event_slot(), cur, cs


def all_reduce(tensor: _Tensor, op: Any = ReduceOp.SUM, group: Optional[Communicator] = None,
               async_op: bool = False, stream: Any = None) -> Optional[TracedWork]:
    """``streamcoll.all_reduce`` as custom ops (what it does under torch.compile)."""
    _no_stream(stream, "all_reduce")
    cid = comm_id(group)
    name, factor = _op_name(op), _op_factor(op)
    if not async_op:
        torch.ops.streamcoll.all_reduce_(tensor, cid, name, factor, -1)
        return None
    ev, cur, cs = _start(cid, [tensor])
    torch.ops.streamcoll.all_reduce_(tensor, cid, name, factor, ev)
    return TracedWork([tensor], ev, cs, cur)


def broadcast(tensor: _Tensor, src: int = 0, group: Optional[Communicator] = None,
              async_op: bool = False, stream: Any = None) -> Optional[TracedWork]:
    _no_stream(stream, "broadcast")
    cid = comm_id(group)
    if not async_op:
        torch.ops.streamcoll.broadcast_(tensor, src, cid, -1)
        return None
    ev, cur, cs = _start(cid, [tensor])
    torch.ops.streamcoll.broadcast_(tensor, src, cid, ev)
    return TracedWork([tensor], ev, cs, cur)


def reduce(tensor: _Tensor, dst: int = 0, op: Any = ReduceOp.SUM, group: Optional[Communicator] = None,
           async_op: bool = False, stream: Any = None) -> Optional[TracedWork]:
    _no_stream(stream, "reduce")
    cid = comm_id(group)
    name, factor = _op_name(op), _op_factor(op)
    if not async_op:
        torch.ops.streamcoll.reduce_(tensor, dst, cid, name, factor, -1)
        return None
    ev, cur, cs = _start(cid, [tensor])
    torch.ops.streamcoll.reduce_(tensor, dst, cid, name, factor, ev)
    return TracedWork([tensor], ev, cs, cur)


def all_gather_into_tensor(output_tensor: _Tensor, input_tensor: _Tensor, group: Optional[Communicator] = None,
                           async_op: bool = False, stream: Any = None) -> Optional[TracedWork]:
    _no_stream(stream, "all_gather_into_tensor")
    cid = comm_id(group)
    if not async_op:
        torch.ops.streamcoll.all_gather_into_tensor_(output_tensor, input_tensor, cid, -1)
        return None
    ts = [output_tensor, input_tensor]
    ev, cur, cs = _start(cid, ts)
    torch.ops.streamcoll.all_gather_into_tensor_(output_tensor, input_tensor, cid, ev)
    return TracedWork(ts, ev, cs, cur)


def reduce_scatter_tensor(output: _Tensor, input: _Tensor, op: Any = ReduceOp.SUM,
                          group: Optional[Communicator] = None, async_op: bool = False,
                          stream: Any = None) -> Optional[TracedWork]:
    _no_stream(stream, "reduce_scatter_tensor")
    cid = comm_id(group)
    name, factor = _op_name(op), _op_factor(op)
    if not async_op:
        torch.ops.streamcoll.reduce_scatter_tensor_(output, input, cid, name, factor, -1)
        return None
    ts = [output, input]
    ev, cur, cs = _start(cid, ts)
    torch.ops.streamcoll.reduce_scatter_tensor_(output, input, cid, name, factor, ev)
    return TracedWork(ts, ev, cs, cur)


def all_to_all_single(output: _Tensor, input: _Tensor, output_split_sizes: Optional[Sequence[int]] = None,
                      input_split_sizes: Optional[Sequence[int]] = None, group: Optional[Communicator] = None,
                      async_op: bool = False, stream: Any = None) -> Optional[TracedWork]:
    _no_stream(stream, "all_to_all_single")
    cid = comm_id(group)
    osz = None if output_split_sizes is None else list(output_split_sizes)
    isz = None if input_split_sizes is None else list(input_split_sizes)
    if not async_op:
        torch.ops.streamcoll.all_to_all_single_(output, input, osz, isz, cid, -1)
        return None
    ts = [output, input]
    ev, cur, cs = _start(cid, ts)
    torch.ops.streamcoll.all_to_all_single_(output, input, osz, isz, cid, ev)
    return TracedWork(ts, ev, cs, cur)


def barrier(group: Optional[Communicator] = None, async_op: bool = False, device_ids: Any = None) -> None:
    """Inside a compiled region barrier is synchronous (``async_op`` is ignored)."""
    torch.ops.streamcoll.barrier(comm_id(group))
    return None


# Public functional API (also usable eagerly): new tensors, inputs untouched.
def functional_all_reduce(input: _Tensor, op: Any = ReduceOp.SUM, group: Optional[Communicator] = None) -> _Tensor:
    """A new tensor holding the reduction of ``input`` across ranks."""
    return torch.ops.streamcoll.all_reduce(input, comm_id(group), _op_name(op), _op_factor(op))


def functional_broadcast(input: _Tensor, src: int = 0, group: Optional[Communicator] = None) -> _Tensor:
    return torch.ops.streamcoll.broadcast(input, src, comm_id(group))


def functional_reduce(input: _Tensor, dst: int = 0, op: Any = ReduceOp.SUM,
                      group: Optional[Communicator] = None) -> _Tensor:
    return torch.ops.streamcoll.reduce(input, dst, comm_id(group), _op_name(op), _op_factor(op))


def functional_all_gather_into_tensor(input: _Tensor, group: Optional[Communicator] = None) -> _Tensor:
    """Every rank's ``input`` concatenated on dim 0, in rank order."""
    return torch.ops.streamcoll.all_gather_into_tensor(input, comm_id(group), _comm_size(group))


def functional_reduce_scatter_tensor(input: _Tensor, op: Any = ReduceOp.SUM,
                                     group: Optional[Communicator] = None) -> _Tensor:
    """Block ``rank`` (on dim 0) of the reduction of ``input`` across ranks."""
    return torch.ops.streamcoll.reduce_scatter_tensor(input, comm_id(group), _op_name(op), _op_factor(op),
                                                      _comm_size(group))


def functional_all_to_all_single(input: _Tensor, output_split_sizes: Optional[Sequence[int]] = None,
                                 input_split_sizes: Optional[Sequence[int]] = None,
                                 group: Optional[Communicator] = None) -> _Tensor:
    osz = None if output_split_sizes is None else list(output_split_sizes)
    isz = None if input_split_sizes is None else list(input_split_sizes)
    return torch.ops.streamcoll.all_to_all_single(input, osz, isz, comm_id(group))
