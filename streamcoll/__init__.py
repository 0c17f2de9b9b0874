"""streamcoll: stream-aware collectives for PyTorch over NCCL and oneCCL.

A drop-in for torch.distributed's collectives in custom training loops::

    import streamcoll as dist
    dist.init()                       # torchrun's RANK/WORLD_SIZE/MASTER_*
    dist.all_reduce(grad)             # current stream, no event, returns None
    work = dist.all_reduce(grad, async_op=True)   # comm stream + event
    work.wait()                       # current stream waits; host does not

Importing streamcoll loads no native library; they load on first use.
"""
from __future__ import annotations

import sys as _sys

# The observers of every communicator attach to the core when imported (streamcoll.core.hooks): the
# watchdog (hangs, the start of quietly queued CPU calls) and torch-format flight dumps. First: an
# import of a higher layer that fails (and leaves the core it loaded in sys.modules) cannot leave
# that core without them.
from .diagnostics import fr_torch, watchdog  # noqa: F401
from .startup.bootstrap import (
    default_communicator,
    destroy,
    destroy_process_group,
    get_rank,
    get_world_size,
    init,
    is_available,
    is_initialized,
    new_communicator,
)
from .collectives import (
    all_gather,
    all_gather_coalesced,
    all_gather_into_tensor,
    all_reduce,
    all_to_all,
    all_to_all_single,
    allreduce,
    barrier,
    batch_isend_irecv,
    broadcast,
    gather,
    irecv,
    isend,
    recv,
    reduce,
    reduce_scatter,
    reduce_scatter_tensor,
    scatter,
    send,
)
from .core.communicator import Communicator, P2POp
from ._ffi.errors import (
    CollectiveError,
    CollectiveTimeout,
    CommunicatorError,
    CudaError,
    FunctionNotFoundError,
    LibraryError,
    LibraryNotFoundError,
    BackendUnavailableError,
    MismatchError,
    NcclError,
    NotSupportedError,
    OnecclError,
    RendezvousError,
    UsageError,
)
from .integrations.grad_sync import GradientSync
from .core.ops import PreMulSum, ReduceOp, premul_sum
from .integrations.process_group import ProcessGroupStreamcoll, register_backend as _register_backend
from .core.work import Work
# public: streamcoll.launchers.adopt() (exports a launcher's ranks for torch.distributed; examples/launch_job.py)
from .startup import launchers  # noqa: F401
_sys.modules[__name__ + ".launchers"] = launchers  # `import streamcoll.launchers` too: the public name

_register_backend()  # torch.distributed.init_process_group("streamcoll")

__version__ = "0.1.0"

__all__ = [
    "init", "new_communicator", "destroy", "destroy_process_group", "is_initialized", "is_available",
    "get_rank", "get_world_size", "default_communicator",
    "Communicator", "Work", "P2POp", "ReduceOp", "PreMulSum", "premul_sum",
    "all_reduce", "allreduce", "broadcast", "reduce", "all_gather_into_tensor", "all_gather",
    "all_gather_coalesced", "reduce_scatter_tensor", "reduce_scatter", "all_to_all_single", "all_to_all", "gather", "scatter",
    "send", "recv", "isend", "irecv", "batch_isend_irecv", "barrier",
    "GradientSync", "ProcessGroupStreamcoll",
    "CollectiveError", "LibraryError", "NcclError", "OnecclError", "CudaError", "LibraryNotFoundError",
    "FunctionNotFoundError", "CommunicatorError", "CollectiveTimeout", "MismatchError",
    "RendezvousError", "BackendUnavailableError", "UsageError", "NotSupportedError",
]
