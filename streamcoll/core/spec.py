"""One declaration per collective: the table every front end derives from.

Each collective is declared once, here, as a :class:`CollectiveSpec` made by
:func:`collective`: its torch.distributed name and aliases, its parameters
(:class:`ParamSpec`: buffers with their role, ranks, the reduction, split
sizes), which C function each library has for it (``c``), how the C call's
arguments follow from the parameters (the argument *order* is read from the
declarations in ``streamcoll/_native/*.h`` by parameter name, see :func:`streamcoll.core.source_text.c_roles`), the
planner used where a library lacks the function (grouped Send/Recv, a flat
buffer and an unpack, oneCCL's reduce scratch buffer, AlltoAllV), the post-op
(AVG/PREMUL emulation), what the debug fingerprint compares, the shape of a
functional result, and a reference implementation for tests.

What derives from it (nothing below repeats the per-collective knowledge):

- ``Communicator`` methods (general path) and each communicator's generated
  fast paths (:mod:`streamcoll.core.launch`),
- the module-level functions (:mod:`streamcoll.collectives`),
- the torch.compile custom ops, their fakes and side-effect marks
  (:mod:`streamcoll.integrations.custom_ops`),
- the debug fingerprint (:mod:`streamcoll.core.checks`), the point-to-point set of
  the flight recorder (:mod:`streamcoll.core.recorder`), the C functions whose
  ``ncclInProgress`` is polled (:mod:`streamcoll.diagnostics.watchdog`), the C function
  names of :mod:`streamcoll.core.backends`,
- the benchmark cases (:mod:`streamcoll.bench.cases`: buffers, the streamcoll,
  raw C and torch.distributed calls, the check) and the test, fuzz and
  bad-input cases (``tests/``), whose expected values come from
  :attr:`CollectiveSpec.reference`.

A planner is the one function per collective that knows its semantics: it
receives the communicator's :class:`PlanContext` and the arguments as
declared, validates them (every check before any C call, so bad input raises
on the calling rank and nothing is half issued) and returns a :class:`Plan`.
Collectives the libraries have as one C call use ``PlanContext.native``,
derived entirely from the declaration.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np

from .ops import ReduceOp
from .references import (ref_all_gather, ref_all_gather_into_tensor, ref_all_reduce, ref_all_to_all,
                         ref_all_to_all_single, ref_barrier, ref_broadcast, ref_gather, ref_reduce,
                         ref_reduce_scatter, ref_reduce_scatter_tensor, ref_scatter)

__all__ = [
    "REQUIRED", "ParamSpec", "CollectiveSpec", "Plan", "collective", "TABLE", "ALIASES", "get",
    "p2p_ops", "c_functions",
]


class _Required:
    def __repr__(self) -> str:
        return "REQUIRED"


REQUIRED: Any = _Required()

# Parameter kinds.
TENSOR = "tensor"
TENSOR_LIST = "tensor_list"
RANK = "rank"        # a rank of the communicator (root or peer)
OP = "op"            # a reduction
SPLITS = "splits"    # all_to_all_single split sizes (None or a list of ints)
TAG = "tag"
ANY = "any"


@dataclasses.dataclass(frozen=True)
class ParamSpec:
    """One parameter of a collective, in torch.distributed's order.

    ``role`` of a buffer: ``"in"`` (read), ``"out"`` (written), ``"inout"``
    (read and written in place). ``root_only``: only the root passes it
    (gather_list, scatter_list). ``compare``: what the debug check compares
    across ranks: ``"exact"`` (shape and dtype, or the value), ``"dtype"``
    (shapes may differ between ranks), or None (not compared).
    """

    name: str
    kind: str
    default: Any = REQUIRED
    role: Optional[str] = None
    root_only: bool = False
    compare: Optional[str] = "exact"

    # Derived once (the planners read them on every general-path call).
    @functools.cached_property
    def is_buffer(self) -> bool:
        return self.kind in (TENSOR, TENSOR_LIST)

    @functools.cached_property
    def mutable(self) -> bool:
        return self.role in ("out", "inout")


@dataclasses.dataclass(frozen=True)
class CollectiveSpec:
    """The declaration of one collective (see the module docstring)."""

    name: str
    params: Tuple[ParamSpec, ...]
    doc: str
    planner: Callable[..., "Plan"]
    aliases: Tuple[str, ...] = ()
    # C function per library ("nccl", "oneccl"); a library missing here has
    # none, and the planner composes it.
    c: Mapping[str, str] = dataclasses.field(default_factory=dict)
    # Native single-call collectives: which parameter is the C call's send
    # buffer and receive buffer, and how the C count follows from them.
    send: Optional[str] = None
    recv: Optional[str] = None
    count: Optional[Tuple[str, str]] = None       # (buffer, "numel" | "numel/size")
    sizes: Tuple[Tuple[str, str, str], ...] = ()  # (buffer, relation, other): checked before the call
    root: Optional[str] = None     # the parameter naming the root rank
    reduces: bool = False          # takes ``op``; AVG/PREMUL_SUM may be emulated (post-op)
    # At two ranks a SUM or PRODUCT through a wider dtype (backends._WIDENED)
    # runs as this collective, an all-gather of the inputs, and one local op
    # (plans.PlanContext.pair_op): the wider dtype's bits, half its bytes.
    pair: Optional[str] = None
    post_on_root_only: bool = False
    # "param": async_op is a parameter (default False); "never": send/recv;
    # "always": isend/irecv/batch_isend_irecv.
    async_mode: str = "param"
    returns: str = "work"          # "work" (Work or None), "src", "none", "work_list"
    p2p: bool = False              # a point-to-point op (not aligned across ranks)
    compiled: bool = False         # has torch.compile custom ops
    functional_shape: Optional[str] = None  # "same", "gather", "scatter", "a2a": the functional op's result
    cross_check: Optional[str] = None       # debug: "single"/"lists" all-to-all count cross-check
    fast: bool = False             # gets a generated per-communicator fast path
    # The torch.distributed ProcessGroup methods this collective serves
    # (streamcoll.integrations.process_group): their names, their parameter list, and an
    # expression per parameter of ours in terms of theirs (``opts`` is torch's
    # option object, or what the C++ API's other overloads pass in its place:
    # a ReduceOp, a root rank; ``_one(x, name)`` unwraps a one-tensor list or
    # takes a single tensor; a ``timeout`` parameter bounds the Work's wait);
    # the first mapped buffer picks the device.
    pg: Tuple[str, ...] = ()
    pg_params: str = ""
    pg_map: Mapping[str, str] = dataclasses.field(default_factory=dict)
    reference: Optional[Callable[..., Any]] = None
    # nccl-tests' bus bandwidth factor at n ranks (doc/PERFORMANCE.md), for the benchmarks.
    bus_factor: Optional[Callable[[int], float]] = None

    @functools.cached_property
    def param_names(self) -> Tuple[str, ...]:
        return tuple(p.name for p in self.params)

    def param(self, name: str) -> ParamSpec:
        for p in self.params:
            if p.name == name:
                return p
        raise KeyError(name)

    @functools.cached_property
    def buffers(self) -> Tuple[ParamSpec, ...]:
        return tuple(p for p in self.params if p.is_buffer)

    def c_name(self, library: str) -> Optional[str]:
        return self.c.get(library)


class Plan:
    """What a launch needs: the C call (``fn(*args, stream)``, returning the
    library's result code; a composed plan's ``fn`` raises itself and returns
    0), the post-op run after it on the same stream (AVG's division, an
    unpack), the tensors to keep alive while it runs and the outputs a Work
    hands back. ``cname`` names the C function in errors."""

    __slots__ = ("fn", "args", "post", "keep", "outputs", "cname", "p2p")

    def __init__(self, fn: Callable[..., int], args: tuple, post: Optional[Callable[[], Any]],
                 keep: tuple, outputs: tuple, cname: str, p2p: bool = False) -> None:
        self.fn = fn
        self.args = args
        self.post = post
        self.keep = keep
        self.outputs = outputs
        self.cname = cname
        self.p2p = p2p


TABLE: Dict[str, CollectiveSpec] = {}
ALIASES: Dict[str, str] = {}


def collective(**kw: Any) -> Callable[[Callable[..., Plan]], Callable[..., Plan]]:
    """Declare a collective; decorates its planner (or pass ``planner=``)."""
    def deco(planner: Callable[..., Plan]) -> Callable[..., Plan]:
        spec = CollectiveSpec(planner=planner, **kw)
        if spec.name in TABLE:
            raise ValueError(f"collective {spec.name!r} declared twice")
        TABLE[spec.name] = spec
        for a in spec.aliases:
            ALIASES[a] = spec.name
        return planner
    return deco


def get(name: str) -> CollectiveSpec:
    """The declaration of ``name`` (or of an alias)."""
    return TABLE[ALIASES.get(name, name)]


def p2p_ops() -> frozenset:
    return frozenset(n for n, s in TABLE.items() if s.p2p)


def c_functions(library: str) -> Dict[str, str]:
    """collective name -> C function of ``library`` (what it has natively)."""
    return {n: s.c[library] for n, s in TABLE.items() if library in s.c}


# ------------------------------------------------------------------ planners
def _splits(cx: Any, splits: Any, t: Any, name: str, row: int) -> List[int]:
    size = cx.size
    if splits is None:
        if t.dim() == 0 or t.shape[0] % size:
            raise ValueError(f"{name}: not given, so dim 0 of the tensor ({tuple(t.shape)}) must divide by world size {size}")
        return [t.numel() // size] * size
    if not isinstance(splits, (list, tuple)):
        raise TypeError(f"{name}: expected a list of {size} ints or None, got {type(splits).__name__}")
    if len(splits) != size:
        raise ValueError(f"{name}: expected {size} split sizes (one per rank), got {len(splits)}")
    if any((isinstance(s, bool) or not isinstance(s, (int, np.integer)) or s < 0) for s in splits):
        raise ValueError(f"{name}: expected non-negative ints, got {list(splits)}")
    if sum(splits) != (t.shape[0] if t.dim() else 0):
        raise ValueError(f"{name}: split sizes sum to {sum(splits)} but dim 0 of the tensor is {t.shape[0] if t.dim() else 0}")
    return [int(s) * row for s in splits]


def _row(t: Any) -> int:
    if t.dim() == 0:
        return 1
    return t[0].numel() if t.shape[0] else t.numel() // max(t.shape[0], 1)


def _unpack(flat: Any, outs: Sequence[Any], n: int) -> Callable[[], None]:
    def post() -> None:
        for i, o in enumerate(outs):
            o.view(-1).copy_(flat[i * n:(i + 1) * n])
    return post


def _same_list(cx: Any, ref: Any, refname: str, lst: Any, name: str, n: int, what: str) -> List[Any]:
    outs = [cx.t(o, f"{name}[{i}]") for i, o in enumerate(cx.tensor_list(lst, name))]
    for i, o in enumerate(outs):
        cx.same_dtype(ref, o, refname, f"{name}[{i}]")
        if o.numel() != n:
            raise ValueError(f"{name}[{i}]: expected {n} elements like {what}, got {o.numel()}")
    return outs


def _rooted(cx: Any, opname: str, tensor: Any, lst: Any, lname: str, root: Any, rname: str,
            role: str) -> Tuple[Any, int, int, List[Any]]:
    """Checks of a rooted list collective (gather, scatter): the tensor, the
    root, the dtype, and the list (one tensor like ``tensor`` per rank on the
    root; None or [] elsewhere). Returns (tensor, root, C dtype, list)."""
    t = cx.t(tensor, "tensor")
    r = cx.check_rank(root, rname)
    d = cx.dtype(t, opname)
    if cx.rank == r:
        return t, r, d, _same_list(cx, t, "tensor", lst, lname, t.numel(), "tensor")
    if lst:
        raise ValueError(f"{lname}: expected None or [] on non-{role} rank {cx.rank} ({rname} is {r})")
    return t, r, d, []


# -------------------------------------------------------------- the table
_T = ParamSpec
_SUMOP = ReduceOp.SUM


@collective(
    name="all_reduce", aliases=("allreduce",),
    params=(_T("tensor", TENSOR, role="inout"), _T("op", OP, _SUMOP)),
    doc="Reduce ``tensor`` across ranks in place (torch.distributed.all_reduce).",
    c={"nccl": "ncclAllReduce", "oneccl": "onecclAllReduce"},
    send="tensor", recv="tensor", count=("tensor", "numel"), reduces=True, pair="all_gather_into_tensor",
    compiled=True, functional_shape="same", fast=True, reference=ref_all_reduce,
    pg=('allreduce',), pg_params='tensors, opts=None, timeout=None',
    pg_map={'tensor': "_one(tensors, 'tensors')", 'op': '_op(opts)'},
    bus_factor=lambda n: 2.0 * (n - 1) / n,
)
def _plan_all_reduce(cx: Any, tensor: Any, op: Any) -> Plan:
    return cx.native(TABLE["all_reduce"], {"tensor": tensor, "op": op})


@collective(
    name="broadcast",
    params=(_T("tensor", TENSOR, role="inout"), _T("src", RANK, 0)),
    doc="Copy ``tensor`` of rank ``src`` to every rank (in place).",
    c={"nccl": "ncclBroadcast", "oneccl": "onecclBroadcast"},
    send="tensor", recv="tensor", count=("tensor", "numel"), root="src",
    compiled=True, functional_shape="same", fast=True, reference=ref_broadcast,
    pg=('broadcast',), pg_params='tensors, opts=None, timeout=None',
    pg_map={'tensor': "_one(tensors, 'tensors')", 'src': '_root(opts)'},
    bus_factor=lambda n: 1.0,
)
def _plan_broadcast(cx: Any, tensor: Any, src: Any) -> Plan:
    return cx.native(TABLE["broadcast"], {"tensor": tensor, "src": src})


@collective(
    name="reduce",
    params=(_T("tensor", TENSOR, role="inout"), _T("dst", RANK, 0), _T("op", OP, _SUMOP)),
    doc="Reduce ``tensor`` onto rank ``dst`` (in place there; other ranks' tensors are unchanged).",
    c={"nccl": "ncclReduce", "oneccl": "onecclReduce"},
    send="tensor", recv="tensor", count=("tensor", "numel"), root="dst", reduces=True,
    post_on_root_only=True, compiled=True, functional_shape="same", fast=True, reference=ref_reduce,
    pg=('reduce',), pg_params='tensors, opts=None, op=None, timeout=None',
    pg_map={'tensor': "_one(tensors, 'tensors')", 'dst': '_root(opts)', 'op': '_op(opts, op)'},
    bus_factor=lambda n: 1.0,
)
def _plan_reduce(cx: Any, tensor: Any, dst: Any, op: Any) -> Plan:
    # oneCCL writes the receive buffer on every rank: non-roots get a scratch
    # one (cx.native does this where the backend says so).
    return cx.native(TABLE["reduce"], {"tensor": tensor, "dst": dst, "op": op})


@collective(
    name="all_gather_into_tensor", aliases=("_all_gather_base",),
    params=(_T("output_tensor", TENSOR, role="out"), _T("input_tensor", TENSOR, role="in")),
    doc="Gather every rank's ``input_tensor`` into ``output_tensor`` (rank order, dim 0).",
    c={"nccl": "ncclAllGather", "oneccl": "onecclAllGather"},
    send="input_tensor", recv="output_tensor", count=("input_tensor", "numel"),
    sizes=(("output_tensor", "size*", "input_tensor"),),
    compiled=True, functional_shape="gather", fast=True, reference=ref_all_gather_into_tensor,
    pg=('all_gather_single', '_allgather_base'), pg_params='output, input, opts=None',
    pg_map={'output_tensor': 'output', 'input_tensor': 'input'},
    bus_factor=lambda n: (n - 1) / n,
)
def _plan_all_gather_into_tensor(cx: Any, output_tensor: Any, input_tensor: Any) -> Plan:
    return cx.native(TABLE["all_gather_into_tensor"], {"output_tensor": output_tensor, "input_tensor": input_tensor})


@collective(
    name="all_gather",
    params=(_T("tensor_list", TENSOR_LIST, role="out"), _T("tensor", TENSOR, role="in")),
    doc="Gather every rank's ``tensor`` into ``tensor_list[rank]`` (an all_gather into a flat buffer, then an unpack).",
    c={}, reference=ref_all_gather,
    pg=('allgather',), pg_params='output_tensors, input_tensors, opts=None',
    pg_map={'tensor_list': "_one(output_tensors, 'output_tensors')", 'tensor': "_one(input_tensors, 'input_tensors')"},
)
def _plan_all_gather(cx: Any, tensor_list: Any, tensor: Any) -> Plan:
    inp = cx.t(tensor, "tensor")
    outs = _same_list(cx, inp, "tensor", tensor_list, "tensor_list", inp.numel(), "tensor")
    flat = inp.new_empty((cx.size * inp.numel(),))
    base = cx.native(TABLE["all_gather_into_tensor"], {"output_tensor": flat, "input_tensor": inp},
                     names={"input_tensor": "tensor"})
    return Plan(base.fn, base.args, _unpack(flat, outs, inp.numel()), (inp, flat, *outs), tuple(outs), base.cname)


@collective(
    name="all_gather_coalesced",
    params=(_T("output_tensor_lists", ANY, role="out", compare=None),
            _T("input_tensor_list", TENSOR_LIST, role="in")),
    doc="Gather every rank's ``input_tensor_list``: ``output_tensor_lists[r][i]`` receives rank r's "
        "``input_tensor_list[i]`` (one all_gather per input, all in one group launch, then an unpack).",
    c={},
    pg=('allgather_coalesced',), pg_params='output_lists, input_list, opts=None',
    pg_map={'output_tensor_lists': 'output_lists', 'input_tensor_list': "_nonempty(input_list, 'input_list')"},
)
def _plan_all_gather_coalesced(cx: Any, output_tensor_lists: Any, input_tensor_list: Any) -> Plan:
    if not isinstance(input_tensor_list, (list, tuple)) or not input_tensor_list:
        raise ValueError("input_tensor_list: expected a non-empty list of tensors")
    ins = [cx.t(x, f"input_tensor_list[{i}]") for i, x in enumerate(input_tensor_list)]
    lists = cx.tensor_list(output_tensor_lists, "output_tensor_lists")
    outs: List[List[Any]] = []
    for r, lst in enumerate(lists):
        name = f"output_tensor_lists[{r}]"
        if not isinstance(lst, (list, tuple)) or len(lst) != len(ins):
            got = len(lst) if isinstance(lst, (list, tuple)) else type(lst).__name__
            raise ValueError(f"{name}: expected a list of {len(ins)} tensors (one per input), got {got}")
        row = [cx.t(o, f"{name}[{i}]") for i, o in enumerate(lst)]
        for i, (o, x) in enumerate(zip(row, ins)):
            cx.same_dtype(x, o, f"input_tensor_list[{i}]", f"{name}[{i}]")
            if o.numel() != x.numel():
                raise ValueError(f"{name}[{i}]: expected {x.numel()} elements like input_tensor_list[{i}], "
                                 f"got {o.numel()}")
        outs.append(row)
    ag = TABLE["all_gather_into_tensor"]
    flats = [x.new_empty((cx.size * x.numel(),)) for x in ins]
    plans = [cx.native(ag, {"output_tensor": f, "input_tensor": x}, names={"input_tensor": f"input_tensor_list[{i}]"},
                       opname="all_gather_coalesced") for i, (f, x) in enumerate(zip(flats, ins))]
    fn, args = cx.group([(p.fn, p.args, p.cname) for p in plans])

    def post() -> None:
        for i, (f, x) in enumerate(zip(flats, ins)):
            n = x.numel()
            for r in range(len(outs)):
                outs[r][i].view(-1).copy_(f[r * n:(r + 1) * n])

    flat_outs = tuple(o for row in outs for o in row)
    return Plan(fn, args, post, (*ins, *flats, *flat_outs), flat_outs, "all_gather_coalesced")


@collective(
    name="reduce_scatter_tensor", aliases=("_reduce_scatter_base",),
    params=(_T("output", TENSOR, role="out"), _T("input", TENSOR, role="in"), _T("op", OP, _SUMOP)),
    doc="Reduce ``input`` across ranks and leave block ``rank`` of the result in ``output``.",
    c={"nccl": "ncclReduceScatter", "oneccl": "onecclReduceScatter"},
    send="input", recv="output", count=("output", "numel"), sizes=(("input", "size*", "output"),),
    reduces=True, compiled=True, functional_shape="scatter", fast=True, reference=ref_reduce_scatter_tensor,
    pg=('reduce_scatter_single', '_reduce_scatter_base'), pg_params='output, input, opts=None',
    pg_map={'output': 'output', 'input': 'input', 'op': '_op(opts)'},
    bus_factor=lambda n: (n - 1) / n,
)
def _plan_reduce_scatter_tensor(cx: Any, output: Any, input: Any, op: Any) -> Plan:
    return cx.native(TABLE["reduce_scatter_tensor"], {"output": output, "input": input, "op": op})


@collective(
    name="reduce_scatter",
    params=(_T("output", TENSOR, role="out"), _T("input_list", TENSOR_LIST, role="in"), _T("op", OP, _SUMOP)),
    doc="Reduce the lists across ranks; ``output`` gets the reduction of everyone's ``input_list[rank]``.",
    c={}, reduces=True, reference=ref_reduce_scatter,
    pg=('reduce_scatter',), pg_params='output_tensors, input_tensors, opts=None',
    pg_map={'output': "_one(output_tensors, 'output_tensors')", 'input_list': "_one(input_tensors, 'input_tensors')", 'op': '_op(opts)'},
)
def _plan_reduce_scatter(cx: Any, output: Any, input_list: Any, op: Any) -> Plan:
    out = cx.t(output, "output")
    ins = _same_list(cx, out, "output", input_list, "input_list", out.numel(), "output")
    # packed into one flat buffer when the call runs (cx.read_first), not now:
    # async work queued before this call may still be writing the inputs
    flat = out.new_empty((out.numel() * len(ins),))
    plan = cx.native(TABLE["reduce_scatter_tensor"], {"output": out, "input": flat, "op": op},
                     names={"input": "input_list"}, keep=tuple(ins))
    return cx.read_first(plan, lambda: cx.torch.cat([x.reshape(-1) for x in ins], out=flat))


@collective(
    name="all_to_all_single",
    params=(_T("output", TENSOR, role="out", compare="dtype"), _T("input", TENSOR, role="in", compare="dtype"),
            _T("output_split_sizes", SPLITS, None, compare=None),
            _T("input_split_sizes", SPLITS, None, compare=None)),
    doc="All-to-all on dim 0 blocks, even (no split sizes) or uneven.",
    c={"nccl": "ncclAlltoAll", "oneccl": "onecclAllToAll"},
    send="input", recv="output", count=("input", "numel/size"), sizes=(("output", "==", "input"),),
    compiled=True, functional_shape="a2a", cross_check="single", fast=True, reference=ref_all_to_all_single,
    pg=('all_to_all_single', 'alltoall_base'), pg_params='output, input, output_split_sizes, input_split_sizes, opts=None',
    pg_map={'output': 'output', 'input': 'input', 'output_split_sizes': 'list(output_split_sizes) or None', 'input_split_sizes': 'list(input_split_sizes) or None'},
    bus_factor=lambda n: (n - 1) / n,
)
def _plan_all_to_all_single(cx: Any, output: Any, input: Any, output_split_sizes: Any = None,
                            input_split_sizes: Any = None) -> Plan:
    spec = TABLE["all_to_all_single"]
    if output_split_sizes is None and input_split_sizes is None and cx.has(spec):
        return cx.native(spec, {"output": output, "input": input})
    out = cx.t(output, "output")
    inp = cx.t(input, "input")
    cx.same_dtype(inp, out, "input", "output")
    d = cx.dtype(inp, "all_to_all_single", "input")
    if output_split_sizes is None and input_split_sizes is None:
        if inp.numel() % cx.size:
            raise ValueError(f"input: expected a number of elements divisible by world size {cx.size}, got {inp.numel()}")
        if out.numel() != inp.numel():
            raise ValueError(f"output: expected {inp.numel()} elements like input, got {out.numel()}")
        send = recv = [inp.numel() // cx.size] * cx.size
    else:
        send = _splits(cx, input_split_sizes, inp, "input_split_sizes", _row(inp))
        recv = _splits(cx, output_split_sizes, out, "output_split_sizes", _row(out))
    return cx.alltoallv(inp, out, send, recv, d)


@collective(
    name="all_to_all",
    params=(_T("output_tensor_list", TENSOR_LIST, role="out", compare="dtype"),
            _T("input_tensor_list", TENSOR_LIST, role="in", compare="dtype")),
    doc="Send ``input_tensor_list[j]`` to rank j; receive rank j's into ``output_tensor_list[j]`` (grouped Send/Recv).",
    c={}, cross_check="lists", reference=ref_all_to_all,
    pg=('alltoall',), pg_params='output_tensors, input_tensors, opts=None',
    pg_map={'output_tensor_list': 'output_tensors', 'input_tensor_list': "_nonempty(input_tensors, 'input_tensors')"},
)
def _plan_all_to_all(cx: Any, output_tensor_list: Any, input_tensor_list: Any) -> Plan:
    outs = [cx.t(o, f"output_tensor_list[{i}]") for i, o in
            enumerate(cx.tensor_list(output_tensor_list, "output_tensor_list"))]
    ins = [cx.t(x, f"input_tensor_list[{i}]") for i, x in
           enumerate(cx.tensor_list(input_tensor_list, "input_tensor_list"))]
    for i in range(cx.size):
        cx.same_dtype(ins[0], ins[i], "input_tensor_list[0]", f"input_tensor_list[{i}]")
        cx.same_dtype(ins[0], outs[i], "input_tensor_list[0]", f"output_tensor_list[{i}]")
    d = cx.dtype(ins[0], "all_to_all", "input_tensor_list")
    me = cx.rank
    if outs[me].numel() != ins[me].numel():
        raise ValueError(f"output_tensor_list[{me}]: expected {ins[me].numel()} elements "
                         f"(input_tensor_list[{me}] is sent to this rank itself), got {outs[me].numel()}")
    vp = cx.vp
    sends = [(vp(ins[p]), ins[p].numel(), p, d) for p in range(cx.size) if p != me and ins[p].numel()]
    recvs = [(vp(outs[p]), outs[p].numel(), p, d) for p in range(cx.size) if p != me and outs[p].numel()]
    src, dst = ins[me], outs[me]

    def post() -> None:
        dst.copy_(src.view(dst.shape) if src.shape != dst.shape else src)

    return cx.p2p_group(sends, recvs, post, (*ins, *outs), tuple(outs))


@collective(
    name="gather",
    params=(_T("tensor", TENSOR, role="in"), _T("gather_list", TENSOR_LIST, None, role="out", root_only=True,
                                                compare=None), _T("dst", RANK, 0)),
    doc="Gather ``tensor`` of every rank into ``gather_list`` on rank ``dst``.",
    c={"nccl": "ncclGather"}, root="dst", reference=ref_gather,
    pg=('gather',), pg_params='output_tensors, input_tensors, opts=None',
    pg_map={'tensor': "_one(input_tensors, 'input_tensors')", 'gather_list': '(list(output_tensors[0]) if output_tensors else []) or None', 'dst': '_root(opts)'},
)
def _plan_gather(cx: Any, tensor: Any, gather_list: Any = None, dst: Any = 0) -> Plan:
    t, dst, d, outs = _rooted(cx, "gather", tensor, gather_list, "gather_list", dst, "dst", "destination")
    me, n = cx.rank, t.numel()
    f = cx.cfunc("gather")
    if f is not None:  # NCCL >= 2.28: one native call into a flat buffer on the root
        flat = t.new_empty((n * cx.size,)) if me == dst else t
        return Plan(f, (cx.vp(t), cx.vp(flat), n, d, dst, cx.handle), _unpack(flat, outs, n) if me == dst else None,
                    (t, flat, *outs), tuple(outs), "gather")
    # oneCCL has no Gather: Send/Recv in one group.
    vp = cx.vp
    sends = [] if me == dst or not n else [(vp(t), n, dst, d)]
    recvs = [(vp(o), n, p, d) for p, o in enumerate(outs) if p != me and n]
    post = (lambda: outs[me].view(-1).copy_(t.view(-1))) if me == dst else None
    return cx.p2p_group(sends, recvs, post, (t, *outs), tuple(outs))


@collective(
    name="scatter",
    params=(_T("tensor", TENSOR, role="out"), _T("scatter_list", TENSOR_LIST, None, role="in", root_only=True,
                                                 compare=None), _T("src", RANK, 0)),
    doc="Scatter ``scatter_list`` of rank ``src``: rank i receives element i into ``tensor``.",
    c={"nccl": "ncclScatter", "oneccl": "onecclScatter"}, root="src", reference=ref_scatter,
    pg=('scatter',), pg_params='output_tensors, input_tensors, opts=None',
    pg_map={'tensor': "_one(output_tensors, 'output_tensors')", 'scatter_list': '(list(input_tensors[0]) if input_tensors else []) or None', 'src': '_root(opts)'},
)
def _plan_scatter(cx: Any, tensor: Any, scatter_list: Any = None, src: Any = 0) -> Plan:
    t, src, d, ins = _rooted(cx, "scatter", tensor, scatter_list, "scatter_list", src, "src", "source")
    me, n = cx.rank, t.numel()
    f = cx.cfunc("scatter")
    if f is not None:  # oneCCL, NCCL >= 2.28: one native call from a flat buffer on the root
        if me != src:
            return Plan(f, (cx.vp(t), cx.vp(t), n, d, src, cx.handle), None, (t,), (t,), "scatter")
        # the root packs scatter_list when the call runs (cx.read_first), behind queued work that may write it
        flat = t.new_empty((n * cx.size,))
        plan = Plan(f, (cx.vp(flat), cx.vp(t), n, d, src, cx.handle), None, (t, flat, *ins), (t,), "scatter")
        return cx.read_first(plan, lambda: cx.torch.cat([x.reshape(-1) for x in ins], out=flat))
    vp = cx.vp
    sends = [(vp(x), n, p, d) for p, x in enumerate(ins) if p != me and n]
    recvs = [] if me == src or not n else [(vp(t), n, src, d)]
    post = (lambda: t.view(-1).copy_(ins[me].view(-1))) if me == src else None
    return cx.p2p_group(sends, recvs, post, (t, *ins), (t,))


def _p2p_planner(kind: str, peer_name: str) -> Callable[..., Plan]:
    def plan(cx: Any, tensor: Any, peer: Any, tag: Any = 0) -> Plan:
        return cx.p2p(kind, tensor, peer, peer_name, tag)
    return plan


for _name, _kind, _peer, _mode, _ret, _doc in (
    ("send", "send", "dst", "never", "none", "Send ``tensor`` to rank ``dst``; returns when it may be reused."),
    ("recv", "recv", "src", "never", "src", "Receive into ``tensor`` from rank ``src``; returns ``src`` (as torch does)."),
    ("isend", "send", "dst", "always", "work", "Send ``tensor`` to rank ``dst`` asynchronously; returns a Work."),
    ("irecv", "recv", "src", "always", "work", "Receive into ``tensor`` from rank ``src`` asynchronously; returns a Work."),
):
    collective(
        name=_name, params=(_T("tensor", TENSOR, role="in" if _kind == "send" else "out"), _T(_peer, RANK),
                            _T("tag", TAG, 0, compare=None)),
        doc=_doc, c={"nccl": "nccl" + _kind.capitalize(), "oneccl": "oneccl" + _kind.capitalize()},
        send="tensor" if _kind == "send" else None, recv="tensor" if _kind == "recv" else None,
        count=("tensor", "numel"), async_mode=_mode, returns=_ret, p2p=True, fast=_mode == "never",
        **({} if _mode != "always" else {
            "pg": (_kind,), "pg_params": f"tensors, {_peer}Rank, tag=0",
            "pg_map": {"tensor": "_one(tensors, 'tensors')", _peer: f"{_peer}Rank", "tag": "tag"}}),
    )(_p2p_planner(_kind, _peer))


@collective(
    name="batch_isend_irecv",
    params=(_T("p2p_op_list", ANY, compare=None),),
    doc="Issue the P2POps as one group launch; returns a one-Work list (as torch's coalesced path).",
    c={}, async_mode="always", returns="work_list", p2p=True,
)
def _plan_batch_isend_irecv(cx: Any, p2p_op_list: Any) -> Plan:
    return cx.batch(p2p_op_list)


@collective(
    name="barrier", params=(),
    doc="Wait until every rank reached the barrier (a one-element all_reduce).",
    c={}, compiled=True, reference=ref_barrier,
)
def _plan_barrier(cx: Any) -> Plan:
    return cx.barrier()


del _name, _kind, _peer, _mode, _ret, _doc
