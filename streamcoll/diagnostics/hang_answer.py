"""What a rank answers when a hang report asks (:mod:`streamcoll.diagnostics.hang_report`):
where its threads stand and which streamcoll calls it is inside; and the
report's text, from the answers (the reporter's message) or from the dumps
(``python -m streamcoll.flight analyze``).

**Where a thread stands** (:func:`locate`), decided here: walking out from
its innermost frame, frames of streamcoll itself (its package and its
generated code), of the standard library (not site-packages) and of torch
are skipped while a frame of any other code exists further out; the first
such frame is the place (``file:line in function``), with up to two callers
of that kind, and the innermost skipped frame is named as what it is inside
(``inside .../distributed_c10d.py:4856 in barrier``). A thread with no such
frame is placed at its innermost frame. Other installed packages
(Lightning, accelerate) count as the program's code: their frame is where
the program called into torch. Only the main thread is placed in the
answer; every thread's stack goes to the dump.

**The answer** (:func:`answer_now`): the rank, its last completed sequence
number on the communicator (the newest entry its flight recorder has
completed) and how many it issued (collectives apart: the alarm is compared
by collective number, as the analysis aligns ranks), the streamcoll calls
this process is inside now (the synchronous call in flight and the comm
thread's call of every live communicator, and the calls waiting in their
cross-rank check, each with communicator name and sequence number; and the
watchdog's text of every native call in flight), and where the main thread
stands. It is taken when the rank notices the alarm: a rank that answers
late says where it is then.
"""
from __future__ import annotations

import os
import socket
import sys
import sysconfig
import threading
import time
import traceback
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from ..core import helper_threads, recorder
from ..core.checks import WAITING
from ..core.communicator import LIVE

__all__ = ["attach", "locate", "threads_now", "answer_now", "report_lines", "from_dumps", "place", "calls_text",
           "inside", "entered", "kind", "ranks_text"]

MAX_FRAMES = 64

# What the watchdog knows of the calls in flight (filled by attach(): the
# watchdog imports this module, so this module cannot import it).
_running_sync: Callable[[Any, int], Any] = lambda comm, last: None
_running_calls: Callable[[], List[str]] = lambda: []


def attach(running_sync: Callable[[Any, int], Any], running_calls: Callable[[], List[str]]) -> None:
    """Called by :mod:`streamcoll.diagnostics.watchdog` at import: its
    functions naming the synchronous call in flight on a communicator and
    every native call in flight in the process."""
    global _running_sync, _running_calls
    _running_sync, _running_calls = running_sync, running_calls


# ------------------------------------------------------------- where threads stand
def _dir(p: str) -> str:
    return os.path.join(os.path.abspath(p), "")


_PKG = _dir(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_TORCH = _dir(os.path.dirname(torch.__file__))
_PATHS = sysconfig.get_paths()
_STDLIB = tuple(_dir(p) for k, p in _PATHS.items() if k in ("stdlib", "platstdlib") and p)
_SITE = tuple(_dir(p) for k, p in _PATHS.items() if k in ("purelib", "platlib") and p)
_LIB: Dict[str, bool] = {}


def _streamcoll(fn: str) -> bool:
    return fn.startswith("<streamcoll generated") or os.path.abspath(fn).startswith(_PKG)


def _library(fn: str) -> bool:
    """Whether a frame of file ``fn`` is skipped when placing a thread:
    streamcoll, the standard library (not site-packages), torch."""
    r = _LIB.get(fn)
    if r is None:
        if fn.startswith("<streamcoll generated") or fn.startswith("<frozen"):
            r = True
        elif fn.startswith("<"):
            r = False  # <string>, <stdin>: the program's
        else:
            a = os.path.abspath(fn)
            r = a.startswith(_PKG) or a.startswith(_TORCH) or (a.startswith(_STDLIB) and not a.startswith(_SITE))
        if len(_LIB) < 4096:
            _LIB[fn] = r
    return r


def _at(f: Any) -> str:
    return f"{f.f_code.co_filename}:{f.f_lineno} in {f.f_code.co_name}"


def locate(frame: Any) -> Dict[str, Any]:
    """Where a thread whose innermost frame is ``frame`` stands (the module
    docstring says which frames are skipped): ``where`` (``file:line in
    function``), ``from`` (up to two callers of the same kind), ``inside``
    (the innermost skipped frame, if any were skipped), ``in_streamcoll``
    (its innermost frame is streamcoll's)."""
    chain: List[Any] = []
    f = frame
    while f is not None and len(chain) < 512:
        chain.append(f)
        f = f.f_back
    if not chain:
        return {"where": None, "from": [], "inside": None, "in_streamcoll": False}
    user = [i for i, x in enumerate(chain) if not _library(x.f_code.co_filename)]
    i = user[0] if user else 0
    return {"where": _at(chain[i]), "from": [_at(chain[j]) for j in user[1:3]],
            "inside": _at(chain[0]) if i > 0 else None,
            "in_streamcoll": _streamcoll(chain[0].f_code.co_filename)}


def _torch_frames(frame: Any) -> List[Dict[str, Any]]:
    """Frames as torch's flight recorder writes them (``name``, ``filename``,
    ``line``), innermost first."""
    out: List[Dict[str, Any]] = []
    f = frame
    while f is not None and len(out) < MAX_FRAMES:
        out.append({"name": f.f_code.co_name, "filename": f.f_code.co_filename, "line": f.f_lineno})
        f = f.f_back
    return out


def threads_now(frames: Optional[Dict[int, Any]] = None) -> List[Dict[str, Any]]:
    """The Python stack of every thread now (``traceback.format_stack``,
    outermost first), the main thread first."""
    frames = sys._current_frames() if frames is None else frames
    by_ident = {t.ident: t for t in threading.enumerate()}
    main = threading.main_thread().ident
    out = []
    for ident, f in frames.items():
        t = by_ident.get(ident)
        try:
            stack = traceback.format_stack(f)
        except Exception as e:  # a source file gone: the stack without its lines
            stack = [f"(stack not formatted: {e})"]
        out.append({"name": t.name if t is not None else f"thread {ident}", "ident": ident,
                    "main": ident == main, "daemon": t.daemon if t is not None else None, "stack": stack})
    out.sort(key=lambda d: (not d["main"], str(d["name"])))
    return out


# ------------------------------------------------------------------ the answer
def _last_completed(comm: Any) -> Tuple[int, Optional[str]]:
    """The newest sequence number of ``comm``'s flight recorder whose
    operation completed, and its op (0, None: none yet)."""
    fr = comm.flight
    for e in fr.recent(comm.seq, 256):
        seq, op = e.seq, e.op  # before the state: the launch path may reuse a sync entry's slot
        try:
            st = fr.state(comm, e)
        except Exception:
            continue
        if st == recorder.COMPLETED and e.seq == seq:
            return seq, op
    return (fr.done, None) if fr.done else (0, None)


def _calls() -> List[Dict[str, Any]]:
    """The streamcoll calls in flight in this process: each live
    communicator's synchronous call and its comm thread's call, and the
    calls waiting in their cross-rank check (:mod:`streamcoll.core.checks`)."""
    out: List[Dict[str, Any]] = []
    for c in list(LIVE):
        if c.destroyed:
            continue
        try:
            e = _running_sync(c, c.seq)
            if e is not None:
                out.append({"communicator": c.name, "size": c.size, "op": e.op, "seq": e.seq,
                            "how": "synchronous"})
            inf = c.flight.inflight
            if inf is not None:
                out.append({"communicator": c.name, "size": c.size, "op": inf.op, "seq": inf.seq,
                            "how": "async, comm thread"})
        except Exception:
            continue
    for c, seq, line in list(WAITING.values()):  # a first-call or debug check: arrived, before its native call
        if not c.destroyed:
            out.append({"communicator": c.name, "size": c.size, "op": line.split(" ", 1)[0], "seq": seq,
                        "how": "its check, waiting in the store for the other ranks"})
    return out


def _prepare(comm: Any) -> None:
    if comm.is_gpu and comm.device.type == "cuda":
        helper_threads.prepare(comm.device.index)  # event queries on the comm's GPU, thread-local capture mode


def answer_now(comm: Any, alarm: Dict[str, Any]) -> Tuple[Dict[str, Any], List[Dict[str, Any]], Dict[str, Any]]:
    """This rank's answer to ``alarm`` on ``comm`` (the module docstring),
    the stacks of its threads, and torch-format frames of the calls in
    flight on ``comm`` (sequence number -> frames)."""
    _prepare(comm)
    frames = sys._current_frames()
    main = frames.get(threading.main_thread().ident or 0)
    last, last_op = _last_completed(comm)
    calls = _calls()
    try:
        text = _running_calls()
    except Exception as e:
        text = [f"(not known: {e})"]
    answer = {
        "rank": comm.rank, "communicator": comm.name, "size": comm.size, "alarm": alarm.get("id"),
        "pid": os.getpid(), "host": socket.gethostname(),
        "issued": comm.seq, "collectives_issued": comm.seq - getattr(comm, "_p2p", 0),
        "last_completed": last, "last_completed_op": last_op,
        "calls": calls, "calls_text": text, "main": locate(main), "answered_at": time.time(),
    }
    # the stack of the thread inside each call in flight on this communicator (torch's "frames")
    mine = [c for c in calls if c["communicator"] == comm.name and c["size"] == comm.size and c["how"] == "synchronous"]
    call_frames: Dict[str, Any] = {}
    if mine:
        in_call = [f for f in frames.values() if _streamcoll(f.f_code.co_filename)]
        named = [f for f in in_call if _has(f, mine[0]["op"])]
        pick = named[0] if len(named) == 1 else (main if main is not None and main in in_call else None)
        if pick is not None:
            call_frames[str(mine[0]["seq"])] = _torch_frames(pick)
    return answer, threads_now(frames), call_frames


def _has(frame: Any, name: str) -> bool:
    f, n = frame, 0
    while f is not None and n < 16:
        if f.f_code.co_name == name and _streamcoll(f.f_code.co_filename):
            return True
        f, n = f.f_back, n + 1
    return False


# ------------------------------------------------------------- the report's text
def ranks_text(r: List[int]) -> str:
    """``rank 1`` / ``ranks 1, 2`` / ``ranks 0, 2-4095`` (runs of 3 or more as ranges)."""
    rs = sorted(set(r))
    parts: List[str] = []
    i = 0
    while i < len(rs):
        j = i
        while j + 1 < len(rs) and rs[j + 1] == rs[j] + 1:
            j += 1
        if j - i >= 2:
            parts.append(f"{rs[i]}-{rs[j]}")
        else:
            parts.extend(str(x) for x in rs[i:j + 1])
        i = j + 1
    return ("rank " if len(rs) == 1 else "ranks ") + ", ".join(parts)


def entered(a: Dict[str, Any], alarm: Dict[str, Any]) -> bool:
    """Whether answer ``a``'s rank issued the alarm's collective (by collective number where known)."""
    cs = alarm.get("collective_seq")
    if cs is not None and a.get("collectives_issued") is not None:
        return int(a["collectives_issued"]) >= int(cs)
    return int(a.get("issued", 0)) >= int(alarm.get("seq", 0))


def inside(a: Dict[str, Any], alarm: Dict[str, Any]) -> bool:
    """Whether answer ``a`` is inside the alarm's collective."""
    return any(c.get("communicator") == alarm.get("communicator") and c.get("seq") == alarm.get("seq")
               for c in a.get("calls") or [])


def kind(a: Optional[Dict[str, Any]], alarm: Dict[str, Any]) -> str:
    """What answer ``a`` says of its rank and the alarm's collective:
    ``silent`` (no answer), ``inside``, ``behind`` (has not entered it) or
    ``past`` (issued it, and is not in it: another order of collectives)."""
    if a is None:
        return "silent"
    if inside(a, alarm):
        return "inside"
    return "past" if entered(a, alarm) else "behind"


def place(a: Dict[str, Any]) -> str:
    """Where answer ``a``'s main thread stands, as the report says it."""
    m = a.get("main") or {}
    if not m.get("where"):
        return "its main thread has no Python frame"
    s = f"its main thread is at {m['where']}"
    if m.get("from"):
        s += ", called from " + ", from ".join(m["from"])
    if m.get("inside"):
        s += f" (inside {m['inside']})"
    return s


def calls_text(a: Dict[str, Any]) -> str:
    """The streamcoll calls answer ``a``'s process is inside, as the report says them."""
    calls = a.get("calls") or []
    if not calls:
        return "not inside a streamcoll call"
    return "inside " + "; ".join(f"{c['op']} (sequence number {c['seq']}, {c['how']}) on communicator "
                                 f"{c['communicator']!r}" for c in calls)


def report_lines(alarm: Dict[str, Any], answers: Dict[int, Optional[Dict[str, Any]]], size: int,
                 budget: float, error: Optional[str] = None, asked: bool = True) -> List[str]:
    """The report's lines (the watchdog's message, a CollectiveTimeout's,
    the analysis): each rank but the alarm's, by what it answered; ranks
    with the same line share it (``ranks 1-4095 are inside ... too``)."""
    op, seq, who = alarm.get("op"), alarm.get("seq"), alarm.get("rank")
    name = alarm.get("communicator")
    what = f"{op} #{seq}"
    lines = [f"Who and where (rank {who} asked every rank of communicator {name!r} through the store; "
             f"{budget:g} s for answers):"]
    if error:
        lines.append(f"  could not ask: {error}")
    said: Dict[Tuple[str, str], List[int]] = {}  # (verb for one rank / for several, the rest) -> ranks
    for r in range(size):
        if r == who:
            continue
        a = answers.get(r)
        if a is None:
            if error:
                continue
            key = (("did not answer", "did not answer"), f" within {budget:g} s: dead (or exited), or holding "
                   "the GIL in C code") if asked else (("left no answer", "left no answer"), "")
        else:
            late = a.get("late_s")
            when = (f" (answered {late:.1f} s after the report, which had named it as not answering)"
                    if late is not None else "")
            last = f"last completed #{a.get('last_completed')}" + (
                f" ({a['last_completed_op']})" if a.get("last_completed_op") else "")
            k = kind(a, alarm)
            if k == "inside":
                key = (("is", "are"), f" inside {what} too" + (f"{when}; {place(a)}" if late is not None else ""))
            elif k == "behind":
                key = (("has", "have"), f" not entered {what}{when}: {last}; {place(a)}; {calls_text(a)}")
            else:
                key = (("has", "have"), f" passed {what}{when} (issued #{a.get('issued')}, {last}): the ranks "
                       f"disagree on the order of collectives; {place(a)}; {calls_text(a)}")
        said.setdefault((key[0][0] + "|" + key[0][1], key[1]), []).append(r)
    inside_too = [(k, rs) for k, rs in said.items() if k[1] == f" inside {what} too"]
    for (verbs, rest), rs in [(k, rs) for k, rs in said.items() if k[1] != f" inside {what} too"] + inside_too:
        one, many = verbs.split("|")
        lines.append(f"  {ranks_text(rs)} {one if len(rs) == 1 else many}{rest}")
    return lines


def from_dumps(dumps: List[Dict[str, Any]]) -> Optional[Tuple[Dict[str, Any], List[str]]]:
    """The hang report of one communicator's dumps (one per rank), as the
    reporter would have written it, with the answers each rank's own dump
    holds (also those that came after the report): the alarm and the lines;
    None if no dump has one."""
    hung = [d for d in dumps if isinstance(d.get("hang"), dict) and d["hang"].get("alarm")]
    if not hung:
        return None
    # the report of the first alarm (a rank that timed out later, when nobody could answer any more, has
    # one too), and one that could ask before one that could not
    reps = sorted((d["hang"]["report"] for d in hung if d["hang"].get("report")),
                  key=lambda r: (r.get("error") is not None, float((r.get("alarm") or {}).get("at") or 0)))
    rep = reps[0] if reps else None
    alarm = rep["alarm"] if rep else min((d["hang"]["alarm"] for d in hung), key=lambda a: float(a.get("at") or 0))
    size = int(dumps[0].get("size") or alarm.get("size") or 0)
    answers: Dict[int, Optional[Dict[str, Any]]] = {}
    if rep:
        for r, a in (rep.get("answers") or {}).items():
            answers[int(r)] = a
    for d in hung:
        a = d["hang"].get("answer")
        if not a or a.get("alarm") != alarm.get("id"):
            continue
        r = int(a.get("rank", d.get("rank", -1)))
        if answers.get(r) is None:
            if rep and a.get("answered_at") and rep.get("ended_at"):
                a = dict(a, late_s=max(0.0, float(a["answered_at"]) - float(rep["ended_at"])))
            answers[r] = a
    budget = float((rep or alarm).get("budget_s") or 0.0)
    return alarm, report_lines(alarm, answers, size, budget, rep.get("error") if rep else None, asked=bool(rep))
