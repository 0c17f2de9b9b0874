"""Where the ranks are: which share a host, and how this host reaches the
rendezvous address. Decides the environment defaults
(:mod:`streamcoll.startup.env_defaults`) from facts each rank reports
through the store (:class:`RankFacts`), not from hostnames, which containers
and cloned images share:

- its host identity (:func:`streamcoll.startup.hosts.host_identity`) and
  its launcher's node (torchrun's ``GROUP_RANK``, else ``RANK -
  LOCAL_RANK`` where ``LOCAL_WORLD_SIZE < WORLD_SIZE``): a host is the pair
  (identity, node);
- its machine (the boot id) and CPU affinity: a machine is oversubscribed
  when its ranks' CPU sets cannot give each rank a core (:func:`core_each`);
- its values of the variables that must agree, native and streamcoll's own
  (:func:`streamcoll.startup.env_defaults.bound`,
  :func:`streamcoll.startup.env_defaults.own`);
- the route to the rendezvous address (``MASTER_ADDR``): the local address
  and interface the kernel uses to reach it.

Rank 0 alone reads every rank's facts, runs :func:`compute` (a pure function
of them, :func:`streamcoll.startup.env_defaults.agree` inside) and publishes
one :class:`Layout`, per host, not per rank, in one key every other rank
reads once; both cross the store through :mod:`streamcoll.startup.wire`.
Each rank keeps its own facts (:attr:`Topology.me`). Why each fact, and how
they meet: docs/design.md, section 'The facts each rank reports'.
"""
from __future__ import annotations

import functools
import ipaddress
import json
import os
import socket
import struct
import typing
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Sequence, Set, Tuple

from .hosts import host_identity, interface_of
from .wire import from_plain, parse_runs, run_text, to_plain

if TYPE_CHECKING:  # pragma: no cover
    from .env_defaults import Agreed

__all__ = ["Route", "RankFacts", "Host", "Clash", "Layout", "Topology", "compute", "to_plain", "from_plain",
           "run_text", "parse_runs", "host_identity", "route_to", "interface_of", "rendezvous_address",
           "local_facts", "exchange_key", "core_each"]


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
    job_size: Optional[int] = None                          # the launcher's world size (WORLD_SIZE), if known
    own: Tuple[Tuple[str, str, str], ...] = ()              # env.own(): streamcoll's own must-agree settings
    job: str = ""                                           # its launched job (job_token()); "" unknown
    first: Optional[str] = None                             # the scope of its first oneCCL communicator
    remade: bool = False                                    # oneCCL remakes its transport at its next init
    first_across: bool = False                              # its first oneCCL communicator spanned hosts

    def to_json(self) -> str:
        """Compact JSON (the CPU list as ranges, ``"0..63"``), see :func:`to_plain`."""
        return json.dumps(to_plain(self), separators=(",", ":"))

    @classmethod
    def from_json(cls, s: typing.Union[str, bytes]) -> "RankFacts":
        return from_plain(cls, json.loads(s))


# ------------------------------------------------------------------ routing
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
    from . import env_defaults as env
    ident, machine, network = host_identity()
    addr = rendezvous_address(store)
    route = route_to(addr) if addr else None
    return RankFacts(rank, ident, machine, network, socket.gethostname(), os.getpid(), _node(rank), _cpus(), route,
                     env.bound(), env.enabled(), _job_size(), env.own(), job_token(), env.first_communicator(),
                     env.remade(), env.first_across_hosts())


def job_token() -> str:
    """What every rank of one launched job shares and a process of another
    job (a server started on its own) does not: the launcher's rendezvous
    address and run id (torchrun's, or what streamcoll exported for srun and
    mpiexec) and SLURM's job and step; "" where no launcher is seen."""
    from . import launchers
    env = os.environ
    parts = [env.get(v, "").strip() for v in ("TORCHELASTIC_RUN_ID", "MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE")]
    try:
        parts.append(launchers.job_scope())
    except ValueError:
        pass
    return "|".join(parts) if any(parts) else ""


def _job_size() -> Optional[int]:
    """The launcher's world size: ``WORLD_SIZE`` (torchrun's, or what
    :mod:`streamcoll.startup.launchers` exported), else the detected launcher's own
    size variable (srun's, mpiexec's: a ``store=``/``rank=`` call adopts no
    launcher), None where unknown or malformed."""
    try:
        n = int(os.environ.get("WORLD_SIZE", ""))
    except ValueError:
        n = 0
    if n > 0:
        return n
    from . import launchers
    try:
        la = launchers.detect()
    except ValueError:
        return None
    return la.world_size if la is not None and la.world_size else None


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


@dataclass(frozen=True)
class Host:
    """One host of a :class:`Layout`: ranks with the same identity and
    launcher node (see the module docstring)."""

    ranks: Tuple[int, ...]       # ascending
    node: Optional[int]          # the launcher's node
    machine: int                 # index into Layout.machine_cores (same boot id: same machine)
    network: int                 # index of its network namespace (boot id and namespace)
    hostnames: Tuple[str, ...]   # distinct, in rank order (usually one)
    iface: Optional[str]         # its first rank's route's interface (one namespace: one routing table)


@dataclass(frozen=True)
class Clash:
    """Two ranks on different hosts with the same hostname and process id."""

    first: int
    second: int
    hostname: str
    pid: int


@dataclass(frozen=True)
class Layout:
    """The computed topology: what :func:`compute` derives from every rank's
    facts, published once by rank 0. Fields added here travel to every rank
    unchanged (:func:`to_plain`)."""

    world_size: int
    hosts: Tuple[Host, ...]              # ordered by first rank
    machine_cores: Tuple[int, ...]       # per machine: cores its ranks may use together (union of affinities)
    clashes: Tuple[Clash, ...] = ()
    # per machine: its ranks cannot have a core each within their CPU sets (core_each)
    machine_oversubscribed: Tuple[bool, ...] = ()
    # the must-agree variables (streamcoll.startup.env_defaults.agree): the one value of each
    # (None: unset) and, where ranks' values would differ, the conflict text
    agreed: Dict[str, Optional[str]] = field(default_factory=dict)
    conflicts: Dict[str, str] = field(default_factory=dict)
    job_size: Optional[int] = None       # the launcher's world size its ranks report (largest), if known
    jobs: int = 1                        # launched jobs its ranks come from (RankFacts.job; "" counts as one)
    # streamcoll's own must-agree settings (streamcoll.startup.env_defaults.OWN): the value every communicator of
    # this layout, and of every sub-group derived from it, runs with
    own: Dict[str, str] = field(default_factory=dict)


def compute(facts: Sequence[RankFacts]) -> Layout:
    """The :class:`Layout` of ``facts`` (rank ``i``'s at index ``i``): a pure
    function, run once, on rank 0 (every rank used to run it on every rank's
    facts). May raise; the rendezvous then hands the error to every rank."""
    for i, f in enumerate(facts):
        if f.rank != i:
            raise ValueError(f"facts: entry {i} holds rank {f.rank}'s facts")
    # A host is (identity, the launcher's node). The node tells hosts apart inside one job only: ranks
    # of several jobs on one identity (a trainer and a server started on its own) share that host.
    jobs: Dict[str, Set[str]] = {}
    for f in facts:
        jobs.setdefault(f.identity, set()).add(f.job)
    groups: Dict[Tuple[str, Optional[int]], List[RankFacts]] = {}
    for f in facts:
        groups.setdefault((f.identity, f.node if len(jobs[f.identity]) == 1 else None), []).append(f)
    machines: Dict[str, int] = {}
    networks: Dict[str, int] = {}
    cpus: Dict[int, set] = {}
    hosts = []
    for members in sorted(groups.values(), key=lambda fs: fs[0].rank):
        first = members[0]
        m = machines.setdefault(first.machine, len(machines))
        for f in members:
            cpus.setdefault(m, set()).update(f.cpus)
        names = tuple(dict.fromkeys(f.hostname for f in members))
        hosts.append(Host(tuple(f.rank for f in members), first.node if len(jobs[first.identity]) == 1 else None, m,
                          networks.setdefault(first.network, len(networks)), names,
                          first.route.iface if first.route else None))
    host_of = {r: i for i, h in enumerate(hosts) for r in h.ranks}
    seen: Dict[Tuple[str, int], int] = {}
    clashes = []
    for f in facts:
        a = seen.setdefault((f.hostname, f.pid), f.rank)
        if a != f.rank and host_of[a] != host_of[f.rank]:
            clashes.append(Clash(a, f.rank, f.hostname, f.pid))
    sets: Dict[int, List[Tuple[int, ...]]] = {}
    for f in facts:
        sets.setdefault(machines[f.machine], []).append(f.cpus)
    sizes = [f.job_size for f in facts if f.job_size is not None]
    layout = Layout(len(facts), tuple(hosts), tuple(max(len(cpus[m]), 1) for m in range(len(machines))),
                    tuple(clashes), tuple(not core_each(sets[m]) for m in range(len(machines))),
                    job_size=max(sizes) if sizes else None, jobs=len({f.job for f in facts}))
    # The settings every rank must share, decided here once from every
    # rank's facts: the defaults from the layout, the values each
    # rank is bound to (the user's, or in effect) from its facts.
    from .env_defaults import agree
    decided = agree(Topology(layout, 0, facts[0]), facts)
    return replace(layout, agreed=dict(decided.values), conflicts=dict(decided.conflicts), own=dict(decided.own))


class Topology:
    """One rank's view of a :class:`Layout`: its host, local rank, and what
    follows for the defaults. ``me`` is this rank's own facts (its route
    decides the interface); other ranks' facts stay with rank 0."""

    def __init__(self, layout: Layout, rank: int, me: RankFacts) -> None:
        if not 0 <= rank < layout.world_size:
            raise ValueError(f"rank: expected an int in [0, {layout.world_size}), got {rank!r}")
        self.layout = layout
        self.rank = rank
        self.me = me

    @classmethod
    def from_facts(cls, facts: Sequence[RankFacts], rank: int) -> "Topology":
        """Rank ``rank``'s view when every rank's facts are at hand."""
        return cls(compute(facts), rank, facts[rank])

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, Topology) and (self.layout, self.rank, self.me)
                == (other.layout, other.rank, other.me))

    def __repr__(self) -> str:
        return f"<Topology {self.summary()}>"

    # -- the world -------------------------------------------------------------
    @property
    def world_size(self) -> int:
        """Ranks of the communicator."""
        return self.layout.world_size

    @functools.cached_property
    def hosts(self) -> List[List[int]]:
        """Each host's ranks, hosts ordered by their first rank."""
        return [list(h.ranks) for h in self.layout.hosts]

    @functools.cached_property
    def host_index(self) -> int:
        """Index of this rank's host in :attr:`hosts`."""
        return next(i for i, h in enumerate(self.layout.hosts) if self.rank in h.ranks)

    @property
    def single_host(self) -> bool:
        """All ranks on one host."""
        return len(self.layout.hosts) == 1

    @property
    def one_network(self) -> bool:
        """All ranks in one network namespace of one machine (loopback reaches all)."""
        return len({h.network for h in self.layout.hosts}) == 1

    @property
    def world_oversubscribed(self) -> bool:
        """Some machine's ranks cannot have a core each: decides the
        settings every rank must share (:func:`streamcoll.startup.env_defaults.agreed_defaults`)."""
        return any(self.layout.machine_oversubscribed)

    @property
    def agreed(self) -> "Agreed":
        """The must-agree variables' values, or their conflicts (computed
        once, on rank 0, in :func:`compute`)."""
        from .env_defaults import Agreed
        return Agreed(dict(self.layout.agreed), dict(self.layout.conflicts), dict(self.layout.own))

    @property
    def hostnames_tell_hosts_apart(self) -> bool:
        """Every hostname belongs to one host. oneCCL's shm transport
        (``CCL_ATL_SHM``) groups ranks by hostname: with a hostname shared by
        two hosts it treats them as one and init hangs (measured, 2 x 2)."""
        owner: Dict[str, int] = {}
        for i, h in enumerate(self.layout.hosts):
            for name in h.hostnames:
                if owner.setdefault(name, i) != i:
                    return False
        return True

    def name_clashes(self) -> List[Tuple[int, int]]:
        """Pairs of ranks on different hosts with the same hostname and the
        same process id (fresh PID namespaces in containers started alike)."""
        return [(c.first, c.second) for c in self.layout.clashes]

    # -- this rank's host ------------------------------------------------------
    @property
    def host(self) -> Host:
        """This rank's host."""
        return self.layout.hosts[self.host_index]

    @property
    def host_ranks(self) -> List[int]:
        """The ranks of this rank's host."""
        return list(self.host.ranks)

    @property
    def local_rank(self) -> int:
        """This rank's index among its host's ranks."""
        return self.host.ranks.index(self.rank)

    @property
    def local_size(self) -> int:
        """Ranks on this rank's host."""
        return len(self.host.ranks)

    @property
    def machine_ranks(self) -> List[int]:
        """Ranks on this rank's machine (any namespace): they share its cores."""
        m = self.host.machine
        return sorted(r for h in self.layout.hosts if h.machine == m for r in h.ranks)

    @property
    def machine_cores(self) -> int:
        """Cores the ranks on this machine may run on together (union of affinities)."""
        return self.layout.machine_cores[self.host.machine]

    @property
    def oversubscribed(self) -> bool:
        """The ranks on this machine cannot have a core each within their CPU sets (:func:`core_each`)."""
        flags = self.layout.machine_oversubscribed
        m = self.host.machine
        return flags[m] if m < len(flags) else len(self.machine_ranks) > self.machine_cores

    # -- derived communicators ---------------------------------------------------
    @property
    def spans_job(self) -> bool:
        """Whether these ranks are the launcher's whole world (true where no
        rank knows the launcher's size). A process's first oneCCL communicator
        that is not must not use shared memory
        (:func:`streamcoll.startup.env_defaults.agreed_defaults`; why:
        docs/design.md, section 'A process's first oneCCL communicator spans
        the world')."""
        return self.layout.job_size is None or self.world_size >= self.layout.job_size

    def subgroup(self, ranks: Sequence[int], rank: int) -> "Topology":
        """The view of a communicator over ``ranks`` (ranks of this one; the
        new rank ``i`` is ``ranks[i]``), as rank ``rank`` of it: derived, no
        exchange (split, new_group). Each machine keeps the cores its parent
        measured, and each host the hostnames of all its parent ranks."""
        index = {r: i for i, r in enumerate(ranks)}
        if len(index) != len(ranks) or any(not 0 <= r < self.world_size for r in ranks):
            raise ValueError(f"ranks: expected distinct ranks in [0, {self.world_size}), got {list(ranks)!r}")
        hosts = []
        for h in self.layout.hosts:
            mine = tuple(sorted(index[r] for r in h.ranks if r in index))
            if mine:
                hosts.append(replace(h, ranks=mine))
        hosts.sort(key=lambda h: h.ranks[0])
        clashes = tuple(Clash(index[c.first], index[c.second], c.hostname, c.pid)
                        for c in self.layout.clashes if c.first in index and c.second in index)
        layout = replace(self.layout, world_size=len(ranks), hosts=tuple(hosts), clashes=clashes)
        return Topology(layout, rank, replace(self.me, rank=rank))

    # -- messages --------------------------------------------------------------
    def describe_rank(self, r: int) -> str:
        """Rank ``r`` for messages: its host, hostname, and route (this rank)
        or interface (another rank: its host's)."""
        h = next(i for i, hr in enumerate(self.layout.hosts) if r in hr.ranks)
        host = self.layout.hosts[h]
        if r == self.rank:
            where = self.me.route.describe() if self.me.route else "no rendezvous address"
            return f"rank {r}: host {h} ({self.me.hostname}, pid {self.me.pid}), route {where}"
        return f"rank {r}: host {h} ({'/'.join(host.hostnames)}), interface {host.iface or '?'}"

    def summary(self) -> str:
        """One line: ranks, hosts (the first 16), this rank's place."""
        hosts = [run_text(h.ranks).replace("..", "-") for h in self.layout.hosts[:16]]
        more = f"; ... ({len(self.layout.hosts)} hosts)" if len(self.layout.hosts) > 16 else ""
        return (f"{self.world_size} ranks on {len(self.layout.hosts)} host(s) "
                f"[{'; '.join(hosts)}{more}]; this rank {self.rank}: "
                f"host {self.host_index}, local rank {self.local_rank} of {self.local_size}, "
                f"{len(self.machine_ranks)} rank(s) on {self.machine_cores} core(s) of this machine")

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
        others = sorted(r for h in self.layout.hosts[1:] for r in h.ranks)
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
