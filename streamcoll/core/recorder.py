"""The flight recorder's ring: one :class:`FlightRecorder` per communicator,
written by the launch path (:mod:`streamcoll.core.launch`), read by the watchdog,
by the dumps (:func:`snapshot`, :func:`dump`: here, next to the ring they
read) and by the analysis of :mod:`streamcoll.diagnostics.flight` (the layout and
its costs: docs/design.md, section 'The flight recorder's ring'). A module of its own so that importing streamcoll
does not import :mod:`streamcoll.diagnostics.flight`, which runs as a command
(``python -m streamcoll.flight``).

Where dumps go, and how they are written safely: :mod:`streamcoll.core.dump_files`."""
from __future__ import annotations

import json
import logging
import os
import re
import socket
import time
import weakref
from typing import Any, Dict, Iterable, List, Optional, Tuple, Union

from . import hooks as _hooks
from . import spec
from .dump_files import default_dir, open_dump_dir, write_private
from .env_vars import read_int

__all__ = ["FlightRecorder", "FlightEntry", "attach", "snapshot", "dump", "default_dir", "open_dump_dir",
           "write_private", "ENQUEUED", "RUNNING", "LAUNCHED", "COMPLETED", "FAILED", "P2P_GROUP", "COALESCED_P2P"]

# States.
ENQUEUED = "enqueued"    # async, waiting for the comm thread
RUNNING = "running"      # inside the C call
LAUNCHED = "launched"    # GPU: enqueued on a stream; completion unknown yet
COMPLETED = "completed"
FAILED = "failed"

log = logging.getLogger("streamcoll.flight")

# Launch names of grouped point-to-point work, which counts as point to point
# (it advances the p2p count, not the collective one), like the table's p2p
# ops: posted ops launched together, and a coalescing block holding p2p ops.
P2P_GROUP = "p2p_group"
COALESCED_P2P = "coalesced_p2p"

now_ns = time.monotonic_ns
wref = weakref.ref


class FlightEntry:
    """One operation in the ring (named fields, one type for both strategies).

    ``sync``: a synchronous call; its state is derived (docs/design.md,
    section 'The flight recorder's ring') and its slot object is reused by later synchronous calls, so
    the hot path allocates nothing. Asynchronous entries are new objects
    (they are referenced by the comm thread and the watchdog until done).

    ``limit``: unset or None (the communicator's timeout applies), or ``(seq,
    seconds)``: the call's own ``timeout=`` (:meth:`own_limit`). Keyed by
    the sequence number because a synchronous slot is reused by later calls
    that do not write it (the hot path writes no more fields than before):
    a later occupant has another number, so the limit is not its.
    """

    __slots__ = ("seq", "op", "p2p", "sync", "t_enq", "refs", "t_start", "t_end", "state", "event", "error",
                 "behind", "limit")

    def __init__(self, seq: int = 0, op: str = "", p2p: int = 0, sync: bool = True, t_enq: int = 0,
                 refs: Any = None, state: str = COMPLETED) -> None:
        self.seq = seq
        self.op = op
        self.p2p = p2p
        self.sync = sync
        self.t_enq = t_enq
        self.refs = refs
        self.t_start = 0
        self.t_end = 0
        self.state = state
        self.event: Any = None
        self.error: Optional[str] = None
        # while it waits for its turn in the process (Backend.turnstile): the call it waits behind
        self.behind: Optional[str] = None
        # ``limit`` stays unset (no store on the launch paths): set only by a call given timeout=

    def own_limit(self, seq: Optional[int] = None) -> Optional[float]:
        """The per-call timeout (seconds) of the call this entry records
        (``seq``: the number the reader took first, when the slot may be
        reused meanwhile), or None: the communicator's timeout applies."""
        lim = getattr(self, "limit", None)
        if lim is None:
            return None
        return lim[1] if lim[0] == (self.seq if seq is None else seq) else None

    def __repr__(self) -> str:
        return f"<FlightEntry #{self.seq} {self.op} {'sync' if self.sync else 'async'} {self.state}>"


def capacity() -> int:
    """``STREAMCOLL_FLIGHT_SIZE``, else torch's ``TORCH_FR_BUFFER_SIZE``, else 1024."""
    if not os.environ.get("STREAMCOLL_FLIGHT_SIZE", "").strip() and os.environ.get("TORCH_FR_BUFFER_SIZE", "").strip():
        return read_int("TORCH_FR_BUFFER_SIZE", 1024, minimum=0)
    return read_int("STREAMCOLL_FLIGHT_SIZE", 1024, minimum=0)


class FlightRecorder:
    """The ring of one communicator, and the state the launch path keeps for
    the watchdog.

    ``ring`` and ``mask`` are what the launch path writes to, together with
    ``done`` (sequence number of the last synchronous call that returned),
    ``cur`` (the tensors of the synchronous call in flight), ``inflight``
    (the async entry running on the CPU comm thread) and ``failed()``;
    everything else here runs off the hot path (watchdog pass, dump).
    """

    __slots__ = ("ring", "mask", "capacity", "wall0", "mono0", "errors", "desc", "_resolved_upto",
                 "done", "cur", "inflight", "running_since")

    def __init__(self, capacity: int) -> None:
        cap = 1
        while cap < capacity:
            cap <<= 1
        self.capacity = cap
        # Pre-filled with (unused, seq 0) synchronous entries: the launch path
        # then only writes fields, it never allocates.
        self.ring: List[Optional[FlightEntry]] = [FlightEntry() for _ in range(cap)]
        self.mask = cap - 1
        # Anchor to turn monotonic stamps into wall-clock times in dumps.
        self.wall0 = time.time()
        self.mono0 = now_ns()
        self.errors: Dict[int, str] = {}  # seq -> error of a failed synchronous call
        self.desc: Dict[int, dict] = {}   # seq -> resolved shapes/dtypes of a synchronous entry
        self._resolved_upto = 0
        self.done = 0
        self.cur: Any = None
        self.inflight: Optional[FlightEntry] = None
        # (seq, monotonic ns): when the watchdog first saw a synchronous call running
        self.running_since: Optional[Tuple[int, int]] = None

    def failed(self, seq: int, exc: BaseException) -> None:
        """Record that synchronous call ``seq`` raised (the launch path's except branch)."""
        self.errors[seq] = f"{type(exc).__name__}: {exc}"
        if len(self.errors) > self.capacity:
            for k in sorted(self.errors)[: len(self.errors) - self.capacity]:
                del self.errors[k]

    def entries(self) -> List[FlightEntry]:
        """Recorded entries, oldest first."""
        return sorted((e for e in self.ring if e is not None and e.seq), key=lambda e: e.seq)

    def at(self, seq: int) -> Optional[FlightEntry]:
        """The entry of sequence number ``seq`` if the ring still holds it."""
        e = self.ring[seq & self.mask]
        return e if e is not None and e.seq == seq else None

    def recent(self, last_seq: int, n: int) -> Iterable[FlightEntry]:
        """Up to ``n`` entries with sequence numbers <= ``last_seq``, newest first."""
        for s in range(last_seq, max(last_seq - n, 0), -1):
            e = self.at(s)
            if e is not None:
                yield e

    def describe(self, comm: Any, e: FlightEntry) -> dict:
        """``{"shapes": [...], "dtypes": [...]}`` of an entry (None where unknown)."""
        if e.sync:
            d = self.desc.get(e.seq)
            if d is not None:
                return d
            cur = self.cur
            if cur is not None and self.state(comm, e) == RUNNING:
                d = _read(cur)
                self.desc[e.seq] = d
                return d
            return {"shapes": None, "dtypes": None}
        r = e.refs
        if type(r) is dict:
            return r
        d = e.refs = _read(r)
        return d

    def resolve(self, comm: Any, last_seq: int) -> None:
        """Read the shapes of async entries up to ``last_seq`` while their
        tensors are still alive (the watchdog calls this periodically)."""
        start = max(self._resolved_upto + 1, last_seq - self.capacity + 1, 1)
        for s in range(start, last_seq + 1):
            e = self.at(s)
            if e is not None and not e.sync:
                self.describe(comm, e)
        self._resolved_upto = max(self._resolved_upto, last_seq)
        if len(self.desc) > 2 * self.capacity:
            lo = last_seq - self.capacity
            for k in [k for k in self.desc if k <= lo]:
                del self.desc[k]

    def state(self, comm: Any, e: FlightEntry) -> str:
        """The state of entry ``e`` of ``comm`` now."""
        if e.sync:
            if e.seq in self.errors:
                return FAILED
            if e.seq > self.done:
                return RUNNING
            if not comm._gpu:
                return COMPLETED
            ev = e.event  # a completion event (streamcoll.core.sync_events), if it got one
            if ev is not None:
                try:
                    if ev.query():
                        return COMPLETED
                except Exception:
                    pass
            return LAUNCHED
        st = e.state
        if st == LAUNCHED and e.event is not None:
            try:
                if e.event.query():
                    return COMPLETED
            except Exception:
                pass
        return st

    def wall(self, mono: int) -> Optional[float]:
        return None if not mono else self.wall0 + (mono - self.mono0) / 1e9


def _read(r: Any) -> dict:
    """Shapes and dtypes of tensors given as weak references or directly."""
    items = (r,) if type(r) is wref else (r or ())
    shapes: List[Optional[List[int]]] = []
    dtypes: List[Optional[str]] = []
    for x in items:
        t: Any = x() if type(x) is wref else x
        try:
            shapes.append(list(t.shape))
            dtypes.append(str(t.dtype).replace("torch.", ""))
        except Exception:  # freed before it was read
            shapes.append(None)
            dtypes.append(None)
    return {"shapes": shapes, "dtypes": dtypes}


def attach(comm: Any) -> FlightRecorder:
    """A recorder for ``comm`` (``STREAMCOLL_FLIGHT_SIZE`` entries)."""
    return FlightRecorder(capacity())


# ----------------------------------------------------------------- dumping
# The JSON record of a communicator's ring (read by ``python -m
# streamcoll.flight analyze``, which holds the format's reader), here next to
# the ring it reads, so that the communicator's dump_flight_record and the
# watchdog need nothing above the core.
FORMAT_VERSION = 1
# What the recorder's entries name point-to-point work: the table's p2p ops and
# the grouped launches (each advances the p2p count, so has no collective number).
P2P_ENTRIES = spec.p2p_ops() | {P2P_GROUP, COALESCED_P2P}


def _entry_json(comm: Any, fr: FlightRecorder, e: Any, now: int, seen: Optional[int]) -> dict:
    desc = fr.describe(comm, e)
    sync = e.sync
    state = fr.state(comm, e)
    if sync:
        t_enq = t_start = seen if state == RUNNING and seen else 0
        t_end = 0
    else:
        t_enq, t_start, t_end = e.t_enq, e.t_start or (e.t_enq if state == LAUNCHED else 0), e.t_end
    d = {
        "seq": e.seq,
        "collective_seq": None if e.op in P2P_ENTRIES else e.seq - e.p2p,
        "op": e.op,
        "shapes": desc["shapes"],
        "dtypes": desc["dtypes"],
        "strategy": "sync" if sync else "async",
        "state": state,
        "enqueued": fr.wall(t_enq),
        "started": fr.wall(t_start),
        "ended": fr.wall(t_end),
        "duration_s": (t_end - t_start) / 1e9 if t_end and t_start else None,
        "age_s": (now - (t_start or t_enq)) / 1e9 if (t_start or t_enq) else None,
    }
    own = e.own_limit()
    if own is not None:
        d["timeout_s"] = own  # the call's own timeout= (else the communicator's, the record's timeout_s)
    if sync and state == RUNNING:
        d["started_note"] = "first seen running by the watchdog" if seen else "running; start time not recorded"
    err = fr.errors.get(e.seq) if sync else e.error
    if err:
        d["error"] = err
    behind = getattr(e, "behind", None)
    if behind and state in (RUNNING, ENQUEUED):
        # not inside the library: it waits for the process's turn
        d["waiting_behind"] = behind
    return d


def snapshot(comm: Any, reason: str = "") -> dict:
    """The JSON-ready flight record of ``comm``."""
    fr: FlightRecorder = comm._flight
    now = now_ns()
    failed = comm._failed
    es = fr.entries()
    d = {
        "format": "streamcoll-flight",
        "version": FORMAT_VERSION,
        "communicator": comm.name,
        "backend": comm._backend.name,
        "device": str(comm._device),
        "rank": comm._rank,
        "size": comm._size,
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "timeout_s": comm.timeout,
        "issued": comm._seq,
        "p2p_issued": comm._p2p,
        "state": "destroyed" if comm._destroyed else ("failed" if failed is not None else "live"),
        "failure": None if failed is None else str(failed),
        "reason": reason,
        "dumped_at": time.time(),
        "capacity": fr.capacity,
        "entries": [_entry_json(comm, fr, e, now, _seen(comm, e)) for e in es],
    }
    for h in list(_hooks.on_snapshot):  # fields an observer adds (streamcoll.diagnostics.hang_report)
        h(comm, d)
    return d


def _seen(comm: Any, e: Any) -> Optional[int]:
    """When the watchdog first saw synchronous entry ``e`` running (monotonic ns)."""
    s = comm._flight.running_since
    return s[1] if s is not None and s[0] == e.seq else None


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name).strip("_") or "comm"


def dump(comm: Any, path: Optional[str] = None, reason: str = "on request") -> str:
    """Write ``comm``'s flight record as JSON; returns the file written.

    ``path`` may be a directory (the file is then
    ``<communicator>.rank<r>.json`` in it) or a file name; default: the
    directory :func:`default_dir` names, private to this user
    (:func:`streamcoll.core.recorder.open_dump_dir` says what is refused and
    where the dump then goes). The file is 0600, written under a temporary
    name and renamed (:func:`streamcoll.core.recorder.write_private`).
    """
    if path is None or os.path.isdir(path) or str(path).endswith(os.sep):
        dfd, d = open_dump_dir(None if path is None else str(path))
        name = f"{_safe(comm.name)}.rank{comm._rank}.json"
    else:
        dfd, d = open_dump_dir(os.path.dirname(os.path.abspath(path)))
        name = os.path.basename(path)
    try:
        write_private(dfd, name, json.dumps(snapshot(comm, reason), indent=1))
    finally:
        os.close(dfd)
    for h in list(_hooks.on_dump):  # torch's format too where its variables ask (streamcoll.diagnostics.fr_torch)
        h(comm, reason)
    return os.path.join(d, name)
