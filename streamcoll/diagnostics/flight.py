"""Flight recorder: a bounded ring of each communicator's recent operations,
dumped as JSON (one file per rank) on a timeout or on request, and a command
that reads the dumps of all ranks and names the first operation where they
disagree or where some rank never arrived::

    python -m streamcoll.flight analyze DIR      # exit status 1 if it found a problem

The ring (:mod:`streamcoll.core.recorder`) is written by index on every
collective: the synchronous launch path reuses the
:class:`~streamcoll.core.recorder.FlightEntry` in ``ring[seq & mask]`` and
stores three fields (sequence number, op, p2p count): about 0.1 us. A
synchronous entry's state is derived
(:attr:`~streamcoll.core.recorder.FlightRecorder.done`); an asynchronous one
also carries times, tensor weak references, its state, the GPU completion
event and the error. The analysis aligns collectives across ranks by their
p2p counts and takes an unknown shape as matching anything.

Settings: ``STREAMCOLL_FLIGHT_SIZE`` (entries per communicator, rounded up to
a power of two; default 1024), ``STREAMCOLL_FLIGHT_DIR`` (where dumps go;
default: a private directory of this user, see
:func:`streamcoll.core.recorder.open_dump_dir`).

What each entry holds, and what recording costs: docs/design.md, section
'The flight recorder's ring'.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

from ..core import spec

__all__ = [
    "FlightRecorder", "FlightEntry", "attach", "dump", "default_dir", "load_dumps", "analyze", "Finding", "main",
]

from ..core.recorder import (  # noqa: F401  (re-exported: the ring, and the dump written next to it)
    COALESCED_P2P, COMPLETED, ENQUEUED, FAILED, FORMAT_VERSION, LAUNCHED, P2P_ENTRIES, P2P_GROUP, RUNNING,
    FlightEntry, FlightRecorder, capacity, attach, default_dir, dump, now_ns, open_dump_dir, snapshot,
    write_private, wref,
)

P2P_OPS = spec.p2p_ops()


# ---------------------------------------------------------------- analysis
def _behind_text(present: Dict[int, dict]) -> str:
    """"; on rank r it waited for its turn behind X..." for entries that
    never entered the library (the call to look at is X, not the peers)."""
    parts = [f"on rank {r} it had not entered the library: it waited for its turn behind {e['waiting_behind']}"
             for r, e in sorted(present.items()) if e.get("waiting_behind")]
    return ("; " + "; ".join(parts) + " (look at that call first)") if parts else ""


class Finding:
    """One problem found by :func:`analyze`."""

    def __init__(self, communicator: str, kind: str, collective_seq: Optional[int], seqs: Dict[int, int],
                 ranks: Sequence[int], message: str) -> None:
        self.communicator = communicator
        self.kind = kind  # "never_arrived", "mismatch", "stuck", "missing_dump", "hang_report"
        self.collective_seq = collective_seq
        self.seqs = dict(seqs)  # rank -> that rank's sequence number for it
        self.ranks = list(ranks)  # the ranks at fault
        self.message = message
        self.hang: Optional[dict] = None  # the hang report's alarm and lines, where a dump holds one

    @property
    def seq(self) -> Optional[int]:
        """The sequence number of the operation (the ranks' common one, else the lowest)."""
        vals = sorted(set(self.seqs.values()))
        return vals[0] if vals else self.collective_seq

    def as_dict(self) -> dict:
        return {"communicator": self.communicator, "kind": self.kind, "collective_seq": self.collective_seq,
                "seq": self.seq, "seqs": {str(k): v for k, v in self.seqs.items()}, "ranks": self.ranks,
                "message": self.message, "hang_report": self.hang}

    def __repr__(self) -> str:
        return f"Finding({self.kind}, seq={self.seq}, ranks={self.ranks})"


def load_dumps(paths: Sequence[str]) -> List[dict]:
    """Read flight dumps from files and/or directories: streamcoll's JSON
    (``*.json``) and torch's pickles (:mod:`streamcoll.diagnostics.fr_torch`: gloo's,
    NCCL's, streamcoll's own with ``TORCH_FR_DUMP_TEMP_FILE``)."""
    from . import fr_torch
    files: List[str] = []
    for p in paths:
        if os.path.isdir(p):
            files += sorted(os.path.join(p, f) for f in os.listdir(p)
                            if f.endswith(".json") or os.path.isfile(os.path.join(p, f)))
        else:
            files.append(p)
    out = []
    for f in files:
        if not f.endswith(".json"):  # torch's pickles (fr_trace's format), streamcoll's or gloo's/NCCL's
            t = fr_torch.load(f)
            if t is not None:
                out += fr_torch.from_torch(t, f)
                continue
            if os.path.isdir(os.path.dirname(f) or ".") and f not in paths:
                continue  # some other file in a dump directory
        with open(f) as fh:
            try:
                d = json.load(fh)
            except json.JSONDecodeError as e:
                raise ValueError(f"{f}: not a JSON flight dump ({e})") from None
        if d.get("format") != "streamcoll-flight":
            continue
        d["_file"] = f
        out.append(d)
    return out


def _fmt_call(e: dict) -> str:
    if e["shapes"] is None:
        return f"{e['op']}(shapes not recorded; {e['strategy']})"
    shapes = ", ".join("?" if s is None else "(" + ", ".join(map(str, s)) + ("," if len(s) == 1 else "") + ")"
                       for s in e["shapes"])
    dts = sorted({d for d in e["dtypes"] if d})
    return f"{e['op']}(shapes [{shapes}], {'/'.join(dts) or '?'}; {e['strategy']})"


def _same(a: dict, b: dict) -> List[str]:
    """How entries ``a`` and ``b`` differ (empty: they match; unknown shapes match anything)."""
    diffs = []
    if a["op"] != b["op"]:
        diffs.append("op")
        return diffs
    sa, sb = a["shapes"], b["shapes"]
    if sa is not None and sb is not None and len(sa) == len(sb):
        if any(x is not None and y is not None and x != y for x, y in zip(sa, sb)):
            diffs.append("shapes")
        if any(x is not None and y is not None and x != y for x, y in zip(a["dtypes"], b["dtypes"])):
            diffs.append("dtypes")
    return diffs


# Ops whose tensor shapes legitimately differ between ranks (roots hold lists,
# uneven splits): compared by op name only.
# Collectives whose shapes may differ between ranks (a root-only list, per-rank splits), from the table.
_SHAPE_FREE = frozenset([n for n, c in spec.TABLE.items()
                         if any(p.root_only or p.compare == "dtype" for p in c.params)] + ["coalesced"])


def _ranks(rs: Iterable[int]) -> str:
    rs = sorted(rs)
    return ("rank " if len(rs) == 1 else "ranks ") + ", ".join(map(str, rs))


def _analyze_group(name: str, dumps: List[dict]) -> List[Finding]:
    size = dumps[0]["size"]
    by_rank = {d["rank"]: d for d in dumps}
    findings: List[Finding] = []
    missing = sorted(set(range(size)) - set(by_rank))
    if missing:
        findings.append(Finding(name, "missing_dump", None, {}, missing,
                                f"communicator {name!r}: no dump from {_ranks(missing)} (of {size}); "
                                f"collect every rank's dump for a full analysis"))
    # Collectives by their collective sequence number (point-to-point ops excluded).
    colls: Dict[int, Dict[int, dict]] = {}
    last: Dict[int, int] = {}
    first: Dict[int, int] = {}
    for r, d in by_rank.items():
        m = {e["collective_seq"]: e for e in d["entries"] if e.get("collective_seq") is not None}
        colls[r] = m
        last[r] = d["issued"] - d.get("p2p_issued", 0)
        first[r] = min(m) if m else last[r] + 1
    if not by_rank:
        return findings
    # Compare where every rank still holds its record (rings are bounded).
    lo = max(first.values())
    hi = max(last.values())
    for k in range(lo, hi + 1):
        present = {r: colls[r][k] for r in by_rank if k in colls[r]}
        absent = [r for r in by_rank if k not in colls[r] and k > last[r]]
        seqs = {r: e["seq"] for r, e in present.items()}
        if absent and present:
            ref = next(iter(present.values()))
            states = sorted({e["state"] for e in present.values()})
            lasts = ", ".join(
                f"rank {r}: #{last[r]}" + (f" {colls[r][last[r]]['op']}" if last[r] in colls[r] else "")
                for r in absent)
            msg = (f"communicator {name!r}: first problem at sequence number {ref['seq']} "
                   f"(collective #{k}): {_ranks(absent)} never arrived (last issued: {lasts}); "
                   f"{_ranks(present)} called {_fmt_call(ref)}, state {'/'.join(states)}" + _behind_text(present))
            findings.append(Finding(name, "never_arrived", k, seqs, absent, msg))
            return findings
        if len(present) < 2:
            continue
        # Group ranks by what they called; the largest group is the reference.
        groups: List[Tuple[dict, List[int]]] = []
        for r, e in sorted(present.items()):
            for g in groups:
                ref = g[0]
                if ref["op"] == e["op"] and (e["op"] in _SHAPE_FREE or not _same(ref, e)):
                    g[1].append(r)
                    break
            else:
                groups.append((e, [r]))
        if len(groups) > 1:
            groups.sort(key=lambda g: (-len(g[1]), g[1]))
            ref, ref_ranks = groups[0]
            parts, odd, hows = [], [], []
            for e, rs in groups[1:]:
                for h in _same(ref, e):
                    if h not in hows:
                        hows.append(h)
                parts.append(f"{_ranks(rs)} called {_fmt_call(e)}")
                odd += rs
            msg = (f"communicator {name!r}: first problem at sequence number {min(seqs.values())} "
                   f"(collective #{k}): ranks disagree in {', '.join(hows)}: {_ranks(ref_ranks)} called "
                   f"{_fmt_call(ref)}; " + "; ".join(parts))
            findings.append(Finding(name, "mismatch", k, seqs, sorted(odd), msg))
            return findings
    # Everyone arrived everywhere: report an operation stuck on some ranks.
    for k in range(lo, hi + 1):
        present = {r: colls[r][k] for r in by_rank if k in colls[r]}
        stuck = [r for r, e in present.items() if e["state"] in (RUNNING, ENQUEUED, LAUNCHED)]
        if stuck and len(present) == len(by_rank):
            e = present[stuck[0]]
            if missing:
                why = (f"{_ranks(missing)} left no dump: it probably died or hung before or inside this "
                       f"operation")
            else:
                why = "every rank reached it: a rank may have died inside it, or the network failed"
            msg = (f"communicator {name!r}: first problem at sequence number {e['seq']} (collective #{k}): "
                   f"{_fmt_call(e)} did not complete on {_ranks(stuck)}; {why}"
                   + _behind_text({r: present[r] for r in stuck}))
            findings.append(Finding(name, "stuck", k, {r: x["seq"] for r, x in present.items()},
                                    missing or stuck, msg))
            return findings
    return findings


def analyze(dumps_or_paths: Sequence[Any]) -> List[Finding]:
    """Findings over the dumps (dicts, or files/directories to read), one
    per communicator at most (its first problem), plus missing-dump notes."""
    dumps = [d for d in dumps_or_paths if isinstance(d, dict)]
    paths = [p for p in dumps_or_paths if not isinstance(p, dict)]
    if paths:
        dumps += load_dumps([str(p) for p in paths])
    groups: Dict[Tuple[str, int], List[dict]] = {}
    for d in dumps:
        groups.setdefault((d["communicator"], d["size"]), []).append(d)
    findings: List[Finding] = []
    for (name, _), ds in sorted(groups.items()):
        # Several dumps of one rank (on request, then on timeout): the latest wins.
        latest: Dict[int, dict] = {}
        for d in ds:
            if d["rank"] not in latest or d["dumped_at"] >= latest[d["rank"]]["dumped_at"]:
                latest[d["rank"]] = d
        found = _analyze_group(name, list(latest.values()))
        _with_hang_report(name, list(latest.values()), found)
        findings += found
    return findings


def _with_hang_report(name: str, dumps: List[dict], found: List[Finding]) -> None:
    """Where a dump holds a hang report (:mod:`streamcoll.diagnostics.hang_report`, read by
    :func:`streamcoll.diagnostics.hang_answer.from_dumps`):
    its lines, with each rank's own answer (also one that came after the
    report), under the communicator's first problem (a finding of its own
    if the records show none)."""
    from .hang_answer import from_dumps
    got = from_dumps(dumps)
    if got is None:
        return
    alarm, lines = got
    main = next((f for f in found if f.kind != "missing_dump"), None)
    if main is None:
        main = Finding(name, "hang_report", alarm.get("collective_seq"), {}, [],
                       f"communicator {name!r}: rank {alarm.get('rank')} timed out in {alarm.get('op')} "
                       f"(sequence number {alarm.get('seq')})")
        found.append(main)
    main.message += "\n  " + "\n  ".join(lines)
    main.hang = {"alarm": alarm, "lines": lines}


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m streamcoll.flight",
                                description="Read streamcoll flight-recorder dumps.")
    sub = p.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("analyze", help="name the first operation where ranks disagree or some rank never arrived")
    a.add_argument("paths", nargs="+", help="dump files or directories holding them (one file per rank)")
    a.add_argument("--json", action="store_true", help="print the findings as JSON")
    s = sub.add_parser("show", help="print one dump's entries")
    s.add_argument("path")
    s.add_argument("--last", type=int, default=20)
    args = p.parse_args(argv)
    if args.cmd == "show":
        (d,) = load_dumps([args.path])
        print(f"{d['communicator']} rank {d['rank']} of {d['size']} ({d['backend']} on {d['device']}), "
              f"{d['issued']} issued, state {d['state']}" + (f": {d['failure']}" if d["failure"] else ""))
        for e in d["entries"][-args.last:]:
            print(f"  #{e['seq']:<6} {_fmt_call(e):60s} {e['state']}"
                  + (f" {e['duration_s'] * 1e6:.0f} us" if e.get("duration_s") is not None else ""))
        return 0
    dumps = load_dumps(args.paths)
    if not dumps:
        print(f"no streamcoll flight dumps in {', '.join(args.paths)}", file=sys.stderr)
        return 2
    findings = analyze(dumps)
    if args.json:
        print(json.dumps([f.as_dict() for f in findings], indent=1))
    else:
        comms = sorted({(d["communicator"], d["size"]) for d in dumps})
        for name, size in comms:
            ranks = sorted(d["rank"] for d in dumps if d["communicator"] == name and d["size"] == size)
            print(f"communicator {name!r}: {size} ranks, dumps from {_ranks(set(ranks))}")
        for f in findings:
            print(f.message)
        if not any(f.kind != "missing_dump" for f in findings):
            print("no disagreement found: every rank recorded the same operations")
    return 1 if any(f.kind != "missing_dump" for f in findings) else 0


if __name__ == "__main__":
    sys.exit(main())
