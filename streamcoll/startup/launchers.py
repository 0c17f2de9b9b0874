"""Which launcher started this process, and what it says: one table.

Each launcher is a small declaration (:class:`Launcher`): the variables whose
presence says it started the process, and where it puts the rank, the world
size, the local rank and size, and the node. The first entry whose variables
are all set is the one (:func:`detect`). :func:`adopt` (called by
``init()``/``new_communicator``) then exports what it says as torchrun's
variables (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``,
``GROUP_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``), only where they are unset,
so that everything after it reads one contract.

The order: torchrun (``TORCHELASTIC_RUN_ID``); explicit ``RANK`` and
``WORLD_SIZE``; SLURM, only for a task ``srun`` started (``SLURM_STEP_ID``);
the MPI launchers (hydra, Open MPI, PMIx; the address, where
MASTER_ADDR/MASTER_PORT are unset, through hydra's PMI, else mpi4py: no MPI
library loaded for it under hydra, see :mod:`streamcoll.startup.pmi`). Never a silent 1-rank world: where a
launcher says N ranks, every rank either joins a rendezvous of N or raises
with what was detected. Launcher variables are parsed when used (a malformed
value names its variable); MASTER_PORT is never parsed here.

Why this order, and each launcher's particulars: docs/design.md, section
'Which launcher started the process'.
"""
from __future__ import annotations

import hashlib
import logging
import os
import re
import socket
import sys
from dataclasses import dataclass, replace
from typing import Any, Dict, Mapping, MutableMapping, NamedTuple, Optional, Tuple

from .._ffi.errors import RendezvousError
from ..diagnostics import failure
from .hosts import host_identity, ipv4_addresses

__all__ = ["Launcher", "Launch", "TABLE", "detect", "adopt", "current", "first_host", "tasks_on_node",
           "slurm_port", "SLURM_PORTS", "job_scope", "DEFAULT_PORT"]

log = logging.getLogger("streamcoll.startup.launchers")

DEFAULT_PORT = 29500
"""torchrun's default port: the MPI launchers' port when MASTER_ADDR is given
without MASTER_PORT and mpi4py cannot choose a free one."""


class Launcher(NamedTuple):
    """One launcher. Each field after ``detect`` names the variables holding
    the value, the first set one wins (``()``: the launcher does not say).
    ``rendezvous``: ``env`` (MASTER_ADDR/MASTER_PORT, as torchrun), ``slurm``
    (the nodelist's first host, a port from the job and step id) or ``mpi``
    (mpi4py)."""

    name: str
    detect: Tuple[str, ...]
    rank: Tuple[str, ...]
    world_size: Tuple[str, ...]
    local_rank: Tuple[str, ...]
    local_size: Tuple[str, ...]
    node_rank: Tuple[str, ...]
    rendezvous: str


_TORCH = ("RANK",), ("WORLD_SIZE",), ("LOCAL_RANK",), ("LOCAL_WORLD_SIZE",)

TABLE: Tuple[Launcher, ...] = (
    Launcher("torchrun", ("TORCHELASTIC_RUN_ID",), *_TORCH, ("GROUP_RANK",), "env"),
    Launcher("environment", ("RANK", "WORLD_SIZE"), *_TORCH, ("GROUP_RANK", "NODE_RANK"), "env"),
    Launcher("slurm", ("SLURM_PROCID", "SLURM_STEP_ID"), ("SLURM_PROCID",), ("SLURM_STEP_NUM_TASKS", "SLURM_NTASKS"),
             ("SLURM_LOCALID",), ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE"), ("SLURM_NODEID",),
             "slurm"),
    Launcher("mpich-hydra", ("PMI_RANK", "PMI_SIZE"), ("PMI_RANK",), ("PMI_SIZE",), ("MPI_LOCALRANKID",),
             ("MPI_LOCALNRANKS",), (), "mpi"),
    Launcher("open-mpi", ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"), ("OMPI_COMM_WORLD_RANK",),
             ("OMPI_COMM_WORLD_SIZE",), ("OMPI_COMM_WORLD_LOCAL_RANK",), ("OMPI_COMM_WORLD_LOCAL_SIZE",), (), "mpi"),
    Launcher("pmix", ("PMIX_RANK",), ("PMIX_RANK",), (), (), (), (), "mpi"),
)


@dataclass(frozen=True)
class Launch:
    """What the detected launcher says about this process. ``world_size``
    None: the launcher has no size variable (PMIx; mpi4py's world gives it).
    ``address``/``port``/``how``: the rendezvous, once :func:`adopt` found it
    (``port`` as text: MASTER_PORT is bootstrap's to parse)."""

    launcher: str
    rank: int
    world_size: Optional[int]
    local_rank: Optional[int] = None
    local_size: Optional[int] = None
    node_rank: Optional[int] = None
    address: Optional[str] = None
    port: Optional[str] = None
    how: str = ""

    def describe(self) -> str:
        """One line: launcher, rank, world, local place, rendezvous."""
        ws = "?" if self.world_size is None else str(self.world_size)
        s = f"launcher {self.launcher}: rank {self.rank} of {ws}"
        if self.local_rank is not None:
            s += f", local rank {self.local_rank}" + (f" of {self.local_size}" if self.local_size is not None else "")
        if self.node_rank is not None:
            s += f", node {self.node_rank}"
        if self.address is not None or self.port is not None:
            s += f"; rendezvous {self.address}:{self.port}" + (f" ({self.how})" if self.how else "")
        return s


def _first(env: Mapping[str, str], names: Tuple[str, ...]) -> Optional[Tuple[str, str]]:
    for n in names:
        v = env.get(n, "").strip()
        if v:
            return n, v
    return None


def _int(env: Mapping[str, str], names: Tuple[str, ...], launcher: str) -> Optional[int]:
    got = _first(env, names)
    if got is None:
        return None
    name, v = got
    try:
        n = int(v)
    except ValueError:
        raise ValueError(f"{name}: expected an integer (set by the {launcher} launcher), got {v!r}") from None
    if n < 0:
        raise ValueError(f"{name}: expected an integer >= 0 (set by the {launcher} launcher), got {n}")
    return n


def tasks_on_node(value: str, node: int) -> Optional[int]:
    """SLURM's tasks-per-node list for node ``node``: ``"2"``, or the
    compressed ``"2(x3),1"`` (3 nodes of 2, then 1). None where it does not
    parse or has no such node."""
    i = 0
    for part in value.split(","):
        m = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if not m:
            return None
        count = int(m.group(2) or 1)
        if node < i + count:
            return int(m.group(1))
        i += count
    return None


def first_host(nodelist: str) -> Optional[str]:
    """The first host of a SLURM compact nodelist: ``host[5-9,12]`` ->
    ``host5``, ``a[01-02],b`` -> ``a01``, ``r[1-2]-n[3-4]`` -> ``r1-n3``.
    None for an empty or unparsable list."""
    s = nodelist.strip()
    out, depth, i = [], 0, 0
    while i < len(s):
        c = s[i]
        if c == "," and depth == 0:
            break
        if c == "[":
            j = s.find("]", i)
            if j < 0:
                return None
            first = re.split(r"[,-]", s[i + 1:j], maxsplit=1)[0].strip()
            if not first.isdigit():
                return None
            out.append(first)
            i = j + 1
            continue
        if c == "]":
            return None
        out.append(c)
        i += 1
    host = "".join(out).strip()
    return host or None


SLURM_PORTS = (15000, 32000)
"""The range of :func:`slurm_port`: below Linux's ephemeral range
(32768-60999), so that no client socket holds a port of it."""


def slurm_port(job_id: int, step_id: int) -> int:
    """The rendezvous port of a SLURM step, the same on every task of the
    step: a hash of the job id over the whole of :data:`SLURM_PORTS`, plus
    the step id (modulo the range), so the steps of one job (which may run
    at once on one first host) never share a port, and two jobs' steps do by
    chance only (1 in 17000). Before, ``job * 64 + step`` modulo the range
    reached only 2125 ports for step 0 (gcd(64, 17000) = 8) and gave job J
    step 64 job J+1 step 0's port. Where two steps do share one, the store
    keys of each carry its job and step (:func:`job_scope`): the second
    never joins the first's rendezvous (its rank 0 cannot bind, and says
    so; its other ranks wait for it). ``MASTER_PORT`` wins over this."""
    lo, hi = SLURM_PORTS
    h = int.from_bytes(hashlib.blake2b(str(job_id).encode(), digest_size=8).digest(), "big")
    return lo + (h + step_id) % (hi - lo)


def job_scope(environ: Optional[Mapping[str, str]] = None) -> str:
    """``slurm<job>.<step>/`` where this process's world is a SLURM step's
    (the launcher :func:`adopt` took up, else the one :func:`detect` sees):
    the start of every rendezvous namespace in the store
    (:func:`streamcoll.startup.bootstrap.rendezvous`), so that ranks of another job
    or step that reach this store (a port that collides, a MASTER_PORT
    copied between jobs) never take or bump this step's keys; else ""."""
    env = os.environ if environ is None else environ
    la = _ADOPTED if environ is None and _ADOPTED is not None else detect(env)
    if la is None or la.launcher != "slurm":
        return ""
    job = next((env[v].strip() for v in ("SLURM_JOB_ID", "SLURM_JOBID") if env.get(v, "").strip()), "")
    step = env.get("SLURM_STEP_ID", "").strip()
    return f"slurm{job}.{step}/".replace(":", "_") if job else ""


def detect(environ: Optional[Mapping[str, str]] = None) -> Optional[Launch]:
    """The first launcher of :data:`TABLE` whose variables are all set, and
    what it says; None where none is (a plain ``python job.py``). Pure:
    reads ``environ`` (default ``os.environ``), writes nothing. A malformed
    rank or size variable is a ValueError naming it."""
    env = os.environ if environ is None else environ
    for la in TABLE:
        if all(env.get(v, "").strip() for v in la.detect):
            return _read(la, env)
    return None


def _read(la: Launcher, env: Mapping[str, str]) -> Launch:
    rank = _int(env, la.rank, la.name)
    if rank is None:  # cannot be: the rank variable is a detect variable
        raise ValueError(f"{la.rank[0]}: not set (the {la.name} launcher sets it)")
    ws = _int(env, la.world_size, la.name)
    if ws is not None and not rank < ws:
        where = _first(env, la.world_size)
        raise ValueError(f"{la.rank[0]}={rank} is not below {where[0] if where else 'the world size'}={ws} "
                         f"(set by the {la.name} launcher)")
    node = _int(env, la.node_rank, la.name)
    got = _first(env, la.local_size)
    local_size: Optional[int] = None
    if got is not None:
        local_size = tasks_on_node(got[1], node or 0) if "(" in got[1] or "," in got[1] else _int(
            env, (got[0],), la.name)
    return Launch(la.name, rank, ws, _int(env, la.local_rank, la.name), local_size, node)


def _slurm_rendezvous(env: Mapping[str, str]) -> Tuple[Optional[str], Optional[str], str]:
    hows = []
    addr = env.get("MASTER_ADDR") or None
    if addr:
        hows.append("MASTER_ADDR")
    else:
        got = _first(env, ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST"))
        if got is not None:
            addr = first_host(got[1])
            hows.append(f"first host of {got[0]}={got[1]}")
    port = env.get("MASTER_PORT") or None
    if port:
        hows.append("MASTER_PORT")
    else:
        job = _int(env, ("SLURM_JOB_ID", "SLURM_JOBID"), "slurm")
        step = env.get("SLURM_STEP_ID", "0").strip()
        if job is not None:
            port = str(slurm_port(job, int(step) if step.isdigit() else 0))
            hows.append(f"port from SLURM_JOB_ID={job}, SLURM_STEP_ID={step}")
    return addr, port, "; ".join(hows)


_MPI4PY_ERROR = ""


def _mpi4py() -> Any:
    """mpi4py's MPI module, or None where mpi4py is not importable (or its
    MPI does not load: why is kept for the error message). It must load
    before oneCCL: both need libfabric, and the MPICH wheel's libmpi needs a
    newer one than a system libfabric oneCCL may have loaded first."""
    global _MPI4PY_ERROR
    import importlib.util
    if importlib.util.find_spec("mpi4py") is None:
        return None
    try:
        if "mpi4py.MPI" not in sys.modules:
            failure.defer_mpi_finalize()  # its MPI_Finalize at exit would wait for a hung rank for good
        from mpi4py import MPI
    except Exception as e:  # ImportError (a library's symbols), RuntimeError (MPI_Init)
        _MPI4PY_ERROR = f"mpi4py is installed but its MPI did not load: {type(e).__name__}: {e}"
        return None
    return MPI


def _reachable_address(same_host: bool) -> str:
    """Rank 0's address for the others: loopback where every rank shares its
    network namespace, else its first non-loopback IPv4 address (by interface
    name), else its hostname."""
    if same_host:
        return "127.0.0.1"
    try:
        table = ipv4_addresses()
    except OSError:
        table = {}
    for a, _ in sorted(table.items(), key=lambda kv: kv[1]):
        if not a.startswith("127."):
            return a
    return socket.gethostname()


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])


def _mpi_rendezvous(launch: Launch, env: Mapping[str, str], timeout: Optional[float] = None) -> Launch:
    """MASTER_ADDR/MASTER_PORT where set; else, under hydra, its PMI
    (``PMI_FD``) unless mpi4py's MPI is loaded already; else mpi4py
    (collective over the MPI world); else a RendezvousError naming the ways."""
    addr, port = env.get("MASTER_ADDR") or None, env.get("MASTER_PORT") or None
    if addr and port and launch.world_size is not None:
        return replace(launch, address=addr, port=port, how="MASTER_ADDR, MASTER_PORT")
    if launch.launcher == "mpich-hydra" and _pmi_wanted(env):
        return _pmi_rendezvous(launch, env, addr, port, timeout)
    MPI = _mpi4py()
    if MPI is None:
        if addr and launch.world_size is not None:
            return replace(launch, address=addr, port=str(DEFAULT_PORT),
                           how=f"MASTER_ADDR; MASTER_PORT unset: torchrun's default {DEFAULT_PORT}")
        missing = "a world size (the launcher sets none)" if launch.world_size is None else "rank 0's address"
        raise RendezvousError(
            f"{launch.describe()}: no way to find {missing}. Set MASTER_ADDR (rank 0's host, reachable from every "
            f"rank) and MASTER_PORT (and WORLD_SIZE where the launcher sets no size) on every rank, or make mpi4py "
            f"importable (pip install mpi4py) so that rank 0 broadcasts its address and a free port"
            + (f" ({_MPI4PY_ERROR})" if _MPI4PY_ERROR else "")
            + ("; hydra's PMI (PMI_FD, which MPICH's and Intel MPI's mpiexec set) is not in the environment either"
               if launch.launcher == "mpich-hydra" and not env.get("PMI_FD", "").strip() else ""),
            [], addr or "", -1, -1 if launch.world_size is None else launch.world_size, timed_out=False)
    comm = MPI.COMM_WORLD
    size, mrank = comm.Get_size(), comm.Get_rank()
    if launch.world_size is not None and (size != launch.world_size or mrank != launch.rank):
        raise RendezvousError(
            f"{launch.describe()}: mpi4py's MPI_COMM_WORLD says rank {mrank} of {size}. Run mpi4py from the MPI "
            f"that launched the job (or set MASTER_ADDR/MASTER_PORT)", [], addr or "", -1, size, timed_out=False)
    nets = comm.allgather(host_identity()[2])
    chosen = (addr or _reachable_address(all(n == nets[0] for n in nets)), port or str(_free_port())) \
        if mrank == 0 else None
    a, p = comm.bcast(chosen, root=0)
    how = ("MASTER_ADDR" if addr else "rank 0's address through mpi4py") + "; " + (
        "MASTER_PORT" if port else "a free port of rank 0 through mpi4py")
    return replace(launch, rank=mrank, world_size=size, address=a, port=p, how=how)


def _pmi_wanted(env: Mapping[str, str]) -> bool:
    """Whether hydra's PMI finds rank 0: ``PMI_FD`` set, and no MPI loaded
    through mpi4py already (then MPI is the way, and its libfabric is in the
    process anyway)."""
    return bool(env.get("PMI_FD", "").strip()) and "mpi4py.MPI" not in sys.modules


def _pmi_rendezvous(launch: Launch, env: Mapping[str, str], addr: Optional[str], port: Optional[str],
                    timeout: Optional[float] = None) -> Launch:
    """hydra's PMI (``PMI_FD``) in place of mpi4py: no MPI library, so no
    MPI's libfabric, in the process (why: :mod:`streamcoll.startup.pmi`).
    Used where mpi4py's MPI is not loaded already (then it is the way)."""
    from . import pmi

    def choose(same_host: bool) -> Tuple[str, str]:
        return addr or _reachable_address(same_host), port or str(_free_port())

    try:
        conn = pmi.connect(env, pmi.TIMEOUT if timeout is None else timeout)
        assert conn is not None
        try:
            a, p = pmi.rendezvous(conn, launch.rank, launch.world_size or 0, host_identity()[2], choose)
        except BaseException:
            conn.close()
            raise
        pmi.finalize_at_exit(conn)  # else hydra takes this process's exit for an abort and kills the job
    except (ValueError, OSError, pmi.PmiError) as e:
        raise RendezvousError(
            f"{launch.describe()}: rank 0's address through hydra's PMI (PMI_FD) failed: {type(e).__name__}: {e}. "
            f"Set MASTER_ADDR and MASTER_PORT on every rank", [], addr or "", -1,
            launch.world_size or -1, timed_out=isinstance(e, socket.timeout)) from e
    how = ("MASTER_ADDR" if addr else "rank 0's address through hydra's PMI") + "; " + (
        "MASTER_PORT" if port else "a free port of rank 0 through hydra's PMI")
    return replace(launch, address=a, port=p, how=how)


def _rendezvous(launch: Launch, env: Mapping[str, str], timeout: Optional[float] = None) -> Launch:
    la = next(la for la in TABLE if la.name == launch.launcher)
    if la.rendezvous == "env":
        return replace(launch, address=env.get("MASTER_ADDR") or None, port=env.get("MASTER_PORT") or None,
                       how="MASTER_ADDR, MASTER_PORT")
    if la.rendezvous == "slurm":
        addr, port, how = _slurm_rendezvous(env)
        if addr is None or port is None:
            need = " and ".join(n for n, v in (("MASTER_ADDR", addr), ("MASTER_PORT", port)) if v is None)
            raise RendezvousError(
                f"{launch.describe()}: SLURM gives no {'nodelist' if addr is None else 'job id'} to derive the "
                f"rendezvous from; set {need} on every task", [], addr or "", -1, launch.world_size or -1, timed_out=False)
        return replace(launch, address=addr, port=port, how=how)
    return _mpi_rendezvous(launch, env, timeout)


_ADOPTED: Optional[Launch] = None
EXPORTED: Dict[str, str] = {}
"""The torchrun variables :func:`adopt` set in this process (name -> value)."""


def current(environ: Optional[Mapping[str, str]] = None) -> Optional[Launch]:
    """The launch :func:`adopt` took up in this process, else what
    :func:`detect` says now (``python -m streamcoll info``)."""
    return _ADOPTED if _ADOPTED is not None and environ is None else detect(environ)


def _torch_initialized() -> bool:
    try:
        import torch.distributed as dist
        return bool(dist.is_available() and dist.is_initialized())
    except Exception:
        return False


def adopt(rendezvous: bool = True, environ: Optional[MutableMapping[str, str]] = None,
          timeout: Optional[float] = None) -> Optional[Launch]:
    """Detect the launcher and export what it says as torchrun's variables
    where they are unset (see the module docstring); with ``rendezvous``
    (no store given and torch.distributed not initialised), find rank 0's
    address and port too and export them as MASTER_ADDR/MASTER_PORT.

    A torchrun variable already set to something else than the launcher
    says is a ValueError naming both (which rank is this process?); a
    launcher that says N > 1 ranks with no way to find rank 0 is a
    :class:`RendezvousError`, raised on every rank. ``timeout`` (seconds)
    bounds each wait of hydra's PMI (a rank that never comes: init's
    timeout; None: 300 s). Returns the launch, or None where no launcher
    is detected (a plain ``python job.py``)."""
    global _ADOPTED
    env = os.environ if environ is None else environ
    launch = detect(env)
    if launch is None:
        return None
    la = next(la for la in TABLE if la.name == launch.launcher)
    needs = rendezvous and la.rendezvous != "env" and not _torch_initialized()
    if needs:
        launch = _rendezvous(launch, env, timeout)
    if la.rendezvous == "env":
        return launch  # torch's own variables: nothing to export
    values = {"RANK": launch.rank, "WORLD_SIZE": launch.world_size, "LOCAL_RANK": launch.local_rank}
    if launch.node_rank is not None:  # else LOCAL_WORLD_SIZE < WORLD_SIZE would make topology guess the node
        values.update(LOCAL_WORLD_SIZE=launch.local_size, GROUP_RANK=launch.node_rank)
    for name, v in values.items():
        have = env.get(name, "").strip()
        if v is not None and have and have != str(v) and EXPORTED.get(name) != have:
            raise ValueError(f"{name}={have} disagrees with the launcher ({launch.describe()}): unset {name}, "
                             f"or start the job with one launcher")
    exported = {k: str(v) for k, v in values.items() if v is not None and not env.get(k, "").strip()}
    if needs:
        exported.update({k: str(v) for k, v in (("MASTER_ADDR", launch.address), ("MASTER_PORT", launch.port))
                         if v is not None and not env.get(k)})
    env.update(exported)
    if environ is None:
        EXPORTED.update(exported)
        _ADOPTED = launch
    log.info("streamcoll: %s%s", launch.describe(),
             f"; exported {' '.join(f'{k}={v}' for k, v in exported.items())}" if exported else "")
    return launch


def who_set(name: str) -> str:
    """Who set torchrun variable ``name`` in this process (for messages)."""
    if name in EXPORTED and _ADOPTED is not None:
        return f"streamcoll from the {_ADOPTED.describe()}"
    if os.environ.get("TORCHELASTIC_RUN_ID"):
        return "torchrun"
    return "the launcher"


__all__ += ["EXPORTED", "who_set"]


def mpi_transport_requested(environ: Optional[Mapping[str, str]] = None) -> bool:
    """Whether ``CCL_ATL_TRANSPORT`` asks for oneCCL's MPI transport."""
    env = os.environ if environ is None else environ
    return env.get("CCL_ATL_TRANSPORT", "").strip().lower() == "mpi"


def mpi_transport_problem(environ: Optional[Mapping[str, str]] = None) -> str:
    """Why oneCCL's MPI transport (``CCL_ATL_TRANSPORT=mpi``) cannot run in
    this process, or ``''`` (also where the variable asks for another one).

    Measured with oneCCL 2022.2 (docs/benchmarks.md, "oneCCL's transport:
    OFI against MPI"): the transport calls ``MPI_Init``, so the ranks must be
    started by that MPI's own ``mpiexec`` (under torchrun each rank is an MPI
    world of one: Intel MPI aborts, "Duplicate ranks", and MPICH hangs in
    the communicator's init); and it ``dlopen``s ``libmpi.so.12`` (or
    ``CCL_MPI_LIBRARY_PATH``), falling back to OFI with only a warning where
    it cannot, so ranks that all agreed on ``mpi`` could run two different
    transports and never meet. Pure apart from that ``dlopen``, which is the
    one oneCCL would make."""
    env = os.environ if environ is None else environ
    if not mpi_transport_requested(env):
        return ""
    if not any(all(env.get(v, "").strip() for v in la.detect) for la in TABLE if la.rendezvous == "mpi"):
        return ("CCL_ATL_TRANSPORT=mpi: oneCCL's MPI transport needs the ranks started by that MPI's own "
                "mpiexec (no PMI_RANK/PMI_SIZE, OMPI_COMM_WORLD_* or PMIX_RANK here: each rank would be an MPI "
                "world of one, which aborts or hangs in the communicator's init); start them with mpiexec, or "
                "unset CCL_ATL_TRANSPORT (oneCCL's default ofi transport runs under every launcher)")
    lib = env.get("CCL_MPI_LIBRARY_PATH", "").strip() or "libmpi.so.12"
    import ctypes
    try:
        ctypes.CDLL(lib)
    except OSError as e:
        return (f"CCL_ATL_TRANSPORT=mpi: oneCCL loads {lib} for it, and it does not load ({e}); oneCCL would "
                "fall back to its ofi transport with only a warning, so ranks agreeing on mpi could run "
                "different transports: put the MPI's lib/ on LD_LIBRARY_PATH or set CCL_MPI_LIBRARY_PATH "
                "(docs/benchmarks.md, \"oneCCL's transport\")")
    return ""
