"""Module-level collectives with torch.distributed's names, argument order and
defaults: swap ``torch.distributed`` for ``streamcoll`` in a training loop.

``group`` takes a :class:`~streamcoll.Communicator` (default: the one
:func:`streamcoll.init` made). Ranks (``src``, ``dst``, peers) are ranks in
that communicator. ``stream=`` (keyword only) launches on an explicit stream.
"""
from __future__ import annotations

from typing import List, Optional, Sequence

import torch
from torch.compiler import is_compiling as _compiling

from . import bootstrap
from . import custom_ops as _traced
from .communicator import Communicator, P2POp
from .ops import ReduceOp
from .work import Work

__all__ = [
    "all_reduce", "allreduce", "broadcast", "reduce", "all_gather_into_tensor", "all_gather",
    "reduce_scatter_tensor", "reduce_scatter", "all_to_all_single", "all_to_all", "gather", "scatter",
    "send", "recv", "isend", "irecv", "batch_isend_irecv", "barrier",
]

_SUM = ReduceOp.SUM


def _g(group: Optional[Communicator]) -> Communicator:
    if group is None:
        return bootstrap.default_communicator()
    if not isinstance(group, Communicator):
        raise TypeError(f"group: expected a streamcoll.Communicator or None, got {type(group).__name__}")
    return group


def all_reduce(tensor, op=_SUM, group: Optional[Communicator] = None, async_op: bool = False, *, stream=None) -> Optional[Work]:
    """Reduce ``tensor`` in place across ranks. Returns a Work if ``async_op`` else None.

    Under torch.compile this (and broadcast, reduce, all_gather_into_tensor,
    reduce_scatter_tensor, all_to_all_single, barrier) becomes streamcoll's
    custom ops (:mod:`streamcoll.custom_ops`); eager calls skip the dispatcher."""
    if _compiling():
        return _traced.all_reduce(tensor, op, group, async_op, stream)
    c = group if type(group) is Communicator else (bootstrap._DEFAULT if group is None else None)
    if c is None:
        c = _g(group)
    return c.all_reduce(tensor, op, async_op, stream=stream)


allreduce = all_reduce


def broadcast(tensor, src: int = 0, group=None, async_op: bool = False, *, stream=None) -> Optional[Work]:
    if _compiling():
        return _traced.broadcast(tensor, src, group, async_op, stream)
    return _g(group).broadcast(tensor, src, async_op, stream=stream)


def reduce(tensor, dst: int = 0, op=_SUM, group=None, async_op: bool = False, *, stream=None) -> Optional[Work]:
    if _compiling():
        return _traced.reduce(tensor, dst, op, group, async_op, stream)
    return _g(group).reduce(tensor, dst, op, async_op, stream=stream)


def all_gather_into_tensor(output_tensor, input_tensor, group=None, async_op: bool = False, *, stream=None) -> Optional[Work]:
    if _compiling():
        return _traced.all_gather_into_tensor(output_tensor, input_tensor, group, async_op, stream)
    return _g(group).all_gather_into_tensor(output_tensor, input_tensor, async_op, stream=stream)


def all_gather(tensor_list: List[torch.Tensor], tensor, group=None, async_op: bool = False, *, stream=None) -> Optional[Work]:
    return _g(group).all_gather(tensor_list, tensor, async_op, stream=stream)


def reduce_scatter_tensor(output, input, op=_SUM, group=None, async_op: bool = False, *, stream=None) -> Optional[Work]:
    if _compiling():
        return _traced.reduce_scatter_tensor(output, input, op, group, async_op, stream)
    return _g(group).reduce_scatter_tensor(output, input, op, async_op, stream=stream)


def reduce_scatter(output, input_list, op=_SUM, group=None, async_op: bool = False, *, stream=None) -> Optional[Work]:
    return _g(group).reduce_scatter(output, input_list, op, async_op, stream=stream)


def all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None, group=None,
                      async_op: bool = False, *, stream=None) -> Optional[Work]:
    if _compiling():
        return _traced.all_to_all_single(output, input, output_split_sizes, input_split_sizes, group, async_op, stream)
    return _g(group).all_to_all_single(output, input, output_split_sizes, input_split_sizes, async_op, stream=stream)


def all_to_all(output_tensor_list, input_tensor_list, group=None, async_op: bool = False, *, stream=None) -> Optional[Work]:
    return _g(group).all_to_all(output_tensor_list, input_tensor_list, async_op, stream=stream)


def gather(tensor, gather_list=None, dst: int = 0, group=None, async_op: bool = False, *, stream=None) -> Optional[Work]:
    return _g(group).gather(tensor, gather_list, dst, async_op, stream=stream)


def scatter(tensor, scatter_list=None, src: int = 0, group=None, async_op: bool = False, *, stream=None) -> Optional[Work]:
    return _g(group).scatter(tensor, scatter_list, src, async_op, stream=stream)


def send(tensor, dst: int, group=None, tag: int = 0, *, stream=None) -> None:
    return _g(group).send(tensor, dst, tag, stream=stream)


def recv(tensor, src: int, group=None, tag: int = 0, *, stream=None) -> int:
    return _g(group).recv(tensor, src, tag, stream=stream)


def isend(tensor, dst: int, group=None, tag: int = 0, *, stream=None) -> Work:
    return _g(group).isend(tensor, dst, tag, stream=stream)


def irecv(tensor, src: int, group=None, tag: int = 0, *, stream=None) -> Work:
    return _g(group).irecv(tensor, src, tag, stream=stream)


def batch_isend_irecv(p2p_op_list: Sequence[P2POp]) -> List[Work]:
    if not p2p_op_list:
        raise ValueError("p2p_op_list: expected a non-empty list of P2POp")
    return _g(getattr(p2p_op_list[0], "group", None)).batch_isend_irecv(p2p_op_list)


def barrier(group=None, async_op: bool = False, device_ids=None) -> Optional[Work]:
    if _compiling():
        return _traced.barrier(group, async_op, device_ids)
    return _g(group).barrier(async_op, device_ids)
