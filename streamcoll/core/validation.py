"""Argument checks, run before any C call so that bad input raises a clear
exception (naming the argument and what was expected) and nothing is half
written or left hanging on other ranks. Exceptions, never ``assert``."""
from __future__ import annotations

from typing import Any, Optional, Sequence

import numpy as np
import torch

__all__ = ["as_tensor", "check_rank", "check_same", "check_list"]

_Tensor = torch.Tensor


def as_tensor(t: Any, name: str, device: torch.device, dev_type: str, dev_index: Optional[int]) -> torch.Tensor:
    """``t`` as a contiguous tensor on the communicator's device.

    numpy arrays are accepted on the CPU (viewed, not copied, so results land
    in the caller's array).
    """
    if not isinstance(t, _Tensor):
        if isinstance(t, np.ndarray):
            if dev_type != "cpu":
                raise TypeError(f"{name}: numpy arrays are host memory; this communicator is on {device}")
            if not t.flags.c_contiguous:
                raise ValueError(f"{name}: expected a C-contiguous numpy array (strides {t.strides})")
            if not t.flags.writeable:
                raise ValueError(f"{name}: expected a writeable numpy array")
            try:
                return torch.from_numpy(t)
            except TypeError as e:
                raise TypeError(f"{name}: numpy dtype {t.dtype} has no torch equivalent ({e})") from None
        raise TypeError(f"{name}: expected a torch.Tensor (or numpy.ndarray on the CPU), got {type(t).__name__}")
    if t.layout is not torch.strided:
        # before the contiguity check, which would call a COO tensor "not
        # contiguous" and raises for CSR; the libraries take dense buffers only
        raise TypeError(f"{name}: sparse tensors are not supported (layout {t.layout}); "
                        "pass a dense tensor (t.to_dense())")
    if t.device.type != dev_type or (dev_index is not None and t.device.index != dev_index):
        raise ValueError(f"{name}: expected a tensor on {device}, got one on {t.device}")
    if not t.is_contiguous():
        raise ValueError(f"{name}: expected a contiguous tensor, got shape {tuple(t.shape)} with strides {t.stride()}")
    return t


def check_rank(value: Any, name: str, size: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name}: expected an int rank in [0, {size}), got {value!r}")
    v = int(value)
    if not 0 <= v < size:
        raise ValueError(f"{name}: expected a rank in [0, {size}), got {v}")
    return v


def check_same(a: torch.Tensor, b: torch.Tensor, aname: str, bname: str) -> None:
    if a.dtype != b.dtype:
        raise TypeError(f"{bname}: expected dtype {a.dtype} (the dtype of {aname}), got {b.dtype}")


def check_list(lst: Any, name: str, length: int) -> Sequence:
    if not isinstance(lst, (list, tuple)):
        raise TypeError(f"{name}: expected a list of {length} tensors, got {type(lst).__name__}")
    if len(lst) != length:
        raise ValueError(f"{name}: expected a list of {length} tensors (one per rank), got {len(lst)}")
    return lst
