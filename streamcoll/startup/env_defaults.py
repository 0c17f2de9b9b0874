"""Environment defaults for the native libraries: which values, why, and how
they reach the library without posing as the user's.

Two kinds of variable (:data:`AGREEMENT` says which each is). Some must be
equal on every rank (oneCCL's algorithm, worker offload, yield, ATL shm and
transport: ranks that differ return wrong sums or fail their init); they are
decided by one pure function of every rank's facts (:func:`agree`, run in
:func:`~streamcoll.startup.topology.compute` on rank 0), never from a
measurement of the calling rank. A value the user set, or one in effect
since the process's first oneCCL init, travels in the rank's facts
(:func:`bound`); where the values in effect would differ, every rank refuses
before the native init. The others (local rank, interfaces, log level)
belong to the rank or its host and may differ. streamcoll's own settings
that change which C call a rank makes or which checks it runs (:data:`OWN`,
:func:`own`) are agreed in the same exchange; every communicator runs with
the agreed values (a split or a sub-group takes its parent's).

Applied, not left behind (:func:`applied`): values are set only around the
native calls that read them (the unique id and the communicator's init),
only where the user set none, and removed after; :data:`APPLIED` records
them (``python -m streamcoll info``); ``STREAMCOLL_NO_ENV_DEFAULTS=1`` turns
them off. The values: :func:`agreed_defaults`, :func:`interface_defaults`.

Why each value, measured (one host and several): docs/design.md, section
'Environment defaults: agreement and values'.
"""
from __future__ import annotations

import contextlib
import logging
import os
import threading
from dataclasses import dataclass, field
from typing import Dict, Iterator, List, Mapping, NamedTuple, Optional, Protocol, Sequence, Tuple

__all__ = ["APPLIED", "RELEVANT", "AGREEMENT", "MUST_AGREE", "OWN", "Own", "OwnValues", "own", "check_own",
           "Agreement",
           "Agreed", "Bound", "agree",
           "agreed_defaults", "bound", "enabled", "plan", "applied", "interface_defaults", "in_effect"]

LOG = logging.getLogger("streamcoll")

APPLIED: Dict[str, str] = {}
"""What streamcoll set around native calls in this process (the latest value
of each variable); none of it stays in ``os.environ``."""

# Every variable streamcoll reads or sets: the table in streamcoll/core/env_vars.py.
from ..core.env_vars import names as _names  # noqa: E402

RELEVANT = tuple(_names())


class Agreement(NamedTuple):
    """Whether a native library's variable must be equal on every rank."""

    library: str   # "oneccl" or "nccl": whose variable it is
    must: bool     # True: one value on every rank, checked before the native init
    why: str


AGREEMENT: Dict[str, Agreement] = {
    "CCL_ALLREDUCE": Agreement("oneccl", True, "the algorithm: ranks running different ones exchange mismatched "
                               "messages (measured: wrong sums, then 'SEND entry failed')"),
    "CCL_WORKER_OFFLOAD": Agreement("oneccl", True, "who progresses a collective (caller or worker thread)"),
    "CCL_YIELD": Agreement("oneccl", True, "how a waiting rank waits; decided with the worker offload"),
    "CCL_ATL_SHM": Agreement("oneccl", True, "shared memory inside hosts: a rank without it cannot decode the "
                             "others' addresses (measured, 2 + 1 ranks on 2 hosts)"),
    "FI_PROVIDER": Agreement("oneccl", True, "libfabric's provider: peers must speak the same one"),
    "CCL_ATL_TRANSPORT": Agreement("oneccl", True, "oneCCL's transport (ofi or mpi): peers must use the same one"),
    "CCL_LOG_LEVEL": Agreement("oneccl", False, "what this process prints"),
    "CCL_LOCAL_RANK": Agreement("oneccl", False, "this rank's place on its host"),
    "CCL_LOCAL_SIZE": Agreement("oneccl", False, "the ranks of this host (hosts may differ)"),
    "CCL_KVS_IFACE": Agreement("oneccl", False, "this host's interface (names differ between hosts)"),
    "CCL_MNIC_NAME": Agreement("oneccl", False, "this host's interface"),
    "CCL_MNIC": Agreement("oneccl", False, "this host's NIC selection"),
    "CCL_MNIC_COUNT": Agreement("oneccl", False, "this host's number of NICs"),
    "CCL_BF16": Agreement("oneccl", False, "this CPU's bf16 implementation (instruction sets differ)"),
    "CCL_ROOT": Agreement("oneccl", False, "where this host's oneCCL is installed"),
    "NCCL_SOCKET_IFNAME": Agreement("nccl", False, "this host's interface"),
    "NCCL_DEBUG": Agreement("nccl", False, "what this process prints"),
    "NCCL_HOME": Agreement("nccl", False, "where this host's NCCL is installed"),
}
MUST_AGREE: Tuple[str, ...] = tuple(k for k, a in AGREEMENT.items() if a.must)


class Own(NamedTuple):
    """One of streamcoll's own settings that must be equal on every rank."""

    library: str                # "oneccl", "nccl" or "any": whose communicators it changes
    variables: Tuple[str, ...]  # what sets it (the first is its name in facts and messages)
    why: str


OWN: Dict[str, Own] = {
    "STREAMCOLL_WIDEN_BF16": Own("oneccl", ("STREAMCOLL_WIDEN_BF16",),
                                 "which C calls a bf16 reduction makes (oneCCL's CPU path: through float32, at "
                                 "two ranks an all-gather): measured, one rank without it and both stuck at "
                                 "100,000 elements"),
    "STREAMCOLL_SIGNATURE_CHECKS": Own("any", ("STREAMCOLL_SIGNATURE_CHECKS",),
                                       "the first-call checks: store keys every rank writes and waits for, for "
                                       "the first N signatures; a rank with none, or another bound, leaves its "
                                       "peers waiting for keys it never writes"),
    "STREAMCOLL_DEBUG_CHECKS": Own("any", ("STREAMCOLL_DEBUG_CHECKS", "TORCH_DISTRIBUTED_DEBUG"),
                                   "the per-call checks (TORCH_DISTRIBUTED_DEBUG=DETAIL turns them on too): the "
                                   "same store protocol on every call"),
}
"""streamcoll's own variables that must agree (see the module docstring);
agreed with the native ones by :func:`agree`, from :func:`own`."""

_OFF = ("0", "false", "no", "off")

OwnValues = Tuple[Tuple[str, str, str], ...]
"""(setting, value, source) for each of :data:`OWN`, as a rank reads them (:func:`own`)."""

USER = "set by the user"
IN_EFFECT = "in effect since this process's first oneCCL init"
DEFAULT = "streamcoll's default"
UNSET = "unset"
POW2_ALLREDUCE = "recursive_doubling:0-16384;nreduce:16385-max"

Bound = Tuple[Tuple[str, Optional[str], str], ...]
"""(variable, value, source) for each must-agree variable a rank does not
leave to streamcoll: ``source`` is :data:`USER` or :data:`IN_EFFECT`
(``value`` None: in effect unset)."""


# What this module reads of a topology and of a rank's facts, as protocols:
# streamcoll.startup.topology's Topology and RankFacts have these members (topology
# imports this module, so this one names no class of it: no import circle).
class _Route(Protocol):
    @property
    def iface(self) -> Optional[str]: ...


class RankFactsLike(Protocol):
    """What :func:`agree` and :func:`plan` read of a rank's
    :class:`streamcoll.startup.topology.RankFacts`."""

    @property
    def rank(self) -> int: ...
    @property
    def bound(self) -> Bound: ...
    @property
    def own(self) -> "OwnValues": ...
    @property
    def defaults(self) -> bool: ...
    @property
    def route(self) -> Optional[_Route]: ...
    @property
    def first(self) -> Optional[str]: ...


class TopologyLike(Protocol):
    """What this module reads of a :class:`streamcoll.startup.topology.Topology`."""

    @property
    def world_size(self) -> int: ...
    @property
    def world_oversubscribed(self) -> bool: ...
    @property
    def single_host(self) -> bool: ...
    @property
    def spans_job(self) -> bool: ...
    @property
    def hosts(self) -> List[List[int]]: ...
    @property
    def hostnames_tell_hosts_apart(self) -> bool: ...
    @property
    def local_rank(self) -> int: ...
    @property
    def local_size(self) -> int: ...
    @property
    def me(self) -> RankFactsLike: ...
    @property
    def agreed(self) -> "Agreed": ...

_LOCK = threading.Lock()
_ACTIVE: Dict[str, str] = {}                # set by applied() now, not the user's
_IN_EFFECT: Dict[str, Optional[str]] = {}   # oneCCL's must-agree values at its first init in this process


def enabled(environ: Optional[Mapping[str, str]] = None) -> bool:
    """Whether streamcoll applies defaults (``STREAMCOLL_NO_ENV_DEFAULTS``)."""
    e = os.environ if environ is None else environ
    return e.get("STREAMCOLL_NO_ENV_DEFAULTS", "0") in ("", "0")


_enabled = enabled  # the name streamcoll.__main__ has used


def _user_env() -> Dict[str, str]:
    """os.environ without what :func:`applied` has set at this moment."""
    with _LOCK:
        return {k: v for k, v in os.environ.items() if _ACTIVE.get(k) != v}


class _First(NamedTuple):
    scope: str          # equal on that communicator's members
    across_hosts: bool  # whether its members were on several hosts


_FIRST: Optional[_First] = None  # this process's first oneCCL communicator (note_first)


def note_first(scope: Optional[str], across_hosts: bool = False) -> None:
    """Record the process's first oneCCL communicator (its scope, equal on
    its members, and whether its members were on several hosts): oneCCL
    made its transport for that communicator's members."""
    global _FIRST
    with _LOCK:
        if _FIRST is None and scope:
            _FIRST = _First(scope, bool(across_hosts))


def first_across_hosts() -> bool:
    """Whether this process's first oneCCL communicator spanned several hosts."""
    return bool(_FIRST and _FIRST.across_hosts)


def first_communicator() -> Optional[str]:
    """The scope of this process's first oneCCL communicator (None: none yet)."""
    return _FIRST.scope if _FIRST else None


def remade() -> bool:
    """Whether oneCCL remakes its transport at this process's next init,
    with shared memory in effect: it ran before and every oneCCL
    communicator of the process is destroyed (it tears its transport down
    with the last). A fact each rank reports, so that a communicator short
    of the launcher's world with such a member is refused on every member
    (:func:`agree`), not by that member alone."""
    if _IN_EFFECT.get("CCL_ATL_SHM") != "1":
        return False
    from ..core.communicator import live_count
    return live_count("oneccl") == 0


def in_effect() -> Dict[str, Optional[str]]:
    """oneCCL's must-agree values at its first init in this process (empty
    before it): oneCCL does not read them again."""
    return dict(_IN_EFFECT)


def bound() -> Bound:
    """This rank's must-agree values that streamcoll does not choose (they
    go into its :class:`~streamcoll.startup.topology.RankFacts`): those oneCCL runs
    with since its first init here, else the user's."""
    user = _user_env()
    out = []
    for name in MUST_AGREE:
        if name in _IN_EFFECT:
            out.append((name, _IN_EFFECT[name], IN_EFFECT))
        elif name in user:
            out.append((name, user[name], USER))
    return tuple(out)


def own(environ: Optional[Mapping[str, str]] = None) -> OwnValues:
    """This rank's value of each of :data:`OWN`, as (name, value, source):
    the effective value as text (``"1"``/``"0"``, the bound as a number),
    so spellings of one value agree; ``source`` :data:`USER`, :data:`DEFAULT`
    or what else set it. A malformed value travels as it is, its source
    saying what was expected: every rank then refuses together
    (:func:`check_own`), where raising here would stop this rank alone
    and leave the others waiting for it."""
    e = os.environ if environ is None else environ
    raw = e.get("STREAMCOLL_WIDEN_BF16", "").strip()
    out: List[Tuple[str, str, str]] = [("STREAMCOLL_WIDEN_BF16", "0" if raw.lower() in _OFF else "1",
                                        USER if raw else DEFAULT)]
    raw = e.get("STREAMCOLL_SIGNATURE_CHECKS", "").strip()
    from ..core.checks import SIGNATURE_BOUND
    try:
        n = int(raw) if raw else SIGNATURE_BOUND
        out.append(("STREAMCOLL_SIGNATURE_CHECKS", str(n), USER if raw else DEFAULT) if n >= 0 else
                   ("STREAMCOLL_SIGNATURE_CHECKS", raw, "not valid: expected an integer >= 0"))
    except ValueError:
        out.append(("STREAMCOLL_SIGNATURE_CHECKS", raw, "not valid: expected an integer >= 0"))
    if e.get("TORCH_DISTRIBUTED_DEBUG", "").strip().upper() == "DETAIL":
        out.append(("STREAMCOLL_DEBUG_CHECKS", "1", "TORCH_DISTRIBUTED_DEBUG=DETAIL"))
    else:
        raw = e.get("STREAMCOLL_DEBUG_CHECKS", "").strip()
        out.append(("STREAMCOLL_DEBUG_CHECKS", "0" if raw.lower() in ("",) + _OFF else "1", USER if raw else DEFAULT))
    return tuple(out)


def check_own(values: Mapping[str, str]) -> Dict[str, str]:
    """``values`` (agreed, :attr:`Agreed.own`) over this process's own
    reading for any missing (a peer of a version without them); a
    malformed one is the ValueError its variable's reader raises. Every
    rank has the same ``values``, so every rank raises together."""
    out = {k: v for k, v, _ in own()}
    out.update(values)
    bound = out["STREAMCOLL_SIGNATURE_CHECKS"]
    try:
        n = int(bound)
    except ValueError:
        n = -1
    if n < 0:
        raise ValueError(f"STREAMCOLL_SIGNATURE_CHECKS: expected an integer >= 0, got {bound}")
    return out


def interface_defaults(iface: Optional[str]) -> Dict[str, str]:
    """The interface that reaches the rendezvous address, for oneCCL's
    key-value store (``CCL_KVS_IFACE``) and NIC (``CCL_MNIC_NAME``: without it
    oneCCL 2022.2 takes the alphabetically first interface, loopback included,
    and hangs when the right one sorts after ``lo``) and NCCL's sockets
    (``NCCL_SOCKET_IFNAME``; a leading ``=`` makes it an exact name, not a
    prefix). Nothing when the interface is unknown."""
    if not iface:
        return {}
    return {"CCL_KVS_IFACE": iface, "CCL_MNIC_NAME": iface, "NCCL_SOCKET_IFNAME": "=" + iface}


def agreed_defaults(topo: "TopologyLike") -> Dict[str, str]:
    """streamcoll's value of each must-agree variable for ``topo`` (absent:
    left unset, oneCCL's own); the why: docs/design.md, section 'Environment
    defaults: agreement and values'. Computed
    from every rank's facts only, so it is the same on every rank."""
    over = topo.world_oversubscribed
    n = topo.world_size
    pow2 = n & (n - 1) == 0
    d: Dict[str, str] = {}
    if over:
        d["CCL_WORKER_OFFLOAD"] = "1"
        # Across hosts the kernel's TCP stack needs the cores the waiting ranks hold: sleep, not sched_yield.
        d["CCL_YIELD"] = "sched_yield" if topo.single_host else "sleep"
    else:
        d["CCL_WORKER_OFFLOAD"] = "0"
    d["CCL_ALLREDUCE"] = POW2_ALLREDUCE if pow2 and not over else "nreduce"
    if not topo.spans_job:
        # A first oneCCL communicator that is not the launcher's whole world runs oneCCL over TCP
        # (why: docs/design.md, section 'A process's first oneCCL communicator spans the world').
        d["CCL_ATL_SHM"] = "0"
        if topo.single_host:
            d["FI_PROVIDER"] = "tcp"
    elif topo.single_host:
        d["CCL_ATL_SHM"] = "1"
        d["FI_PROVIDER"] = "shm"
    elif any(len(h) > 1 for h in topo.hosts) and topo.hostnames_tell_hosts_apart:
        d["CCL_ATL_SHM"] = "1"
    return d


@dataclass(frozen=True)
class Agreed:
    """The must-agree variables of a topology: the one value every rank runs
    with (None: unset), and a text per variable whose values would differ."""

    values: Dict[str, Optional[str]]
    conflicts: Dict[str, str]
    own: Dict[str, str] = field(default_factory=dict)  # streamcoll's own (OWN): the value every rank runs with

    def conflicts_for(self, backend: str) -> List[str]:
        """The conflicts that matter to ``backend``'s communicators."""
        def library(k: str) -> str:
            return AGREEMENT[k].library if k in AGREEMENT else OWN[k].library
        return [t for k, t in self.conflicts.items() if library(k) in (backend, "any")]

    def to_json(self) -> Dict[str, object]:
        """For a topology published through the store (plain JSON types)."""
        return {"values": self.values, "conflicts": self.conflicts, "own": self.own}

    @classmethod
    def from_json(cls, d: Mapping[str, object]) -> "Agreed":
        """The inverse of :meth:`to_json`."""
        return cls(dict(d["values"]), dict(d["conflicts"]), dict(d.get("own") or {}))  # type: ignore[call-overload]


def _ranks(rs: Sequence[int]) -> str:
    head = "rank " if len(rs) == 1 else "ranks "
    shown = ", ".join(map(str, rs[:8])) + (f", ... ({len(rs)} in all)" if len(rs) > 8 else "")
    return head + shown


def agree(topo: "TopologyLike", facts: Sequence["RankFactsLike"]) -> Agreed:
    """Every must-agree variable's value for ``topo``, from all ranks'
    ``facts`` (run once, on rank 0, by :func:`streamcoll.startup.topology.compute`).

    A rank's value is its bound one (the user's, or in effect since its
    first oneCCL init); a rank without one takes the value in effect on
    the ranks whose oneCCL already runs (when they agree: they cannot
    change theirs), else streamcoll's default; none where the rank turned
    the defaults off. Values that differ between ranks are a conflict."""
    defaults = agreed_defaults(topo)
    values: Dict[str, Optional[str]] = {}
    conflicts: Dict[str, str] = {}
    for name in MUST_AGREE:
        held = {f.rank: (v, src) for f in facts for (k, v, src) in f.bound if k == name}
        running = {v for v, src in held.values() if src == IN_EFFECT}
        free: Tuple[Optional[str], str] = ((running.pop(), IN_EFFECT) if len(running) == 1
                                           else (defaults.get(name), DEFAULT))
        per_rank = {f.rank: held.get(f.rank) or (free if f.defaults else (None, UNSET)) for f in facts}
        distinct = {v for v, _ in per_rank.values()}
        if len(distinct) == 1:
            values[name] = distinct.pop()
            continue
        groups: Dict[Tuple[Optional[str], str], List[int]] = {}
        for r, vs in sorted(per_rank.items()):
            groups.setdefault(vs, []).append(r)
        parts = [f"{_ranks(rs)}: {repr(v) if v is not None else 'unset'} ({src})"
                 for (v, src), rs in sorted(groups.items(), key=lambda kv: kv[1][0])]
        conflicts[name] = f"{name}: " + "; ".join(parts)
        values[name] = None
    mine: Dict[str, str] = {}
    for name in OWN:  # streamcoll's own: every rank's effective value, no defaults to fill in
        said = {f.rank: (v, src) for f in facts for (k, v, src) in f.own if k == name}
        kinds = {v for v, _ in said.values()}
        if len(kinds) == 1:
            mine[name] = kinds.pop()
        elif kinds:
            by: Dict[Tuple[str, str], List[int]] = {}
            for r, vs in sorted(said.items()):
                by.setdefault(vs, []).append(r)
            conflicts[name] = f"{name}: " + "; ".join(f"{_ranks(rs)}: {v!r} ({src})" for (v, src), rs
                                                      in sorted(by.items(), key=lambda kv: kv[1][0]))
    problem = _outside_first(facts)
    again = [f.rank for f in facts if getattr(f, "remade", False)]
    if again and not topo.spans_job:
        problem = (problem + "; " if problem else "") + (
            f"{_ranks(again)} destroyed all their oneCCL communicators, so oneCCL makes its transport again from "
            f"this one, with shared memory (CCL_ATL_SHM=1, in effect since their process's first init), sized for "
            f"its {topo.world_size} ranks: a later communicator with any other rank would never finish its "
            f"creation. Keep a communicator over the whole world alive (do not destroy the streamcoll world group "
            f"or streamcoll.init()'s communicator before making sub-groups), or start the process afresh")
    if problem:
        conflicts["CCL_ATL_SHM"] = (conflicts["CCL_ATL_SHM"] + "; " if "CCL_ATL_SHM" in conflicts else "") + problem
    return Agreed(values, conflicts, mine)


def _over_tcp(f: "RankFactsLike") -> bool:
    """Whether rank ``f``'s oneCCL runs without shared memory since its first init."""
    got = {k: v for (k, v, src) in f.bound if src == IN_EFFECT}
    if got.get("CCL_ATL_SHM") == "0" and got.get("FI_PROVIDER") not in (None, "", "shm"):
        return True
    # Across hosts libfabric's provider, unset, is a network one: oneCCL without its own shared memory
    # (CCL_ATL_SHM unset or 0, streamcoll's default for a first communicator across hosts) reaches any peer.
    return (bool(getattr(f, "first_across", False)) and got.get("CCL_ATL_SHM") in (None, "", "0")
            and got.get("FI_PROVIDER") in (None, ""))


def _outside_first(facts: Sequence["RankFactsLike"]) -> Optional[str]:
    """Why a communicator of ``facts``' ranks would never finish its creation
    (None: it can): a rank whose oneCCL runs with shared memory since its
    process's first oneCCL communicator can reach only that communicator's
    members, and a rank here was not one (a process of another job, a server
    started on its own, or a rank whose own first communicator came later).
    oneCCL sized its transport for that communicator (docs/design.md, section
    'A process's first oneCCL communicator spans the world'); nothing but a
    new process changes it. Every rank sees the same facts: every rank raises."""
    fixed = [f for f in facts if getattr(f, "first", None) and not _over_tcp(f)]
    if not fixed:
        return None
    stuck = sorted({f.rank for f in fixed if any(g.first != f.first for g in facts)})
    if not stuck:
        return None
    outside = sorted({g.rank for f in fixed if f.rank in stuck for g in facts if g.first != f.first})
    return (f"{_ranks(stuck)} run oneCCL with shared memory since their process's first oneCCL communicator, "
            f"which {_ranks(outside)} of this one did not belong to (a process of another job, such as a server "
            f"started on its own, or a rank that made another communicator first): oneCCL made its transport "
            f"for that first communicator's members only, so this communicator's creation would never finish. "
            f"Start every process that joins communicators beyond its first one (the trainer's ranks and the "
            f"server alike) with CCL_ATL_SHM=0 FI_PROVIDER=tcp in its environment (oneCCL then runs over TCP "
            f"from its first communicator on: docs/backends-and-defaults.md says what it costs), or make this "
            f"communicator each process's first")


def plan(topo: "TopologyLike", backend: str, environ: Optional[Mapping[str, str]] = None,
         running: Optional[Mapping[str, Optional[str]]] = None) -> Dict[str, str]:
    """What streamcoll sets around this rank's native calls for ``topo``
    (``environ``: the user's environment, default os.environ less what
    :func:`applied` holds; ``running``: :func:`in_effect`, whose variables
    oneCCL does not read again): the agreed values and this rank's own
    ones, for variables the user has not set. Empty with the defaults off."""
    user = _user_env() if environ is None else dict(environ)
    fixed = _IN_EFFECT if running is None else running
    if not enabled(user):
        return {}
    d: Dict[str, str] = {}
    if backend == "oneccl":
        d.update({k: v for k, v in topo.agreed.values.items() if v is not None and k not in fixed})
        d.update(CCL_LOCAL_RANK=str(topo.local_rank), CCL_LOCAL_SIZE=str(topo.local_size), CCL_LOG_LEVEL="error")
        if topo.single_host:
            d["CCL_KVS_IFACE"] = "lo"
        else:
            iface = topo.me.route.iface if topo.me.route else None
            d.update({k: v for k, v in interface_defaults(iface).items() if k.startswith("CCL_")})
            if "CCL_MNIC" in user:  # the user's multi-NIC selection: one name would narrow it
                d.pop("CCL_MNIC_NAME", None)
    else:
        if topo.single_host:
            d["NCCL_SOCKET_IFNAME"] = "lo"
        else:
            iface = topo.me.route.iface if topo.me.route else None
            d.update({k: v for k, v in interface_defaults(iface).items() if k.startswith("NCCL_")})
    return {k: v for k, v in d.items() if k not in user}


@contextlib.contextmanager
def applied(values: Mapping[str, str], backend: str) -> Iterator[None]:
    """Set ``values`` (those not set already) in os.environ around a native
    call that reads them, and remove them after (see the module docstring).
    The first time for oneCCL, records the must-agree values it then reads
    (:func:`in_effect`)."""
    mine: Dict[str, str] = {}
    with _LOCK:
        for k, v in values.items():
            if k not in os.environ:
                os.environ[k] = v
                mine[k] = v
        _ACTIVE.update(mine)
        APPLIED.update(mine)
        if backend == "oneccl" and not _IN_EFFECT:
            _IN_EFFECT.update({k: os.environ.get(k) for k in MUST_AGREE if AGREEMENT[k].library == "oneccl"})
    try:
        yield
    finally:
        with _LOCK:
            for k, v in mine.items():
                if os.environ.get(k) == v:
                    del os.environ[k]
                if _ACTIVE.get(k) == v:
                    del _ACTIVE[k]
