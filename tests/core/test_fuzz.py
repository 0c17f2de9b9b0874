"""Bad input, fuzzed (issue 7): hypothesis generates calls of every
collective of the declaration table (:mod:`streamcoll.core.spec`) with random
shapes, dtypes, strides, devices, ranks, ops and list lengths, often with one
argument broken; every rank of a real oneCCL world runs the same call.

Everything per collective comes from its declaration: the arguments from its
ParamSpecs (a buffer per tensor parameter, sized by the declared size
relations, right or off by one; a list of one tensor per rank; roots; the
reduction; split sizes), the call from its signature, the expected values
from its ``reference`` (point-to-point pairs: the receiver holds what the
sender sent). A collective added to the table is fuzzed without new code;
only batch_isend_irecv (a list of P2POps) is built by hand, and what cannot be
built is listed in ``NOT_FUZZED`` with the reason. Each call must either give the right result or raise a
clear exception (TypeError/ValueError/NotImplementedError or a streamcoll
error other than a library error, its message starting with the name of the
argument) before any C call (the communicator's sequence number does not
move); the process never crashes; the communicator stays usable (a real
all_reduce after every call).

The calls are generated in the test process (derandomized) and sent to the
ranks, so every rank runs the same sequence; ranks only differ where the API
says they do (root-only lists, which rank sends or receives), and the faults
are chosen so that every rank sees the same verdict: an argument that only
one rank checks, broken on that rank alone, would leave the others inside a
collective, which no validation can prevent (torch.distributed has the same
limit; the debug mode's cross-rank check is the tool for that).
"""
from __future__ import annotations

import re
from typing import Any, Dict, List, Optional, Tuple

import numpy as np
import pytest
import torch

import streamcoll
from streamcoll.core import spec

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

DTYPES = ["float32", "float64", "float16", "bfloat16", "int32", "int64", "int8", "uint8", "bool"]
BAD_DTYPES = ["complex64", "uint16", "uint32", "float8_e4m3fn"]
TENSOR_FAULTS = ["meta", "noncontig", "expanded", "baddtype", "list", "none", "int", "numpy"]
RANK_FAULTS = ["size", "negative", "bool", "float", "str", "none", "np_int"]
OPS = ["SUM", "PRODUCT", "MIN", "MAX", "AVG", "premul", "torch_SUM", "str_max"]
BAD_OPS = ["bogus", "int3", "none", "PREMUL_SUM_nofactor", "torch_BAND"]
CLEAR = (TypeError, ValueError, NotImplementedError, streamcoll.CollectiveError)
ARG_FIRST = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\[\d+\])?(\.[a-z_]+)?: ")


# ======================================================== on every rank
def _fill(shape, dtype: torch.dtype, v: int) -> torch.Tensor:
    n = int(np.prod(shape)) if len(shape) else 1
    base = torch.arange(n, dtype=torch.int64) + v
    if dtype == torch.bool:
        x = base % 2 == 0
    else:
        x = (base % 3 + 1).to(dtype)
    return x.reshape(tuple(shape))


def _make(ts: Dict[str, Any], v: int, empty: bool = False) -> Any:
    """The tensor (or broken stand-in) a spec describes, filled with value key ``v``."""
    shape = tuple(ts["shape"])
    dtype = getattr(torch, ts["dtype"])
    fault = ts.get("fault")
    good = torch.zeros(shape, dtype=dtype) if empty else _fill(shape, dtype, v)
    if fault is None:
        return good
    if fault == "meta":
        return torch.empty(shape, dtype=dtype, device="meta")
    if fault == "noncontig":
        big = torch.zeros(shape + (2,), dtype=dtype)
        big[..., 0] = good
        return big[..., 0]
    if fault == "expanded":  # stride 0: not contiguous (unless it has one element or none)
        if not len(shape):
            return good
        one = good.reshape(-1)[:1] if good.numel() else torch.zeros(1, dtype=dtype)
        return one.expand(*shape)
    if fault == "baddtype":
        return torch.zeros(shape, dtype=getattr(torch, ts["bad_dtype"]))
    if fault == "list":
        return good.tolist()
    if fault == "none":
        return None
    if fault == "int":
        return 3
    if fault == "numpy":
        return good.numpy() if dtype in (torch.float32, torch.float64, torch.int32, torch.int64) else good
    raise AssertionError(fault)


def _as_torch(x: Any) -> torch.Tensor:
    return torch.from_numpy(x) if isinstance(x, np.ndarray) else x


def _is_me(root: Any, r: int) -> bool:
    return isinstance(root, (int, np.integer)) and not isinstance(root, bool) and int(root) == r


def _rank_value(spec_rank: Any, size: int) -> Any:
    """A (possibly broken) rank argument; valid values are given as ints."""
    if isinstance(spec_rank, int):
        return spec_rank
    kind, val = spec_rank
    return {"size": size, "negative": -1, "bool": True, "float": float(val), "str": str(val), "none": None,
            "np_int": np.int64(val), "big": size + 5}[kind]


def _op_value(name: str):
    import torch.distributed as dist
    return {"SUM": streamcoll.ReduceOp.SUM, "PRODUCT": streamcoll.ReduceOp.PRODUCT, "MIN": streamcoll.ReduceOp.MIN,
            "MAX": streamcoll.ReduceOp.MAX, "AVG": streamcoll.ReduceOp.AVG, "premul": streamcoll.premul_sum(2.0),
            "torch_SUM": dist.ReduceOp.SUM, "str_max": "max", "bogus": "bogus", "int3": 3, "none": None,
            "PREMUL_SUM_nofactor": streamcoll.ReduceOp.PREMUL_SUM, "torch_BAND": dist.ReduceOp.BAND}[name]


# The reduction each fuzzed op spelling means (the reference's names), and its factor.
_OP_REF = {"SUM": ("SUM", 1.0), "PRODUCT": ("PRODUCT", 1.0), "MIN": ("MIN", 1.0), "MAX": ("MAX", 1.0),
           "AVG": ("AVG", 1.0), "premul": ("PREMUL_SUM", 2.0), "torch_SUM": ("SUM", 1.0), "str_max": ("MAX", 1.0)}


def _rejected(opname: str, dtype: torch.dtype) -> str:
    """Why the library must refuse ``opname`` on ``dtype`` ('' where it must not)."""
    if opname not in _OP_REF:
        return f"op {opname} accepted"
    ref = _OP_REF[opname][0]
    if dtype == torch.bool and ref in ("AVG", "PREMUL_SUM"):
        return f"{opname} on bool accepted"
    if ref == "PREMUL_SUM" and not dtype.is_floating_point:
        return "premul_sum on an integer dtype accepted"
    return ""


def _np(x: torch.Tensor) -> np.ndarray:
    """What the reference computes on (numpy has no bfloat16: float32 holds its values exactly)."""
    return (x.float() if x.dtype == torch.bfloat16 else x).numpy()


def _same(got: Any, want: Any, what: str) -> None:
    """``got`` (a tensor, or the numpy array it was passed as) holds the reference's ``want``,
    element by element in the buffer's own dtype."""
    got = _as_torch(got)
    want = torch.as_tensor(np.asarray(want)).reshape(-1).to(got.dtype)
    assert got.numel() == want.numel(), (what, got, want)
    g = got.reshape(-1)
    if got.dtype.is_floating_point:
        ok = torch.allclose(g.double(), want.double(), rtol=1e-2, atol=1e-2)
    else:
        ok = torch.equal(g, want)
    assert ok, f"{what}: wrong result {got} != {want}"


def _value_key(rank: int, pidx: int, j: int, n: int) -> int:
    return 1 + rank * n + j + 3 * pidx


def _shape(c: Dict[str, Any], pname: str, rank: int, n: int) -> List[int]:
    """Buffer ``pname``'s shape on ``rank``: as generated, or (split sizes drawn) rows from the matrix."""
    M = c.get("matrix")
    if M is None or pname not in c["split_of"]:
        return c["shapes"][pname]
    rows = sum(M[rank]) if c["split_of"][pname] == "in" else sum(M[i][rank] for i in range(n))
    return [rows] + c["rest"]


def _splits_value(c: Dict[str, Any], p: spec.ParamSpec, rank: int, n: int) -> Any:
    M = c.get("matrix")
    if M is None:
        return None
    if c["splits"][p.name] == "in":
        v = list(M[rank])
        return _break_splits(v, c["split_fault"], n) if c.get("split_fault") else v
    return [M[i][rank] for i in range(n)]


def _build(c: Dict[str, Any], s: spec.CollectiveSpec, rank: int, n: int, real: bool):
    """Rank ``rank``'s arguments of the generated call ``c`` (``real``: with its faults) and
    its inputs as the reference sees them."""
    root = _rank_value(c["ranks"][s.root], n) if s.root else None
    args: Dict[str, Any] = {}
    ins: Dict[str, Any] = {}
    for i, p in enumerate(s.params):
        if p.kind == spec.TENSOR:
            ts = dict(c["tensors"][p.name], shape=_shape(c, p.name, rank, n))
            fill = p.role in ("in", "inout")
            v = _value_key(rank, i, 0, n)
            ins[p.name] = _np(_fill(ts["shape"], getattr(torch, ts["dtype"]), v)) if fill else None
            args[p.name] = _make(ts if real else dict(ts, fault=None), v, empty=not fill)
        elif p.kind == spec.TENSOR_LIST:
            if p.root_only and not _is_me(root, rank):
                args[p.name] = None
                continue
            lst = c["lists"][p.name]
            fill = p.role in ("in", "inout")
            ins[p.name] = [_np(_fill(x["shape"], getattr(torch, x["dtype"]), _value_key(rank, i, j, n)))
                           for j, x in enumerate(lst)] if fill else None
            args[p.name] = [_make(x if real else dict(x, fault=None), _value_key(rank, i, j, n), empty=not fill)
                            for j, x in enumerate(lst)]
        elif p.kind == spec.RANK:
            args[p.name] = _rank_value(c["ranks"][p.name], n)
        elif p.kind == spec.OP:
            args[p.name] = _op_value(c["op"])
        elif p.kind == spec.SPLITS:
            args[p.name] = ins[p.name] = _splits_value(c, p, rank, n)
        else:
            args[p.name] = p.default
    return args, ins


def _call(comm, c: Dict[str, Any]):
    """Build the arguments of the generated call ``c`` for this rank, call, return a checker of the result."""
    if c["fn"] == "batch_isend_irecv":
        return _call_batch(comm, c)
    if "pair" in c:
        return _call_pair(comm, c)
    s = spec.TABLE[c["fn"]]
    r, n = comm.rank, comm.size
    group: Any = comm if c.get("group_fault") is None else c["group_fault"]
    args, _ = _build(c, s, r, n, real=True)
    kw: Dict[str, Any] = {"group": group}
    if s.async_mode == "param":
        kw["async_op"] = c["async_op"]
    w = getattr(streamcoll, s.name)(*[args[p] for p in s.param_names], **kw)
    if w is not None:
        w.wait()
    # Accepted: what every rank passed, and what the reference says this rank holds now.
    ins = [_build(c, s, i, n, real=False)[1] for i in range(n)]
    rkw: Dict[str, Any] = {p.name: args[p.name] for p in s.params if p.kind == spec.RANK}
    if s.reduces:
        dtype = _as_torch(args[s.buffers[0].name] if s.buffers[0].kind == spec.TENSOR
                          else args[s.buffers[0].name][0]).dtype
        why = _rejected(c["op"], dtype)
        if why:
            raise AssertionError(why)
        rkw["op"], factor = _OP_REF[c["op"]]
        if rkw["op"] == "PREMUL_SUM":
            rkw["factor"] = factor
    want = s.reference(n, r, ins, **rkw)  # type: ignore[misc]

    def check() -> None:
        for pname, exp in want.items():
            if isinstance(exp, list):
                assert len(args[pname]) == len(exp), (pname, args[pname])
                for j, e in enumerate(exp):
                    _same(args[pname][j], e, f"{s.name} {pname}[{j}]")
            else:
                _same(args[pname], exp, f"{s.name} {pname}")
    return check


def _call_pair(comm, c: Dict[str, Any]):
    """A point-to-point pair of the table (a sender and its receiver): rank 0
    sends to rank 1, the others take no part; what rank 1 receives is what
    rank 0 sent. A broken peer is the same on every rank, so every rank
    calls both and raises."""
    snd, rcv = (spec.TABLE[x] for x in c["pair"])
    r = comm.rank
    group: Any = comm if c.get("group_fault") is None else c["group_fault"]
    ts = c["tensors"]["tensor"]
    t = _make(ts, 7 if r == 0 else 0, empty=(r != 0))

    def call(sp: spec.CollectiveSpec, peer: Any) -> None:
        ret = getattr(streamcoll, sp.name)(t, peer, group=group)
        if sp.returns == "src":
            assert ret == peer, (sp.name, ret, peer)
        elif sp.async_mode == "always":
            ret.wait()
        else:
            assert ret is None, (sp.name, ret)

    fault = c.get("peer")
    if fault is None:
        if r == 0:
            call(snd, 1)
        elif r == 1:
            call(rcv, 0)
            return lambda: _same(t, _np(_fill(ts["shape"], getattr(torch, ts["dtype"]), 7)), rcv.name)
        return "idle"
    peer = r if fault[0] == "self" else _rank_value(fault, comm.size)
    call(snd, peer)
    call(rcv, peer)
    return lambda: None


def _call_batch(comm, c: Dict[str, Any]):
    """batch_isend_irecv (its parameter is a list of P2POps, which no ParamSpec
    describes): a ring of isend to rank+1 and irecv from rank-1."""
    r, n = comm.rank, comm.size
    group: Any = comm if c.get("group_fault") is None else c["group_fault"]
    ts = c["tensors"]["tensor"]
    dt = getattr(torch, ts["dtype"])
    s = _make(ts, r + 1)
    rb = torch.zeros(tuple(ts["shape"]), dtype=dt)
    nxt, prv = (r + 1) % n, (r - 1) % n
    if c.get("peer") is not None:
        nxt = prv = _rank_value(c["peer"], n)
    op_send = {"ok": streamcoll.isend, "bogus": print, "torch": torch.distributed.isend}[c["p2p_op"]]
    ops = [streamcoll.P2POp(op_send, s, nxt, group), streamcoll.P2POp(streamcoll.irecv, rb, prv, group)]
    if c.get("empty"):
        ops = []
    for w in streamcoll.batch_isend_irecv(ops):
        w.wait()
    return lambda: _same(rb, _np(_fill(ts["shape"], dt, (r - 1) % n + 1)), "batch_isend_irecv")


def _break_splits(sizes: List[int], fault: str, n: int) -> Any:
    if fault == "length":
        return sizes + [0]
    if fault == "negative":
        return [-1] + sizes[1:]
    if fault == "sum":
        return [sizes[0] + 1] + sizes[1:]
    if fault == "bool":
        return [True] + sizes[1:]
    if fault == "float":
        return [float(sizes[0])] + sizes[1:]
    raise AssertionError(fault)


def run_spec(comm, spec_: Dict[str, Any]) -> Dict[str, Any]:
    """Run one generated call on this rank; check its result or its error."""
    seq0 = comm.seq
    res: Dict[str, Any] = {}
    try:
        check = _call(comm, spec_)
        if check == "idle":  # takes no part in this point-to-point exchange
            check = None
            res["idle"] = True
    except CLEAR as e:
        assert not isinstance(e, (streamcoll.LibraryError, streamcoll.CommunicatorError)), \
            f"{spec_}: raised after reaching the library: {e!r}"
        msg = str(e)
        assert ARG_FIRST.match(msg), f"{spec_}: message does not start with the argument's name: {msg!r}"
        assert comm.seq == seq0, f"{spec_}: {type(e).__name__} raised after a launch (seq {seq0} -> {comm.seq})"
        res.update(outcome="error", type=type(e).__name__, arg=msg.split(":", 1)[0])
    else:
        if check is not None:
            check()
        res["outcome"] = "ok"
    # Still usable: a real collective on the same communicator.
    x = torch.ones(3)
    comm.all_reduce(x)
    assert x.tolist() == [float(comm.size)] * 3
    return res


# ======================================================== generation
def _p(draw) -> float:
    """A uniform draw in [0, 1) (hypothesis biases float draws towards their bounds)."""
    return draw(st.integers(0, 99)) / 100


def _tensor(draw, shape=None, dtype=None, fault_rate=0.25, faults=TENSOR_FAULTS) -> Dict[str, Any]:
    if shape is None:
        shape = draw(st.lists(st.integers(0, 3), min_size=0, max_size=3))
    ts = {"shape": list(shape), "dtype": dtype or draw(st.sampled_from(DTYPES)), "fault": None}
    if _p(draw) < fault_rate:
        ts["fault"] = draw(st.sampled_from(faults))
        if ts["fault"] == "baddtype":
            ts["bad_dtype"] = draw(st.sampled_from([d for d in BAD_DTYPES if hasattr(torch, d)]))
    return ts


def _root(draw, n: int) -> Any:
    if _p(draw) < 0.2:
        kind = draw(st.sampled_from(RANK_FAULTS + ["big"]))
        return [kind, draw(st.integers(0, n - 1))]
    return draw(st.integers(0, n - 1))


def _list(draw, n: int, shape, dtype, fault_rate=0.3) -> List[Dict[str, Any]]:
    length = n
    if _p(draw) < 0.15:
        length = draw(st.sampled_from([0, n - 1, n + 1]))
    lst = [{"shape": list(shape), "dtype": dtype, "fault": None} for _ in range(length)]
    if lst and _p(draw) < fault_rate:
        i = draw(st.integers(0, length - 1))
        lst[i] = _tensor(draw, shape, dtype, fault_rate=1.0, faults=["meta", "noncontig", "baddtype", "none", "int"])
    return lst


def _numel(shape: List[int]) -> int:
    return int(np.prod(shape)) if shape else 1


def _p2p_pairs() -> Dict[str, Tuple[str, str]]:
    """The table's point-to-point pairs: each sender (``tensor`` read, a peer) with the
    receiver of the same launch mode."""
    def role(s: spec.CollectiveSpec) -> Optional[str]:
        return s.param("tensor").role if "tensor" in s.param_names else None
    out = {}
    for a in spec.TABLE.values():
        if a.p2p and role(a) == "in":
            for b in spec.TABLE.values():
                if b.p2p and role(b) == "out" and b.async_mode == a.async_mode:
                    out[f"{a.name}+{b.name}"] = (a.name, b.name)
    return out


PAIRS = _p2p_pairs()
# Not fuzzed, with the reason (its own tests cover it): a parameter no ParamSpec kind can build.
NOT_FUZZED = {"all_gather_coalesced": "a list of lists per rank; tests/integrations/test_process_group.py covers it"}
FNS = [n for n, s in spec.TABLE.items() if not s.p2p and n not in NOT_FUZZED] + list(PAIRS) + ["batch_isend_irecv"]


@st.composite
def calls(draw, fn: str, n: int):
    c: Dict[str, Any] = {"fn": fn, "async_op": draw(st.booleans())}
    if _p(draw) < 0.05:
        c["group_fault"] = draw(st.sampled_from(["default", 0]))
    if fn in PAIRS or fn == "batch_isend_irecv":
        if fn in PAIRS:
            c["pair"] = PAIRS[fn]
        c["tensors"] = {"tensor": _tensor(draw, fault_rate=0.25, faults=["meta", "noncontig", "baddtype", "none"])}
        if _p(draw) < 0.3:
            c["peer"] = draw(st.sampled_from(
                [["size", 0], ["negative", 0], ["bool", 0], ["float", 0], ["none", 0], ["big", 0]]
                + ([["self", 0]] if fn != "batch_isend_irecv" else [])))
        if fn == "batch_isend_irecv":
            c["p2p_op"] = draw(st.sampled_from(["ok"] * 4 + ["bogus", "torch"]))
            c["empty"] = _p(draw) < 0.05
        return c
    s = spec.TABLE[fn]
    if s.reduces:
        c["op"] = draw(st.sampled_from(BAD_OPS if _p(draw) < 0.2 else OPS))
    c["ranks"] = {p.name: _root(draw, n) for p in s.params if p.kind == spec.RANK}
    dtype = draw(st.sampled_from(DTYPES))
    base = draw(st.lists(st.integers(0, 3), min_size=0, max_size=3))
    # Split sizes (torch's all-to-all): a parameter ``<buffer>_split_sizes`` splits dim 0 of
    # ``<buffer>``; drawn as a matrix M (rank i sends M[i][j] rows to rank j), the input buffer's
    # splits are its row, the output's its column, and the buffers' row counts follow.
    splits = {p.name: ("in" if s.param(p.name[:-len("_split_sizes")]).role == "in" else "out")
              for p in s.params if p.kind == spec.SPLITS}
    c["splits"] = splits
    c["split_of"] = {k[:-len("_split_sizes")]: v for k, v in splits.items()}
    faults = TENSOR_FAULTS
    if splits:
        rest = c["rest"] = draw(st.lists(st.integers(1, 2), min_size=0, max_size=1))
        if draw(st.booleans()):
            c["matrix"] = None
            base = [n * draw(st.integers(0, 2))] + rest
            faults = ["meta", "noncontig", "baddtype"]
        else:
            c["matrix"] = [[draw(st.integers(0, 2)) for _ in range(n)] for _ in range(n)]
            # Row counts differ between ranks here: only faults that break a tensor of any size
            # (a one-element strided tensor is contiguous, so valid on one rank and not another).
            base = [1] + rest
            faults = ["meta", "baddtype"]
            if _p(draw) < 0.3:
                c["split_fault"] = draw(st.sampled_from(["length", "negative", "sum", "bool", "float"]))
    # Shapes: every buffer like the base, but where the declaration relates two sizes
    # (``size*``: n times the other's elements), right or off by one.
    shapes = {p.name: list(base) for p in s.buffers}
    for buf, rel, other in s.sizes:
        m = _numel(shapes[other])
        if rel == "size*":
            shapes[buf] = draw(st.sampled_from([[n * m], [n] + shapes[other], [n * m + 1], [max(n * m - 1, 0)]]))
    c["shapes"] = shapes
    c["tensors"] = {p.name: _tensor(draw, shapes[p.name], dtype, fault_rate=0.2, faults=faults)
                    for p in s.params if p.kind == spec.TENSOR}
    # Lists: one tensor like the base per rank. A root-only list is the root's alone: broken
    # there only, the other ranks would go ahead into the collective (see the module
    # docstring), so it is left whole; the root's tensor and the root itself are fuzzed.
    c["lists"] = {p.name: ([{"shape": list(base), "dtype": dtype, "fault": None} for _ in range(n)]
                           if p.root_only else _list(draw, n, base, dtype))
                  for p in s.params if p.kind == spec.TENSOR_LIST}
    return c


def faults(c: Dict[str, Any], n: int) -> List[str]:
    """The faults the generator put into call ``c`` (empty: a valid call,
    which must go through and match the reference). Decided from what was
    generated, never from what the library accepts: a dtype of ``DTYPES``
    is one every backend must take, so a backend that loses one fails here
    instead of counting its refusal as a right answer. A drawn fault that
    happens to leave the argument valid (a "non-contiguous" tensor of one
    element) still counts as a fault: such calls are checked either way."""
    out: List[str] = []
    if c.get("group_fault") is not None:
        out.append("group")
    for name, ts in (c.get("tensors") or {}).items():
        if ts.get("fault") not in (None, "numpy"):  # numpy arrays are valid CPU buffers (README)
            out.append(f"{name}:{ts['fault']}")
    for name, lst in (c.get("lists") or {}).items():
        if len(lst) != n:
            out.append(f"{name}:length")
        out += [f"{name}[{j}]:{x['fault']}" for j, x in enumerate(lst) if x.get("fault") is not None]
    out += [f"{name}:{v[0]}" for name, v in (c.get("ranks") or {}).items() if not isinstance(v, int)]
    if c.get("peer") is not None:
        out.append(f"peer:{c['peer'][0]}")
    if c.get("p2p_op", "ok") != "ok":
        out.append(f"p2p_op:{c['p2p_op']}")
    if c.get("empty"):
        out.append("empty p2p_op_list")
    if c.get("split_fault"):
        out.append(f"splits:{c['split_fault']}")
    if c["fn"] in spec.TABLE:
        s = spec.TABLE[c["fn"]]
        shapes = c.get("shapes") or {}
        for buf, rel, other in s.sizes:
            if rel == "size*" and _numel(shapes[buf]) != n * _numel(shapes[other]):
                out.append(f"{buf}:size")
        if s.reduces:
            first = s.buffers[0].name
            dtype = (c["tensors"][first] if first in c["tensors"] else c["lists"][first][0])["dtype"]
            why = _rejected(c["op"], getattr(torch, dtype))
            if why:
                out.append(f"op:{why}")
    return out


# ======================================================== the test
@pytest.mark.parametrize("fn", FNS)
def test_fuzz_public_collectives(world3, fn):
    n = world3.size
    outcomes: List[Dict[str, Any]] = []
    valid: List[Dict[str, Any]] = []

    @settings(max_examples=25, derandomize=True, database=None, deadline=None, print_blob=True,
              suppress_health_check=list(HealthCheck))
    @given(call=calls(fn, n))
    def one(call):
        res = world3.run(run_spec, call, timeout=60)
        kinds = {(x["outcome"], x.get("type"), x.get("arg")) for x in res if not x.get("idle")}
        assert len(kinds) == 1, f"ranks disagree on {call}: {res}"
        if not faults(call, n):
            # No fault: it must go through (and run_spec checked the values against the reference).
            assert kinds == {("ok", None, None)}, f"a valid call was refused: {call}: {res}"
            valid.append(call)
        outcomes.append(res[0])

    one()
    assert valid, f"{fn}: no valid call among the generated ones"
    # Both branches were exercised: some calls went through, some were rejected
    # (a collective without parameters, barrier, can only go through).
    got = {o["outcome"] for o in outcomes}
    assert got == {"ok", "error"} or (fn in spec.TABLE and not spec.TABLE[fn].params), (fn, outcomes)
