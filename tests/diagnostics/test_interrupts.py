"""Interrupt anywhere (issue 33): each public call of the hot and life-cycle
paths is interrupted by a KeyboardInterrupt at its k-th interruptible point
inside streamcoll's code, for every k the call reaches, one run per k; after
each the call has raised or completed, no exec lock or turnstile ticket is
left behind, and the communicator (or a fresh one) still gives right sums.

The points are where CPython (3.11, 3.12) delivers an asynchronous exception
(a signal handler's KeyboardInterrupt, pytest-timeout, a SIGALRM timeout, a
SIGTERM handler's ``sys.exit``): on entry to a function (``RESUME``, here the
trace's ``call`` event, generator resumptions too), after a loop's back edge
(``JUMP_BACKWARD``) and right after a call returns, before its result is
stored (the eval-breaker checks at the end of ``CALL``). The last is finer
than a line: ``t = take_ticket()`` can be interrupted with the ticket taken
and not stored (why streamcoll takes tickets with no call:
``Turnstile.take``). Lines that hold no call (the first line of a ``finally``
that passes the turn, say) are no such point: no signal can interrupt them,
so raising there would test something CPython never does.

Real oneCCL, one-rank communicators in one subprocess per scenario (a lock
left behind must hang that process, not the test run); many k per process.
"""
from __future__ import annotations

import dis
import faulthandler
import json
import os
import subprocess
import sys
import threading
import time
from typing import Any, Callable, Dict, List, Optional

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # tests/: conftest, world
ROOT = os.path.dirname(TESTS)

# Modules of pure computation (building tables and code, reading the
# environment): no lock, ticket or native handle is held in their frames,
# and interrupting them costs runs, not coverage.
# (Those split out of one keep its place: references and source_text from
# spec, dump_files from recorder, wire from topology.)
_PURE = {"launch.py", "recorder.py", "dump_files.py", "plans.py", "spec.py", "references.py", "source_text.py",
         "env_defaults.py", "env_vars.py", "topology.py", "wire.py", "timeouts.py", "checks.py",
         "native_output.py", "validation.py", "ops.py"}

# A new communicator costs 0.3 s here: its points outside the modules that
# take the turn and hold the native handle are sampled, one in _STRIDE.
_STRIDE = {"new_communicator": 10}
_DENSE = {"backends.py", "turnstile.py", "signals.py", "streams.py"}

# Code of those modules that keeps state across calls, interrupted like the rest:
# the widened fast path's scratch views (launch._ScratchViews, issue 35).
_STATEFUL = {"_ScratchViews.__call__", "_ScratchViews._make"}

_AFTER = {dis.opmap[n] for n in ("CALL", "CALL_FUNCTION_EX", "JUMP_BACKWARD") if n in dis.opmap}


class Interrupter:
    """``sys.settrace`` on the calling thread: counts the interruptible points
    in streamcoll's frames (its modules, its generated launchers) and raises
    KeyboardInterrupt at point ``k`` (0: count only)."""

    def __init__(self, k: int = 0) -> None:
        import streamcoll
        self.pkg = os.path.dirname(os.path.abspath(streamcoll.__file__)) + os.sep
        self.k = k
        self.n = 0
        self.where: Optional[str] = None
        self.in_finaliser = False  # the interrupt was raised inside a __del__ (a Work dropped mid-call)
        self.files: List[str] = []  # the module of each point

    def _ours(self, code) -> bool:
        f = code.co_filename
        return f.startswith(self.pkg) or f.startswith("<streamcoll generated")

    @staticmethod
    def _skip(code) -> bool:
        """A comprehension, or a module that takes no lock, ticket or handle."""
        if getattr(code, "co_qualname", "") in _STATEFUL:
            return False
        return code.co_name.startswith("<") or os.path.basename(code.co_filename) in _PURE

    def _point(self, frame, what: str) -> None:
        code = frame.f_code
        self.n += 1
        self.files.append(os.path.basename(code.co_filename))
        if self.n == self.k:
            self.where = f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno} {frame.f_code.co_name} ({what})"
            f = frame
            while f is not None and not self.in_finaliser:
                self.in_finaliser = f.f_code.co_name == "__del__"
                f = f.f_back
            raise KeyboardInterrupt(f"interrupt #{self.k}")

    def _global(self, frame, event, arg):
        if event != "call" or not self._ours(frame.f_code) or self._skip(frame.f_code):
            return None
        frame.f_trace_opcodes = True
        self._point(frame, "entry")
        code = frame.f_code.co_code
        prev = [-1]

        def local(frame, event, arg):
            if event == "opcode":
                p = prev[0]
                prev[0] = code[frame.f_lasti]
                if p in _AFTER:
                    self._point(frame, dis.opname[p].lower())
            return local
        return local

    def __enter__(self) -> "Interrupter":
        sys.settrace(self._global)
        return self

    def __exit__(self, *exc) -> None:
        sys.settrace(None)


def _next_ticket(ts) -> int:
    return ts.issued


def _consistent(comms: List[Any]) -> Optional[str]:
    """What is left behind, or None: every exec lock free, no call pending,
    the turn at the next ticket with nobody inside or waiting."""
    for c in comms:
        rt = c._rt
        deadline = time.monotonic() + 5
        while getattr(rt, "_pending", 0) and time.monotonic() < deadline:
            time.sleep(0.001)
        if getattr(rt, "_pending", 0):
            return f"{c.name}: {rt._pending} calls still pending on the comm thread"
        if not repr(rt.exec_lock).startswith("<unlocked"):
            return f"{c.name}: exec lock left held: {rt.exec_lock!r}"
    from streamcoll.core.backends import get_backend
    ts = get_backend("oneccl").turnstile
    ts.wake()  # settles tickets cancelled behind the turn
    nxt = _next_ticket(ts)
    if ts.turn != nxt or ts._owner is not None or ts.waiting or ts.skipped:
        return (f"turnstile: turn {ts.turn}, next ticket {nxt}, owner {ts._owner}, waiting {ts.waiting}, "
                f"skipped {sorted(ts.skipped)}")
    return None


def _reap(keep: List[Any]) -> None:
    """Destroy the communicators an interrupted creation left made (oneCCL
    has a bounded number of communicator ids)."""
    from streamcoll.core.communicator import LIVE
    for c in list(LIVE):
        if not any(c is k for k in keep) and not c.destroyed:
            c.destroy()


def _sums(c, size: int = 4) -> Optional[str]:
    import torch
    t = torch.arange(size, dtype=torch.float32)
    c.all_reduce(t)
    big = torch.ones(1 << 16)
    c.all_reduce(big, async_op=True).wait()
    small = torch.full((3,), 2.0)
    c.all_reduce(small, async_op=True).wait()
    if t.tolist() != list(map(float, range(size))) or big[0].item() != 1.0 or small.tolist() != [2.0] * 3:
        return f"wrong values: {t.tolist()} {big[0].item()} {small.tolist()}"
    return None


def _new(name: str):
    import torch.distributed as dist
    import streamcoll
    return streamcoll.new_communicator(backend="oneccl", device="cpu", rank=0, world_size=1,
                                       store=dist.HashStore(), name=name)


# ------------------------------------------------------------- scenarios ---
# Each: (setup() -> state, call(state), comms(state) -> communicators to check).
def _scenarios() -> Dict[str, Any]:
    import numpy as np
    import torch
    import streamcoll

    A = _new("A")
    B = _new("B")
    small = torch.ones(4)
    big = torch.ones(1 << 16)

    def after_split(st):
        child = st.get("child")
        if child is not None:
            child.destroy()

    def split(st):
        st["child"] = A.split(0)

    def new_comm(st):
        st["child"] = _new("N")

    def destroy_setup():
        return {"victim": A.split(0)}  # a new communicator: 0.3 s each; a split one: 2 ms

    def destroy(st):
        st["victim"].destroy()

    def sync_behind_async(st):
        w = A.all_reduce(big, async_op=True)
        A.all_reduce(small)
        w.wait()

    return {
        "fast_sync": (dict, lambda st: A.all_reduce(small), None, [A, B]),
        "fast_async": (dict, lambda st: A.all_reduce(small, async_op=True).wait(), None, [A, B]),
        "module_sync": (dict, lambda st: streamcoll.all_reduce(small, group=B), None, [A, B]),
        "general_sync": (dict, lambda st: A.all_reduce(np.ones(4, dtype=np.float32)), None, [A, B]),
        "general_async": (dict, lambda st: A.all_reduce(np.ones(4, dtype=np.float32), async_op=True).wait(),
                          None, [A, B]),
        "queued_async": (dict, lambda st: A.all_reduce(big, async_op=True).wait(), None, [A, B]),
        "sync_behind_async": (dict, sync_behind_async, None, [A, B]),
        # a quiet small call woken by a query or a bounded wait (the review's real-signal runs)
        "poll_async": (dict, lambda st: (lambda w: (w.is_completed(), w.wait()))(A.all_reduce(small, async_op=True)),
                       None, [A, B]),
        "timed_wait": (dict, lambda st: A.all_reduce(small, async_op=True).wait(5.0), None, [A, B]),
        "split": (dict, split, after_split, [A, B]),
        "new_communicator": (dict, new_comm, after_split, [A, B]),
        "destroy": (destroy_setup, destroy, None, [A, B]),
    }


def _wide_scenario() -> Any:
    """The widened (bf16) fast path from cold: its scratch-view cache
    (launch._ScratchViews) missed, grown, then hit; afterwards every cached
    entry must be whole (issue 35)."""
    import torch
    import streamcoll

    A = _new("A")
    B = _new("B")

    def bf16_setup():
        # the widened fast path from cold: no view cached, no scratch (a miss that grows it), then a hit
        g = A.all_reduce.__globals__
        g["_wv"].clear()
        g["_sc"][0] = torch.empty(0)
        return {"bf": torch.arange(12, dtype=torch.bfloat16)}

    def bf16_call(st):
        A.all_reduce(st["bf"].view(3, 4), streamcoll.ReduceOp.AVG)
        A.all_reduce(st["bf"])

    def bf16_after(st):
        # every cached entry whole (its views in its key's shapes, its pointers theirs), values right
        g = A.all_reduce.__globals__
        bf = torch.arange(12, dtype=torch.bfloat16)
        for key, entry in list(g["_wv"].items()):
            (w, p) = entry
            if w.shape != key or int(A._cx.ffi.cast("uintptr_t", p)) != w.data_ptr() or w.dtype != torch.float32:
                raise AssertionError(f"a half-made scratch view for {key}: {w.shape} {w.dtype}")
        for shape in ((12,), (3, 4), (2, 6)):
            t = bf.view(shape).clone()
            A.all_reduce(t)
            if not torch.equal(t, bf.view(shape)):
                raise AssertionError(f"bf16 {shape}: {t.tolist()}")

    return (bf16_setup, bf16_call, bf16_after, [A, B])


_EXTRA = {"fast_sync_bf16": _wide_scenario}


def run_scenario(name: str, limit: int) -> Dict[str, Any]:
    """Interrupt scenario ``name`` at each of its points (at most ``limit``);
    a dict: points, interrupted, completed, failures."""
    faulthandler.dump_traceback_later(240, exit=True)  # a lock left behind hangs: say where
    setup, call, after, comms = _EXTRA[name]() if name in _EXTRA else _scenarios()[name]
    st = setup()
    call(st)  # warm: fast paths built, comm threads started
    if after:
        after(st)
    st = setup()
    with Interrupter() as it:
        call(st)
    if after:
        after(st)
    n = it.n
    stride = _STRIDE.get(name, 1)
    ks = [k for k, f in enumerate(it.files, 1) if k % stride == 0 or f in _DENSE][:limit]
    out: Dict[str, Any] = {"points": n, "runs": len(ks), "interrupted": 0, "completed": 0, "failures": []}
    slow = []
    for k in ks:
        t0 = time.monotonic()
        if slow and slow[-1][0] is None:
            slow[-1] = (time.monotonic() - slow[-1][1], slow[-1][2])
        st = setup()
        it = Interrupter(k)
        try:
            with it:
                call(st)
            out["completed"] += 1
        except KeyboardInterrupt:
            out["interrupted"] += 1
        except TypeError as e:
            # A trace function's KeyboardInterrupt raised inside a finaliser (Work.__del__, run
            # when the scenario's call drops its Work) sometimes comes out of CPython 3.11 as this
            # TypeError (cause not found: no streamcoll code calls a traceback; real signals in
            # tests/core/test_trylock_stress.py never gave it). Counted as interrupted: what is left
            # behind is still checked below.
            if not (it.in_finaliser and "'traceback' object is not callable" in str(e)):
                out["failures"].append(f"k={k} at {it.where}: raised {type(e).__name__}: {e}")
                continue
            out["interrupted"] += 1
            out["mangled"] = out.get("mangled", 0) + 1
        except Exception as e:  # noqa: BLE001 - a call may say why it cannot go on
            out["failures"].append(f"k={k} at {it.where}: raised {type(e).__name__}: {e}")
            continue
        finally:
            sys.settrace(None)
        victim = st.get("victim")  # destroyed (or not, interrupted): its exec lock is free all the same
        if victim is not None and not repr(victim._rt.exec_lock).startswith("<unlocked"):
            out["failures"].append(f"k={k} at {it.where}: the destroyed communicator's exec lock left held: "
                                   f"{victim._rt.exec_lock!r}")
            break
        _reap(comms + [victim])
        bad = _consistent(comms)
        if bad is None:
            try:
                if after:
                    after(st)
                for c in comms:
                    bad = bad or _sums(c)
                bad = bad or _consistent(comms)
            except Exception as e:  # noqa: BLE001
                bad = f"afterwards: {type(e).__name__}: {e}"
        slow.append((None, t0, f"k={k} {it.where}"))
        if bad is not None:
            out["failures"].append(f"k={k} at {it.where}: {bad}")
            break  # what is left behind would hang or spoil the next runs
    faulthandler.cancel_dump_traceback_later()
    out["slowest"] = sorted((x for x in slow if x[0] is not None), reverse=True)[:3]
    return out


def main(argv: List[str]) -> int:
    names = argv[1:] or list(_scenarios())
    res = {}
    for n in names:
        t0 = time.monotonic()
        res[n] = run_scenario(n, int(os.environ.get("INTERRUPT_LIMIT", "100000")))
        res[n]["seconds"] = round(time.monotonic() - t0, 2)
    print("RESULT " + json.dumps(res))
    return 0


# ------------------------------------------------------------------ tests ---
import pytest  # noqa: E402

sys.path.insert(0, TESTS)
from conftest import needs_oneccl  # noqa: E402

HOT = ["fast_sync", "fast_async", "module_sync", "general_sync", "general_async", "queued_async",
       "sync_behind_async", "poll_async", "timed_wait"]
# the widened (bf16) fast path's cache: a process of its own (its scenario's
# allocations would move when the garbage collector runs in the others')
WIDE = ["fast_sync_bf16"]
# one process each: an interrupted destroy leaves its native communicator
# allocated (oneCCL's communicator ids run out after a few hundred)
LIFE = ["split", "new_communicator", "destroy"]


def _run(names: List[str], timeout: float) -> Dict[str, Any]:
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
               STREAMCOLL_WATCHDOG="off")
    p = subprocess.run([sys.executable, __file__, *names], env=env, capture_output=True, text=True,
                       timeout=timeout, cwd=ROOT)
    line = [x for x in p.stdout.splitlines() if x.startswith("RESULT ")]
    if p.returncode != 0 or not line:
        raise AssertionError(f"rc {p.returncode}\nstdout:\n{p.stdout[-4000:]}\nstderr:\n{p.stderr[-8000:]}")
    return json.loads(line[0][len("RESULT "):])


def test_the_modules_it_names_are_the_package_s():
    """_PURE and _DENSE name modules by file name: each must be one of the
    package's (a module renamed or split out and not named here is sampled
    as it was not meant to be: the layout's renames left env.py, debug.py
    and logs.py behind, and the modules split out of spec, recorder and
    topology unnamed)."""
    import streamcoll
    pkg = os.path.dirname(os.path.abspath(streamcoll.__file__))
    names = {f for _, _, fs in os.walk(pkg) for f in fs if f.endswith(".py")}
    assert sorted((_PURE | _DENSE) - names) == []
    # what was split out of a pure module is pure too
    assert {"references.py", "source_text.py", "dump_files.py", "wire.py"} <= _PURE


@needs_oneccl
@pytest.mark.parametrize("names", [HOT, WIDE] + [[n] for n in LIFE], ids=["hot", "wide"] + LIFE)
def test_an_interrupt_at_any_point_leaves_no_lock_or_ticket_behind(names):
    res = _run(names, timeout=280)
    for n in names:
        r = res[n]
        assert r["points"] > 5, (n, r)
        assert not r["failures"], (n, r["failures"][:5])
        assert r["interrupted"] + r["completed"] == r["runs"], (n, r)


if __name__ == "__main__":
    sys.exit(main(sys.argv))
