"""The version x feature table of scripts/matrix.sh's results (docs/versions.md).

    python scripts/matrix_table.py OUT_DIR PAIR...   (PAIR: 3.12:2.11.0)

Reads OUT_DIR/<pair>.xml (pytest's junit XML) and OUT_DIR/<pair>.info
(``python -m streamcoll info``) and prints a Markdown table: one row per
feature, one column per pair; a cell is "pass (n)" when every test of the
feature passed, "FAIL k/n" otherwise, with the skipped ones counted and
their reasons listed under the table. A feature with no test in a pair's
results reads "-" (a run cut short shows there).
"""
import os
import re
import sys
import xml.etree.ElementTree as ET
from typing import Callable, Dict, List, Tuple

# (feature, does a test id belong to it); a test may count for several.
FEATURES: List[Tuple[str, Callable[[str], bool]]] = [
    ("README's jobs (2 ranks, torchrun)", lambda t: "test_readme" in t),
    ("direct API (streamcoll.all_reduce, ...)", lambda t: "test_collectives" in t),
    ("process group (backend=\"streamcoll\", vs gloo)",
     lambda t: "test_process_group" in t and not re.search("ddp|fsdp", t)),
    ("DDP (vs gloo)", lambda t: "ddp" in t),
    ("torch.compile (streamcoll and torch ReduceOp)", lambda t: "test_compile" in t),
    ("FSDP2 (vs gloo)", lambda t: "fsdp" in t),
    ("DTensor, functional collectives (vs gloo)", lambda t: "dtensor" in t or "test_torch_integration" in t),
    ("profiler", lambda t: "test_profiling" in t),
    ("async Works (contract, vs gloo)", lambda t: "test_async_contract" in t),
    ("floor refusals (torch < 2.10)", lambda t: "test_torch_version" in t),
    ("GPU run's CPU side (cuda tests set up, gpu_check.sh --dry-run)",
     lambda t: "test_cuda" in t or "test_gpu_check" in t or "cuda" in t.split("::")[-1]),
]


def _results(path: str) -> Dict[str, Tuple[str, str]]:
    """test id -> (outcome, skip reason)."""
    out: Dict[str, Tuple[str, str]] = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        tid = f"{case.get('classname', '')}::{case.get('name', '')}"
        status, why = "pass", ""
        for child in case:
            if child.tag in ("failure", "error"):
                status = "fail"
            elif child.tag == "skipped" and status != "fail":
                status, why = "skip", (child.get("message") or "").strip()
        out[tid] = (status, why)
    return out


def _cell(res: Dict[str, Tuple[str, str]], member: Callable[[str], bool], notes: List[str]) -> str:
    mine = [v for t, v in res.items() if member(t)]
    if not mine:
        return "-"
    n = len(mine)
    bad = sum(s == "fail" for s, _ in mine)
    skipped = [w for s, w in mine if s == "skip"]
    ran = n - len(skipped)
    cell = f"FAIL {bad}/{ran}" if bad else (f"pass ({ran})" if ran else "not run")
    if skipped:
        for w in sorted(set(skipped)):
            if w not in notes:
                notes.append(w)
        cell += f", {len(skipped)} skipped [{', '.join(str(notes.index(w) + 1) for w in sorted(set(skipped)))}]"
    return cell


def _column(out_dir: str, pair: str) -> Tuple[str, str]:
    """(header, the info line) of a pair's column."""
    py, torch_v = pair.split(":")
    head = f"Python {py} + torch {torch_v}"
    info = ""
    path = os.path.join(out_dir, f"{pair}.info")
    if os.path.exists(path):
        with open(path) as f:
            text = f.read()
        m = re.search(r"^  python (\S+), .*torch (\S+)$", text, re.M)
        if m:
            head = f"Python {m.group(1)} + torch {m.group(2)}"
        m = re.search(r"^  against: nccl (\S+) loaded, declarations of (\S+) .*?: (.*)$", text, re.M)
        if m:
            warn = re.search(r"^  WARNING: nccl \S+ lacks (\d+) declared", text, re.M)
            info = f"NCCL {m.group(1)} vs {m.group(2)} declarations" + (
                f": WARNING, {warn.group(1)} functions missing" if warn else "")
        else:
            info = "FAIL (no 'against: nccl' line)"
    return head, info or "-"


def _dry_run(out_dir: str, pair: str) -> str:
    """scripts/gpu_check.sh --dry-run's outcome where the pair ran it."""
    path = os.path.join(out_dir, f"{pair}.gpu_check.result")
    if not os.path.exists(path):
        return ""
    with open(path) as f:
        ok = f.read().split()[-1] == "0"
    n = ""
    log = os.path.join(out_dir, f"{pair}.gpu_check.log")
    if os.path.exists(log):
        with open(log) as f:
            m = re.search(r"cuda tests collected: (\d+)", f.read())
        n = f", {m.group(1)} cuda tests collected" if m else ""
    return f"; gpu_check.sh --dry-run {'pass' if ok else 'FAIL'}{n}"


def main(argv: List[str]) -> int:
    out_dir, pairs = argv[0], argv[1:]
    cols = [_column(out_dir, p) for p in pairs]
    res = {}
    for p in pairs:
        path = os.path.join(out_dir, f"{p}.xml")
        res[p] = _results(path) if os.path.exists(path) else {}
    notes: List[str] = []
    print("| feature | " + " | ".join(h for h, _ in cols) + " |")
    print("| --- |" + " --- |" * len(cols))
    print("| `python -m streamcoll info` (torch's own NCCL) | " + " | ".join(i for _, i in cols) + " |")
    for name, member in FEATURES:
        cells = [_cell(res[p], member, notes) for p in pairs]
        if name.startswith("GPU run's CPU side"):
            cells = [c + _dry_run(out_dir, p) for c, p in zip(cells, pairs)]
        print(f"| {name} | " + " | ".join(cells) + " |")
    total = [f"{sum(s == 'pass' for s, _ in r.values())} passed, {sum(s == 'fail' for s, _ in r.values())} failed, "
             f"{sum(s == 'skip' for s, _ in r.values())} skipped" if r else "no results" for r in res.values()]
    print("| all selected tests | " + " | ".join(total) + " |")
    if notes:
        print()
        for i, w in enumerate(notes, 1):
            print(f"[{i}] {w}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
