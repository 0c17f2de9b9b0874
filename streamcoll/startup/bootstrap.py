"""Creating communicators: rank and world from torchrun's variables, the
unique id exchanged through a torch.distributed store, and the default
communicator the module-level functions use.

Rendezvous is torch.distributed's (``env://``: TCPStore at MASTER_ADDR,
MASTER_PORT, or the agent's store under torchrun); after it, NCCL's or
oneCCL's own bootstrap and networking take over. What streamcoll adds over
the store is :func:`rendezvous`, where the ranks' facts meet at rank 0 (its
store requests and their count: :mod:`streamcoll.startup.rendezvous`). The
store side (the default store, the rendezvous protocol) is that module's;
this module checks what the ranks met on, sets the environment around the
native calls and makes the communicator.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import time
from datetime import timedelta
from typing import Any, Callable, Dict, Iterator, List, Optional, Union

import torch

from ..core.backends import make_nonblocking, nccl_nonblocking_requested, resolve
from ..core.communicator import Communicator, adopt
from ..core.timeouts import seconds as _seconds
from . import env_defaults as env, launchers, topology
from ..diagnostics import shm_regions, watchdog
from ..core.env_vars import read_int
from .._ffi.errors import BackendUnavailableError, CommunicatorError, UsageError
from .rendezvous import Meeting  # noqa: F401  (bootstrap's, as before)
from .rendezvous import _get_store, _world_size, rendezvous as _rendezvous, store_at, parse_address

log = logging.getLogger("streamcoll.startup.bootstrap")

__all__ = ["init", "new_communicator", "rendezvous", "Meeting", "group_topology", "is_initialized", "get_rank",
           "get_world_size", "destroy", "default_communicator", "is_available"]

_DEFAULT: Optional[Communicator] = None
# The topology of a communicator over the launcher's (torch's) whole world,
# process rank r = its rank r: what subgroups derive theirs from.
_WORLD_TOPOLOGY: Optional[topology.Topology] = None
LOG = logging.getLogger("streamcoll")


def is_available(backend: str = "oneccl") -> bool:
    """Whether ``backend``'s native library loads here. Never raises."""
    try:
        from ..core.backends import get_backend
        return get_backend(backend).binding.is_available()
    except Exception:
        return False


def _default_device(backend: Optional[str], local_rank: int) -> torch.device:
    if backend == "nccl" or (backend is None and torch.cuda.is_available()):
        return torch.device("cuda", local_rank % max(torch.cuda.device_count(), 1))
    if backend in ("oneccl",) and hasattr(torch, "xpu") and torch.xpu.is_available() and os.environ.get("STREAMCOLL_DEVICE") == "xpu":
        return torch.device("xpu", local_rank)
    return torch.device("cpu")


@contextlib.contextmanager
def _native_entry(backend: str, settings: Dict[str, str]) -> Iterator[None]:
    """Around the calls that may be the process's first into the library
    (the unique id, the communicator's init): streamcoll's environment
    values are set for the call and removed after (:func:`env.applied`);
    oneCCL sets itself up there, printing a line on stdout (kept off it, see
    :mod:`streamcoll.startup.native_output`) and installing signal handlers (Python's are put
    back for SIGINT/SIGTERM, see :mod:`streamcoll.diagnostics.signals`)."""
    from .native_output import quiet_oneccl_startup
    from ..diagnostics.signals import native_entry
    with env.applied(settings, backend):
        if backend != "oneccl":
            yield
            return
        shm_regions.before_first_init()  # the exit hook for libfabric's /dev/shm regions, stale ones swept
        from ..core.backends import get_backend
        with quiet_oneccl_startup():  # once around both: its start-up line comes at the first call, not the load
            with native_entry():
                get_backend(backend).lib()  # loading installs oneCCL's handlers: Python's back before a call that waits
            with native_entry():
                yield


def group_topology(pg: Any) -> Optional[topology.Topology]:
    """The topology of the torch.distributed group ``pg``'s ranks (as this
    process's rank in it), derived with no exchange from that of a
    communicator over the whole world made before (``init()``'s, or the
    world group's on the streamcoll backend); None for the world group
    itself, for a group this process is not in, or where none is known."""
    import torch.distributed as dist
    try:
        ranks = dist.get_process_group_ranks(pg)
        me = dist.get_rank()
        n = dist.get_world_size()
    except (RuntimeError, ValueError, KeyError):
        return None
    if ranks == list(range(n)) or me not in ranks:
        return None
    world = _WORLD_TOPOLOGY
    if world is None or world.world_size != n or world.rank != me:
        world = None
        default = dist.distributed_c10d._get_default_group()
        for c in getattr(default, "_comms", {}).values():  # ProcessGroupStreamcoll's communicators
            t = getattr(c, "topology", None)
            if isinstance(t, topology.Topology) and t.world_size == n and t.rank == me:
                world = t
                break
    return None if world is None else world.subgroup(ranks, ranks.index(me))


def _check_world_size(world_size: int) -> None:
    """Without ``store=``, the ranks that meet are the launcher's (torchrun's
    WORLD_SIZE) or torch.distributed's: a different ``world_size`` could only
    time out, waiting for ranks that do not exist (or leave ranks out of
    the env:// rendezvous), so it raises at once."""
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized():
        n = dist.get_world_size()
        if world_size > n:
            raise ValueError(f"world_size: {world_size} ranks asked for, but torch.distributed's world (whose "
                             f"store is used) has {n}; pass store= for a communicator over other ranks")
        return
    env = read_int("WORLD_SIZE")
    if env is not None and env != world_size:
        who = launchers.who_set("WORLD_SIZE")
        raise ValueError(f"world_size: {world_size} disagrees with WORLD_SIZE={env} (set by {who}); the env:// "
                         "rendezvous meets WORLD_SIZE ranks. Leave world_size unset, or pass store= for a "
                         "communicator over other ranks")


def _default_uid(topo: topology.Topology, cname: str) -> bytes:
    b, _ = resolve(None, torch.device("cpu"))
    with _native_entry(b.name, _settings(b.name, topo)):
        return bytes(b.unique_id())


def rendezvous(store: Any, rank: int, world_size: int, *, timeout: Union[float, timedelta],
               facts: Optional[topology.RankFacts] = None,
               make_uid: Optional[Callable[[topology.Topology, str], bytes]] = None,
               name: Optional[str] = None, known: Optional[topology.Topology] = None) -> Meeting:
    """:func:`streamcoll.startup.rendezvous.rendezvous` (the store part of creating
    a communicator), ``make_uid`` by default the CPU backend's unique id made
    in the environment of a native call (:func:`_default_uid`): the unique
    id is this module's side, which the store side is given."""
    return _rendezvous(store, rank, world_size, timeout=timeout, facts=facts,
                       make_uid=_default_uid if make_uid is None else make_uid, name=name, known=known)


def new_communicator(
    backend: Optional[str] = None,
    device: Union[None, str, torch.device] = None,
    timeout: Union[None, float, timedelta] = None,
    store: Any = None,
    rank: Optional[int] = None,
    world_size: Optional[int] = None,
    record_stream: Optional[bool] = None,
    name: Optional[str] = None,
    *,
    known_topology: Optional[topology.Topology] = None,
    job_scoped: Optional[bool] = None,
) -> Communicator:
    """Create a Communicator over ``world_size`` ranks (collective: every
    rank calls it with the same arguments in the same order).

    ``rank``/``world_size`` default to RANK/WORLD_SIZE (torchrun sets them;
    under srun or mpiexec :mod:`streamcoll.startup.launchers` sets them from theirs);
    ``device`` defaults to ``cuda:LOCAL_RANK`` where CUDA is available, else
    cpu; ``backend`` defaults by device (cpu, xpu: oneccl; cuda: nccl).
    ``store`` is any torch.distributed Store, or an address ``"host:port"``
    (processes of different jobs, no launcher variables needed: rank 0
    hosts a TCPStore there unless one listens already, the others connect;
    docs/api.md, "Beyond one job"); by default the one torch.distributed
    was initialised with, else the env:// rendezvous.
    Its timeout stays as it is: every wait here passes its own.
    ``known_topology``: these ranks' topology where already known (a
    subgroup's, :func:`group_topology`); used on rank 0, which then reads
    no other rank's facts (the others take rank 0's).
    ``job_scoped``: whether the launcher's job leads the rendezvous keys
    (:func:`launchers.job_scope`: SLURM's job and step, so that a step whose
    port collides with another's never joins its rendezvous). By default
    only on the launcher's own store (``store`` None); a store given, object
    or address, is shared by whoever passed it, members of other jobs
    included (an srun task and a server started with python), so no job's
    scope is added. The process group passes True where torch's world is
    the launcher's job (its store then is the launcher's).
    """
    t = _seconds(timeout)
    if isinstance(store, str):  # processes of different jobs
        parse_address(store)  # a bad address is a ValueError naming store, before anything else
    elif store is not None and not isinstance(store, getattr(torch.distributed, "Store", object)):
        raise ValueError(f"store: expected a torch.distributed Store or an address 'host:port', got "
                         f"{type(store).__name__} {store!r}"[:300])
    if store is None or rank is None or world_size is None:  # srun, mpiexec: torchrun's variables from theirs
        launchers.adopt(rendezvous=store is None, timeout=t)
    if rank is None:
        rank = read_int("RANK", 0)
    if world_size is None:
        world_size = read_int("WORLD_SIZE", 1)
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size: expected a positive int, got {world_size!r}")
    if store is None:  # before the rank's check: every rank of a launcher's world says the same
        _check_world_size(world_size)
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ValueError(f"rank: expected an int in [0, {world_size}), got {rank!r}")
    if backend is not None and not isinstance(backend, str):
        raise TypeError(f"backend: expected 'nccl', 'oneccl' or None, got {backend!r}")

    def local_rank() -> int:  # read only where a device index is needed: a call that names one does not parse it
        return read_int("LOCAL_RANK", rank) or 0

    if device is None:
        device = _default_device(backend.lower() if backend else None, local_rank())
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"device: expected a torch device or string like 'cpu' or 'cuda:0', got {device!r}") from e
    b, device = resolve(backend.lower() if backend else None, device)
    from ..core.work import POSTING, launch_posted
    if POSTING:
        launch_posted()  # the rendezvous blocks on the other ranks: nothing posted here may be what they wait on
    if (b.name == "nccl" or device.type == "cuda") and not torch.cuda.is_available():
        why = (f"this torch build has no CUDA (torch {torch.__version__})" if torch.version.cuda is None
               else "no CUDA GPU is visible (CUDA_VISIBLE_DEVICES, driver)")
        raise BackendUnavailableError(f"backend {b.name!r} on {device} needs a CUDA GPU: {why}; use "
                                      "backend='oneccl' (device 'cpu') here")
    if device.type in ("cuda", "xpu") and device.index is None:
        device = torch.device(device.type, local_rank())

    spans_world = store is None and world_size == _world_size()
    scoped = store is None if job_scoped is None else bool(job_scoped)
    if store is None:
        store = _get_store(rank, world_size, t)
    elif isinstance(store, str):  # processes of different jobs: rank 0 hosts it there unless a store listens
        store = store_at(store, rank, world_size, t)

    made: Dict[str, Dict[str, str]] = {}  # "settings": the native calls' environment; "own": env.OWN's values

    def prepare(topo: topology.Topology, cname: str) -> Dict[str, str]:
        """Before this rank's first library call: what cannot work fails here
        (every rank sees the same layout, so every rank raises: on rank 0
        inside the rendezvous, which hands the error to every rank), then the
        settings for its place (topology.py says from what, env_defaults.py which
        values; the must-agree ones were decided once, on rank 0)."""
        if b.name == "oneccl" and topo.name_clashes():
            raise CommunicatorError(f"init of communicator {cname!r}: {_clash_text(topo)}")
        if b.name == "oneccl":
            _check_first_transport(topo, cname)
            why = launchers.mpi_transport_problem()
            if why:  # the same launcher and variables on every rank: every rank raises
                raise CommunicatorError(f"init of communicator {cname!r}: {why}")
        conflicts = topo.agreed.conflicts_for(b.name)
        if conflicts:  # computed from every rank's facts: every rank raises, before the native init
            raise CommunicatorError(f"init of communicator {cname!r}: {_conflict_text(conflicts)}")
        made["own"] = env.check_own(topo.agreed.own)  # one value on every rank: a malformed one raises on all
        if b.name == "oneccl":
            _warn_imposed(topo, cname)
        settings = _settings(b.name, topo)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        return settings

    def make_uid(topo: topology.Topology, cname: str) -> bytes:
        s = made["settings"] = prepare(topo, cname)
        with _native_entry(b.name, s):
            return bytes(b.unique_id())

    # The store part (see rendezvous): the first point where all ranks meet;
    # it waits with progress lines and names the missing ranks at the timeout.
    m = _rendezvous(store, rank, world_size, timeout=t, make_uid=make_uid, name=name,
                    known=known_topology, scoped=scoped)
    topo, uid, pstore, cname = m.topology, m.uid, m.store, m.name
    if b.name == "oneccl" and launchers.mpi_transport_requested():
        _agree_mpi_transport(pstore, rank, world_size, cname)
    settings = made["settings"] if rank == 0 else prepare(topo, cname)
    if spans_world:
        global _WORLD_TOPOLOGY
        _WORLD_TOPOLOGY = topo
    advertised = topology.advertised_address(b.name, uid)
    problem = topo.loopback_problem(advertised[0] if advertised else None)
    if problem:  # every rank sees the same facts, so every rank raises
        raise CommunicatorError(f"init of communicator {cname!r}: {problem}. {_LOOPBACK_HINT}")
    nonblocking = b.name == "nccl" and nccl_nonblocking_requested()
    pstore.set(f"init/{rank}", json.dumps({k: os.environ.get(k, settings.get(k)) for k in _IFACE_VARS}))
    if nonblocking:  # polled with ncclCommGetAsyncError: times out with CollectiveTimeout
        with _native_entry(b.name, settings):  # NCCL's init reads its variables until it is ready
            handle = b.init_rank(world_size, bytes(uid), rank, blocking=False, timeout=t)
    else:  # a blocking init whose peers never come must not hang silently
        what = f"init of communicator {cname!r} (rank {rank} of {world_size}, {b.name} on {device})"
        with watchdog.guard(what, t, lambda: _init_report(pstore, topo, advertised, b.name)):
            with _native_entry(b.name, settings):
                handle = b.init_rank(world_size, bytes(uid), rank, what=what)  # named while it waits its turn
    # equal on every rank, unique on the store's server: the unique id names no run (oneCCL's is
    # "IP_port", the first free port from 4096: two runs one after the other on a kept store drew the
    # same), rank 0's random nonce does (shared by the rendezvous)
    scope = hashlib.sha256(f"{cname}/{world_size}/{m.nonce}/".encode() + bytes(uid)).hexdigest()[:24]
    if b.name == "oneccl":
        env.note_first(scope, not topo.single_host)  # oneCCL made its transport for its members (if the first)
    pstore.set(f"ready/{rank}", "1")
    comm = adopt(b, handle, lambda: Communicator(b, device, handle, rank, world_size, t, record_stream, pstore,
                                                 name=cname, own=made["own"], scope=scope))  # freed if it raises
    comm.topology = topo
    if nonblocking:
        make_nonblocking(comm)
    return comm


def _agree_mpi_transport(pstore: Any, rank: int, world_size: int, cname: str) -> None:
    """``CCL_ATL_TRANSPORT=mpi`` (equal on every rank: checked): whether its
    libmpi loads is each host's fact, so each rank posts its own
    :func:`launchers.mpi_transport_problem` before the native init and every
    rank raises if any rank has one (else the others wait in oneCCL's init
    for the refused rank until their timeout). Rank 0's passed inside the
    rendezvous (a problem there raised on every rank)."""
    why = "" if rank == 0 else launchers.mpi_transport_problem()
    pstore.set(f"mpi-transport/{rank}", why or "ok")
    if why:
        raise CommunicatorError(f"init of communicator {cname!r}: {why}")
    for r in range(1, world_size):
        v = "ok" if r == rank else pstore.get(f"mpi-transport/{r}").decode()
        if v != "ok":
            raise CommunicatorError(f"init of communicator {cname!r}: rank {r} cannot run oneCCL's MPI "
                                    f"transport, so no rank starts it: {v}")


def _check_first_transport(topo: "topology.Topology", cname: str) -> None:
    """oneCCL makes its transport with a process's first communicator (and
    again with the next one after the last was destroyed), for that
    communicator's members only (docs/design.md, section 'A process's first
    oneCCL communicator spans the world'). Where that communicator is not the
    launcher's whole world, :func:`env.agreed_defaults` picks TCP; shared
    memory in effect since an earlier init (oneCCL reads its variables once)
    is refused on every member by :func:`env.agree` (``RankFacts.remade``,
    ``RankFacts.first``); here only a warning where the user set it."""
    if topo.spans_job:
        return
    running = env.in_effect()
    if not running and os.environ.get("CCL_ATL_SHM") == "1":
        log.warning("communicator %r is this process's first oneCCL communicator and spans %d of the launcher's "
                    "%s ranks, with CCL_ATL_SHM=1 set: oneCCL's shared memory then cannot serve a later "
                    "communicator with the other ranks (its creation hangs); unset CCL_ATL_SHM/FI_PROVIDER "
                    "(streamcoll then uses TCP for it) or make the world's communicator first", cname,
                    topo.world_size, topo.layout.job_size)


_IFACE_VARS = ("CCL_KVS_IFACE", "CCL_MNIC_NAME", "NCCL_SOCKET_IFNAME", "FI_PROVIDER", "CCL_ATL_SHM")
_LOOPBACK_HINT = ("Set MASTER_ADDR to an address of rank 0's host that the other hosts reach (not one that "
                  "resolves to 127.0.0.1 there) and leave CCL_KVS_IFACE/NCCL_SOCKET_IFNAME unset (streamcoll then "
                  "uses the interface that reaches MASTER_ADDR), or set them to that interface")


def _clash_text(topo: "topology.Topology") -> str:
    pairs = "; ".join(f"ranks {c.first} and {c.second} (hostname {c.hostname!r}, pid {c.pid})"
                      for c in topo.layout.clashes)
    return (f"{pairs}: same hostname and process id on different hosts. oneCCL 2022.2's key-value store tells "
            f"processes apart by hostname and process id, and its init fails with 'Unregister Barrier request' "
            f"and hangs for such ranks (measured on simulated hosts). Give the hosts distinct hostnames, or start "
            f"the ranks so that their process ids differ (containers started identically get identical ones)")


def _conflict_text(conflicts: List[str]) -> str:
    native = any(not t.startswith(tuple(env.OWN)) for t in conflicts)
    return ("settings that must be equal on every rank differ: " + " | ".join(conflicts) + ". Ranks that "
            "run different ones exchange mismatched messages, or wait for checks their peers never make "
            "(wrong results or a hang). Set each on every rank alike, or on none (streamcoll then chooses one "
            "value for all)" + ("; a value in effect since a process's first oneCCL init stays for that "
                                "process (oneCCL reads its variables once): make that process's first "
                                "communicator agree, or start it afresh" if native else ""))


_IMPOSED_SAID: List[str] = []


def _warn_imposed(topo: "topology.Topology", cname: str) -> None:
    """A communicator over the launcher's whole world made after another
    was this process's first oneCCL communicator (``STREAMCOLL_EAGER_INIT=0``,
    ``auto`` on a CUDA host, ``new_communicator`` over a subset first):
    oneCCL read its variables once, at that first init, so this one runs
    with that communicator's choices, not with its own layout's: TCP, and
    also its spin and algorithm (a one-rank group never shares a core, so
    an oversubscribed world spins where it would yield). Said once per
    process, on every rank (each computes the same); values the user set
    are the user's choice and not named. Not for a communicator with
    processes of other jobs (a trainer's ranks and a server): its members'
    first communicators differ by design."""
    running = env.in_effect()
    if not running or not topo.spans_job or topo.layout.jobs > 1 or _IMPOSED_SAID:
        return
    user = env._user_env()
    wanted = env.agreed_defaults(topo)
    differ = [f"{k}={repr(v) if v is not None else 'unset'} (this communicator's layout: "
              f"{repr(wanted.get(k)) if wanted.get(k) is not None else 'unset'})"
              for k, v in running.items() if k not in user and v != wanted.get(k)]
    if not differ or not env.enabled(user):
        return
    _IMPOSED_SAID.append(cname)
    log.warning("communicator %r (the launcher's whole world) runs with settings in effect since this process's "
                "first oneCCL communicator (oneCCL reads its variables once), not those its own layout calls for: "
                "%s. Make the world's communicator first (STREAMCOLL_EAGER_INIT=1, or a world collective before "
                "any sub-group's) to run with its own", cname, ", ".join(differ))


def _settings(backend: str, topo: "topology.Topology") -> Dict[str, str]:
    """What streamcoll sets around this rank's native calls
    (:func:`env.plan`); logged at debug level with the topology."""
    settings = env.plan(topo, backend)
    if LOG.isEnabledFor(logging.DEBUG):
        route = topo.me.route.describe() if topo.me.route else "no rendezvous address"
        LOG.debug("rank %d: %s; route to the rendezvous: %s; defaults applied: %s", topo.rank, topo.summary(),
                  route, " ".join(f"{k}={v}" for k, v in settings.items()) or "none (already set or off)")
    return settings


FABRIC_WAIT = 2.0
"""Seconds a timed-out oneCCL init's report waits for the other ranks'
libfabric (each publishes its own when its own watchdog fires)."""


def _fabrics(pstore: Any, topo: "topology.Topology", started: List[int]) -> Dict[int, str]:
    """Each rank's libfabric (:func:`mapped_libfabric`: oneCCL's init has
    begun, so it is mapped): this rank's published, the others' read as
    they publish theirs, for at most :data:`FABRIC_WAIT` s."""
    from .._ffi.oneccl import mapped_libfabric
    mine = mapped_libfabric()
    got: Dict[int, str] = {}
    try:
        pstore.set(f"fabric/{topo.rank}", mine or "?")
        end = time.monotonic() + FABRIC_WAIT
        while True:
            for r in started:
                if r not in got and pstore.check([f"fabric/{r}"]):
                    got[r] = pstore.get(f"fabric/{r}").decode()
            if len(got) == len(started) or time.monotonic() > end:
                return got
            time.sleep(0.05)
    except Exception:
        return got


def _fabric_cause(topo: "topology.Topology", fabrics: Dict[int, str]) -> str:
    """Why a oneCCL init on one host cannot finish where its ranks run
    different libfabric versions ('' where they do not)."""
    for host in topo.layout.hosts:
        kinds: Dict[str, List[int]] = {}
        for r in host.ranks:
            v = fabrics.get(r, "?")
            if " " in v and not v.startswith("?"):  # "VERSION PATH"; '?', '' or a short value: unknown
                kinds.setdefault(v.split(" ", 1)[0], []).append(r)
        if len(kinds) > 1:
            parts = "; ".join(f"rank(s) {', '.join(map(str, rs))}: libfabric {v} "
                              f"({fabrics[rs[0]].split(' ', 1)[1]})" for v, rs in sorted(kinds.items()))
            return ("\n  Likely cause: the ranks run oneCCL on different libfabric versions (" + parts + "): "
                    "libfabric's tcp provider of one does not speak the other's (measured: 1.17 and 2.5 never "
                    "finish oneCCL's init). oneCCL opens libfabric.so.1 by name and takes the one mapped first: "
                    "an MPI's own where MPI was initialised before (mpi4py), else LD_LIBRARY_PATH's, else the "
                    "system's. Make every process load the same one (LD_LIBRARY_PATH=<its folder> on the others)")
    return ""


def _init_report(pstore: Any, topo: "topology.Topology", advertised: Optional[tuple], backend: str = "") -> str:
    """For the watchdog when a native init outlives its timeout: who never
    finished init, and the address, port and interface each rank used (and
    with oneCCL each rank's libfabric)."""
    lines, stuck, absent = [], [], []
    fabrics = (_fabrics(pstore, topo, [r for r in range(topo.world_size) if _check(pstore, f"init/{r}")])
               if backend == "oneccl" else {})  # NCCL's report asks the store nothing more
    for r in range(topo.world_size):
        try:
            started = pstore.check([f"init/{r}"])
            used = json.loads(pstore.get(f"init/{r}").decode()) if started else {}
            ready = pstore.check([f"ready/{r}"])
        except Exception:
            started, used, ready = False, {}, False
        if not started:
            absent.append(r)
        elif not ready:
            stuck.append(r)
        env_used = " ".join(f"{k}={v}" for k, v in used.items() if v is not None)
        if r in fabrics:
            env_used += f"{' ' if env_used else ''}libfabric {fabrics[r]}"
        lines.append(f"    {topo.describe_rank(r)}; {'ready' if ready else 'not ready'}"
                     + (f"; {env_used}" if env_used else ""))
    head = []
    if absent:
        head.append(f"rank(s) {', '.join(map(str, absent))} never reached the native init")
    if stuck:
        head.append(f"rank(s) {', '.join(map(str, stuck))} did not finish it")
    if advertised:
        head.append(f"rank 0's bootstrap listens at {advertised[0]}:{advertised[1]}")
    head.append(topo.summary())
    return "; ".join(head) + "\n  Each rank:\n" + "\n".join(lines) + _fabric_cause(topo, fabrics) + (
        "\n  Likely cause: a rank that cannot reach rank 0's bootstrap address (a firewall, or an interface "
        "variable naming one that does not connect the hosts), or a rank that died")


def _check(pstore: Any, key: str) -> bool:
    try:
        return bool(pstore.check([key]))
    except Exception:
        return False


def init(
    backend: Optional[str] = None,
    device: Union[None, str, torch.device] = None,
    timeout: Union[None, float, timedelta] = None,
    store: Any = None,
    rank: Optional[int] = None,
    world_size: Optional[int] = None,
    record_stream: Optional[bool] = None,
) -> Communicator:
    """Create the default communicator used by the module-level collectives
    (``streamcoll.all_reduce(...)``) and return it. See :func:`new_communicator`."""
    global _DEFAULT
    if _DEFAULT is not None and not _DEFAULT._destroyed:
        raise UsageError("streamcoll.init() was already called; call streamcoll.destroy() first")
    _DEFAULT = new_communicator(backend, device, timeout, store, rank, world_size, record_stream, name="default")
    return _DEFAULT


def is_initialized() -> bool:
    """Whether :func:`init` made a default communicator that is not destroyed."""
    return _DEFAULT is not None and not _DEFAULT._destroyed


def default_communicator() -> Communicator:
    """The communicator :func:`init` made (what ``group=None`` means).
    Raises CommunicatorError before ``init()`` or after ``destroy()``."""
    c = _DEFAULT
    if c is None or c._destroyed:
        raise CommunicatorError("streamcoll is not initialised: call streamcoll.init() first (or pass group=)")
    return c


def get_rank(group: Optional[Communicator] = None) -> int:
    """This process's rank in ``group`` (default: the default communicator)."""
    return (group or default_communicator()).rank


def get_world_size(group: Optional[Communicator] = None) -> int:
    """The number of ranks of ``group`` (default: the default communicator)."""
    return (group or default_communicator()).size


def destroy(group: Optional[Communicator] = None) -> None:
    """Destroy ``group`` (default: the default communicator). Idempotent."""
    global _DEFAULT
    if group is None:
        c, _DEFAULT = _DEFAULT, None
        if c is not None:
            c.destroy()
    else:
        group.destroy()


destroy_process_group = destroy
