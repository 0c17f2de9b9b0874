"""Reduction operators, with the names torch.distributed uses.

``streamcoll.ReduceOp.SUM`` and ``torch.distributed.ReduceOp.SUM`` are both
accepted everywhere an ``op`` is taken, so swapping the import keeps working.
PREMUL_SUM carries a factor: ``streamcoll.premul_sum(0.5)`` (or torch's
``dist._make_nccl_premul_sum(0.5)``).
"""
from __future__ import annotations

import enum
from typing import Any, Hashable, Optional, Tuple, Union

import torch

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


_ONE = torch.ones((), dtype=torch.float64)


class PreMulSum:
    """SUM of inputs each multiplied by ``factor`` first (NCCL's ncclRedOpCreatePreMulSum).

    ``factor``: a Python float, or a one-element floating tensor (as torch's
    ``_make_nccl_premul_sum`` takes). The factor is also kept as a 0-d
    float64 CPU tensor, :attr:`tensor`, made once here: that is what
    compiled code passes the custom ops, so under ``torch.compile`` the
    factor is a graph input, not a constant baked into (and guarded by) the
    graph; a per-step factor (``1 / num_tokens``) then needs one graph, not
    one per value. Eager code reads :attr:`factor` (a tensor given on a GPU
    is read once, with a synchronisation).
    """

    __slots__ = ("tensor", "_factor")

    def __init__(self, factor: Union[float, "torch.Tensor"]) -> None:
        if isinstance(factor, torch.Tensor):
            if factor.numel() != 1 or not factor.dtype.is_floating_point:
                raise TypeError(f"premul_sum factor: expected a Python float or a one-element floating tensor, "
                                f"got a {factor.dtype} tensor of shape {tuple(factor.shape)}")
            self.tensor = factor.detach().reshape(()).to(device="cpu", dtype=torch.float64)
            self._factor: Optional[float] = None
            return
        if torch.compiler.is_compiling():
            # traced: a float argument of the compiled function the compiler made
            # symbolic stays symbolic (float() or scalar_tensor would specialise it)
            self._factor = None
            self.tensor = _ONE * factor
            return
        if isinstance(factor, bool) or not isinstance(factor, (int, float)):
            raise TypeError(f"premul_sum factor: expected a Python float, got {type(factor).__name__}")
        self._factor = float(factor)
        self.tensor = torch.tensor(self._factor, dtype=torch.float64)

    @property
    def factor(self) -> float:
        """The factor as a float."""
        f = self._factor
        if f is None:
            f = self._factor = float(self.tensor.item())
        return f

    def __eq__(self, other: object) -> bool:
        return isinstance(other, PreMulSum) and other.factor == self.factor

    def __hash__(self) -> int:
        return hash(("PREMUL_SUM", self.factor))

    def __repr__(self) -> str:
        return f"premul_sum({self.factor!r})"


def premul_sum(factor: Union[float, "torch.Tensor"]) -> PreMulSum:
    """A PREMUL_SUM reduction with the given factor (a float or a one-element tensor)."""
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
            return "PREMUL_SUM", _torch_premul_factor(op)
        if name in ReduceOp.__members__:
            return ReduceOp[name].value, 1.0
        raise TypeError(f"op: {name} is not supported by streamcoll (supported: SUM, PRODUCT, MIN, MAX, AVG, PREMUL_SUM)")
    raise TypeError(f"op: expected a streamcoll.ReduceOp or torch.distributed.ReduceOp, got {op!r}")


def _torch_premul_factor(op: Any) -> float:
    """The factor of torch's ``dist._make_nccl_premul_sum(factor)`` (FSDP2's
    ``set_gradient_divide_factor`` passes one): torch keeps it in a C++
    supplement that only the op's pickle state, ``(PREMUL_SUM, factor)``,
    exposes to Python. A tensor factor (one element) is read as a float."""
    getstate = getattr(op, "__getstate__", None)
    state = getstate() if callable(getstate) else None
    factor = state[1] if isinstance(state, tuple) and len(state) == 2 else None
    if factor is None:
        raise TypeError("op: torch's PREMUL_SUM without a factor; pass streamcoll.premul_sum(factor) or "
                        "torch.distributed._make_nccl_premul_sum(factor)")
    if hasattr(factor, "numel"):
        if factor.numel() != 1:
            raise ValueError(f"op: PREMUL_SUM factor: expected one element, got a tensor of shape "
                             f"{tuple(factor.shape)}")
        factor = factor.item()
    if isinstance(factor, bool) or not isinstance(factor, (int, float)):
        raise TypeError(f"op: PREMUL_SUM factor: expected a float, got {factor!r}")
    return float(factor)


def op_key(op: Any) -> Hashable:
    """A hashable cache key for ``op``. By value, ``(name, factor)``, for
    torch's ReduceOp instances: some are not hashable, and its PREMUL_SUMs
    hash and compare equal whatever their factors."""
    if type(op).__name__ == "ReduceOp" and not isinstance(op, ReduceOp):
        return ("op", canonical_op(op))
    try:
        hash(op)
        return op
    except TypeError:
        return ("op", canonical_op(op))
