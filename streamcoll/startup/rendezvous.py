"""The store side of creating a communicator: the default store (the
``env://`` rendezvous's TCPStore, or torch.distributed's) and
:func:`rendezvous`, the protocol by which the ranks' facts meet at rank 0,
which publishes the topology and the unique id in one key: a constant
number of store requests per rank, whatever the world size (how many, and
against torch's and NCCL's own patterns: docs/design.md, section 'The
rendezvous'). Every wait passes its own timeout: the caller's store keeps
its own.

:mod:`streamcoll.startup.bootstrap` makes the communicator around it (the native
init, the default communicator, the unique id that :func:`rendezvous` is
given as ``make_uid``), re-exports :class:`Meeting`, and offers
:func:`rendezvous` with the CPU backend's unique id as the default
(``streamcoll.startup.bootstrap.rendezvous``).
"""
from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import re
import socket
import threading
import time
import zlib
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, Dict, List, Optional, Tuple, Union

from . import launchers, topology
from ..core.env_vars import read_int
from .._ffi.errors import CommunicatorError, RendezvousError

# the logger of streamcoll.startup.bootstrap, whose part this was (what users' logging filters name)
log = logging.getLogger("streamcoll.startup.bootstrap")

__all__ = ["rendezvous", "Meeting"]

_STORE: Any = None
_LOCK = threading.Lock()


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
            else:  # bounded: a listener that is no store would hold torch's client for good
                store = _client_within(addr, port, timeout)
        except (RuntimeError, OSError) as e:  # DistNetworkError, DistStoreError
            who = ("no store server answered" if not agent else "torchrun's agent store did not answer")
            advice = (f"Check that rank 0 runs and that MASTER_ADDR/MASTER_PORT are the same on every rank "
                      f"and reachable from this host (WORLD_SIZE={os.environ.get('WORLD_SIZE')}).")
            if master:
                # Binding fails at once, not at the timeout: say what holds the port.
                who = "could not start the store server"
                advice = (f"MASTER_PORT={port} is already in use on this host (another job, or a process left "
                          f"over from one): pick another MASTER_PORT." if _in_use(e) else
                          f"Check that MASTER_ADDR={addr} is an address of this host.")
                where = f"at {addr}:{port}"
            else:
                where = f"at {addr}:{port} within {timeout:g} s"
            raise RendezvousError(
                f"rendezvous failed on rank {rank} of {world_size}: {who} {where} ({_first_lines(e)}). {advice}",
                [0] if not master else [], addr, port, world_size, os.environ.get("WORLD_SIZE"),
            ) from None
        if store is None:
            raise _not_a_store(addr, port, rank, world_size, timeout, "check MASTER_ADDR/MASTER_PORT")
        _STORE = store
    return _STORE


def _in_use(e: BaseException) -> bool:
    """Whether a store server's start failed because its port is taken."""
    return "EADDRINUSE" in str(e) or "address already in use" in str(e).lower()


_AT: Dict[Tuple[str, int], Any] = {}  # store_at's servers and clients, one per address in this process


_HOST = re.compile(r"[A-Za-z0-9_.-]+|[0-9A-Fa-f:.]*:[0-9A-Fa-f:.]*(%[A-Za-z0-9_.-]+)?")  # a name, IPv4 or IPv6


def parse_address(address: str) -> Tuple[str, int]:
    """``host:port`` (``[v6]:port``, an optional ``tcp://``) of ``store=``;
    a ValueError naming ``store`` otherwise."""
    text = address.strip()
    if text.startswith("tcp://"):
        text = text[len("tcp://"):]
    host, sep, port_text = text.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    port = int(port_text) if port_text.isascii() and port_text.isdigit() else -1
    if not sep or not _HOST.fullmatch(host) or not 0 < port < 2 ** 16:
        raise ValueError(f"store: expected a torch.distributed Store or an address 'host:port', got {address!r}")
    return host, port


def store_at(address: str, rank: int, world_size: int, timeout: float) -> Any:
    """The TCPStore at ``address`` for a communicator's ranks that share no
    launcher (processes of different jobs): rank 0 hosts it where nothing
    listens there yet, else (another job's store already listens: the
    trainer's own) every rank is a client; a client waits for the server
    within ``timeout`` and says so. One store per address in a process."""
    import torch.distributed as dist
    host, port = parse_address(address)
    got = _AT.get((host, port))
    if got is not None:
        try:
            got.check(["streamcoll/alive"])  # the host it reached may have exited (a restarted trainer)
            return got
        except (RuntimeError, OSError):  # DistNetworkError: that server is gone; a new one may listen there
            del _AT[(host, port)]
    store = None
    if rank == 0:
        try:
            store = dist.TCPStore(host, port, None, True, timedelta(seconds=timeout), wait_for_workers=False,
                                  multi_tenant=True)
        except (RuntimeError, OSError) as e:
            if not _in_use(e):
                raise RendezvousError(
                    f"rendezvous failed on rank 0 of {world_size}: could not start a store server at {host}:{port} "
                    f"({_first_lines(e)}). Check that {host} is an address of this host, or start a store there "
                    f"first and pass it", [], host, port, world_size, None) from None
    if store is None:
        start = time.monotonic()
        _wait_for_server(host, port, rank, world_size, timeout, False)
        try:
            store = _client_within(host, port, max(1.0, timeout - (time.monotonic() - start)))
        except (RuntimeError, OSError) as e:
            raise RendezvousError(
                f"rendezvous failed on rank {rank} of {world_size}: no store server answered at {host}:{port} "
                f"within {timeout:g} s ({_first_lines(e)})", [0], host, port, world_size, None) from None
        if store is None:
            raise _not_a_store(host, port, rank, world_size, timeout, "pass another address")
    _AT[(host, port)] = store
    return store


def _not_a_store(host: str, port: int, rank: int, world_size: int, timeout: float, advice: str) -> RendezvousError:
    return RendezvousError(
        f"rendezvous failed on rank {rank} of {world_size}: something listens at {host}:{port} but did not answer "
        f"as a torch.distributed store within {timeout:g} s (a process that is no store holds the port?): {advice}",
        [], host, port, world_size, None, timed_out=False)


def _client_within(host: str, port: int, timeout: float) -> Any:
    """A TCPStore client of ``host:port``, or None where its connection
    does not complete within ``timeout``: torch's client waits for the
    server's answer to its handshake without a bound, so a listener that is
    no store (it accepts, never answers) held it as long as it lived
    (measured: over 80 s for ``timeout=5``). The waiting thread is left
    behind (a daemon); its store, if it ever connects, is dropped."""
    import torch.distributed as dist
    box: Dict[str, Any] = {}

    def connect() -> None:
        try:
            box["store"] = dist.TCPStore(host, port, None, False, timedelta(seconds=timeout))
        except BaseException as e:  # noqa: BLE001  (re-raised in the caller)
            box["error"] = e

    t = threading.Thread(target=connect, name="streamcoll-store-connect", daemon=True)
    t.start()
    t.join(timeout)
    if "error" in box:
        raise box["error"]
    return box.get("store")


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
    namespace in the store (a PrefixStore), the name messages use and
    ``nonce``: random hex drawn by rank 0, equal on every rank (oneCCL's
    unique id is ``IP_port``, the first free port from 4096: equal for two
    runs one after the other, so it names no run)."""

    topology: topology.Topology
    uid: bytes
    store: Any
    name: str
    nonce: str = ""


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
        return {"kind": "rendezvous", "message": e.message, "missing": e.missing, "timed_out": e.timed_out}
    kind = "communicator" if isinstance(e, CommunicatorError) else type(e).__name__
    return {"kind": kind, "message": str(e), "missing": []}


def _raise_published(err: dict, rank: int, world_size: int) -> None:
    addr, port = _reported_address() if "MASTER_PORT" in os.environ else ("", -1)
    msg = f"{err['message']} (reported by rank 0 to every rank; this is rank {rank})"
    if err["kind"] == "rendezvous":
        raise RendezvousError(msg, err.get("missing") or [], addr, port, world_size, os.environ.get("WORLD_SIZE"),
                              timed_out=err.get("timed_out", True))
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
            "world size, or raise the timeout.", missing, addr, port, self.world_size, env_ws, timed_out=not err)

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
                detail = (f"the store stopped answering ({_first_lines(e)}) after {time.monotonic() - start:.1f} s, "
                          f"before rank 0 published the outcome, and nothing timed out: the process hosting the "
                          f"store left or died (rank 0 under env:// without torchrun, or with a TCPStore it made)"
                          f"{last}")
            elif said:
                detail = (f"rank 0 still waited for {_ranks_text(list(topology.parse_runs(said)))}, which never "
                          f"joined within {timeout:g} s")
            else:
                detail = (f"rank 0 published nothing within {timeout:g} s: it never reached the rendezvous, or "
                          f"died (look at rank 0's output){_conflict(store)}")
            missing = list(topology.parse_runs(said)) if said and not failed else [0]
            raise RendezvousError(
                f"rendezvous of communicator {cname!r} failed on rank {rank}: {detail} (store{where}; world size "
                f"{world_size}, WORLD_SIZE={env_ws}). " + (
                    "Look at the output of the process that hosted the store for why it ended." if failed else
                    "Start every rank with the same MASTER_ADDR/MASTER_PORT and world size, or raise the timeout."),
                missing, addr, port, world_size, env_ws, timed_out=not failed) from None
        if "waiting" in body:
            said = body["waiting"]
            log.warning("streamcoll: rank %d waiting for %s to join communicator %r (rank 0 says; store%s; world "
                        "size %d, WORLD_SIZE=%s): %.0f s of %g s", rank, _ranks_text(list(topology.parse_runs(said))), cname,
                        where, world_size, env_ws, time.monotonic() - start, timeout)
            k += 1
            continue
        if "error" in body:
            if body.get("ack"):  # rank 0 keeps the store up until every rank has read why (_hold_for_readers)
                with contextlib.suppress(RuntimeError, OSError):
                    store.set(_read_key(rank), "1")
            _raise_published(body["error"], rank, world_size)
        return body


def rendezvous(store: Any, rank: int, world_size: int, *, timeout: Union[float, timedelta],
               facts: Optional[topology.RankFacts] = None,
               make_uid: Callable[[topology.Topology, str], bytes],
               name: Optional[str] = None, known: Optional[topology.Topology] = None,
               scoped: bool = True) -> Meeting:
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
       another's never joins its rendezvous (``scoped`` False: not;
       ``new_communicator`` scopes only the launcher's own store, a store
       given being shared by whoever passed it, members of different jobs
       included: an srun task and a server started with python). Communicators of one name and
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
       ``make_uid(its topology, the communicator's name)`` (the native
       side's: :func:`streamcoll.startup.bootstrap.rendezvous` defaults it to the
       CPU backend's unique id) and publishes the layout and the id as one key; the others wait
       for that key and read it. With ``known`` (this group's topology,
       derived from a parent's) rank 0 still waits for every rank but reads
       no facts.

    While it waits, rank 0 says every ``timeout/5`` (1 to 30 s) which ranks
    are missing and tells the others, who say it too; at the timeout every
    rank raises a :class:`RendezvousError` naming them. An error of rank 0's
    (the computation, ``make_uid``) is published and raised on every rank;
    rank 0 raises it once every rank has read it (at most
    :data:`HOLD_FOR_READERS` s), so that a rank 0 hosting the store does not
    close it under a rank still reading. A rank 0 that never comes or dies
    leaves the others a RendezvousError within the timeout (at once where
    rank 0 hosted the store, saying so, with ``timed_out`` False).
    """
    import torch.distributed as dist
    t = timeout.total_seconds() if isinstance(timeout, timedelta) else float(timeout)
    _check_name(name, world_size)
    base = f"streamcoll/{launchers.job_scope() if scoped else ''}{name or 'comm'}/{world_size}"
    with _LOCK:
        n = (int(store.add(f"{base}/made", 1)) - 1) // world_size + 1
    prefix = f"{base}/{n}/"
    pstore = dist.PrefixStore(prefix, store)
    cname = name or ("default" if n == 1 else f"comm{n}")
    me = facts if facts is not None else topology.local_facts(rank, store)
    _claim(pstore, rank, world_size, me, cname, prefix)
    if rank != 0:
        body = _follow(pstore, rank, world_size, t, cname)
        return Meeting(topology.Topology(body["layout"], rank, me), body["uid"], pstore, cname, body.get("nonce", ""))
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
                    f"or another name=", timed_out=False)
            everyone = [me] + [topology.RankFacts.from_json(v) for v in values]
            topo = topology.Topology(topology.compute(everyone), 0, me)
        uid = bytes(make_uid(topo, cname))
    except Exception as e:
        if world_size > 1:
            with contextlib.suppress(RuntimeError, OSError):
                if rounds.publish(pstore, {"error": _published_error(e), "ack": 1}, final=True):
                    _hold_for_readers(pstore, world_size, t)
        raise
    nonce = os.urandom(12).hex()
    if world_size > 1:
        rounds.publish(pstore, {"topology": topology.to_plain(topo.layout), "uid": uid.hex(), "nonce": nonce},
                       final=True)
    return Meeting(topo, uid, pstore, cname, nonce)


def _read_key(rank: int) -> str:
    return f"read-error/{rank}"


def _hold_for_readers(pstore: Any, world_size: int, timeout: float) -> None:
    """After rank 0 published why it refused (every rank had joined: its
    facts were read), wait until every rank has read it, at most
    :data:`HOLD_FOR_READERS` s. Rank 0 often hosts the store (env://
    without torchrun, a TCPStore it made) and leaves right after raising:
    a rank that had not yet read the outcome then found the store gone and
    could only guess (it reported a timeout that never ran: "did not
    complete within 1800 s", at once). One server-side wait on rank 0, one
    ``set`` per other rank, on this path only."""
    keys = [_read_key(r) for r in range(1, world_size)]
    with contextlib.suppress(RuntimeError, OSError):
        pstore.wait(keys, timedelta(seconds=max(0.1, min(HOLD_FOR_READERS, timeout))))


HOLD_FOR_READERS = 10.0
"""Seconds rank 0 waits, at most, for every rank to read the error it published."""


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
    raise RendezvousError(msg, [], addr, port, world_size, os.environ.get("WORLD_SIZE"), timed_out=False)
