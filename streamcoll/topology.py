"""Where the ranks are: which share a host, and how this host reaches the
rendezvous address. Decides the environment defaults (:mod:`streamcoll.env`)
from facts each rank reports through the store, not from hostnames.

Why not hostnames: containers and cloned images often share one, and with
equal hostnames on two machines the single-host defaults (shared memory,
loopback key-value store) make init hang. A rank reports instead:

- its **host identity**, which is what shared memory and loopback need to be
  shared: the kernel's boot id (``/proc/sys/kernel/random/boot_id``, random
  per boot, so two machines never share it), and the inodes of its network,
  IPC and PID namespaces plus the device of ``/dev/shm``. Two processes with
  the same identity reach each other on 127.0.0.1 and through ``/dev/shm``
  (libfabric's shm provider also needs the same PID namespace for its
  cross-memory copies). The hostname is not part of it: equal hostnames
  prove nothing and different ones (a private UTS namespace) change nothing;
  it is reported for the messages only.
- **what the launcher says**: torchrun's ``GROUP_RANK`` (its node), or, where
  ``LOCAL_WORLD_SIZE < WORLD_SIZE`` without it, ``RANK - LOCAL_RANK`` (the
  node's first rank: torchrun numbers a node's ranks contiguously). Ranks
  that the launcher puts on different nodes are on different hosts even when
  their identities agree (two agents on one machine), so a host is the pair
  (identity, node).
- its **machine** (the boot id alone) and CPU affinity: ranks on one machine
  share its cores even in different namespaces, which decides whether they
  may spin (see ``env.py``): a machine is oversubscribed when its ranks'
  CPU sets cannot give each rank a core of its own (:func:`core_each`).
- the values of the variables that must agree across ranks which are not
  streamcoll's to choose (the user's, or in effect since the process's first
  oneCCL init: :func:`streamcoll.env.bound`), and whether it applies
  defaults at all; :class:`Topology` computes from all ranks' facts the one
  value of each such variable, or the conflict that refuses the init
  (:func:`streamcoll.env.agree`).
- the **route to the rendezvous address** (``MASTER_ADDR``, else the store's
  own host): the local address and interface the kernel uses to reach it,
  found with a UDP ``connect()`` (sends nothing) and ``getsockname()``, then
  the interface holding that address (``SIOCGIFCONF`` for IPv4,
  ``/proc/net/if_inet6`` for IPv6). That interface reaches the other hosts
  (the rendezvous works through it), so it becomes oneCCL's key-value store
  and NIC interface and NCCL's socket interface on several hosts; oneCCL's
  own choice is the alphabetically first interface, loopback included.
"""
from __future__ import annotations

import array
import fcntl
import ipaddress
import json
import os
import socket
import struct
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Sequence, Set, Tuple

if TYPE_CHECKING:  # pragma: no cover
    from .env import Agreed

__all__ = ["Route", "RankFacts", "Topology", "host_identity", "route_to", "interface_of",
           "rendezvous_address", "local_facts", "exchange_key", "core_each"]


@dataclass(frozen=True)
class Route:
    """How this process reaches ``target`` (the rendezvous host)."""

    target: str                 # the address as given (MASTER_ADDR or the store's host)
    remote: Optional[str]       # the resolved address
    local: Optional[str]        # the source address the kernel picks
    iface: Optional[str]        # the interface holding ``local``
    error: str = ""             # why something is None

    @property
    def loopback(self) -> bool:
        try:
            return self.local is not None and ipaddress.ip_address(self.local).is_loopback
        except ValueError:
            return False

    def describe(self) -> str:
        if self.error:
            return f"{self.target}: {self.error}"
        return f"{self.local} on {self.iface} (to {self.target}" + (
            f" = {self.remote})" if self.remote != self.target else ")")


@dataclass(frozen=True)
class RankFacts:
    """What one rank reports about itself (JSON through the store)."""

    rank: int
    identity: str
    machine: str
    network: str
    hostname: str
    pid: int
    node: Optional[int]
    cpus: Tuple[int, ...]
    route: Optional[Route] = None
    bound: Tuple[Tuple[str, Optional[str], str], ...] = ()  # env.bound(): must-agree values not streamcoll's
    defaults: bool = True                                   # streamcoll applies defaults (env.enabled())

    def to_json(self) -> str:
        d = asdict(self)
        return json.dumps(d)

    @classmethod
    def from_json(cls, s: str) -> "RankFacts":
        d = json.loads(s)
        r = d.get("route")
        d["route"] = Route(**r) if r else None
        d["cpus"] = tuple(d.get("cpus") or ())
        d["bound"] = tuple(tuple(b) for b in d.get("bound") or ())
        return cls(**d)


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return "?"


def _ns(kind: str) -> str:
    try:
        return str(os.stat(f"/proc/self/ns/{kind}").st_ino)
    except OSError:
        return "?"


def host_identity() -> Tuple[str, str, str]:
    """(identity, machine, network): see the module docstring for what and
    why; ``network`` (boot id and network namespace) is what loopback needs."""
    boot = _read("/proc/sys/kernel/random/boot_id")
    try:
        st = os.stat("/dev/shm")
        shm = f"{st.st_dev}:{st.st_ino}"
    except OSError:
        shm = "none"
    network = f"boot={boot} net={_ns('net')}"
    ident = f"{network} ipc={_ns('ipc')} pid={_ns('pid')} shm={shm}"
    return ident, boot, network


# ------------------------------------------------------------------ routing
_SIOCGIFCONF = 0x8912
_IFREQ = 40  # sizeof(struct ifreq) on 64-bit Linux


def _ipv4_addresses() -> Dict[str, str]:
    """Every labelled IPv4 address -> its interface (``SIOCGIFCONF``)."""
    out: Dict[str, str] = {}
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        n = 64
        while True:
            buf = array.array("B", bytes(_IFREQ * n))
            ifc = struct.pack("iL", len(buf), buf.buffer_info()[0])
            got = struct.unpack("iL", fcntl.ioctl(s.fileno(), _SIOCGIFCONF, ifc))[0]
            if got < len(buf) or n >= 4096:
                break
            n *= 4
        raw = buf.tobytes()
        for off in range(0, got, _IFREQ):
            name = raw[off:off + 16].split(b"\0", 1)[0].decode(errors="replace").split(":", 1)[0]
            out.setdefault(socket.inet_ntoa(raw[off + 20:off + 24]), name)
    finally:
        s.close()
    return out


def _ipv6_addresses() -> Dict[str, str]:
    out: Dict[str, str] = {}
    try:
        with open("/proc/net/if_inet6") as f:
            for line in f:
                parts = line.split()
                if len(parts) >= 6:
                    out[str(ipaddress.IPv6Address(bytes.fromhex(parts[0])))] = parts[5]
    except OSError:
        pass
    return out


def interface_of(address: str) -> Optional[str]:
    """The interface holding the local ``address``, or None."""
    try:
        ip = ipaddress.ip_address(address.split("%", 1)[0])
    except ValueError:
        return None
    table = _ipv4_addresses() if ip.version == 4 else _ipv6_addresses()
    return table.get(str(ip))


def route_to(target: str, port: int = 9) -> Route:
    """The local address and interface the kernel uses to reach ``target``
    (a UDP socket's ``connect`` picks the route without sending a packet)."""
    try:
        infos = socket.getaddrinfo(target, port, type=socket.SOCK_DGRAM)
    except OSError as e:
        return Route(target, None, None, None, f"cannot resolve: {e}")
    if not infos:
        return Route(target, None, None, None, "cannot resolve: no address")
    family, _, _, _, sockaddr = infos[0]  # the first, as a TCP client would try it
    remote = str(sockaddr[0])
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect(sockaddr)
            local = str(s.getsockname()[0])
    except OSError as e:
        return Route(target, remote, None, None, f"no route to {remote}: {e}")
    iface = interface_of(local)
    if iface is None:
        return Route(target, remote, local, None, f"no interface found holding {local}")
    return Route(target, remote, local, iface)


def rendezvous_address(store: Any = None) -> Optional[str]:
    """``MASTER_ADDR``, else the host of a TCPStore (under PrefixStores)."""
    addr = os.environ.get("MASTER_ADDR")
    if addr:
        return addr
    s, depth = store, 0
    while s is not None and depth < 8:
        host = getattr(s, "host", None)
        if isinstance(host, str) and host:
            return host
        s = getattr(s, "underlying_store", None)
        depth += 1
    return None


def _node(rank: int) -> Optional[int]:
    """The launcher's node for this rank (see the module docstring)."""
    env = os.environ
    g = env.get("GROUP_RANK")
    if g not in (None, ""):
        try:
            return int(g)
        except ValueError:
            pass
    try:
        lws, ws = int(env.get("LOCAL_WORLD_SIZE", "")), int(env.get("WORLD_SIZE", ""))
        if lws < ws:
            return rank - int(env.get("LOCAL_RANK", "0"))
    except ValueError:
        pass
    return None


def _cpus() -> Tuple[int, ...]:
    try:
        return tuple(sorted(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return tuple(range(os.cpu_count() or 1))


def local_facts(rank: int, store: Any = None) -> RankFacts:
    """This process's :class:`RankFacts`."""
    from . import env
    ident, machine, network = host_identity()
    addr = rendezvous_address(store)
    route = route_to(addr) if addr else None
    return RankFacts(rank, ident, machine, network, socket.gethostname(), os.getpid(), _node(rank), _cpus(), route,
                     env.bound(), env.enabled())


def exchange_key(rank: int) -> str:
    """The store key (under the communicator's prefix) of ``rank``'s facts."""
    return f"host/{rank}"


def core_each(cpusets: Sequence[Sequence[int]]) -> bool:
    """Whether every rank can have a core of its own, each within its CPU
    set: a matching of ranks to distinct cores (augmenting paths). Ranks
    pinned to separate cores have one each; two ranks on one core, or
    three whose sets cover two cores, do not."""
    owner: Dict[int, int] = {}

    def place(r: int, seen: Set[int]) -> bool:
        for c in cpusets[r]:
            if c not in seen:
                seen.add(c)
                if c not in owner or place(owner[c], seen):
                    owner[c] = r
                    return True
        return False

    return all(place(r, set()) for r in range(len(cpusets)))


@dataclass
class Topology:
    """Every rank's facts and what follows from them; computed from the
    facts alone, so every rank that has them computes the same."""

    facts: List[RankFacts]
    rank: int
    hosts: List[List[int]] = field(init=False)
    agreed: "Agreed" = field(init=False)   # the must-agree variables' values, or their conflicts

    def __post_init__(self) -> None:
        from .env import agree
        groups: Dict[Tuple[str, Optional[int]], List[int]] = {}
        for f in self.facts:
            groups.setdefault((f.identity, f.node), []).append(f.rank)
        self.hosts = sorted(groups.values(), key=lambda rs: rs[0])
        self.agreed = agree(self)

    # -- this rank's host ----------------------------------------------------
    @property
    def me(self) -> RankFacts:
        return self.facts[self.rank]

    @property
    def host_index(self) -> int:
        return next(i for i, h in enumerate(self.hosts) if self.rank in h)

    @property
    def host_ranks(self) -> List[int]:
        return self.hosts[self.host_index]

    @property
    def local_rank(self) -> int:
        return self.host_ranks.index(self.rank)

    @property
    def local_size(self) -> int:
        return len(self.host_ranks)

    @property
    def single_host(self) -> bool:
        return len(self.hosts) == 1

    @property
    def one_network(self) -> bool:
        """All ranks in one network namespace of one machine (loopback reaches all)."""
        return len({f.network for f in self.facts}) == 1

    @property
    def machine_ranks(self) -> List[int]:
        """Ranks on this rank's machine (any namespace): they share its cores."""
        return [f.rank for f in self.facts if f.machine == self.me.machine]

    @property
    def machine_cores(self) -> int:
        """Cores the ranks on this machine may run on together (union of affinities)."""
        cpus: set = set()
        for r in self.machine_ranks:
            cpus.update(self.facts[r].cpus)
        return max(len(cpus), 1)

    @property
    def oversubscribed(self) -> bool:
        """The ranks on this machine cannot have a core each (:func:`core_each`)."""
        return not core_each([self.facts[r].cpus for r in self.machine_ranks])

    @property
    def world_oversubscribed(self) -> bool:
        """Some machine's ranks cannot have a core each: decides the
        settings every rank must share (:func:`streamcoll.env.agreed_defaults`)."""
        machines: Dict[str, List[Tuple[int, ...]]] = {}
        for f in self.facts:
            machines.setdefault(f.machine, []).append(f.cpus)
        return not all(core_each(sets) for sets in machines.values())

    def describe_rank(self, r: int) -> str:
        f = self.facts[r]
        h = next(i for i, hr in enumerate(self.hosts) if r in hr)
        route = f.route.describe() if f.route else "no rendezvous address"
        return f"rank {r}: host {h} ({f.hostname}, pid {f.pid}), route {route}"

    def summary(self) -> str:
        return (f"{len(self.facts)} ranks on {len(self.hosts)} host(s) "
                f"[{'; '.join(','.join(map(str, h)) for h in self.hosts)}]; this rank {self.rank}: "
                f"host {self.host_index}, local rank {self.local_rank} of {self.local_size}, "
                f"{len(self.machine_ranks)} rank(s) on {self.machine_cores} core(s) of this machine")

    @property
    def hostnames_tell_hosts_apart(self) -> bool:
        """Every hostname belongs to one host. oneCCL's shm transport
        (``CCL_ATL_SHM``) groups ranks by hostname: with a hostname shared by
        two hosts it treats them as one and init hangs (measured, 2 x 2)."""
        owner: Dict[str, int] = {}
        for i, h in enumerate(self.hosts):
            for r in h:
                if owner.setdefault(self.facts[r].hostname, i) != i:
                    return False
        return True

    def name_clashes(self) -> List[Tuple[int, int]]:
        """Pairs of ranks on different hosts with the same hostname and the
        same process id (fresh PID namespaces in containers started alike)."""
        host = {r: i for i, h in enumerate(self.hosts) for r in h}
        seen: Dict[Tuple[str, int], int] = {}
        out = []
        for f in self.facts:
            first = seen.setdefault((f.hostname, f.pid), f.rank)
            if first != f.rank and host[first] != host[f.rank]:
                out.append((first, f.rank))
        return out

    def loopback_problem(self, advertised: Optional[str]) -> Optional[str]:
        """Why init cannot complete, if rank 0's bootstrap address is a
        loopback one while ranks sit in different network namespaces or
        machines (each would reach only its own 127.0.0.1), else None."""
        if advertised is None or self.one_network:
            return None
        try:
            if not ipaddress.ip_address(advertised).is_loopback:
                return None
        except ValueError:
            return None
        others = [r for r in range(len(self.facts)) if r not in self.hosts[0]]
        which = f"rank {others[0]} is" if len(others) == 1 else f"ranks {_ranges(others)} are"
        return (f"rank 0 advertises its bootstrap address {advertised}, a loopback address, but {which} on "
                f"another host: each host would reach only its own {advertised}")


def _ranges(rs: Sequence[int]) -> str:
    return ", ".join(map(str, rs))


def advertised_address(backend: str, uid: bytes) -> Optional[Tuple[str, int]]:
    """The bootstrap address rank 0 put in a unique id, where the format is
    known: oneCCL writes text ``"<ip>_<port>"`` (measured: "192.0.2.2_4096");
    NCCL a ``union ncclSocketAddress`` after an 8-byte magic (IPv4 and IPv6)."""
    try:
        if backend == "oneccl":
            text = uid.split(b"\0", 1)[0].decode("ascii")
            ip, _, port = text.rpartition("_")
            ipaddress.ip_address(ip)
            return ip, int(port)
        if backend == "nccl" and len(uid) >= 8 + 28:
            fam = struct.unpack_from("<H", uid, 8)[0]
            port = struct.unpack_from(">H", uid, 10)[0]
            if fam == socket.AF_INET:
                return socket.inet_ntop(socket.AF_INET, uid[12:16]), port
            if fam == socket.AF_INET6:
                return socket.inet_ntop(socket.AF_INET6, uid[16:32]), port
    except (ValueError, UnicodeDecodeError, struct.error, OSError):
        return None
    return None


__all__ += ["advertised_address"]


# ---------------------------------------------------------------- exchange
def _rendezvous_text() -> str:
    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    return f"{addr}:{port}" if addr else "the store passed in"


def exchange(store: Any, rank: int, world_size: int, timeout: float, facts: Optional[RankFacts] = None,
             wait: Optional[Any] = None) -> Topology:
    """Publish this rank's facts under ``store`` (a communicator's
    PrefixStore) and wait for every rank's: with ``wait(keys)`` where given
    (bootstrap's, with progress lines and a RendezvousError), else the store's
    wait. Ranks that do not arrive within ``timeout`` are named in the
    :class:`~streamcoll.errors.CommunicatorError`, with this rank's route and
    the likely causes."""
    from datetime import timedelta

    from .errors import CommunicatorError

    facts = facts or local_facts(rank, store)
    store.set(exchange_key(rank), facts.to_json())
    keys = [exchange_key(r) for r in range(world_size)]
    if wait is not None:
        wait(keys)
        return Topology([RankFacts.from_json(store.get(k).decode()) for k in keys], rank)
    try:
        store.wait(keys, timedelta(seconds=timeout))
    except Exception as e:  # torch raises DistStoreError (a RuntimeError) on timeout
        missing: List[int] = []
        for r, k in enumerate(keys):
            try:
                if not store.check([k]):
                    missing.append(r)
            except Exception:
                missing.append(r)
        route = facts.route.describe() if facts.route else "no rendezvous address known"
        raise CommunicatorError(
            f"rendezvous: rank(s) {_ranges(missing) or '?'} of {world_size} did not arrive within {timeout:g} s "
            f"(store at {_rendezvous_text()}; this is rank {rank} on {facts.hostname}, route {route}). Likely "
            f"cause: those ranks were not started, failed before init, or use another MASTER_ADDR/MASTER_PORT "
            f"or world size ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
        ) from None
    return Topology([RankFacts.from_json(store.get(k).decode()) for k in keys], rank)


__all__ += ["exchange"]
