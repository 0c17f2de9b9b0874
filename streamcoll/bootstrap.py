"""Creating communicators: rank and world from torchrun's variables, the
unique id exchanged through a torch.distributed store, and the default
communicator the module-level functions use.

Rendezvous is torch.distributed's (``env://``: TCPStore at MASTER_ADDR,
MASTER_PORT, or the agent's store under torchrun); after it, NCCL's or
oneCCL's own bootstrap and networking take over. What streamcoll adds over
the store is :func:`rendezvous`: the ranks' facts meet at rank 0, which
publishes the topology and the unique id in one key, a constant number of
requests per rank (torch's own pattern for a NCCL group is one request per
rank; NCCL's bootstrap is a ring among the ranks). Every wait passes its own
timeout: the caller's store keeps its own.
"""
from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import socket
import threading
import time
import zlib
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple, Union

import torch

from .backends import resolve
from .communicator import Communicator, _seconds, adopt
from . import env, launchers, shm_regions, topology
from .env_vars import read_int
from .errors import BackendUnavailableError, CommunicatorError, RendezvousError, UsageError

log = logging.getLogger("streamcoll.bootstrap")

__all__ = ["init", "new_communicator", "rendezvous", "Meeting", "group_topology", "is_initialized", "get_rank",
           "get_world_size", "destroy", "default_communicator", "is_available"]

_DEFAULT: Optional[Communicator] = None
_STORE: Any = None
# The topology of a communicator over the launcher's (torch's) whole world,
# process rank r = its rank r: what subgroups derive theirs from.
_WORLD_TOPOLOGY: Optional[topology.Topology] = None
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


def _world_size() -> Optional[int]:
    """The world's size: torch.distributed's where initialised, else WORLD_SIZE."""
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return read_int("WORLD_SIZE")


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


def _ranks_text(ranks: Optional[list]) -> str:
    """``rank 1``, ``ranks 1, 2``, ``ranks 0, 1, ... (900 in all)``."""
    if not ranks:
        return "ranks ?"
    head = "rank " if len(ranks) == 1 else "ranks "
    if len(ranks) > 16:
        return head + ", ".join(map(str, ranks[:16])) + f", ... ({len(ranks)} in all)"
    return head + ", ".join(map(str, ranks))


# ---------------------------------------------------------------- rendezvous
@dataclass
class Meeting:
    """What :func:`rendezvous` gives each rank: its view of the topology,
    the library's unique id (made by rank 0), the communicator's own
    namespace in the store (a PrefixStore) and the name messages use."""

    topology: topology.Topology
    uid: bytes
    store: Any
    name: str


def _round_key(k: int) -> str:
    return f"topology/{k}"


def _conflict(store: Any) -> str:
    """What a process that found its slot of this namespace taken left
    there (:func:`_claim`), for a timeout's message; else ""."""
    try:
        return f". Meanwhile: {store.get('conflict').decode()}" if store.check(["conflict"]) else ""
    except Exception:
        return ""


def _store_failed(e: BaseException) -> bool:
    """A store call that failed for another reason than its own timeout."""
    return "timeout" not in str(e).lower() and "timed out" not in str(e).lower()


def _missing(store: Any, keys: List[str], ranks: List[int]) -> List[int]:
    """The ranks whose key in ``keys`` is absent: one ``check`` per 64 keys,
    then one per key only inside the blocks that are incomplete."""
    out: List[int] = []
    for i in range(0, len(keys), 64):
        block = keys[i:i + 64]
        if not store.check(block):
            out.extend(r for r, k in zip(ranks[i:i + 64], block) if not store.check([k]))
    return out


class _Rounds:
    """Rank 0's announcements under ``topology/1``, ``topology/2``, ...: a
    status while it waits (who is missing), then the outcome (the layout and
    the unique id, or the error). The other ranks read them in order, each
    with a server-side ``wait`` that rank 0's next announcement ends, so a
    slow rendezvous costs them one wait and one get per progress interval
    and no client-side timeouts (torch logs a C++ warning for each)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.next = 1
        self.closed = False

    def publish(self, store: Any, body: dict, final: bool) -> bool:
        with self.lock:
            if self.closed:
                return False
            k, self.next = self.next, self.next + 1
            self.closed = final
            store.set(_round_key(k), zlib.compress(json.dumps(body, separators=(",", ":")).encode()))
            return True


@functools.lru_cache(maxsize=4)
def _announcement(raw: bytes) -> dict:
    """One of rank 0's announcements, decoded; the outcome's layout as a
    (frozen) Layout. Cached by its bytes: ranks simulated as threads of one
    process (``streamcoll.bench.rendezvous``) decode it once, as one real
    rank does."""
    body = json.loads(zlib.decompress(raw))
    if "topology" in body:
        body["layout"] = topology.from_plain(topology.Layout, body.pop("topology"))
        body["uid"] = bytes.fromhex(body["uid"])
    return body


def _published_error(e: BaseException) -> dict:
    if isinstance(e, RendezvousError):
        return {"kind": "rendezvous", "message": e.message, "missing": e.missing}
    kind = "communicator" if isinstance(e, CommunicatorError) else type(e).__name__
    return {"kind": kind, "message": str(e), "missing": []}


def _raise_published(err: dict, rank: int, world_size: int) -> None:
    addr, port = _reported_address() if "MASTER_PORT" in os.environ else ("", -1)
    msg = f"{err['message']} (reported by rank 0 to every rank; this is rank {rank})"
    if err["kind"] == "rendezvous":
        raise RendezvousError(msg, err.get("missing") or [], addr, port, world_size, os.environ.get("WORLD_SIZE"))
    if err["kind"] != "communicator":
        msg = f"rank 0 failed to compute the topology: {err['kind']}: {msg}"
    raise CommunicatorError(msg)


class _Lead:
    """Rank 0's side: wait for every rank's facts in the server, with a
    reporter thread that, only if the wait outlasts a progress interval,
    names the missing ranks on a second connection (``store.clone()``), tells
    the others, and at the timeout publishes the failure and ends the wait."""

    def __init__(self, store: Any, world_size: int, timeout: float, cname: str, rounds: _Rounds,
                 clone: Callable[[], Any]) -> None:
        self.store, self.world_size, self.timeout, self.cname = store, world_size, timeout, cname
        self.clone = clone
        self.rounds = rounds
        self.ranks = list(range(1, world_size))
        self.keys = [topology.exchange_key(r) for r in self.ranks]
        self.done = threading.Event()
        self.error: Optional[RendezvousError] = None
        self.start = time.monotonic()

    def _error(self, missing: List[int], waited: float, err: str = "", store: Any = None) -> RendezvousError:
        addr, port = _reported_address() if "MASTER_PORT" in os.environ else ("", -1)
        where = f" at {addr}:{port}" if addr else ""
        env_ws = os.environ.get("WORLD_SIZE")
        detail = (f"the store stopped answering ({err})" if err else
                  f"{_ranks_text(missing)} never joined within {self.timeout:g} s"
                  f"{_conflict(store) if store is not None else ''}")
        return RendezvousError(
            f"rendezvous of communicator {self.cname!r} failed on rank 0: {detail} (store{where}; world size "
            f"{self.world_size}, WORLD_SIZE={env_ws}). Start every rank with the same MASTER_ADDR/MASTER_PORT and "
            "world size, or raise the timeout.", missing, addr, port, self.world_size, env_ws)

    def _report(self) -> None:
        interval = _progress_interval(self.timeout)
        side: Any = None
        keep: Any = None  # the clone under side's prefix, kept alive
        while not self.done.wait(min(interval, max(self.start + self.timeout - time.monotonic(), 0.0))):
            try:
                if side is None:
                    side, keep = self.clone()
                missing = _missing(side, self.keys, self.ranks)
            except Exception as e:  # no second connection: the main wait's own timeout decides
                log.debug("rendezvous: no second store connection for progress reports (%s)", _first_lines(e))
                return
            if not missing or self.done.is_set():
                return
            waited = time.monotonic() - self.start
            if waited >= self.timeout:
                self.error = self._error(missing, waited, store=side)
                try:
                    self.rounds.publish(side, {"error": _published_error(self.error)}, final=True)
                    for k in (topology.exchange_key(r) for r in missing):
                        side.compare_set(k, "", b"")  # ends the main wait; a rank's own facts win
                except Exception:
                    pass
                return
            addr, port = _reported_address() if "MASTER_PORT" in os.environ else ("", -1)
            where = f" at {addr}:{port}" if addr else ""
            log.warning("streamcoll: rank 0 waiting for %s to join communicator %r (store%s; world size %d, "
                        "WORLD_SIZE=%s): %.0f s of %g s", _ranks_text(missing), self.cname, where,
                        self.world_size, os.environ.get("WORLD_SIZE"), waited, self.timeout)
            try:
                self.rounds.publish(side, {"waiting": topology.run_text(missing), "waited": round(waited, 1)}, final=False)
            except Exception:
                pass

    def wait_all(self) -> None:
        """Return once every rank's facts are in the store, or raise."""
        if not self.keys:
            return
        reporter = threading.Thread(target=self._report, name="streamcoll-rendezvous", daemon=True)
        reporter.start()
        try:
            # One request; the reporter ends it at the timeout, the slack is for a store without clone().
            self.store.wait(self.keys, timedelta(seconds=self.timeout + _progress_interval(self.timeout)))
            failure: Optional[BaseException] = None
        except (RuntimeError, OSError) as e:
            failure = e
        finally:
            self.done.set()
            reporter.join()
        if self.error is not None:
            raise self.error
        if failure is not None:
            waited = time.monotonic() - self.start
            err = _first_lines(failure) if _store_failed(failure) else ""
            try:
                missing = [] if err else _missing(self.store, self.keys, self.ranks)
            except (RuntimeError, OSError) as e:
                missing, err = [], _first_lines(e)
            error = self._error(missing, waited, err, store=None if err else self.store)
            if not err:
                with contextlib.suppress(RuntimeError, OSError):
                    self.rounds.publish(self.store, {"error": _published_error(error)}, final=True)
            raise error from None


def _follow(store: Any, rank: int, world_size: int, timeout: float, cname: str) -> dict:
    """A rank other than 0: read rank 0's announcements until the outcome."""
    start = time.monotonic()
    addr, port = _reported_address() if "MASTER_PORT" in os.environ else ("", -1)
    where = f" at {addr}:{port}" if addr else ""
    env_ws = os.environ.get("WORLD_SIZE")
    k, said = 1, ""
    while True:
        remaining = start + timeout - time.monotonic()
        try:
            if remaining <= 0:
                raise RuntimeError("timeout")
            store.wait([_round_key(k)], timedelta(seconds=remaining))
            body = _announcement(store.get(_round_key(k)))
        except (RuntimeError, OSError) as e:
            failed = _store_failed(e)
            if failed:
                last = (f"; it last said it waited for {_ranks_text(list(topology.parse_runs(said)))}"
                        if said else "")
                detail = (f"the store stopped answering ({_first_lines(e)}); rank 0, which publishes the topology, "
                          f"may have died (it hosts the store under env:// without torchrun){last}")
            elif said:
                detail = (f"rank 0 still waited for {_ranks_text(list(topology.parse_runs(said)))}, which never "
                          f"joined within {timeout:g} s")
            else:
                detail = (f"rank 0 published nothing within {timeout:g} s: it never reached the rendezvous, or "
                          f"died (look at rank 0's output){_conflict(store)}")
            missing = list(topology.parse_runs(said)) if said and not failed else [0]
            raise RendezvousError(
                f"rendezvous of communicator {cname!r} failed on rank {rank}: {detail} (store{where}; world size "
                f"{world_size}, WORLD_SIZE={env_ws}). Start every rank with the same MASTER_ADDR/MASTER_PORT and "
                "world size, or raise the timeout.", missing, addr, port, world_size, env_ws) from None
        if "waiting" in body:
            said = body["waiting"]
            log.warning("streamcoll: rank %d waiting for %s to join communicator %r (rank 0 says; store%s; world "
                        "size %d, WORLD_SIZE=%s): %.0f s of %g s", rank, _ranks_text(list(topology.parse_runs(said))), cname,
                        where, world_size, env_ws, time.monotonic() - start, timeout)
            k += 1
            continue
        if "error" in body:
            _raise_published(body["error"], rank, world_size)
        return body


def rendezvous(store: Any, rank: int, world_size: int, *, timeout: Union[float, timedelta],
               facts: Optional[topology.RankFacts] = None,
               make_uid: Optional[Callable[[topology.Topology, str], bytes]] = None,
               name: Optional[str] = None, known: Optional[topology.Topology] = None) -> Meeting:
    """The store part of creating a communicator (collective), in a constant
    number of store requests per rank: 4 here (5 on rank 0), whatever ``world_size``
    (``new_communicator`` adds two keys around the native init).

    1. Every rank adds 1 to ``streamcoll/<name>/<world_size>/made``: the
       k-th communicator of that name and size gets the namespace
       ``streamcoll/<name>/<world_size>/k/`` (numbered through the store, not
       by a process's own count, which differs between ranks whose processes
       made different communicators before; keyed by the size, so that one
       rank's communicators of another size, a 1-rank one on the shared
       store, shift no one's count). Under srun the job and step lead the
       name (:func:`launchers.job_scope`): a job whose port collides with
       another's never joins its rendezvous. Communicators of one name and
       size on one store are made one after another by their members:
       groups made at the same time need their own ``name`` (or store), and
       a sub-world communicator (``1 < world_size < WORLD_SIZE``) without a
       name is refused (a ValueError naming ``name``).
    2. Every rank takes its slot with its facts (``facts``, default measured
       here) in one ``compare_set``: a rank whose slot another process holds
       (two processes claiming one rank of one namespace: groups that share
       a name, or an earlier creation not every rank joined) raises a
       RendezvousError saying so at once, and leaves the reason for the
       others' timeout messages.
    3. Rank 0 waits for all of them in the server (one ``wait``), reads
       them (one ``multi_get``), runs :func:`topology.compute` once, calls
       ``make_uid(its topology, the communicator's name)`` (default: the
       CPU backend's unique id) and publishes the layout and the id as one key; the others wait
       for that key and read it. With ``known`` (this group's topology,
       derived from a parent's) rank 0 still waits for every rank but reads
       no facts.

    While it waits, rank 0 says every ``timeout/5`` (1 to 30 s) which ranks
    are missing and tells the others, who say it too; at the timeout every
    rank raises a :class:`RendezvousError` naming them. An error of rank 0's
    (the computation, ``make_uid``) is published and raised on every rank. A
    rank 0 that never comes or dies leaves the others a RendezvousError
    within the timeout (at once where rank 0 hosted the store).
    """
    import torch.distributed as dist
    t = timeout.total_seconds() if isinstance(timeout, timedelta) else float(timeout)
    _check_name(name, world_size)
    base = f"streamcoll/{launchers.job_scope()}{name or 'comm'}/{world_size}"
    with _LOCK:
        n = (int(store.add(f"{base}/made", 1)) - 1) // world_size + 1
    prefix = f"{base}/{n}/"
    pstore = dist.PrefixStore(prefix, store)
    cname = name or ("default" if n == 1 else f"comm{n}")
    me = facts if facts is not None else topology.local_facts(rank, store)
    _claim(pstore, rank, world_size, me, cname, prefix)
    if rank != 0:
        body = _follow(pstore, rank, world_size, t, cname)
        return Meeting(topology.Topology(body["layout"], rank, me), body["uid"], pstore, cname)
    rounds = _Rounds()
    def clone() -> Any:
        # Cloned below the prefix: a PrefixStore's clone over a store written in Python (a
        # dist.Store subclass) calls pure virtual functions in torch 2.13. The clone is kept
        # referenced: a PrefixStore does not keep a Python store's overrides alive.
        base = store.clone()
        return dist.PrefixStore(prefix, base), base

    lead = _Lead(pstore, world_size, t, cname, rounds, clone)
    lead.wait_all()
    try:
        if known is not None:
            if known.world_size != world_size or known.rank != 0:
                raise ValueError(f"known: a topology of rank 0 of {world_size} ranks expected, got rank "
                                 f"{known.rank} of {known.world_size}")
            topo = known
        else:
            values = pstore.multi_get(lead.keys) if lead.keys else []
            empty = [r for r, v in enumerate(values, 1) if not v]
            if empty:  # a slot an earlier, timed-out attempt on this store marked (its reporter's b"")
                raise RendezvousError(
                    f"communicator {cname!r}: rank(s) {', '.join(map(str, empty))} left no facts in namespace "
                    f"{prefix!r} (an earlier attempt on this store timed out there): retry with a new store, "
                    f"or another name=")
            everyone = [me] + [topology.RankFacts.from_json(v) for v in values]
            topo = topology.Topology(topology.compute(everyone), 0, me)
        uid = bytes((make_uid or _default_uid)(topo, cname))
    except Exception as e:
        if world_size > 1:
            with contextlib.suppress(RuntimeError, OSError):
                rounds.publish(pstore, {"error": _published_error(e)}, final=True)
        raise
    if world_size > 1:
        rounds.publish(pstore, {"topology": topology.to_plain(topo.layout), "uid": uid.hex()}, final=True)
    return Meeting(topo, uid, pstore, cname)


def _check_name(name: Optional[str], world_size: int) -> None:
    """A communicator over some of the launcher's ranks needs a name: with
    the default one, two groups made at once on one store take ranks from
    each other in the order they reach it (process 0 with process 3)."""
    job = _world_size()
    if name is None and 1 < world_size and job is not None and world_size < job:
        raise ValueError(
            f"name: a communicator over {world_size} of the job's {job} ranks needs a name that its members "
            f"pass and no other group making one on this store uses (e.g. name=f'pair{{RANK // {world_size}}}'), "
            "or a store of its own (torch.distributed.PrefixStore): with the default name, groups made at the "
            "same time would meet each other's ranks")


def _claim(pstore: Any, rank: int, world_size: int, me: topology.RankFacts, cname: str, prefix: str) -> None:
    """Take ``rank``'s slot of the namespace with this rank's facts (one
    ``compare_set``); another process's facts there: a RendezvousError."""
    mine = me.to_json()
    got = bytes(pstore.compare_set(topology.exchange_key(rank), "", mine))
    if got == mine.encode():
        return
    try:
        o = topology.RankFacts.from_json(got)
        who = f"pid {o.pid} on {o.hostname}"
    except Exception:
        who = "another process"
    addr, port = _reported_address() if "MASTER_PORT" in os.environ else ("", -1)
    msg = (f"rendezvous of communicator {cname!r} failed on rank {rank}: rank {rank} of this {world_size}-rank "
           f"communicator's store namespace {prefix!r} is held by {who} (this is pid {me.pid} on {me.hostname}). "
           "The ranks disagree on which communicator this is: groups making communicators of one name and size "
           "on one store at the same time (give each its own name=), or an earlier creation not every rank "
           "joined (use a new name or store)")
    with contextlib.suppress(RuntimeError, OSError):
        pstore.set("conflict", msg)  # for the timeout messages of the ranks that wait in this namespace
    raise RendezvousError(msg, [], addr, port, world_size, os.environ.get("WORLD_SIZE"))


def _default_uid(topo: topology.Topology, cname: str) -> bytes:
    b, _ = resolve(None, torch.device("cpu"))
    with _native_entry(b.name, _settings(b.name, topo)):
        return bytes(b.unique_id())


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
) -> Communicator:
    """Create a Communicator over ``world_size`` ranks (collective: every
    rank calls it with the same arguments in the same order).

    ``rank``/``world_size`` default to RANK/WORLD_SIZE (torchrun sets them;
    under srun or mpiexec :mod:`streamcoll.launchers` sets them from theirs);
    ``device`` defaults to ``cuda:LOCAL_RANK`` where CUDA is available, else
    cpu; ``backend`` defaults by device (cpu, xpu: oneccl; cuda: nccl).
    ``store`` is any torch.distributed Store; by default the one
    torch.distributed was initialised with, else the env:// rendezvous.
    Its timeout stays as it is: every wait here passes its own.
    ``known_topology``: these ranks' topology where already known (a
    subgroup's, :func:`group_topology`); used on rank 0, which then reads
    no other rank's facts (the others take rank 0's).
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

    spans_world = store is None and world_size == _world_size()
    if store is None:
        store = _get_store(rank, world_size, t)

    made: Dict[str, Dict[str, str]] = {}

    def prepare(topo: topology.Topology, cname: str) -> Dict[str, str]:
        """Before this rank's first library call: what cannot work fails here
        (every rank sees the same layout, so every rank raises: on rank 0
        inside the rendezvous, which hands the error to every rank), then the
        settings for its place (topology.py says from what, env.py which
        values; the must-agree ones were decided once, on rank 0)."""
        if b.name == "oneccl" and topo.name_clashes():
            raise CommunicatorError(f"init of communicator {cname!r}: {_clash_text(topo)}")
        if b.name == "oneccl":
            _check_first_transport(topo, cname)
        conflicts = topo.agreed.conflicts_for(b.name)
        if conflicts:  # computed from every rank's facts: every rank raises, before the native init
            raise CommunicatorError(f"init of communicator {cname!r}: {_conflict_text(conflicts)}")
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
    m = rendezvous(store, rank, world_size, timeout=t, make_uid=make_uid, name=name,
                   known=known_topology)
    topo, uid, pstore, cname = m.topology, m.uid, m.store, m.name
    settings = made["settings"] if rank == 0 else prepare(topo, cname)
    if spans_world:
        global _WORLD_TOPOLOGY
        _WORLD_TOPOLOGY = topo
    advertised = topology.advertised_address(b.name, uid)
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
                handle = b.init_rank(world_size, bytes(uid), rank, what=what)  # named while it waits its turn
    pstore.set(f"ready/{rank}", "1")
    comm = adopt(b, handle, lambda: Communicator(b, device, handle, rank, world_size, t, record_stream, pstore,
                                                 name=cname))  # freed if its construction raises (issue 33)
    comm.topology = topo
    if nonblocking:
        watchdog.make_nonblocking(comm)
    return comm


def _check_first_transport(topo: "topology.Topology", cname: str) -> None:
    """oneCCL makes its transport with a process's first communicator (and
    again with the next one after the last was destroyed), its peer map sized
    for that communicator, and its shared-memory path misroutes later peers
    from outside it (issue 32). Where that communicator is not the launcher's
    whole world, :func:`env.agreed_defaults` picks TCP; here what it cannot
    fix: shared memory in effect since an earlier init (oneCCL reads its
    variables once), or set by the user."""
    if topo.spans_job:
        return
    from .communicator import live_count
    running = env.in_effect()
    if running and running.get("CCL_ATL_SHM") == "1" and live_count("oneccl") == 0:
        raise CommunicatorError(
            f"init of communicator {cname!r}: this process destroyed all its oneCCL communicators, so oneCCL "
            f"makes its transport again from this one, with shared memory (CCL_ATL_SHM=1, in effect since the "
            f"process's first init), sized for its {topo.world_size} of the launcher's {topo.layout.job_size} "
            f"ranks: a later communicator with any other rank would never finish its creation. Keep a "
            f"communicator over the whole world alive (do not destroy the streamcoll world group or "
            f"streamcoll.init()'s communicator before making sub-groups), or start the process afresh")
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


def _init_report(pstore: Any, topo: "topology.Topology", advertised: Optional[tuple]) -> str:
    """For the watchdog when a native init outlives its timeout: who never
    finished init, and the address, port and interface each rank used."""
    lines, stuck, absent = [], [], []
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
