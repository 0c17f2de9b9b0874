"""Who and where, when a collective hangs: the rank whose call times out asks
every rank of the communicator, through the communicator's store, what it
is doing; each rank answers with its place and dumps its flight record with
the Python stack of every thread; the timing-out rank's report (the
watchdog's message before exit 86, a :class:`~streamcoll.CollectiveTimeout`'s
message) and ``python -m streamcoll.flight analyze`` name, for each rank that
has not entered the stuck collective, its last completed sequence number,
where its main thread is (``file:line in function``) and the streamcoll calls
it is inside, on this or another communicator; a rank that does not answer
in time is named as such.

**Keys.** For a communicator streamcoll made over a TCPStore, at the
server's root under the prefix ``<scope>/`` of streamcoll's hang keys (:attr:`scope`: a digest of
the unique id and of a random nonce rank 0 drew at the rendezvous, so a
second communicator of the same name on the same store, or a second run on
a store kept alive, under whatever PrefixStore, has keys of its own; a
split's child derives its scope from its parent's); else under the
communicator's store (``comm.store``: the PrefixStore
``streamcoll/<name>/<size>/<n>/`` the rendezvous numbers through the store;
a split's children share their parent's namespace and are told apart by
name and size, as the checks' keys are); with ``K = hang/<communicator
name>/<size>``:

- ``K/alarm``: set once (``compare_set``) by the first rank whose call timed
  out: JSON with its rank, the op, sequence and collective numbers, and a
  random id. A second rank timing out in the same collective keeps the first
  one's alarm and gathers the same answers.
- ``K/answers``: each rank appends its answer once (a JSON line; a rank
  inside the stuck collective sends only that), then adds 1 to
  ``K/answered``. A reporter polls that counter and reads every answer in
  one ``get`` when all ranks answered, else at its deadline; answers to
  another alarm id are ignored.

**Load on the store, at scale.** Per rank and communicator: one ``check``
per watchdog pass, and not more often than :func:`poll_period` (1 ms per
rank: a communicator's ranks together poll at most 1000 times a second);
nothing more until an alarm. On an alarm each rank makes 3 requests to
answer (``get``, ``append``, ``add``); each reporter 3 to raise it (the
alarm and its own answer), one counter poll per :func:`round_period` (20
ms, or 0.2 ms per rank: when a dead peer times every rank out at once, all
of them report) and one ``get`` of the answers; past 500 ranks a reporter
waits at least one poll period and 1 s more (:func:`wait_s`).

**Who polls, and on what connection.** One thread per process
(``streamcoll-hang-report``), woken by the watchdog at the end of each pass
(:func:`after_pass`: an event set, no store request on the watchdog's
thread), checks the alarm key of each communicator that has not answered yet
with one ``check``: at most one request per communicator per watchdog pass
(``min(0.5 s, timeout / 10)``), none on any collective's path, none once it
answered. The requests go over a connection of its own, a ``clone()`` made
by that thread: one per store server for the communicators streamcoll made
over a TCPStore (their keys under the communicator's :attr:`scope`, a digest
of its unique id and of a random nonce rank 0 drew at its rendezvous: the id
alone names no run, oneCCL's being ``IP_port``; at the server's root, so
equal for a second attempt on a kept store but for that nonce), else one per
store object; with a
request timeout of
:data:`REQUEST_TIMEOUT_S`; never over the main thread's, which may be
blocked in a store wait or a gloo call. Why a thread of its own and not the
watchdog's: a store request can block (a new TCPStore connection here can
stall the server 5 s on a reverse DNS lookup; a store whose host is gone
blocks until the request's timeout), and the watchdog must go on watching
the other communicators and ending the process. While a report of this
process is gathering answers the thread runs rounds every
:data:`ROUND_S` and polls every communicator's alarm in each (two ranks
reporting two communicators at once answer each other); only then.

**The answer** (:func:`streamcoll.diagnostics.hang_answer.answer_now`: its
last completed sequence number, the streamcoll calls it is inside, where
its main thread stands). The rank then dumps its flight record (JSON, and torch's
pickle where torch's variables ask; :mod:`streamcoll.core.recorder`) with a
``hang`` field: the alarm, its answer, and the stack of every thread
(``sys._current_frames`` + ``traceback``); in torch's format the stack of
the thread inside a call in flight goes to that entry's ``frames``
(:mod:`streamcoll.diagnostics.fr_torch`). A rank answers from its Python
thread, so it answers while its main thread runs Python, sleeps, or waits in
a C call that releases the GIL (a collective, a gloo barrier, a store wait);
a rank that is dead, holds the GIL in C code for the whole wait, runs with
``STREAMCOLL_WATCHDOG=off`` or ``STREAMCOLL_HANG_REPORT_S=0``, has destroyed
the communicator, or whose store cannot be cloned safely (a store written in
Python: its clone under a PrefixStore is not kept alive) does not answer.

Where a thread stands: :func:`streamcoll.diagnostics.hang_answer.locate`.

**The reporter** (:func:`gather`, called by the watchdog when it declares a
call stuck and by :func:`streamcoll.diagnostics.failure.handle_timeout` when a
wait times out) raises the alarm with its own answer and waits up to
``STREAMCOLL_HANG_REPORT_S`` seconds (default 2; ``0``: no reports, no
polling, no extra connection) for the others, then reports. A rank that
answers later still dumps: the analysis reads its answer from its dump and
says it came late. A report never blocks longer than that wait plus
:data:`FINAL_S`, whatever the store does.

The thread and the connections are the parent's only: a forked child
forgets them (its communicators are unusable anyway).
"""
from __future__ import annotations

import atexit
import json
import logging
import math
import os
import socket
import threading
import time
import uuid
import weakref
from datetime import timedelta
from typing import Any, Dict, List, Optional, Tuple

from ..core import helper_threads, hooks as _hooks, recorder
from ..core.communicator import LIVE
from .hang_answer import answer_now, calls_text, inside, kind, place, ranks_text, report_lines
from .hang_store import (REQUEST_TIMEOUT_S, _BUSY, _Conn, _back, _client_of, _gone, _socket_of,  # noqa: F401
                         _unsafe, requests_made)

__all__ = ["ENV", "DEFAULT_S", "budget_s", "after_pass", "gather", "gathering", "Report", "requests_made", "keys", "poll_period",
           "round_period", "wait_s"]

log = logging.getLogger("streamcoll.diagnostics.watchdog")  # the watchdog's reports: one logger

ENV = "STREAMCOLL_HANG_REPORT_S"
DEFAULT_S = 2.0
ROUND_S = 0.02          # between the reporter's rounds (counter poll), while a report gathers
PER_RANK_S = 0.001      # poll_period: one communicator's ranks poll its alarm <= 1000 times a second together
FINAL_S = 1.0           # a report's last reads after its deadline, at most


def budget_s() -> float:
    """``STREAMCOLL_HANG_REPORT_S``: how long a timing-out rank waits for the
    answers (default 2; 0 turns hang reports off). Read at each use, so it
    may change while the process runs; a malformed value is logged once and
    the default used (it is read on the watchdog's thread, where raising
    would only repeat the error every pass)."""
    v = os.environ.get(ENV, "").strip()
    if not v:
        return DEFAULT_S
    try:
        x = float(v)
    except ValueError:
        x = -1.0
    if x >= 0 and math.isfinite(x):
        return x
    global _WARNED
    if not _WARNED:
        _WARNED = True
        log.error("streamcoll: %s: expected seconds >= 0, got %r; using %g", ENV, v, DEFAULT_S)
    return DEFAULT_S


_WARNED = False

# ------------------------------------------------------------------ the store side
def _route(comm: Any) -> Tuple[Any, Any, str]:
    """Where ``comm``'s keys live: (the connection's key, the store to clone,
    the keys' prefix). A communicator with a :attr:`scope` over a TCPStore
    shares one connection per store server with every other such
    communicator (the keys sit on the server's root, under the scope); any
    other has one per store object, its keys relative to it."""
    store = comm.store
    scope = getattr(comm, "scope", None)
    if scope is not None:
        import torch.distributed as dist
        base = getattr(store, "_underlying_non_prefix_store", store)
        tcp = getattr(dist, "TCPStore", None)
        if tcp is not None and type(base) is tcp:
            try:
                return ("tcp", base.host, int(base.port)), base, f"streamcoll/hang/{scope}/"
            except Exception:
                pass
    return None, store, ""


def keys(comm: Any) -> Dict[str, str]:
    """The hang report's keys of ``comm`` (on the store :func:`_route` names)."""
    k = f"{_route(comm)[2]}hang/{comm.name}/{comm.size}"
    return {"alarm": f"{k}/alarm", "count": f"{k}/answered", "answers": f"{k}/answers"}


def poll_period(size: int) -> float:
    """The shortest time between two polls of one communicator's alarm by
    one rank (:data:`PER_RANK_S` per rank: all ranks together poll one
    communicator at most 1000 times a second; a pass is longer below 50 ranks)."""
    return size * PER_RANK_S


def round_period(size: int) -> float:
    """The shortest time between two polls of the answer counter by one
    reporter (every rank may report at once: a dead peer times them all out)."""
    return max(ROUND_S, size * PER_RANK_S / 5)


def wait_s(budget: float, size: int) -> float:
    """How long a reporter waits for the answers: ``budget``, and past 500
    ranks at least a poll period and 1 s more."""
    return budget if size <= 500 else max(budget, poll_period(size) + 1.0)


def _line(comm: Any, answer: Dict[str, Any], alarm: Dict[str, Any]) -> str:
    """What goes to the store of ``answer`` (the dump keeps all of it): a
    rank inside the alarm's collective sends only what says so (in a dead
    peer's hang that is almost every rank, and every reporter reads every
    answer), the others all but the text of the calls."""
    if inside(answer, alarm):
        keep = ("rank", "alarm", "issued", "collectives_issued", "last_completed", "last_completed_op")
        out = {k: answer.get(k) for k in keep}
        out["calls"] = [c for c in answer.get("calls") or []
                        if c.get("communicator") == alarm.get("communicator") and c.get("seq") == alarm.get("seq")]
    else:
        out = {k: v for k, v in answer.items() if k != "calls_text"}
    return json.dumps(out, separators=(",", ":")) + "\n"


class _State:
    """What the hang report knows of one communicator."""

    __slots__ = ("alarm", "answered", "answer", "threads", "frames", "report", "conn", "next_poll", "queued",
                 "__weakref__")

    def __init__(self) -> None:
        self.alarm: Optional[Dict[str, Any]] = None
        self.answered = False
        self.answer: Optional[Dict[str, Any]] = None
        self.threads: Optional[List[Dict[str, Any]]] = None
        self.frames: Dict[str, Any] = {}
        self.report: Optional[Dict[str, Any]] = None
        self.conn: Optional[_Conn] = None  # where the store takes no weak reference
        self.next_poll = 0.0  # monotonic: not polled before (poll_period)
        self.queued = False  # a background report was queued (gathering)


_STATES: "weakref.WeakKeyDictionary[Any, _State]" = weakref.WeakKeyDictionary()
_CONNS: "weakref.WeakKeyDictionary[Any, _Conn]" = weakref.WeakKeyDictionary()
_SERVERS: Dict[Tuple[str, str, int], _Conn] = {}  # ("tcp", host, port): one connection per store server
_LOCK = threading.Lock()
_WAKE = threading.Event()
_THREAD: Optional[threading.Thread] = None
_POLLED: List["weakref.ref[Any]"] = []
_JOBS: List["_Job"] = []


def _state(comm: Any) -> _State:
    st = _STATES.get(comm)
    if st is None:
        st = _STATES.setdefault(comm, _State())
    return st


def _conn(comm: Any) -> _Conn:
    """The connection that polls ``comm``'s keys (made here, on the hang
    report's thread: a new connection can take seconds): one per store
    server where :func:`_route` names one, else one per store object."""
    server, store, _ = _route(comm)
    st = _state(comm)
    if server is not None:
        c = _SERVERS.get(server)
        if c is None or _back(c, store):
            tried = c.tried if c is not None else set()
            c = _SERVERS[server] = _clone(store)
            c.tried = tried | {_client_of(store)}
        return c
    try:
        c = _CONNS.get(store)
    except TypeError:
        c = st.conn
    if c is None:
        c = _clone(store)
        try:
            _CONNS[store] = c
        except TypeError:
            st.conn = c
    return c


def _clone(store: Any) -> _Conn:
    """A connection of the hang report's own to ``store``'s server (not where
    the store's own client already sees its server gone: a clone of a gone
    TCPStore server retries for the store's whole timeout and logs C++ traces)."""
    why = _unsafe(store)
    if why is not None:
        return _Conn(None, why)
    if _gone(store):  # its host ended before the first poll (or a restart's old client)
        c = _Conn(None, "the store closed the connection (its host process ended)")
        c.closed = True
        return c
    _BUSY.set()
    try:
        clone = store.clone()
    except Exception as e:
        return _Conn(None, f"its store could not be cloned ({type(e).__name__}: {e})")
    finally:
        _BUSY.clear()
    try:
        clone.set_timeout(timedelta(seconds=REQUEST_TIMEOUT_S))
    except Exception:
        pass
    return _Conn(clone)


class _Job:
    """One report gathering answers (:func:`gather`)."""

    def __init__(self, comm: Any, alarm: Dict[str, Any], answer: Dict[str, Any], budget: float,
                 background: bool = False) -> None:
        self.comm = comm
        self.background = background  # nobody waits: the thread logs the report and dumps again
        self.started = time.monotonic()
        self.alarm = alarm
        self.answer = answer
        self.budget = budget
        self.deadline = time.monotonic() + budget
        self.next_poll = 0.0
        self.raised = False
        self.answers: Dict[int, Dict[str, Any]] = {}
        self.error: Optional[str] = None
        self.done = threading.Event()
        self.reported = threading.Event()  # background: logged and dumped (the exit waits for it)

    def finish(self, error: Optional[str] = None) -> None:
        if error and not self.error:
            self.error = error
        self.done.set()


_STOP = threading.Event()
EXIT_JOIN_S = 1.0  # how long the interpreter's exit waits for the thread to leave a store request
BUSY_JOIN_S = 6.0  # ... while it is inside one (a new connection: up to 5 s of reverse DNS lookup)


def _stop_at_exit() -> None:
    """Stop the thread before the interpreter finalizes: a daemon thread that
    comes back from a store request (a torch C++ call, GIL released) during
    finalization is ended by ``pthread_exit`` inside torch's code, which
    aborts the process ("terminate called without an active exception").

    First the reports still gathering are finished (:func:`_finish_reports`):
    a call past its own ``timeout=`` raised just before the program ended
    (its error uncaught, a Ctrl-C) promised its report. Registered when this
    module is imported, so that it runs after the ``atexit`` handlers a
    program registers later (handlers run newest first): a collective
    hanging in one of those is still reported with the other ranks' answers."""
    try:
        _finish_reports()
    finally:
        _STOP.set()
        _WAKE.set()
        t = _THREAD
        if t is not None and t.is_alive() and t is not threading.current_thread():
            # Finalization ends a daemon thread that comes back from torch's C++ with pthread_exit,
            # which aborts the process: wait out a request (or a clone) the thread is inside.
            t.join(EXIT_JOIN_S)
            if t.is_alive() and _BUSY.is_set():
                t.join(BUSY_JOIN_S)


def _finish_reports() -> None:
    """Wait for the reports gathering now, each until its deadline and
    :data:`FINAL_S` at most (2 s and 1 s by default): a background one
    until it is logged and dumped."""
    t = _THREAD
    if t is None or not t.is_alive() or t is threading.current_thread():
        return
    with _LOCK:
        jobs = list(_JOBS)
    for j in jobs:
        left = j.deadline + FINAL_S - time.monotonic()
        if left > 0:
            (j.reported if j.background else j.done).wait(left)


def _ensure_thread() -> None:
    global _THREAD
    with _LOCK:
        if _STOP.is_set():
            return  # the interpreter is exiting
        if _THREAD is None or not _THREAD.is_alive():
            _THREAD = helper_threads.Thread(target=_run, name="streamcoll-hang-report", daemon=True)
            _THREAD.start()


def _run() -> None:
    while not _STOP.is_set():
        with _LOCK:
            busy = bool(_JOBS)
        _WAKE.wait(ROUND_S if busy else None)
        _WAKE.clear()
        if _STOP.is_set():
            return
        try:
            _round()
        except Exception as e:  # never let the thread die silently
            log.error("streamcoll hang report: internal error: %r", e)


def _round() -> None:
    with _LOCK:
        jobs = [j for j in _JOBS if not j.done.is_set()]
        comms = [c for c in (r() for r in _POLLED) if c is not None]
    for j in jobs:
        if not j.raised:
            _raise(j)
    seen = set()
    for c in comms + [j.comm for j in jobs]:
        if id(c) not in seen:
            seen.add(id(c))
            _poll(c)
    now = time.monotonic()
    for j in jobs:
        if j.raised and not j.done.is_set():
            _collect(j, now)
        if j.background and j.done.is_set():
            try:
                _report_in_background(j)
            finally:
                j.reported.set()
                with _LOCK:
                    if j in _JOBS:
                        _JOBS.remove(j)
    _prune()


def _raise(job: _Job) -> None:
    """The alarm (the first rank's stays), then this rank's answer."""
    comm = job.comm
    conn = _conn(comm)
    if conn.broken:
        job.finish(conn.broken)
        return
    k = keys(comm)
    st = _state(comm)
    try:
        cur = json.loads(conn.call("compare_set", k["alarm"], "", json.dumps(job.alarm)))
        if cur.get("id") != job.alarm["id"]:
            job.alarm = cur  # another rank timed out first: its alarm, the same answers
            job.answer["alarm"] = cur.get("id")
        if st.alarm is None or not st.answered:
            st.alarm = job.alarm
        if not st.answered:
            st.answered = True
            conn.call("append", k["answers"], _line(comm, job.answer, job.alarm))
            conn.call("add", k["count"], 1)
    except Exception as e:
        job.finish(conn.broken or f"the store did not answer ({type(e).__name__}: {e})")
        return
    job.raised = True


def _poll(comm: Any) -> None:
    """One check of ``comm``'s alarm; answer it if it is there."""
    st = _state(comm)
    if st.answered or comm.destroyed or getattr(comm, "_forked", False) or comm.size < 2 or comm.store is None:
        return
    now = time.monotonic()
    if now < st.next_poll:
        return
    st.next_poll = now + poll_period(comm.size)
    conn = _conn(comm)
    if conn.broken:
        return
    k = keys(comm)
    try:
        if not conn.call("check", [k["alarm"]]):
            return
        alarm = json.loads(conn.call("get", k["alarm"]))
    except Exception:
        return
    _answer(comm, st, conn, alarm)


def _answer(comm: Any, st: _State, conn: _Conn, alarm: Dict[str, Any]) -> None:
    answer, threads, frames = answer_now(comm, alarm)
    st.alarm, st.answer, st.threads, st.frames, st.answered = alarm, answer, threads, frames, True
    k = keys(comm)
    try:
        conn.call("append", k["answers"], _line(comm, answer, alarm))
        conn.call("add", k["count"], 1)
    except Exception as e:  # the store is gone (the reporter hosted it and exited): the dump still says it
        answer["not_delivered"] = f"{type(e).__name__}: {e}"
    try:
        path = recorder.dump(comm, None, f"hang report: rank {alarm.get('rank')} timed out in "
                                         f"{alarm.get('op')} #{alarm.get('seq')}")
    except Exception as e:
        path = f"(could not be written: {e})"
    log.warning("streamcoll: rank %s reports %s (sequence number %s) on communicator %r stuck (its timeout "
                "passed); this rank (%d) answered: %s; %s; %s. Flight record and thread stacks: %s",
                alarm.get("rank"), alarm.get("op"), alarm.get("seq"), comm.name, comm.rank,
                f"last completed #{answer['last_completed']}", place(answer), calls_text(answer), path)


def _collect(job: _Job, now: float) -> None:
    """Poll the answer counter; read every answer (one request) once all
    ranks answered, or at the deadline."""
    if now < job.next_poll:
        return
    comm = job.comm
    size = comm.size
    job.next_poll = now + round_period(size)
    conn = _conn(comm)
    k = keys(comm)
    try:
        n = int(conn.call("add", k["count"], 0))
        if n < size and now < job.deadline:
            return
        raw = conn.call("get", k["answers"]) if n > 0 else b""
    except Exception as e:
        job.finish(conn.broken or f"the store did not answer ({type(e).__name__}: {e})")
        return
    for text in bytes(raw).decode("utf-8", "replace").splitlines():
        try:
            a = json.loads(text)
            r = int(a["rank"])
        except Exception:
            continue
        if a.get("alarm") == job.alarm.get("id") and 0 <= r < size and r not in job.answers:
            job.answers[r] = a  # another alarm's answer (a reused namespace) never counts
    job.finish()


def _prune() -> None:
    """Let go of the connections of stores no live communicator uses."""
    try:
        with _LOCK:
            reporting = [j.comm for j in _JOBS]  # a failed (aborted) communicator's report still gathers
        live = [c for c in list(LIVE) if not c.destroyed] + reporting
        used = {id(c.store) for c in live}
        for s in list(_CONNS.keys()):
            if id(s) not in used:
                _CONNS.pop(s, None)
        servers = {_route(c)[0] for c in live}
        for k in list(_SERVERS):
            if k not in servers:
                _SERVERS.pop(k, None)
    except Exception:
        pass


def after_pass(comms: List[Any]) -> None:
    """Called by the watchdog after each pass: the hang report's thread
    checks the alarm of each of ``comms`` that has not answered (no store
    request here)."""
    if budget_s() <= 0:
        return
    polled = []
    for c in comms:
        if c.size < 2 or c.store is None:
            continue
        st = _STATES.get(c)
        if st is None or not st.answered:
            polled.append(weakref.ref(c))
    with _LOCK:
        _POLLED[:] = polled
    if not polled:
        return
    _ensure_thread()
    _WAKE.set()


# ------------------------------------------------------------------ the reporter
class Report:
    """What :func:`gather` found: the alarm, each rank's answer (None: none
    in time), the wait, and an error where the ranks could not be asked."""

    def __init__(self, alarm: Dict[str, Any], answers: Dict[int, Optional[Dict[str, Any]]], size: int,
                 budget: float, waited: float, error: Optional[str]) -> None:
        self.alarm = alarm
        self.answers = answers
        self.size = size
        self.budget = budget
        self.waited = waited
        self.error = error
        self.ended_at = time.time()

    def lines(self) -> List[str]:
        return report_lines(self.alarm, self.answers, self.size, self.budget, self.error)

    def cause(self) -> Optional[str]:
        """One sentence naming the ranks the report blames (None: none)."""
        if self.error:
            return None
        by: Dict[str, List[int]] = {"silent": [], "inside": [], "behind": [], "past": []}
        for r in range(self.size):
            if r != self.alarm.get("rank"):
                by[kind(self.answers.get(r), self.alarm)].append(r)
        out: List[str] = []
        behind, past, silent = by["behind"], by["past"], by["silent"]
        if behind:
            out.append(f"{ranks_text(behind)} {'has' if len(behind) == 1 else 'have'} not reached this collective")
        if past:
            out.append(f"{ranks_text(past)} went past it (another order of collectives)")
        if silent:
            out.append(f"{ranks_text(silent)} did not answer (dead, or holding the GIL)")
        return "; ".join(out) + " (who and where: below)" if out else None

    def text(self, indent: str = "  ") -> str:
        return "\n".join(indent + x for x in self.lines())

    def as_dict(self) -> Dict[str, Any]:
        return {"alarm": self.alarm, "answers": {str(r): a for r, a in self.answers.items()}, "size": self.size,
                "budget_s": self.budget, "waited_s": self.waited, "error": self.error, "ended_at": self.ended_at}


def gather(comm: Any, op: str, seq: int, wait: bool = True) -> Optional[Report]:
    """Raise the alarm for ``op`` #``seq`` on ``comm`` and wait (bounded)
    for the answers; None where hang reports are off or nobody can be asked
    (one rank, no store, a forked child). ``wait=False`` (a call past its
    own ``timeout=``: its deadline is the caller's, the report must not
    stretch it): returns None at once; the hang report's thread gathers the
    answers, logs the report as a warning and dumps the flight record again
    with it."""
    budget = budget_s()
    if budget <= 0 or comm.size < 2 or comm.store is None or getattr(comm, "_forked", False):
        return None
    if _STOP.is_set():  # the interpreter is exiting (a program's atexit handler): nobody polls now
        return None if not wait else Report({"id": None, "rank": comm.rank, "communicator": comm.name,
                                             "size": comm.size, "op": op, "seq": seq}, {}, comm.size, budget, 0.0,
                                            "not asked: the interpreter is exiting (the hang report's thread "
                                            "has stopped)")
    budget = wait_s(budget, comm.size)
    e = comm.flight.at(seq)
    p2p = e.p2p if e is not None else None
    alarm = {"id": uuid.uuid4().hex, "rank": comm.rank, "communicator": comm.name, "size": comm.size, "op": op,
             "seq": seq, "collective_seq": None if p2p is None or op in recorder.P2P_ENTRIES else seq - p2p,
             "at": time.time(), "host": socket.gethostname(), "pid": os.getpid(), "budget_s": budget}
    st = _state(comm)
    if st.answered and st.answer is not None:
        own = st.answer  # answered another rank's alarm already: that answer stands
    else:
        own, threads, frames = answer_now(comm, alarm)
        st.answer, st.threads, st.frames = own, threads, frames
    job = _Job(comm, alarm, own, budget, background=not wait)
    t0 = job.started = time.monotonic()
    with _LOCK:
        _JOBS.append(job)
    st.queued = st.queued or not wait
    _ensure_thread()
    _WAKE.set()
    if not wait:
        return None
    done = job.done.wait(budget + FINAL_S)
    with _LOCK:
        if job in _JOBS:
            _JOBS.remove(job)
    error = job.error if done else (job.error or f"the store connection did not answer within {budget:g} s")
    answers: Dict[int, Optional[Dict[str, Any]]] = {r: job.answers.get(r) for r in range(comm.size)}
    answers[comm.rank] = answers.get(comm.rank) or own
    rep = Report(job.alarm, answers, comm.size, budget, time.monotonic() - t0, error)
    st.alarm = st.alarm or job.alarm
    st.report = rep.as_dict()
    return rep


def gathering(comm: Any) -> bool:
    """Whether :func:`gather` with ``wait=False`` queued a report of ``comm``
    (gathered in the background, logged once done: the error may say so)."""
    st = _STATES.get(comm)
    return st is not None and st.queued


def _finished(job: _Job) -> Report:
    comm = job.comm
    answers: Dict[int, Optional[Dict[str, Any]]] = {r: job.answers.get(r) for r in range(comm.size)}
    answers[comm.rank] = answers.get(comm.rank) or job.answer
    return Report(job.alarm, answers, comm.size, job.budget, time.monotonic() - job.started, job.error)


def _report_in_background(job: _Job) -> None:
    """A report nobody waited for (:func:`gather` with ``wait=False``): in the
    log, and in the flight record dumped again."""
    comm = job.comm
    rep = _finished(job)
    st = _state(comm)
    st.alarm = st.alarm or job.alarm
    st.report = rep.as_dict()
    path = None
    try:
        path = recorder.dump(comm, None, f"hang report of {job.alarm.get('op')} #{job.alarm.get('seq')} "
                                         "(past its own timeout=)")
    except Exception as e:
        path = f"(could not be written: {e})"
    cause = rep.cause()
    log.warning("streamcoll: %s (sequence number %s) on communicator %r (rank %d of %d) passed its own "
                "timeout=; %s\n%s\n  Flight record: %s", job.alarm.get("op"), job.alarm.get("seq"), comm.name,
                comm.rank, comm.size, f"likely cause: {cause}" if cause else "who and where:", rep.text("  "), path)


# ------------------------------------------------------------------ dumps and analysis
def _on_snapshot(comm: Any, d: Dict[str, Any]) -> None:
    """The ``hang`` field of a flight record (:data:`streamcoll.core.hooks.on_snapshot`)."""
    try:
        st = _STATES.get(comm)
    except TypeError:
        return
    if st is None or (st.alarm is None and st.report is None):
        return
    d["hang"] = {"alarm": st.alarm, "answer": st.answer, "threads": st.threads, "report": st.report,
                 "call_frames": st.frames}


# ------------------------------------------------------------------ fork
_FORKED_AWAY: List[Any] = []


def _after_fork_in_child() -> None:
    """A forked child forgets the parent's connections and reports without
    destroying them (a client's destructor is the parent's socket's
    business): they stay referenced, unused."""
    global _LOCK, _WAKE, _THREAD
    _LOCK = threading.Lock()  # a parent thread may have held it at fork
    _WAKE = threading.Event()
    _THREAD = None
    _FORKED_AWAY.append((list(_CONNS.values()), list(_SERVERS.values()), list(_STATES.values()), list(_JOBS)))
    _POLLED.clear()
    _JOBS.clear()
    _CONNS.clear()
    _SERVERS.clear()
    _STATES.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)

atexit.register(_stop_at_exit)  # at import: after the handlers a program registers later (_stop_at_exit)

_hooks.on_snapshot.append(_on_snapshot)  # attached to the core at import (streamcoll.core.hooks)
