"""Debug mode: before each collective, check through the communicator's
store that every rank calls the same op with the same shapes, dtypes, root
and reduction, and raise :class:`~streamcoll.MismatchError` on every rank,
saying which ranks differ and how, before any C call.

Off by default (it costs a store round trip per collective). Turn it on with
``STREAMCOLL_DEBUG_CHECKS=1`` (every communicator created afterwards) or
:func:`enable` (a collective call: every rank of the communicator at the same
point). It is a pre-launch hook (``Communicator.register_pre_hook``), so
the launch path is untouched when it is off.

What is compared, per collective: the op; the shape and dtype of every
tensor argument (lists: length and each element), the root (``src``/``dst``)
and the reduction. Arguments whose shapes legitimately differ between ranks
are left out (``gather_list``/``scatter_list``, which only the root passes)
or compared by dtype only (the tensors of ``all_to_all_single``/``all_to_all``), and for
all-to-all the counts are cross-checked instead: what rank i sends to rank j
must be what rank j expects from rank i. Point-to-point calls are not checked
(their peers call different functions by design). ``async_op`` and
``stream`` may differ.

After a :class:`MismatchError` the communicator stays usable (no rank issued
the C call). A rank that never reaches the check (it skipped the collective,
died or hung) makes the others raise :class:`~streamcoll.CollectiveTimeout`
after the communicator's timeout, naming the missing ranks.

The exchange: each rank sets ``dbg/<ns>/<n>/<rank>`` (JSON of its call) in
``comm._store`` (a PrefixStore unique to the communicator), waits for every
rank's key, and deletes its key of check ``n - 2`` (by then every rank has
read it).
"""
from __future__ import annotations

import json
import logging
import os
import threading
import time
import weakref
from datetime import timedelta
from typing import Any, Dict, List, Optional, Tuple

from . import spec
from .ops import canonical_op
from .._ffi.errors import CollectiveTimeout, MismatchError

log = logging.getLogger("streamcoll.core.checks")

__all__ = ["enable", "disable", "is_enabled", "maybe_install", "CHECKED", "Signatures", "signatures_for",
           "SIGNATURE_BOUND"]

def _derive() -> Dict[str, Tuple[Tuple[str, ...], Tuple[str, ...], Optional[str]]]:
    """collective -> (arguments compared exactly, by dtype only, count
    cross-check), from the declarations (``ParamSpec.compare``)."""
    out: Dict[str, Tuple[Tuple[str, ...], Tuple[str, ...], Optional[str]]] = {}
    for name, s in spec.TABLE.items():
        if s.p2p:
            continue  # peers call different functions by design
        out[name] = (tuple(p.name for p in s.params if p.compare == "exact"),
                     tuple(p.name for p in s.params if p.compare == "dtype"), s.cross_check)
    out["split"] = ((), (), None)
    return out


_ARGS = _derive()
CHECKED = tuple(_ARGS)

def _env_on() -> bool:
    """``STREAMCOLL_DEBUG_CHECKS`` on, or torch's ``TORCH_DISTRIBUTED_DEBUG=DETAIL``
    (what turns on torch's own per-call collective checks)."""
    if os.environ.get("TORCH_DISTRIBUTED_DEBUG", "").strip().upper() == "DETAIL":
        return True
    return os.environ.get("STREAMCOLL_DEBUG_CHECKS", "0").strip().lower() not in ("", "0", "false", "no", "off")


def _tensor(x: Any) -> str:
    shape = getattr(x, "shape", None)
    dtype = getattr(x, "dtype", None)
    if shape is None or dtype is None:
        return f"<{type(x).__name__}>"
    dt = str(dtype).replace("torch.", "")
    return f"{dt}[{', '.join(str(int(s)) for s in shape)}]"


def _dtype(x: Any) -> str:
    d = getattr(x, "dtype", None)
    return f"<{type(x).__name__}>" if d is None else str(d).replace("torch.", "")


def _value(name: str, x: Any, exact: bool) -> Any:
    if name == "op":
        try:
            n, f = canonical_op(x)
            return n if n != "PREMUL_SUM" else f"PREMUL_SUM({f:g})"
        except Exception:
            return repr(x)
    if isinstance(x, (list, tuple)):
        if not exact:
            return sorted({_dtype(t) for t in x}) if x else []
        return [_tensor(t) for t in x]
    if hasattr(x, "shape"):
        return _tensor(x) if exact else _dtype(x)
    if x is None:
        return None
    if isinstance(x, bool) or not isinstance(x, int):
        return repr(x)
    return int(x)


def _numel(x: Any) -> int:
    try:
        return int(x.numel()) if hasattr(x, "numel") else int(x.size)
    except Exception:
        return -1


def _counts(kind: str, b: Dict[str, Any], size: int) -> Optional[Tuple[List[int], List[int]]]:
    """(sent to each rank, expected from each rank) in elements, or None if unknown."""
    try:
        if kind == "single":
            inp, out = b["input"], b["output"]
            isz, osz = b.get("input_split_sizes"), b.get("output_split_sizes")
            row_in = _numel(inp) // max(int(inp.shape[0]), 1) if len(inp.shape) else 1
            row_out = _numel(out) // max(int(out.shape[0]), 1) if len(out.shape) else 1
            send = [int(s) * row_in for s in isz] if isz is not None else [_numel(inp) // size] * size
            recv = [int(s) * row_out for s in osz] if osz is not None else [_numel(out) // size] * size
            return send, recv
        ins, outs = b["input_tensor_list"], b["output_tensor_list"]
        return [_numel(t) for t in ins], [_numel(t) for t in outs]
    except Exception:
        return None


def _fingerprint(comm: Any, name: str, a: Dict[str, Any]) -> dict:
    exact, loose, cross = _ARGS[name]
    fp: Dict[str, Any] = {"call": name}
    for k in exact:
        fp[k] = _value(k, a.get(k), True)
    for k in loose:
        fp[k] = _value(k, a.get(k), False)
    if cross:
        fp["_counts"] = _counts(cross, a, comm.size)
    return fp


def _show(fp: dict) -> str:
    args = ", ".join(f"{k}={v}" for k, v in fp.items() if k != "call" and not k.startswith("_"))
    return f"{fp['call']}({args})"


def _ranks(rs: List[int]) -> str:
    return ("rank " if len(rs) == 1 else "ranks ") + ", ".join(map(str, sorted(rs)))


def _compare(fps: List[dict], size: int) -> Tuple[Optional[str], List[int]]:
    """Why the ranks' calls do not match (None if they do), and the odd ranks."""
    groups: List[Tuple[dict, List[int]]] = []
    for r, fp in enumerate(fps):
        key = {k: v for k, v in fp.items() if not k.startswith("_")}
        for g in groups:
            if g[0] == key:
                g[1].append(r)
                break
        else:
            groups.append((key, [r]))
    if len(groups) > 1:
        groups.sort(key=lambda g: (-len(g[1]), g[1]))
        ref, ref_ranks = groups[0]
        parts = [f"{_ranks(ref_ranks)} called {_show(ref)}"]
        odd: List[int] = []
        for fp, rs in groups[1:]:
            odd += rs
            if fp["call"] != ref["call"]:
                how = f"a different collective ({fp['call']} instead of {ref['call']})"
            else:
                keys = [k for k in sorted(set(fp) | set(ref)) if fp.get(k) != ref.get(k)]
                how = "; ".join(f"{k} {fp.get(k)} instead of {ref.get(k)}" for k in keys)
            parts.append(f"{_ranks(rs)} called {_show(fp)}: {how}")
        return "ranks disagree: " + "; ".join(parts), sorted(odd)
    counts = [fp.get("_counts") for fp in fps]
    if counts and all(c is not None for c in counts):
        bad: List[str] = []
        pairs: set = set()
        for i in range(size):
            for j in range(size):
                sent, expected = counts[i][0][j], counts[j][1][i]  # type: ignore[index]
                if sent != expected:
                    bad.append(f"rank {i} sends {sent} elements to rank {j}, which expects {expected}")
                    pairs.update((i, j))
        if bad:
            return (f"{fps[0]['call']} counts disagree: " + "; ".join(bad[:8]) + (" ..." if len(bad) > 8 else ""),
                    sorted(pairs))
    return None, []


# Store connections of deferred checks no longer used, per store (store ->
# [clones], held weakly): a destroyed communicator's clone serves the next
# communicator on the same store object, kept only while another live
# communicator holds that store (a split's children share their parent's:
# :data:`_USERS` counts the first-call checks on each store); the last one's
# destroy closes the store's spares with its own (``release``), so a
# destroyed communicator keeps no connection open. Opening a TCPStore
# connection is not cheap: torch names both ends of it by a reverse lookup of
# the peer's address (``getnameinfo`` in the client's connect and in the
# server's accept, on the server's one thread), a query to the DNS server for
# ``::ffff:127.0.0.1``, which /etc/hosts does not answer; a resolver that drops
# one query in about 25 (measured here) makes that connect, and every request
# to the store meanwhile, wait for glibc's 5 s retry. Cleared in a forked child
# (the parent's sockets are not the child's). Not covered: communicators made
# one after another by ``new_communicator`` or ``dist.new_group`` (each has a
# PrefixStore of its own over the base store: no spare fits another's).
_SPARE: "weakref.WeakKeyDictionary[Any, List[Any]]" = weakref.WeakKeyDictionary()
_USERS: "weakref.WeakKeyDictionary[Any, int]" = weakref.WeakKeyDictionary()
_SPARE_LOCK = threading.Lock()
SPARE_MAX = 4  # kept per store: more communicators than this alive at once each open their own


def _take_spare(store: Any) -> Any:
    with _SPARE_LOCK:
        try:
            got = _SPARE.get(store)
        except TypeError:  # a store that takes no weak reference: never pooled
            return None
        return got.pop() if got else None


def _use(store: Any) -> None:
    """A live communicator's first-call checks use ``store``."""
    with _SPARE_LOCK:
        try:
            _USERS[store] = _USERS.get(store, 0) + 1
        except TypeError:
            pass


def _done_with(store: Any, conn: Any) -> None:
    """A communicator's checks are done with ``store``: its connection
    ``conn`` (or None: none, or not reusable) is kept for the next
    communicator on ``store`` while another one still uses it; the last
    one's leaves none behind (the spares close as their references go)."""
    with _SPARE_LOCK:
        try:
            n = _USERS.get(store, 1) - 1
        except TypeError:
            return
        if n <= 0:
            _USERS.pop(store, None)
            _SPARE.pop(store, None)
            return
        _USERS[store] = n
        if conn is not None:
            got = _SPARE.setdefault(store, [])
            if len(got) < SPARE_MAX:
                got.append(conn)


def _forget_spares() -> None:
    global _SPARE_LOCK
    _SPARE_LOCK = threading.Lock()  # a parent thread may have held it at fork
    _SPARE.clear()
    _USERS.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_spares)


# The checks waiting in the store now: (communicator, sequence number, line)
# (watchdog.running_calls: a Ctrl-C during a check names the collective, not
# the store's wait; cleared in a forked child).
WAITING: Dict[object, Tuple[Any, int, str]] = {}


class _Checker:
    """The debug state of one communicator."""

    def __init__(self, comm: Any, prefix: str = "dbg", label: str = "debug check") -> None:
        self.comm = comm
        store = comm._store
        if store is None:
            raise ValueError(f"debug checks need the communicator's store; {comm.name!r} has none")
        self.store = store
        self.prefix = prefix
        self.label = label
        # Keys of one communicator object: its name is unique in its store (a
        # rendezvous gives each communicator a namespace of its own, and a
        # split's children are named by the parent's split count); ``ns``
        # counts this communicator's checkers of this kind (debug mode turned
        # on again), on every rank alike: enable() is collective. No store key.
        self.comm_key = f"{comm.name}/{comm._size}"
        made = comm.__dict__.setdefault("_checkers_made", {})
        self.ns = made[prefix] = made.get(prefix, -1) + 1
        self.key = f"{prefix}/{self.comm_key}/{self.ns}/{{}}/{{}}"
        self.n = 0
        self.last = 0  # the number of the last check this rank completed (its key is still in the store)
        self.handle: Any = None
        self.sig: Optional["Signatures"] = None  # the first-call checks, set aside while this is on

    def check(self, name: str, fp: dict, n: Optional[int] = None, store: Any = None,
              seq: Optional[int] = None, poll: bool = False, limit: Optional[float] = None) -> None:
        """Check number ``n`` (default: the next one) of ``fp`` across ranks
        (through ``store``, default the communicator's). ``seq``: the call's
        sequence number where it is not the next one (a deferred check runs
        on the comm thread after its call took its number). ``poll``: wait
        by polling (:func:`_poll_wait`), not in the server. ``limit``: the
        call's own timeout (seconds), which bounds the wait instead of the
        communicator's."""
        comm = self.comm
        wait_s = comm.timeout if limit is None else limit
        deferred = seq is not None
        if seq is None:
            seq = comm._seq + 1
        if n is None:
            self.n += 1
            n = self.n
        me, size = comm._rank, comm._size
        if store is None:  # the caller's thread is about to block on the other ranks
            from .work import POSTING, launch_posted
            if POSTING:
                launch_posted()  # posted p2p first: a peer may be waiting on it (as a synchronous call does)
        store = self.store if store is None else store
        # the communicator's name and size in the key: communicators on one store (a split's
        # children share their parent's) each count their checks from 1
        key = self.key
        store.set(key.format(n, me), json.dumps(fp, default=repr))
        keys = [key.format(n, r) for r in range(size)]
        how = "async, comm thread" if deferred else "synchronous"
        tag = object()
        try:  # the entry inside the try: an interrupt after it leaves no stale line
            WAITING[tag] = (comm, seq, f"{name} (sequence number {seq}, {how}) on communicator {comm.name!r} "
                            f"(rank {me} of {size}, {comm.backend}): in its {self.label} #{n}, waiting in the "
                            "store for the other ranks before any native call")
            if poll:
                _poll_wait(store, keys, wait_s)
            else:
                store.wait(keys, timedelta(seconds=wait_s))
        except Exception as e:
            missing = [r for r in range(size) if not store.check([keys[r]])]
            if not missing:
                raise
            raise CollectiveTimeout(
                name, seq, wait_s, [], me, size,
                f"{self.label} #{n}: {_ranks(missing)} never reached this collective within the timeout "
                f"(skipped it, died or hung); this rank called {_show(fp)}") from e
        finally:
            WAITING.pop(tag, None)
        vals = store.multi_get(keys) if hasattr(store, "multi_get") else [store.get(k) for k in keys]
        fps = [json.loads(v) for v in vals]
        # A communicator's checks run one at a time, in the same order on every rank: every rank
        # set its key of check n after it had read every key of check n - 1, so this rank's key of
        # n - 1 is read by all (the last check's keys: release(), at destroy).
        self.last = n
        if n > 1:
            try:
                store.delete_key(key.format(n - 1, me))
            except Exception:
                pass
        why, odd = _compare(fps, size)
        if why is not None:
            err = MismatchError(
                f"{self.label} #{n} on communicator {comm.name!r} (rank {me} of {size}, before sequence "
                f"number {seq}): {why}. No rank issued the collective; the communicator is "
                f"still usable")
            err.ranks = odd
            err.calls = fps
            raise err


    def release(self) -> None:
        """The communicator is destroyed: the last of its ranks to get here
        removes every rank's key of the last check (one counter in the
        store; the other keys went as the checks ran). A rank that never
        destroys it leaves its last key behind."""
        n, self.last = self.last, 0
        if not n:
            return
        store, size = self.store, self.comm._size
        try:
            if int(store.add(self.key.format(n, "left"), 1)) >= size:
                for r in range(size):
                    store.delete_key(self.key.format(n, r))
                store.delete_key(self.key.format(n, "left"))
        except Exception as e:  # the store's server gone (rank 0 exited first): nothing left to clean
            log.debug("could not remove the keys of %s #%d of communicator %r: %s", self.label, n,
                      self.comm.name, e)


def _poll_wait(store: Any, keys: List[str], timeout: float) -> None:
    """Wait until every key in ``keys`` is set, by polling ``check``: each
    request is short, so a store client shared with another thread (a store
    that cannot be cloned) is never held for the whole wait, as a
    server-side ``wait`` would hold it. Raises TimeoutError past ``timeout``."""
    deadline = time.monotonic() + timeout
    pause = 0.0001
    while not store.check(keys):
        if time.monotonic() > deadline:
            raise TimeoutError(f"keys not set within {timeout:g} s")
        time.sleep(pause)
        pause = min(pause * 2, 0.005)


def release(comm: Any) -> None:
    """Called by ``Communicator.destroy``: the store keys its checks left,
    and the deferred checks' own store connection (closed now, not when the
    garbage collector gets to the communicator's reference cycle)."""
    dbg = getattr(comm, "_debug", None)
    sigs = [s for s in (getattr(comm, "_sig", None), getattr(dbg, "sig", None)) if s is not None]
    for ch in [s._checker for s in sigs] + [dbg]:
        if ch is not None:
            ch.release()
    for s in sigs:
        st, s._async_store = s._async_store, None
        if s._released:
            continue
        s._released = True
        # a clone left between requests: the next communicator's on the same store
        _done_with(s.comm._store, st if st and not s._async_busy else None)


def enable(comm: Any) -> None:
    """Turn the checks on for ``comm`` (collective: every rank, same point).
    A pre-launch hook: the communicator's fast paths are off while it is on."""
    if getattr(comm, "_debug", None) is not None:
        return
    ch = _Checker(comm)

    def hook(rec: Any) -> None:
        if rec.name in _ARGS:
            ch.check(rec.name, _fingerprint(comm, rec.name, rec.args))

    ch.sig, comm._sig = getattr(comm, "_sig", None), None  # every call is checked: no first-call checks
    ch.handle = comm.register_pre_hook(hook)
    comm._debug = ch


def disable(comm: Any) -> None:
    """Turn the checks off for ``comm`` (every rank, as :func:`enable`:
    the last rank to do so removes the last check's keys from the store)."""
    ch = getattr(comm, "_debug", None)
    if ch is None:
        return
    ch.handle.remove()
    comm._debug = None
    ch.release()  # its last check's keys: removed by the last rank to turn it off (as at destroy)
    if ch.sig is not None:
        comm._sig = ch.sig
        comm._build_fast_paths()  # with their first-call check again


def is_enabled(comm: Any) -> bool:
    return getattr(comm, "_debug", None) is not None


def maybe_install(comm: Any, on: Optional[bool] = None) -> None:
    """Called by ``Communicator.__init__``: enable if ``on`` (the agreed
    ``STREAMCOLL_DEBUG_CHECKS``; None: this process's environment)."""
    comm._debug = None
    if (_env_on() if on is None else on) and comm._store is not None:
        enable(comm)


# ------------------------------------------------------ first-call checks
#: distinct call signatures checked per communicator by default
#: (``STREAMCOLL_SIGNATURE_CHECKS``; 0: none)
SIGNATURE_BOUND = 256


def _coarse(name: str, x: Any, exact: bool) -> Any:
    """What the first-call check compares of one argument: element counts
    and dtypes (not shapes: a flat collective of equal counts is correct
    whatever the shapes), the canonical reduction, roots."""
    if name == "op":
        try:
            n, f = canonical_op(x)
        except Exception:
            return repr(x)
        return n if n != "PREMUL_SUM" else f"PREMUL_SUM({f:g})"
    if isinstance(x, (list, tuple)):
        if not exact:
            return tuple(sorted({_dtype(t) for t in x}))
        return tuple(_coarse("", t, True) for t in x)
    d = getattr(x, "dtype", None)
    if d is not None:
        return (d, _numel(x)) if exact else d
    if x is None or (isinstance(x, int) and not isinstance(x, bool)):
        return x
    return repr(x)


def _shown(v: Any) -> Any:
    """A coarse value as the exchanged (JSON) fingerprint shows it."""
    if isinstance(v, tuple) and len(v) == 2 and isinstance(v[1], int) and not isinstance(v[0], (str, tuple)):
        return f"{str(v[0]).replace('torch.', '')}[{v[1]} elements]"
    if isinstance(v, tuple):
        return [_shown(t) for t in v]
    if v is not None and not isinstance(v, (int, str)):
        return str(v).replace("torch.", "")
    return v


# split (its colors differ by design) and barrier (no arguments; it may carry
# its own timeout, which a store wait would not honour) are not checked.
_FIRST = frozenset(n for n in _ARGS if n not in ("split", "barrier"))


class Signatures:
    """The default check: each distinct call signature (the collective,
    each tensor's element count and dtype, the reduction, the root; for an
    even all-to-all its element counts, for an uneven one (split sizes
    given) nothing of its counts, each rank's own: what each rank sends to
    and expects from each other is cross-checked by the check, not keyed) is
    checked across ranks the first time this communicator sees it, through
    the store exactly as debug mode checks every call (a mismatch raises
    :class:`~streamcoll.MismatchError` on every rank before any C call),
    up to ``bound`` signatures; a signature seen before costs no exchange.

    Rank-symmetric by construction: a check is numbered, and whether a call
    needs one is decided, where the call runs, and a communicator's calls
    run in issue order (the CPU comm thread's queue; a GPU launch on the
    issuing thread). An async call's check runs right before its C call;
    a synchronous call made while async work is queued first lets that
    work (and its checks) finish. So after the same calls every rank holds
    the same ``seen`` (signatures whose check passed), the same check
    number and the same count against the bound, whatever the timing: a
    second call of a signature whose first check is still pending is
    checked again if that check failed, and not if it passed, on every rank
    alike. A signature found in ``seen`` when issued passed on every rank.

    Correct programs call the same sequence of collectives with the same
    signatures on every rank, so every rank checks at the same calls. The
    generated fast paths keep a set of their own keys (element count,
    dtype, the C reduction, the root: each determines the signature) and
    call :meth:`first_fast` only when a key is not in it: no frame after
    warm-up. What it cannot catch: a mismatch where one rank's signature was
    seen before (it goes on into the library while the other waits for it
    in the store and raises CollectiveTimeout naming it after the timeout;
    debug mode catches it), different shapes of equal element counts (the
    results are the same), different contents, inconsistent counts of an
    uneven all-to-all after its signature's first call, point-to-point
    calls, and signatures past the bound."""

    def __init__(self, comm: Any, bound: int) -> None:
        self.comm = comm
        self.bound = bound
        self.seen: set = set()   # signatures whose check passed (decided where calls run)
        self.fast: set = set()   # fast-path keys whose signature needs no check
        self._checker: Optional[_Checker] = None
        self._async_store: Any = None  # the deferred checks' store connection (a clone), or False: none
        self._async_busy = False  # a deferred check did not end normally on it: not handed on (release)
        self._released = False
        _use(comm._store)  # counted until release(): spares are kept for a store a live communicator holds
        self.checks = 0

    def _key(self, name: str, args: tuple) -> Optional[tuple]:
        s = spec.TABLE[name]
        exact, loose, cross = _ARGS[name]
        a = dict(zip(s.param_names, args))
        key = (name,) + tuple((k, _coarse(k, a.get(k), True)) for k in exact) + \
            tuple((k, _coarse(k, a.get(k), False)) for k in loose)
        if cross == "single":
            # all-to-all: the counts differ between ranks by design where splits are given (what
            # each rank sends and expects is cross-checked, :meth:`_check`, not keyed: a key must
            # be new or seen on every rank alike); even, every rank's element counts are equal
            even = a.get("input_split_sizes") is None and a.get("output_split_sizes") is None
            key += (("_even", (_numel(a.get("input")), _numel(a.get("output"))) if even else None),)
        return key

    def _cross(self, name: str, args: tuple) -> Any:
        """All-to-all: (sent to each rank, expected from each rank) of this
        call, cross-checked between the ranks by a check (else None)."""
        cross = _ARGS[name][2]
        if not cross:
            return None
        c = _counts(cross, dict(zip(spec.TABLE[name].param_names, args)), self.comm._size)
        return None if c is None else [list(c[0]), list(c[1])]

    def _due(self, key: tuple) -> bool:
        """Whether a call of ``key`` is checked now (where it runs)."""
        return key not in self.seen and len(self.seen) < self.bound

    def _check(self, name: str, key: tuple, counts: Any, store: Any = None, seq: Optional[int] = None,
               poll: bool = False, limit: Optional[float] = None) -> None:
        """Number and run the check of ``key`` (where its call runs, in issue
        order); ``seen`` takes it once it passed on every rank. ``counts``:
        all-to-all's, cross-checked (:meth:`_cross`)."""
        ch = self._checker
        if ch is None:
            # created at the first check, not with the communicator: creating one costs no store request
            ch = self._checker = _Checker(self.comm, prefix="sig", label="first-call check")
        fp: Dict[str, Any] = {"call": name}
        for k, v in key[1:]:
            fp[k] = _shown(v) if not isinstance(v, tuple) or k != "_even" else list(v)
        if counts is not None:
            fp["_counts"] = counts
        self.checks += 1
        ch.n += 1
        ch.check(name, fp, ch.n, store, seq, poll, limit)
        self.seen.add(key)  # passed (a mismatch stays unseen: the same call again is checked again)

    def _deferred_store(self) -> Tuple[Any, bool]:
        """The store a deferred check uses, and whether it must poll: a
        connection of its own (a clone), so that the comm thread's wait
        neither queues behind nor blocks another thread's request on the
        same client (measured: they deadlocked); a store that cannot be
        cloned (a framework's own ``dist.Store`` subclass) is shared, and
        polled instead of waited on in its server. The clone of a destroyed
        communicator on the same store is taken first (:data:`_SPARE`: a new
        connection can cost 5 s)."""
        st = self._async_store
        if st is None:
            if self._checker is None:
                self._checker = _Checker(self.comm, prefix="sig", label="first-call check")
            try:
                st = _take_spare(self._checker.store) or self._checker.store.clone()
            except Exception as e:
                log.debug("communicator %r: its store cannot be cloned (%s): deferred checks poll it",
                          self.comm.name, e)
                st = False
            self._async_store = st
        return (self._checker.store, True) if st is False else (st, False)  # type: ignore[union-attr]

    def first(self, s: Any, args: tuple, plan: Any = None, async_op: Any = False,
              limit: Optional[float] = None) -> None:
        """Check ``s``'s call with ``args`` across ranks if its signature is
        new (the class docstring: decided where the call runs). An async
        call (``plan`` given) is checked right before its C call (the comm
        thread on the CPU): ``async_op=True`` still returns before the peers
        arrive, and a mismatch is the Work's error. A synchronous one is
        checked here, after the async work queued before it. ``limit``: the
        call's own timeout, which bounds the check's wait for the peers."""
        name = s.name
        if name not in _FIRST:
            return
        comm = self.comm
        if not comm._usable:
            return  # failed or destroyed: the launch raises why, at once (no wait for peers in the store)
        key = self._key(name, args)
        if key is None or not self._due(key):
            return  # passed on every rank (it is in seen), or past the bound: no rank checks it
        counts = self._cross(name, args)
        coalescing = comm._coalescing is not None
        if async_op is True and plan is not None and not coalescing:
            fn = plan.fn
            st, poll = self._deferred_store()
            seq = comm._seq + 1  # the number this call takes right after (under the exec lock)

            def checked(*a: Any) -> Any:
                if self._due(key):  # decided in issue order: a pending check of key has run by now
                    self._async_busy = True  # left so by any exception: the connection may be mid-request
                    try:
                        self._check(name, key, counts, st, seq, poll, limit)
                    except MismatchError:
                        self._async_busy = False  # raised after the check's last request: between requests
                        raise
                    self._async_busy = False
                return fn(*a)

            plan.fn = checked
            return
        rt = comm._rt
        if getattr(rt, "_pending", 0):
            # async work queued before this call runs (and is checked) first, in issue order
            from .work import POSTING, launch_posted
            if POSTING:
                launch_posted()  # posted p2p first: that work may wait on it
            t0 = time.monotonic()
            if not rt.drain(limit):  # a call's own timeout bounds this wait too (a coalescing block's call)
                raise comm._not_issued(name, plan, limit, "the work issued before it on this communicator did not "
                                       "finish (its first-call check waits for it: issue order)")
            if not self._due(key) or not comm._usable:
                return
            if limit is not None:  # the rest of it for the check's wait in the store
                limit = max(limit - (time.monotonic() - t0), 0.001)
        self._check(name, key, counts, limit=limit)

    def first_fast(self, fk: tuple, s: Any, args: tuple, async_op: bool = False) -> bool:
        """A fast path's key ``fk`` missed: check the signature (a
        synchronous call), then remember ``fk``; True: the fast path goes on.
        False for an async call of a signature not known to have passed: the
        fast path hands it to the general method, which checks it right
        before its C call."""
        if async_op and s.name in _FIRST and self.comm._usable and self._due(self._key(s.name, args)):  # type: ignore[arg-type]
            return False
        self.first(s, args)
        if len(self.fast) < FAST_KEYS_MAX:  # past it (sizes without end), a new size costs a frame, no growth
            self.fast.add(fk)
        return True


FAST_KEYS_MAX = 4096


def signatures_for(comm: Any, bound: Optional[int] = None) -> Optional[Signatures]:
    """The first-call checks of a new communicator, up to ``bound``
    signatures (the agreed ``STREAMCOLL_SIGNATURE_CHECKS``; None: this
    process's environment); None: one rank, no store, or a bound of 0."""
    if comm._size < 2 or comm._store is None:
        return None
    if bound is None:
        from .env_vars import read_int
        bound = read_int("STREAMCOLL_SIGNATURE_CHECKS", SIGNATURE_BOUND, 0)
    return Signatures(comm, bound) if bound else None
