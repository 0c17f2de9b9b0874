"""Creating communicators: rank and world from torchrun's variables, the
unique id exchanged through a torch.distributed store, and the default
communicator the module-level functions use.

Rendezvous is torch.distributed's (``env://``: TCPStore at MASTER_ADDR,
MASTER_PORT, or the agent's store under torchrun); after it, NCCL's or
oneCCL's own bootstrap and networking take over. Nothing home-made.
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import threading
import time
from datetime import timedelta
from typing import Any, Dict, Iterator, List, Optional, Tuple, Union

import torch

from .backends import resolve
from .communicator import Communicator, _seconds
from . import env, launchers, shm_regions, topology
from .env_vars import read_int
from .errors import BackendUnavailableError, CommunicatorError, RendezvousError, UsageError

log = logging.getLogger("streamcoll.bootstrap")

__all__ = ["init", "new_communicator", "is_initialized", "get_rank", "get_world_size",
           "destroy", "default_communicator", "is_available"]

_DEFAULT: Optional[Communicator] = None
_STORE: Any = None
_LOCK = threading.Lock()
LOG = logging.getLogger("streamcoll")


def is_available(backend: str = "oneccl") -> bool:
    """Whether ``backend``'s native library loads here. Never raises."""
    try:
        from .backends import get_backend
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
    :mod:`streamcoll.logs`) and installing signal handlers (Python's are put
    back for SIGINT/SIGTERM, see :mod:`streamcoll.signals`)."""
    from .logs import quiet_oneccl_startup
    from .signals import native_entry
    with env.applied(settings, backend):
        if backend != "oneccl":
            yield
            return
        shm_regions.before_first_init()  # the exit hook for libfabric's /dev/shm regions, stale ones swept
        with native_entry(), quiet_oneccl_startup():
            yield


def _store_address() -> Tuple[str, int]:
    """MASTER_ADDR and MASTER_PORT for the env:// store, which needs them:
    a MASTER_PORT that is no integer is a ValueError naming it."""
    addr = os.environ.get("MASTER_ADDR", "")
    try:
        port = int(os.environ.get("MASTER_PORT", "-1"))
    except ValueError:
        raise ValueError(f"environment variable MASTER_PORT: expected an integer port, "
                         f"got {os.environ.get('MASTER_PORT')!r}") from None
    return addr, port


def _reported_address() -> Tuple[str, int]:
    """MASTER_ADDR and MASTER_PORT for messages only, never raising: with
    ``store=`` given they are not used, and may hold anything (Kubernetes
    sets ``MASTER_PORT=tcp://10.96.0.5:29500`` for a Service named
    "master"); a port that is no integer is reported as -1."""
    try:
        return _store_address()
    except ValueError:
        return os.environ.get("MASTER_ADDR", ""), -1


def _first_lines(e: BaseException) -> str:
    """torch's store errors without the C++ frames they carry."""
    out = []
    for line in str(e).splitlines():
        if line.startswith(("Exception raised from", "frame #")) or not line.strip():
            break
        out.append(line.strip())
    return " ".join(out)[:300] or type(e).__name__


def _progress_interval(timeout: float) -> float:
    """How often a rendezvous that waits says so: 30 s for the default 600 s
    timeout, down to 1 s for short ones."""
    return max(1.0, min(30.0, timeout / 5))


def _get_store(rank: int, world_size: int, timeout: float):
    """The default store: torch.distributed's if it is initialised, else the
    ``env://`` rendezvous's TCPStore (created once per process and reused).

    The TCPStore is made as torch's env:// rendezvous makes it (rank 0 hosts
    it, multi-tenant; under torchrun every rank is a client of the agent's
    store), except that rank 0 does not wait inside the constructor for the
    others (``wait_for_workers=False``): the host exchange that follows does
    the waiting, says every so often which ranks it waits for, and raises a
    :class:`RendezvousError` naming them at the timeout. A client that cannot
    reach the store raises one too, without torch's C++ frames."""
    global _STORE
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized():
        return dist.distributed_c10d._get_default_store()
    if _STORE is None:
        for var in ("MASTER_ADDR", "MASTER_PORT"):
            if var not in os.environ:
                raise ValueError(
                    f"{var} is not set: launch with torchrun, set MASTER_ADDR/MASTER_PORT, or pass store="
                )
        addr, port = _store_address()
        if not 0 <= port < 2 ** 16:
            raise ValueError(f"environment variable MASTER_PORT: expected a port in [0, 65536), got {port}")
        agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == str(True)
        master = rank == 0 and not agent
        if not master:
            _wait_for_server(addr, port, rank, world_size, timeout, agent)
        try:
            if master:
                store = dist.TCPStore(addr, port, world_size, True, timedelta(seconds=timeout),
                                      wait_for_workers=False, multi_tenant=True)
            else:
                store = dist.TCPStore(addr, port, world_size, False, timedelta(seconds=timeout))
        except (RuntimeError, OSError) as e:  # DistNetworkError, DistStoreError
            who = ("could not start the store server" if master else
                   "no store server answered" if not agent else "torchrun's agent store did not answer")
            raise RendezvousError(
                f"rendezvous failed on rank {rank} of {world_size}: {who} at {addr}:{port} within {timeout:g} s "
                f"({_first_lines(e)}). Check that rank 0 runs and that MASTER_ADDR/MASTER_PORT are the same on "
                f"every rank and reachable from this host (WORLD_SIZE={os.environ.get('WORLD_SIZE')}).",
                [0] if not master else [], addr, port, world_size, os.environ.get("WORLD_SIZE"),
            ) from None
        _STORE = store
    return _STORE


def _wait_for_server(addr: str, port: int, rank: int, world_size: int, timeout: float, agent: bool) -> None:
    """Wait until the store's port accepts connections, with progress lines.

    torch's TCPStore client retries a refused connection itself, but past
    the timeout it takes up to twice as long and logs C++ stack frames on
    each retry (measured: 20.6 s and 30 frames for ``timeout=10``); a plain
    socket probe keeps the wait within the timeout and the output readable.
    """
    start = time.monotonic()
    interval = _progress_interval(timeout)
    next_report = start + interval
    pause = 0.01
    last = ""
    while True:
        try:
            with socket.create_connection((addr, port), timeout=max(0.1, min(2.0, timeout))):
                return
        except OSError as e:
            last = f"{type(e).__name__}: {e}"
        now = time.monotonic()
        waited = now - start
        env_ws = os.environ.get("WORLD_SIZE")
        server = "torchrun's agent store" if agent else "the store server of rank 0"
        if waited >= timeout:
            raise RendezvousError(
                f"rendezvous failed on rank {rank} of {world_size}: {server} at {addr}:{port} did not answer "
                f"within {timeout:g} s (last attempt: {last}). Check that rank 0 runs and that "
                f"MASTER_ADDR/MASTER_PORT are the same on every rank and reachable from this host "
                f"(world size {world_size}, WORLD_SIZE={env_ws}).",
                [] if agent else [0], addr, port, world_size, env_ws)
        if now >= next_report:
            log.warning("streamcoll: rank %d waiting for %s at %s:%d (world size %d, WORLD_SIZE=%s): %.0f s of %g s "
                        "(%s)", rank, server, addr, port, world_size, env_ws, waited, timeout, last)
            next_report = now + interval
        time.sleep(min(pause, max(timeout - waited, 0.0)))
        pause = min(pause * 2, 0.25)


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


def _wait_all(pstore: Any, keys: List[str], rank: int, world_size: int, timeout: float, cname: str) -> None:
    """Wait until every rank set its key in ``keys`` (the topology exchange:
    the first point where all ranks meet), with progress lines, naming the
    missing ranks, the store and the world sizes at the timeout."""
    start = time.monotonic()
    interval = _progress_interval(timeout)
    next_report = start + interval
    pause = 0.001
    # Polled with check(): a store wait() that times out logs a C++ warning each time.
    while True:
        try:
            if pstore.check(keys):
                break
            missing: Optional[list] = None
            err = ""
        except (RuntimeError, OSError) as e:  # the store went away (its host died)
            missing, err = None, _first_lines(e)
        now = time.monotonic()
        waited = now - start
        if err or waited >= timeout or now >= next_report:
            if not err:
                try:
                    missing = [r for r in range(world_size) if not pstore.check([keys[r]])]
                except (RuntimeError, OSError) as e:
                    err = _first_lines(e)
                if missing == []:
                    break
            addr, port = _reported_address() if "MASTER_PORT" in os.environ else ("", -1)
            where = f" at {addr}:{port}" if addr else ""
            env_ws = os.environ.get("WORLD_SIZE")
            shown = _ranks_text(missing)
            if err or waited >= timeout:
                detail = (f"{shown} never joined within {timeout:g} s" if not err
                          else f"the store stopped answering ({err})")
                raise RendezvousError(
                    f"rendezvous of communicator {cname!r} failed on rank {rank}: {detail} "
                    f"(store{where}; world size {world_size}, WORLD_SIZE={env_ws}). Start every rank with the "
                    "same MASTER_ADDR/MASTER_PORT and world size, or raise the timeout.",
                    missing or [], addr, port, world_size, env_ws)
            log.warning("streamcoll: rank %d waiting for %s to join communicator %r (store%s; world size %d, "
                        "WORLD_SIZE=%s): %.0f s of %g s", rank, shown, cname, where, world_size, env_ws,
                        waited, timeout)
            next_report = now + interval
        time.sleep(min(pause, max(timeout - waited, 0.0)))
        pause = min(pause * 2, 0.1)
    return None


def _ranks_text(ranks: Optional[list]) -> str:
    """``rank 1``, ``ranks 1, 2``, ``ranks 0, 1, ... (900 in all)``."""
    if not ranks:
        return "ranks ?"
    head = "rank " if len(ranks) == 1 else "ranks "
    if len(ranks) > 16:
        return head + ", ".join(map(str, ranks[:16])) + f", ... ({len(ranks)} in all)"
    return head + ", ".join(map(str, ranks))


def new_communicator(
    backend: Optional[str] = None,
    device: Union[None, str, torch.device] = None,
    timeout: Union[None, float, timedelta] = None,
    store: Any = None,
    rank: Optional[int] = None,
    world_size: Optional[int] = None,
    record_stream: Optional[bool] = None,
    name: Optional[str] = None,
) -> Communicator:
    """Create a Communicator over ``world_size`` ranks (collective: every
    rank calls it with the same arguments in the same order).

    ``rank``/``world_size`` default to RANK/WORLD_SIZE (torchrun sets them;
    under srun or mpiexec :mod:`streamcoll.launchers` sets them from theirs);
    ``device`` defaults to ``cuda:LOCAL_RANK`` where CUDA is available, else
    cpu; ``backend`` defaults by device (cpu, xpu: oneccl; cuda: nccl).
    ``store`` is any torch.distributed Store; by default the one
    torch.distributed was initialised with, else the env:// rendezvous.
    """
    t = _seconds(timeout)
    if store is None or rank is None or world_size is None:  # srun, mpiexec: torchrun's variables from theirs
        launchers.adopt(rendezvous=store is None)
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
    from .work import POSTING, launch_posted
    if POSTING:
        launch_posted()  # the rendezvous blocks on the other ranks: nothing posted here may be what they wait on
    if (b.name == "nccl" or device.type == "cuda") and not torch.cuda.is_available():
        why = (f"this torch build has no CUDA (torch {torch.__version__})" if torch.version.cuda is None
               else "no CUDA GPU is visible (CUDA_VISIBLE_DEVICES, driver)")
        raise BackendUnavailableError(f"backend {b.name!r} on {device} needs a CUDA GPU: {why}; use "
                                      "backend='oneccl' (device 'cpu') here")
    if device.type in ("cuda", "xpu") and device.index is None:
        device = torch.device(device.type, local_rank())

    if store is None:
        store = _get_store(rank, world_size, t)
    import torch.distributed as dist
    # The communicator's namespace in the store: numbered through the store
    # itself (every rank adds 1; the k-th communicator of this name gets k),
    # not by a counter of this process, which differs between ranks whose
    # processes made different communicators before (a worker pool, a failed
    # init on one rank) and would put the ranks in different namespaces.
    with _LOCK:
        n = (int(store.add(f"streamcoll/{name or 'comm'}/made", 1)) - 1) // world_size + 1
    prefix = f"streamcoll/{name or 'comm'}/{n}/"
    pstore = dist.PrefixStore(prefix, store)
    pstore.set_timeout(timedelta(seconds=t))

    # Which ranks share a host, and the interface reaching the rendezvous:
    # decides the defaults (topology.py says from what, env.py which values).
    # The first point where all ranks meet: it waits with progress lines and
    # names the missing ranks at the timeout (RendezvousError).
    cname = name or ("default" if n == 1 else f"comm{n}")
    topo = topology.exchange(pstore, rank, world_size, t,
                             wait=lambda keys: _wait_all(pstore, keys, rank, world_size, t, cname))
    if b.name == "oneccl" and topo.name_clashes():  # every rank sees the same facts, so every rank raises
        raise CommunicatorError(f"init of communicator {cname!r}: {_clash_text(topo)}")
    conflicts = topo.agreed.conflicts_for(b.name)
    if conflicts:  # computed from every rank's facts: every rank raises, before the native init
        raise CommunicatorError(f"init of communicator {cname!r}: {_conflict_text(conflicts)}")
    settings = _settings(b.name, topo)
    if device.type == "cuda":
        torch.cuda.set_device(device)

    if rank == 0:
        with _native_entry(b.name, settings):
            uid = b.unique_id()
        pstore.set("uid", uid)  # type: ignore[arg-type]  # torch stores take bytes too
    else:
        uid = _wait_uid(pstore, rank, t, topo)
    advertised = topology.advertised_address(b.name, bytes(uid))
    problem = topo.loopback_problem(advertised[0] if advertised else None)
    if problem:  # every rank sees the same facts, so every rank raises
        raise CommunicatorError(f"init of communicator {cname!r}: {problem}. {_LOOPBACK_HINT}")
    from . import watchdog
    nonblocking = b.name == "nccl" and watchdog.nccl_nonblocking_requested()
    pstore.set(f"init/{rank}", json.dumps({k: os.environ.get(k, settings.get(k)) for k in _IFACE_VARS}))
    if nonblocking:  # polled with ncclCommGetAsyncError: times out with CollectiveTimeout
        with _native_entry(b.name, settings):  # NCCL's init reads its variables until it is ready
            handle = b.init_rank(world_size, bytes(uid), rank, blocking=False, timeout=t)
    else:  # a blocking init whose peers never come must not hang silently
        what = f"init of communicator {cname!r} (rank {rank} of {world_size}, {b.name} on {device})"
        with watchdog.guard(what, t, lambda: _init_report(pstore, topo, advertised)):
            with _native_entry(b.name, settings):
                handle = b.init_rank(world_size, bytes(uid), rank)
    pstore.set(f"ready/{rank}", "1")
    comm = Communicator(b, device, handle, rank, world_size, t, record_stream, pstore, name=cname)
    comm.topology = topo
    if nonblocking:
        watchdog.make_nonblocking(comm)
    return comm


_IFACE_VARS = ("CCL_KVS_IFACE", "CCL_MNIC_NAME", "NCCL_SOCKET_IFNAME", "FI_PROVIDER", "CCL_ATL_SHM")
_LOOPBACK_HINT = ("Set MASTER_ADDR to an address of rank 0's host that the other hosts reach (not one that "
                  "resolves to 127.0.0.1 there) and leave CCL_KVS_IFACE/NCCL_SOCKET_IFNAME unset (streamcoll then "
                  "uses the interface that reaches MASTER_ADDR), or set them to that interface")


def _clash_text(topo: "topology.Topology") -> str:
    pairs = "; ".join(f"ranks {a} and {b} (hostname {topo.facts[a].hostname!r}, pid {topo.facts[a].pid})"
                      for a, b in topo.name_clashes())
    return (f"{pairs}: same hostname and process id on different hosts. oneCCL 2022.2's key-value store tells "
            f"processes apart by hostname and process id, and its init fails with 'Unregister Barrier request' "
            f"and hangs for such ranks (measured on simulated hosts). Give the hosts distinct hostnames, or start "
            f"the ranks so that their process ids differ (containers started identically get identical ones)")


def _conflict_text(conflicts: List[str]) -> str:
    return ("settings that must be equal on every rank differ: " + " | ".join(conflicts) + ". Ranks that "
            "run different ones exchange mismatched messages (wrong results or a hang). Set each on every rank "
            "alike, or on none (streamcoll then chooses one value for all); a value in effect since a process's "
            "first oneCCL init stays for that process (oneCCL reads its variables once): make that "
            "process's first communicator agree, or start it afresh")


def _settings(backend: str, topo: "topology.Topology") -> Dict[str, str]:
    """What streamcoll sets around this rank's native calls
    (:func:`env.plan`); logged at debug level with the topology."""
    settings = env.plan(topo, backend)
    if LOG.isEnabledFor(logging.DEBUG):
        route = topo.me.route.describe() if topo.me.route else "no rendezvous address"
        LOG.debug("rank %d: %s; route to the rendezvous: %s; defaults applied: %s", topo.rank, topo.summary(),
                  route, " ".join(f"{k}={v}" for k, v in settings.items()) or "none (already set or off)")
    return settings


def _wait_uid(pstore: Any, rank: int, timeout: float, topo: "topology.Topology") -> bytes:
    try:
        return pstore.get("uid")
    except (RuntimeError, OSError) as e:  # DistStoreError: rank 0 went away after the host exchange
        raise RendezvousError(
            f"rendezvous failed on rank {rank}: rank 0 ({topo.describe_rank(0)}) did not publish the unique id "
            f"within {timeout:g} s (it creates it with the library's bootstrap; look at rank 0's error) "
            f"({_first_lines(e)})", [0], *_reported_address(), len(topo.facts), os.environ.get("WORLD_SIZE")) from None


def _init_report(pstore: Any, topo: "topology.Topology", advertised: Optional[tuple]) -> str:
    """For the watchdog when a native init outlives its timeout: who never
    finished init, and the address, port and interface each rank used."""
    lines, stuck, absent = [], [], []
    for r in range(len(topo.facts)):
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
    return "; ".join(head) + "\n  Each rank:\n" + "\n".join(lines) + (
        "\n  Likely cause: a rank that cannot reach rank 0's bootstrap address (a firewall, or an interface "
        "variable naming one that does not connect the hosts), or a rank that died")


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
