"""streamcoll's collectives as ``torch.library`` custom ops, for ``torch.compile``.

Why a second entry point: Dynamo cannot trace into cffi calls, so without
these a collective inside a compiled function is a graph break. Each op here
is a thin shell whose implementation calls the very Communicator method eager
code calls (one code path for the launch); its fake implementation describes
the result's shape and dtype, so tracing needs no communication. The
module-level functions switch to these ops only while compiling
(``torch.compiler.is_compiling()``): eager calls never pass through the
dispatcher, which would add several microseconds to every collective.

What reaches the graph are integers and strings, never Python objects: a
communicator by its ``id`` (:func:`comm_id`), a reduction as ``(op name,
factor)`` (:func:`_op_parts`), a stream by its index (:func:`stream_index`),
an asynchronous collective's Work by an event slot (:func:`new_event_slot`).
``async_op=True`` is modelled as explicit ops: ``fork_`` (current stream ->
comm stream), the collective with an event slot, and ``join_`` (what
``wait()`` becomes).

Limits: launch and ``wait()`` of one async collective belong in the same
compiled region; one compiled function must not run concurrently in two
threads; ``stream=`` and ``timeout=`` are not supported inside a compiled
region (NotImplementedError: the ops carry neither). How fork and join keep
functionalization from moving reads and writes, and each limit's reason:
docs/design.md, section 'torch.compile's custom ops'.
"""
# No ``from __future__ import annotations`` here: torch.library.custom_op
# infers each op's schema from its annotations, and torch 2.4 rejects string
# annotations ("unsupported type _Tensor"; 2.5-2.6 evaluate them in torch's
# namespace, 2.7 reads them): real objects work on every torch. The
# generated ops are compiled with dont_inherit=True for the same reason.
import linecache
import threading
from typing import Any, Dict, List, Optional, Tuple

import torch

from ..startup import bootstrap
from ..core import source_text as _text
from ..core import spec as _spec
from . import torch_version as _tv
from ..core.communicator import Communicator, communicator_by_id
from ..core.ops import PreMulSum, ReduceOp, canonical_op

__all__ = [
    "comm_id", "lookup_comm", "stream_index", "lookup_stream", "new_event_slot", "TracedWork", "barrier",
    "SIDE_EFFECT_OPS",
]  # + the generated traced wrappers and functional_* functions (see _install)

_NS = "streamcoll"
_Tensor = torch.Tensor
_LOCK = threading.Lock()



def assume_constant_result(fn):
    """What ``torch.compiler.assume_constant_result`` does (mark the function
    so Dynamo calls it at trace time and bakes the result into the graph),
    without importing Dynamo when streamcoll is imported (~1 s here).
    tests/integrations/test_compile.py checks the marker still matches torch's."""
    fn._dynamo_marked_constant = True
    return fn


# ---------------------------------------------------------------- registries
DEFAULT_COMM = 0  # id resolved to bootstrap's default communicator at run time

def comm_id(group: Optional[Communicator]) -> int:
    """The id of ``group`` (0 for None: the default communicator, looked up
    when the op runs). Every Communicator has an integer ``id`` from birth,
    so under Dynamo this is an attribute read of the group (guarded on its
    identity) and compiled code receives an int: torch 2.11's Dynamo cannot
    pass a user object to a constant-result function (it calls
    ``as_python_constant()`` on it); 2.13 can. Works on both."""
    if group is None:
        return DEFAULT_COMM
    if not isinstance(group, Communicator):
        raise TypeError(f"group: expected a streamcoll.Communicator or None, got {type(group).__name__}")
    return group.id


def lookup_comm(cid: int) -> Communicator:
    """The communicator behind an id (raises if it is gone)."""
    if cid == DEFAULT_COMM:
        return bootstrap.default_communicator()
    c = communicator_by_id(cid)
    if c is None:
        raise RuntimeError(f"comm: streamcoll communicator id {cid} is not registered or was garbage-collected")
    return c


@assume_constant_result
def _default_size() -> int:
    return bootstrap.default_communicator().size


def _comm_size(group: Optional[Communicator]) -> int:
    """World size at trace time (the fake implementations need it for shapes)."""
    return _default_size() if group is None else group.size


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
        raise IndexError(f"event: slot {slot} was not allocated by streamcoll.integrations.custom_ops.new_event_slot()")
    _EVENTS[slot] = work


# ---------------------------------------------------------------- reductions
_OPS: Dict[Tuple[str, float], Any] = {}  # (name, factor) -> the reduction, at run time


@assume_constant_result
def _op_name(op: Any) -> str:
    return canonical_op(op)[0]


@assume_constant_result
def _op_factor(op: Any) -> float:
    return float(canonical_op(op)[1])


_ONE = torch.ones((), dtype=torch.float64)  # the factor tensor of every op but PREMUL_SUM


def _op_parts(op: Any) -> Tuple[str, _Tensor]:
    """``(name, factor)`` of ``op`` for the ops' schema; the factor is a 0-d
    float64 CPU tensor. A PreMulSum's is its :attr:`~streamcoll.PreMulSum.tensor`,
    so under Dynamo the factor is a graph input (a tensor attribute of an
    input, guarded on its dtype and shape, not on its value): one graph
    serves every factor, where a float (an attribute read, guarded as a
    constant) cost a graph per value and failed ``fullgraph=True`` at the
    recompile limit. Enum and string ops are constants and go through
    :func:`_op_name`; their factor is 1."""
    if isinstance(op, PreMulSum):
        return "PREMUL_SUM", op.tensor
    if not isinstance(op, (ReduceOp, str)):
        # torch.distributed.ReduceOp.SUM (a RedOpType): torch 2.11's Dynamo
        # cannot pass it into a constant-result function (it calls
        # as_python_constant() on it) nor trace int(op), == or a dict lookup
        # of it; its ``.name`` traces on every torch. A dist.ReduceOp
        # instance (``.op`` wraps the RedOpType; ``_make_nccl_premul_sum(f)``
        # carries a factor) goes to both constant-result functions, name and
        # factor (a constant: a graph per factor; torch 2.10/2.11's Dynamo
        # cannot take an instance there and fails: pass the enum, or
        # streamcoll.premul_sum(f)); canonical_op names anything else or raises.
        name = getattr(op, "name", None)
        if isinstance(name, str):
            op = name
        else:
            return _op_name(op), _ONE * _op_factor(op)
    return _op_name(op), _ONE


def _reduce_op(name: str, factor: _Tensor) -> Any:
    """The reduction an op runs (at run time: the factor tensor is read on the CPU, no sync)."""
    f = float(factor.item()) if name == "PREMUL_SUM" else 1.0
    key = (name, f)
    op = _OPS.get(key)
    if op is None:
        if len(_OPS) >= 4096:  # per-step factors: bounded
            _OPS.clear()
        op = _OPS[key] = PreMulSum(f) if name == "PREMUL_SUM" else ReduceOp(name)
    return op


# ---------------------------------------------------------------- the ops
# Generated from the declarations (streamcoll.core.spec, ``compiled=True``): for
# each collective an in-place op ``<name>_`` (the buffers it writes declared
# mutated; ``event >= 0``: async, its Work stored in that slot) and a
# functional op ``<name>`` (new tensors out, inputs untouched, synchronous),
# each with its fake, plus the traced wrappers the module-level functions call
# while compiling. Schemas follow one rule: tensors, ranks, split sizes,
# ``comm``, the reduction as ``(op, factor)``, ``world_size`` (functional ops
# whose result shape depends on it), ``event``.
def _launch(work: Any, event: int) -> None:
    if event >= 0:
        _put_event(event, work)


def _gather_shape(input: _Tensor, world_size: int) -> List[int]:
    shape = list(input.shape)
    if not shape:
        return [world_size]
    shape[0] = shape[0] * world_size
    return shape


def _scatter_shape(input: _Tensor, world_size: int) -> List[int]:
    shape = list(input.shape)
    if not shape or shape[0] % world_size:
        raise ValueError(f"input: dim 0 of shape {tuple(input.shape)} must divide by world size {world_size}")
    shape[0] //= world_size
    return shape


def _a2a_shape(input: _Tensor, output_split_sizes: Optional[List[int]]) -> List[int]:
    shape = list(input.shape)
    if output_split_sizes is not None and shape:
        shape[0] = sum(output_split_sizes)
    return shape


def _check_size(c: Communicator, world_size: int) -> Communicator:
    if c.size != world_size:
        raise RuntimeError(f"world_size: traced for {world_size} ranks, communicator has {c.size}")
    return c


_ANN = {_spec.TENSOR: "_Tensor", _spec.RANK: "int", _spec.SPLITS: "Optional[List[int]]"}
_RESULT = {"same": "input.clone(memory_format=torch.contiguous_format)",
           "gather": "inp.new_empty(_gather_shape(inp, world_size))",
           "scatter": "inp.new_empty(_scatter_shape(inp, world_size))",
           "a2a": "inp.new_empty(_a2a_shape(inp, output_split_sizes))"}
_FAKE = {"same": "torch.empty_like(input, memory_format=torch.contiguous_format)",
         "gather": "input.new_empty(_gather_shape(input, world_size))",
         "scatter": "input.new_empty(_scatter_shape(input, world_size))",
         "a2a": "input.new_empty(_a2a_shape(input, output_split_sizes))"}
SIDE_EFFECT_OPS: List[Any] = []


def _sources(s: _spec.CollectiveSpec) -> Tuple[str, List[str]]:
    """The source of the ops and wrappers of ``s``, and the names of the ops."""
    bufs = [p for p in s.buffers]
    ranks = [p for p in s.params if p.kind == _spec.RANK]
    splits = [p for p in s.params if p.kind == _spec.SPLITS]
    red = s.reduces
    ns = repr(_NS)
    src: List[str] = []
    # in place
    sig = [f"{p.name}: _Tensor" for p in bufs] + [f"{p.name}: int" for p in ranks]
    sig += [f"{p.name}: {_ANN[p.kind]}" for p in splits] + ["comm: int"]
    sig += ["op: str", "factor: _Tensor"] if red else []
    sig += ["event: int"]
    names = [a.split(":")[0] for a in sig]
    call = ", ".join(("_reduce_op(op, factor)" if p.kind == _spec.OP else p.name) for p in s.params)
    mut = tuple(p.name for p in bufs if p.mutable)
    src += [f"@torch.library.custom_op({ns} + '::{s.name}_', mutates_args={mut!r})",
            f"def {s.name}_({', '.join(sig)}) -> None:",
            f"    _launch(lookup_comm(comm).{s.name}({call}, event >= 0), event)",
            "",
            f"@{s.name}_.register_fake",
            f"def _({', '.join(names)}):",
            "    return None",
            ""]
    # functional
    fargs = ["input: _Tensor"] + [f"{p.name}: int" for p in ranks] + [f"{p.name}: {_ANN[p.kind]}" for p in splits]
    fargs += ["comm: int"] + (["op: str", "factor: _Tensor"] if red else [])
    shape = s.functional_shape
    if shape in ("gather", "scatter"):
        fargs.append("world_size: int")
    fnames = [a.split(":")[0] for a in fargs]
    get = "_check_size(lookup_comm(comm), world_size)" if shape in ("gather", "scatter") else "lookup_comm(comm)"
    fcall = ", ".join("out" if p.mutable else "inp" if p.is_buffer else
                      "_reduce_op(op, factor)" if p.kind == _spec.OP else p.name for p in s.params)
    src += [f"@torch.library.custom_op({ns} + '::{s.name}', mutates_args=())",
            f"def {s.name}_functional({', '.join(fargs)}) -> _Tensor:",
            f"    c = {get}",
            "    inp = input.contiguous()",
            f"    out = {_RESULT[shape]}",  # type: ignore[index]
            f"    c.{s.name}({fcall})",
            "    return out",
            "",
            f"@{s.name}_functional.register_fake",
            f"def _({', '.join(fnames)}):",
            f"    return {_FAKE[shape]}",  # type: ignore[index]
            ""]
    # traced wrapper (what streamcoll.<name> is while compiling)
    wsig = _text.signature_text(s, group=True).replace(", *,", ",")
    opargs = ", ".join([p.name for p in bufs] + [p.name for p in ranks]
                       + [f"_lst({p.name})" for p in splits] + ["cid"] + (["name", "factor"] if red else []))
    ts = "[" + ", ".join(p.name for p in sorted(bufs, key=lambda p: not p.mutable)) + "]"
    src += [f"def {s.name}({wsig}):",
            f'    """``streamcoll.{s.name}`` as custom ops (what it does under torch.compile)."""',
            "    _compile_gate()",
            f"    _no_stream(stream, {s.name!r})",
            f"    _no_timeout(timeout, {s.name!r})",
            "    cid = comm_id(group)"]
    if red:
        src += ["    name, factor = _op_parts(op)"]
    src += ["    if not async_op:",
            f"        torch.ops.streamcoll.{s.name}_({opargs}, -1)",
            "        return None",
            f"    ts = {ts}",
            "    ev, cur, cs = _start(cid, ts)",
            f"    torch.ops.streamcoll.{s.name}_({opargs}, ev)",
            "    return TracedWork(ts, ev, cs, cur)",
            ""]
    # public functional wrapper
    pub = ["input"] + [f"{p.name}={p.default!r}" if p.default is not _spec.REQUIRED else p.name
                       for p in s.params if not p.is_buffer and p.kind != _spec.OP] \
        + (["op=_SUM"] if red else []) + ["group=None"]
    pargs = ", ".join(["input"] + [p.name for p in ranks] + [f"_lst({p.name})" for p in splits] + ["comm_id(group)"]
                      + (["*_op_parts(op)"] if red else [])
                      + (["_comm_size(group)"] if shape in ("gather", "scatter") else []))
    src += [f"def functional_{s.name}({', '.join(pub)}):",
            f'    """A new tensor: the result of {s.name} of ``input`` across ranks (inputs untouched)."""',
            "    if _COMPILE_REFUSAL is not None and torch.compiler.is_compiling():",
            "        _compile_gate()",
            f"    return torch.ops.streamcoll.{s.name}({pargs})",
            ""]
    return "\n".join(src), [f"{s.name}_", f"{s.name}_functional"]


# Below torch 2.10 a collective inside torch.compile refuses, naming the
# release (streamcoll/integrations/torch_version.py). The message is made here, at
# import: Dynamo then traces only a constant test and a raise (torch 2.4's
# Dynamo cannot trace the version parsing).
_COMPILE_REFUSAL = _tv.refusal(
    "a streamcoll collective inside torch.compile",
    "older torch.compile removes an in-place collective whose result is unused (its auto_functionalized "
    "form is not kept as a side effect before 2.10), so one rank would skip a collective its peers run")


@assume_constant_result
def _compile_gate() -> None:
    """Raise :data:`_COMPILE_REFUSAL` (called only while compiling). Marked
    constant-result: Dynamo runs it as plain Python at trace time, so the
    error reaches the user as it is (torch 2.4's Dynamo cannot trace the
    construction of an exception class of ours); on a supported torch it
    returns None."""
    if _COMPILE_REFUSAL is not None:
        raise _tv.TorchVersionError(_COMPILE_REFUSAL)


def _lst(x: Any) -> Optional[List[int]]:
    return None if x is None else list(x)


def _install() -> None:
    g = globals()
    for name, s in _spec.TABLE.items():
        if not s.compiled or name == "barrier":
            continue
        src, ops = _sources(s)
        filename = f"<streamcoll generated custom ops {name}>"
        linecache.cache[filename] = (len(src), None, src.splitlines(True), filename)
        exec(compile(src, filename, "exec", dont_inherit=True), g)
        SIDE_EFFECT_OPS.extend(g[o] for o in ops)
        __all__.extend([name, f"functional_{name}"])


_SUM = ReduceOp.SUM
_install()


@torch.library.custom_op(f"{_NS}::barrier", mutates_args=())
def barrier_op(comm: int) -> None:
    lookup_comm(comm).barrier()


@barrier_op.register_fake
def _(comm):
    return None


SIDE_EFFECT_OPS.append(barrier_op)


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
        raise IndexError(f"event: slot {event} was not allocated by streamcoll.integrations.custom_ops.new_event_slot()")
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
for _op in SIDE_EFFECT_OPS + [fork_, join_]:
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


def _no_timeout(timeout: Any, name: str) -> None:
    if timeout is not None:
        raise NotImplementedError(f"{name}(timeout=...) is not supported inside torch.compile (the custom ops "
                                  "carry no deadline); call it outside the compiled region, or use the "
                                  "communicator's timeout (timeout=None)")


def _start(cid: int, tensors: List[_Tensor]) -> Tuple[int, int, int]:
    """fork: returns (event slot, current stream index, comm stream index)."""
    cur = stream_index("current", cid)
    cs = stream_index("comm", cid)
    torch.ops.streamcoll.fork_(tensors, cur, cs)
    return new_event_slot(), cur, cs


def barrier(group: Optional[Communicator] = None, async_op: bool = False, device_ids: Any = None,
            timeout: Any = None) -> None:
    """Inside a compiled region barrier is synchronous (``async_op`` is ignored)."""
    _compile_gate()
    _no_timeout(timeout, "barrier")
    torch.ops.streamcoll.barrier(comm_id(group))
    return None


