"""Reduction operators, with the names torch.distributed uses.

``streamcoll.ReduceOp.SUM`` and ``torch.distributed.ReduceOp.SUM`` are both
accepted everywhere an ``op`` is taken, so swapping the import keeps working.
PREMUL_SUM carries a factor: ``streamcoll.premul_sum(0.5)`` (or torch's
``dist._make_nccl_premul_sum(0.5)``).
"""
from __future__ import annotations

import enum
from typing import Any, Hashable, Tuple

__all__ = ["ReduceOp", "PreMulSum", "premul_sum", "canonical_op"]


class ReduceOp(enum.Enum):
    """The reductions of torch.distributed.ReduceOp that collectives libraries implement."""

    SUM = "SUM"
    PRODUCT = "PRODUCT"
    MIN = "MIN"
    MAX = "MAX"
    AVG = "AVG"
    PREMUL_SUM = "PREMUL_SUM"

    # torch.distributed spells it PRODUCT; PROD is accepted as an alias.
    PROD = "PRODUCT"

    def __repr__(self) -> str:
        return f"ReduceOp.{self.name}"


class PreMulSum:
    """SUM of inputs each multiplied by ``factor`` first (NCCL's ncclRedOpCreatePreMulSum)."""

    __slots__ = ("factor",)

    def __init__(self, factor: float) -> None:
        if isinstance(factor, bool) or not isinstance(factor, (int, float)):
            raise TypeError(f"premul_sum factor: expected a Python float, got {type(factor).__name__}")
        self.factor = float(factor)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, PreMulSum) and other.factor == self.factor

    def __hash__(self) -> int:
        return hash(("PREMUL_SUM", self.factor))

    def __repr__(self) -> str:
        return f"premul_sum({self.factor!r})"


def premul_sum(factor: float) -> PreMulSum:
    """A PREMUL_SUM reduction with the given scalar factor."""
    return PreMulSum(factor)


def canonical_op(op: Any) -> Tuple[str, float]:
    """``(name, factor)`` for any accepted op spelling; ``factor`` is 1.0 except
    for PREMUL_SUM. Raises TypeError naming the argument for anything else."""
    if isinstance(op, ReduceOp):
        if op is ReduceOp.PREMUL_SUM:
            raise TypeError("op: ReduceOp.PREMUL_SUM needs a factor; pass streamcoll.premul_sum(factor)")
        return op.value, 1.0
    if isinstance(op, PreMulSum):
        return "PREMUL_SUM", op.factor
    if isinstance(op, str) and op.upper() in ReduceOp.__members__:
        return canonical_op(ReduceOp[op.upper()])
    # torch.distributed.ReduceOp.RedOpType (what dist.ReduceOp.SUM is) or a
    # dist.ReduceOp instance wrapping one.
    inner = getattr(op, "op", op)
    name = getattr(inner, "name", None)
    if isinstance(name, str) and type(inner).__name__ == "RedOpType":
        if name == "PREMUL_SUM":
            raise TypeError(
                "op: torch's PREMUL_SUM does not expose its factor to Python; "
                "pass streamcoll.premul_sum(factor)"
            )
        if name in ReduceOp.__members__:
            return ReduceOp[name].value, 1.0
        raise TypeError(f"op: {name} is not supported by streamcoll (supported: SUM, PRODUCT, MIN, MAX, AVG, PREMUL_SUM)")
    raise TypeError(f"op: expected a streamcoll.ReduceOp or torch.distributed.ReduceOp, got {op!r}")


def op_key(op: Any) -> Hashable:
    """A hashable cache key for ``op`` (torch's ReduceOp instances are not hashable)."""
    try:
        hash(op)
        return op
    except TypeError:
        return ("op", canonical_op(op))
