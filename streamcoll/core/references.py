"""What each collective must leave on every rank, in numpy: the reference
semantics the table names (:attr:`CollectiveSpec.reference
<streamcoll.core.spec.CollectiveSpec>`), which the table-driven, fuzz and
bad-input tests and the benchmark checks compare against. Never on a call
path."""
from __future__ import annotations

from typing import List, Sequence

import numpy as np

# Reference implementations: ``ref(size, rank, inputs, **args)`` where
# ``inputs[r]`` is what rank r passed (numpy arrays; lists for list buffers)
# returns what rank ``rank`` must hold afterwards, as {param: array or list}.
def _reduce(arrs: Sequence[np.ndarray], op: str, factor: float = 1.0) -> np.ndarray:
    a = np.stack([np.asarray(x) for x in arrs])
    if op == "SUM":
        return a.sum(0).astype(a.dtype)
    if op == "PRODUCT":
        return a.prod(0).astype(a.dtype)
    if op == "MIN":
        return a.min(0)
    if op == "MAX":
        return a.max(0)
    if op == "AVG":
        s = a.sum(0)
        if np.issubdtype(a.dtype, np.integer):
            return (s // len(arrs)).astype(a.dtype)  # non-negative test values: trunc == floor
        return (s / len(arrs)).astype(a.dtype)
    if op == "PREMUL_SUM":
        return (a * factor).sum(0).astype(a.dtype)
    raise ValueError(op)


def ref_all_reduce(size: int, rank: int, ins: List[dict], op: str = "SUM", factor: float = 1.0) -> dict:
    return {"tensor": _reduce([i["tensor"] for i in ins], op, factor)}


def ref_broadcast(size: int, rank: int, ins: List[dict], src: int = 0) -> dict:
    return {"tensor": ins[src]["tensor"]}


def ref_reduce(size: int, rank: int, ins: List[dict], dst: int = 0, op: str = "SUM", factor: float = 1.0) -> dict:
    return {"tensor": _reduce([i["tensor"] for i in ins], op, factor) if rank == dst else ins[rank]["tensor"]}


def ref_all_gather_into_tensor(size: int, rank: int, ins: List[dict]) -> dict:
    return {"output_tensor": np.concatenate([i["input_tensor"].reshape(-1) for i in ins])}


def ref_all_gather(size: int, rank: int, ins: List[dict]) -> dict:
    return {"tensor_list": [i["tensor"] for i in ins]}


def ref_reduce_scatter_tensor(size: int, rank: int, ins: List[dict], op: str = "SUM", factor: float = 1.0) -> dict:
    full = _reduce([i["input"].reshape(-1) for i in ins], op, factor)
    n = full.size // size
    return {"output": full[rank * n:(rank + 1) * n]}


def ref_reduce_scatter(size: int, rank: int, ins: List[dict], op: str = "SUM", factor: float = 1.0) -> dict:
    return {"output": _reduce([i["input_list"][rank] for i in ins], op, factor)}


def ref_all_to_all_single(size: int, rank: int, ins: List[dict]) -> dict:
    # ins[r] may carry rank r's input_split_sizes (rows of dim 0); without them the split is even.
    blocks = []
    for r in range(size):
        splits = ins[r].get("input_split_sizes")
        if splits is None:
            x = ins[r]["input"].reshape(-1)
            n = x.size // size
            blocks.append(x[rank * n:(rank + 1) * n])
        else:
            start = sum(splits[:rank])
            blocks.append(ins[r]["input"][start:start + splits[rank]].reshape(-1))
    return {"output": np.concatenate(blocks)}


def ref_all_to_all(size: int, rank: int, ins: List[dict]) -> dict:
    return {"output_tensor_list": [ins[r]["input_tensor_list"][rank] for r in range(size)]}


def ref_gather(size: int, rank: int, ins: List[dict], dst: int = 0) -> dict:
    return {"gather_list": [i["tensor"] for i in ins]} if rank == dst else {}


def ref_scatter(size: int, rank: int, ins: List[dict], src: int = 0) -> dict:
    return {"tensor": ins[src]["scatter_list"][rank]}


def ref_barrier(size: int, rank: int, ins: List[dict]) -> dict:
    return {}
