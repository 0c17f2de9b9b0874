"""The sweep's MPI column: mpi4py (over whatever MPI it finds, MPICH from the
package index in ``benchmarks/setup_mpi.sh``'s venv) timed beside streamcoll,
the raw C call and torch.distributed, in the same processes.

streamcoll never depends on MPI; this module imports mpi4py only when the
sweep asks for the column, and only inside an MPI world.

Which world. mpi4py needs every rank to be part of one ``MPI_COMM_WORLD``,
which only an MPI launcher (``mpiexec``) creates. A process started by
torchrun that initialises MPI becomes a *singleton*: a world of size 1, and
two singletons cannot be joined afterwards (``MPI_Comm_join`` between two
MPICH 5.0.2 singletons fails: "Local and remote groups ... both contain
process 0"). So:

- under ``mpiexec`` (hydra sets ``PMI_RANK``/``PMI_SIZE``, Open MPI
  ``OMPI_COMM_WORLD_*``, PMIx ``PMIX_RANK``): :func:`adopt_launcher_env`
  turns the launcher's rank variables into torchrun's (``RANK``,
  ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``) so that
  torch.distributed's store and streamcoll come up as under torchrun, and
  the MPI column is measured;
- under torchrun the column is left out, and the sweep says why
  (:func:`open_world` returns the reason instead of a communicator).

Order matters: mpi4py must be imported before oneCCL is loaded. Both need
``libfabric.so.1``; the MPICH wheel's libmpi needs symbol versions that
Debian's libfabric 1.17 lacks (``FABRIC_1.9 not found``), while oneCCL 2022.2
runs on the wheel's libfabric 2.5.1. Whichever is loaded first serves the
whole process, so in an MPI run oneCCL uses MPICH's libfabric;
:func:`loaded_libfabric` reports which one a run used.
"""
from __future__ import annotations

import importlib.util
import os
from typing import Any, Callable, Dict, Mapping, Optional, Tuple

__all__ = ["LAUNCHER_VARS", "adopt_launcher_env", "launched_by_mpi", "open_world", "runner", "tiny",
           "loaded_libfabric", "library_version"]

# (rank, size, local rank, local size) as each launcher family names them.
LAUNCHER_VARS = (
    ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"),  # MPICH / Intel MPI hydra
    ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
     "OMPI_COMM_WORLD_LOCAL_SIZE"),  # Open MPI
    ("PMIX_RANK", "PMIX_SIZE", "PMIX_LOCAL_RANK", "PMIX_LOCAL_SIZE"),  # PMIx launchers
)


def launched_by_mpi(environ: Optional[Mapping[str, str]] = None) -> Optional[Tuple[str, str, str, str]]:
    """The launcher variable names of this process's MPI launcher, or None."""
    e = os.environ if environ is None else environ
    for names in LAUNCHER_VARS:
        if names[0] in e and names[1] in e:
            return names
    return None


def adopt_launcher_env(environ: Optional[Dict[str, str]] = None) -> bool:
    """Under an MPI launcher without torchrun's variables, set ``RANK``,
    ``WORLD_SIZE``, ``LOCAL_RANK`` and ``LOCAL_WORLD_SIZE`` from it (local
    rank and size fall back to rank and size: one host). Returns whether this
    process was started by an MPI launcher. Variables already set win."""
    e = os.environ if environ is None else environ
    names = launched_by_mpi(e)
    if names is None:
        return False
    rank, size = e[names[0]], e[names[1]]
    e.setdefault("RANK", rank)
    e.setdefault("WORLD_SIZE", size)
    e.setdefault("LOCAL_RANK", e.get(names[2], rank))
    e.setdefault("LOCAL_WORLD_SIZE", e.get(names[3], size))
    return True


def open_world(rank: int, size: int) -> Tuple[Optional[Any], str]:
    """``(MPI.COMM_WORLD, description)`` when this process is one of an MPI
    world matching the sweep's ranks, else ``(None, why not)``. Call it before
    anything loads oneCCL (see the module docstring)."""
    if importlib.util.find_spec("mpi4py") is None:
        return None, "mpi4py is not importable (bash benchmarks/setup_mpi.sh makes a venv that has it)"
    if launched_by_mpi() is None:
        return None, ("not launched by mpiexec: an MPI world needs an MPI launcher, and a process "
                      "started by torchrun would be an MPI singleton (a world of 1); "
                      "LAUNCHER=mpiexec bash benchmarks/sweep.sh")
    try:
        from mpi4py import MPI
    except Exception as e:  # the library was not found or failed to load: say so, run the rest
        return None, f"mpi4py failed to load its MPI library: {type(e).__name__}: {e}".splitlines()[0]
    w = MPI.COMM_WORLD
    if (w.Get_rank(), w.Get_size()) != (rank, size):
        return None, (f"MPI_COMM_WORLD is rank {w.Get_rank()} of {w.Get_size()}, the sweep rank {rank} of "
                      f"{size}: not the same world")
    return w, library_version()


def library_version() -> str:
    """The MPI library's own first version line (``MPI_Get_library_version``)."""
    from mpi4py import MPI
    import mpi4py
    first = MPI.Get_library_version().strip().splitlines()[0]
    return f"mpi4py {mpi4py.__version__}, {' '.join(first.split())}"


def loaded_libfabric() -> Optional[str]:
    """Path of the ``libfabric.so.1`` mapped into this process (Linux), if any."""
    try:
        with open("/proc/self/maps") as fh:
            for line in fh:
                p = line.split()[-1]
                if p.endswith("/libfabric.so.1") or "/libfabric.so.1." in p:
                    return os.path.realpath(p)
    except OSError:
        pass
    return None


def _mpi_type(dtype) -> Optional[Any]:
    import torch
    from mpi4py import MPI
    table = {torch.float32: MPI.FLOAT, torch.float64: MPI.DOUBLE, torch.int32: MPI.INT32_T,
             torch.int64: MPI.INT64_T, torch.int8: MPI.INT8_T, torch.uint8: MPI.UINT8_T}
    return table.get(dtype)


def _buf(t, mt) -> list:
    """An mpi4py buffer spec on a CPU tensor's memory (no copy)."""
    return [t.numpy(), t.numel(), mt]


def runner(case, comm) -> Callable[[], None]:
    """The MPI call timed for one sweep case, on the case's own buffers, so
    the same fill and check cover it. Raises ``NotImplementedError`` (the row
    goes on without MPI, as for a dtype gloo lacks) where MPI has no datatype
    or the case's device is not the CPU."""
    from mpi4py import MPI
    ctx = case.ctx
    if ctx.device.type != "cpu":
        raise NotImplementedError("MPI column: host buffers only")
    if ctx.async_op:
        raise NotImplementedError("MPI column: async_op=False only")
    mt = _mpi_type(ctx.dtype)
    if mt is None:
        raise NotImplementedError(f"MPI column: no MPI datatype for {ctx.dtype}")
    if case.name == "sendrecv":
        s, r, nxt, prv = _buf(case.sbuf, mt), _buf(case.rbuf, mt), case.nxt, case.prv
        f = comm.Sendrecv
        return lambda: f(s, nxt, 0, r, prv, 0)
    decl = getattr(case, "spec", None)
    how = _MPI_BY_C.get(decl.c.get("nccl", "")) if decl is not None else None
    if how is None:
        raise NotImplementedError(f"MPI column: no runner for {case.name}")
    kind, fname = how
    f = getattr(comm, fname)
    if kind == "in_place":  # Allreduce(IN_PLACE, buf)
        b, inp = _buf(case.recv, mt), MPI.IN_PLACE
        return lambda: f(inp, b)
    if kind == "rooted":  # Bcast(buf, root)
        b, root = _buf(case.recv, mt), case.root
        return lambda: f(b, root)
    i, o = _buf(case.send, mt), _buf(case.recv, mt)
    return lambda: f(i, o)


# NCCL's C function of a table entry -> how MPI does the same: (call form, mpi4py method).
_MPI_BY_C = {
    "ncclAllReduce": ("in_place", "Allreduce"), "ncclBroadcast": ("rooted", "Bcast"),
    "ncclAllGather": ("send_recv", "Allgather"), "ncclReduceScatter": ("send_recv", "Reduce_scatter_block"),
    "ncclAlltoAll": ("send_recv", "Alltoall"),
}


def tiny(comm) -> Callable[[], None]:
    """A one-element MPI all-reduce: what lines the ranks up before each MPI
    batch (as the other libraries' tiny collectives do for theirs)."""
    import numpy as np
    from mpi4py import MPI
    a = np.zeros(1, dtype=np.float32)
    f, inp = comm.Allreduce, MPI.IN_PLACE
    return lambda: f(inp, a)
