"""The mutation check: break the library one line at a time in a temporary
copy of the tree and run the tests that should notice; report every break
no test catches.

A test that passes while the feature it covers is broken is a defect (issue
28 found four by hand). This makes the hunt repeatable: each
:class:`Mutation` is a small textual edit (``old`` -> ``new``, each ``old``
occurring exactly once in its file, so a mutation that no longer applies is
reported, not skipped) and the pytest arguments that must fail with it.

The list has two parts:

- :data:`FIXED`: the breaks issue 28 found, and a few others of the same
  kind, each with the test that now catches it;
- :func:`derived`: one mutation of each kind per collective of the
  declaration table (:mod:`streamcoll.core.spec`), made from the planner's own
  source: a wrong reduction (the planner passes ``ReduceOp.MAX`` whatever
  it was given), a wrong root (``n - 1 - root``), a dropped post-op (the
  unpack or copy after the C call), a skipped keep-alive (the plan keeps no
  tensor). Their test is the fuzz case of the same collective, which checks
  every call against the declaration's reference.

``--ci`` runs the short list (``ci=True``, chosen to run in about two
minutes on the 2-core machine; ``tests/repo/test_mutation.py`` runs it in the
test command and requires every one caught); the default runs everything
(the benchmark tier). Worlds run one at a time: each mutation's pytest
runs alone, with ``-n 0``.

Usage: ``python scripts/mutation_check.py [--ci] [--list] [-k SUBSTRING] [--keep]``.
Exit status: 0 when every selected break was caught, 1 when one survived
(or no longer applies), 2 on a usage error.
"""
from __future__ import annotations

import argparse
import dataclasses
import inspect
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Dict, List, Optional, Sequence, Tuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclasses.dataclass(frozen=True)
class Mutation:
    """One break: ``edits`` are ``(path, old, new)``, applied together (a
    break of one behaviour may need the same line changed in the general
    and the generated fast path); ``tests`` the pytest arguments that must
    fail with it."""

    name: str
    edits: Tuple[Tuple[str, str, str], ...]
    tests: Tuple[str, ...]
    ci: bool = False
    why: str = ""


FUZZ = "tests/core/test_fuzz.py::test_fuzz_public_collectives"
COLLECTIVES = "tests/core/test_collectives.py"
# The value test of tests/core/test_collectives.py that covers each collective.
OWN_TEST: Dict[str, Tuple[str, ...]] = {
    "all_reduce": ("test_all_reduce_every_op_and_dtype",),
    "broadcast": ("test_broadcast_and_reduce",), "reduce": ("test_broadcast_and_reduce",),
    **{n: ("test_gathers_and_scatters",) for n in ("all_gather_into_tensor", "all_gather", "reduce_scatter_tensor",
                                                  "reduce_scatter", "gather", "scatter")},
    "all_to_all_single": ("test_all_to_all_even_uneven_lists",), "all_to_all": ("test_all_to_all_even_uneven_lists",),
}

# Tests that see a skipped keep-alive where the collective's value tests
# cannot. On the CPU the queued item holds the whole plan until the C call
# returned, outputs included: where ``keep`` holds nothing but the outputs
# (a scatter's receiving rank), dropping it changes no lifetime. ``keep`` is
# also what the flight record names (an async entry's tensors, a running
# synchronous call's), which a CPU test can read; run first (``-x``).
KEEP_TEST: Dict[str, Tuple[str, ...]] = {
    "scatter": ("tests/core/test_plan_keep.py::test_every_rank_s_flight_record_names_the_tensors_of_its_scatter",),
    "all_gather": ("tests/core/test_plan_keep.py::test_an_async_all_gather_keeps_a_temporary_input_alive",),
}

FIXED: List[Mutation] = [
    Mutation(
        "process_group._op always MAX",
        (("streamcoll/integrations/process_group.py", "    if op is None:\n        if opts is None or isinstance(opts, int):\n            return dist.ReduceOp.SUM\n",
          "    return dist.ReduceOp.MAX\n    if op is None:\n        if opts is None or isinstance(opts, int):\n            return dist.ReduceOp.SUM\n"),),
        ("tests/integrations/test_process_group.py::test_collectives_through_torch_distributed",),
        ci=True, why="issue 28 finding 1 (the PyTorch-suite subset: test_reduce_sum, test_get_future)"),
    Mutation(
        "process_group._op always MAX (against gloo)",
        (("streamcoll/integrations/process_group.py", "    if op is None:\n        if opts is None or isinstance(opts, int):\n            return dist.ReduceOp.SUM\n",
          "    return dist.ReduceOp.MAX\n    if op is None:\n        if opts is None or isinstance(opts, int):\n            return dist.ReduceOp.SUM\n"),),
        ("tests/integrations/test_process_group.py::test_reductions_match_gloo_and_numpy",)),
    Mutation(
        "process_group._op always MAX (PyTorch's suite)",
        (("streamcoll/integrations/process_group.py", "    if op is None:\n        if opts is None or isinstance(opts, int):\n            return dist.ReduceOp.SUM\n",
          "    return dist.ReduceOp.MAX\n    if op is None:\n        if opts is None or isinstance(opts, int):\n            return dist.ReduceOp.SUM\n"),),
        ("tests/integrations/test_torch_dist_suite.py::TestStreamcollDistBackend::test_reduce_sum",),
        why="issue 28 finding 1: torch's all_reduce tests compare no value; these do"),
    Mutation(
        "AVG computed as SUM (general and fast path)",
        (("streamcoll/core/plans.py", "return lambda: out.div_(n)", "return lambda: out.div_(1)"),
         ("streamcoll/core/launch.py", "{spec.recv or spec.send}.div_(_size)", "{spec.recv or spec.send}.div_(1)"),
         ("streamcoll/core/launch.py", "w{oi}.div_(_size)", "w{oi}.div_(1)"),
         ("streamcoll/core/launch.py", "w{oi}.mul_(_rsize)", "w{oi}.mul_(1)"),
         ("streamcoll/core/launch.py", "{out_b}.div_(_size)", "{out_b}.div_(1)")),
        ("tests/integrations/test_compile.py::test_compiled_step_aot_eager",),
        why="issue 28 finding 2 (compiled vs eager compared with a plain-torch reference)"),
    Mutation(
        "AVG computed as SUM, seen by the all_reduce value test",
        (("streamcoll/core/plans.py", "return lambda: out.div_(n)", "return lambda: out.div_(1)"),
         ("streamcoll/core/launch.py", "{spec.recv or spec.send}.div_(_size)", "{spec.recv or spec.send}.div_(1)"),
         ("streamcoll/core/launch.py", "w{oi}.div_(_size)", "w{oi}.div_(1)"),
         ("streamcoll/core/launch.py", "w{oi}.mul_(_rsize)", "w{oi}.mul_(1)"),
         ("streamcoll/core/launch.py", "{out_b}.div_(_size)", "{out_b}.div_(1)")),
        (COLLECTIVES + "::test_all_reduce_every_op_and_dtype[w2-sync]",), ci=True),
    Mutation(
        "float64 missing from the dtype table",
        (("streamcoll/core/backends.py", '    torch.float64: "Float64",\n', ""),),
        (FUZZ + "[broadcast]",), ci=True,
        why="issue 28 finding 3 (a fault-free call must go through)"),
    Mutation(
        "queued async call keeps no tensor",
        (("streamcoll/core/async_launch.py", "item = rt.submit(lane, self._execute_host, plan, e, here)",
          "item = rt.submit(lane, self._execute_host, Plan(plan.fn, plan.args, plan.post, (), (), plan.cname), e, here)"),),
        ("tests/core/test_streams.py::test_async_results_survive_dropped_tensors[w2]",), ci=True,
        why="issue 28 finding 4 (the Work dropped too; a weak reference to the tensor)"),
    Mutation(
        "async all_reduce issues nothing (returns success)",
        (("streamcoll/core/async_launch.py", "item = rt.submit(lane, self._execute_host, plan, e, here)",
          "item = rt.submit(lane, self._execute_host, Plan(lambda *a: 0, plan.args, plan.post, plan.keep, "
          "plan.outputs, plan.cname), e, here)"),),
        ("tests/core/test_streams.py::test_event_pool_does_not_grow_over_10k_calls",),
        why="issue 28 finding 5 (the event-pool test checked value > 0)"),
    Mutation(
        "generated fast paths issue nothing (report success)",
        (("streamcoll/core/launch.py", 'call = "_f(" + ", ".join(vals[r] for r in roles) + ")"', 'call = "0"'),),
        ("tests/core/test_validation.py::test_stream_on_the_cpu",), ci=True,
        why="issue 28 finding 5: one-rank value checks passed with a collective that does nothing"),
    Mutation(
        "single-host CCL_KVS_IFACE default deleted",
        (("streamcoll/startup/env_defaults.py", '            d["CCL_KVS_IFACE"] = "lo"\n', "            pass\n"),),
        ("tests/startup/test_rendezvous.py::test_torchrun_job_with_none_of_the_suites_variables",),
        why="issue 28: hidden by the suite's blanket CCL_KVS_IFACE=lo (a torchrun job with none of them)"),
    Mutation(
        "namespace probe forgets root",
        (("tests/netns.py", "    if os.geteuid() != 0:\n", "    if False:\n"),),
        ("tests/startup/test_topology.py::test_namespace_probe_names_what_is_missing",),
        why="issue 28 finding 5 (the probe's assert was always true)"),
]


def _planner_body(spec) -> Tuple[str, List[str], int]:
    """(repository-relative path, the lines of the planner after its ``def``, index of the first)."""
    path = inspect.getsourcefile(spec.planner)
    lines, start = inspect.getsourcelines(spec.planner)
    d = next(i for i, ln in enumerate(lines) if ln.lstrip().startswith("def "))
    return os.path.relpath(path, ROOT), lines[d + 1:], start + d


def _unique_line(text: str, line: str) -> bool:
    return text.count(line) == 1


def derived() -> List[Mutation]:
    """One break of each applicable kind per collective, from its declaration and planner."""
    sys.path.insert(0, ROOT)
    from streamcoll.core import spec as sp

    out: List[Mutation] = []
    for name, s in sp.TABLE.items():
        if s.planner.__name__ == "plan" or s.p2p:  # the shared p2p planner: covered by the fixed list
            continue
        path, body, _ = _planner_body(s)
        with open(os.path.join(ROOT, path)) as f:
            text = f.read()
        # the collective's own value test (both launch strategies: the planner
        # serves the general path, e.g. async_op=True), then its fuzz case
        test = (*(f"{COLLECTIVES}::{t}[w2-{m}]" for t in OWN_TEST.get(name, ()) for m in ("sync", "async")),
                f"{FUZZ}[{name}]") if name != "all_gather_coalesced" else (
            "tests/integrations/test_process_group.py::test_collectives_through_torch_distributed",)

        def first(pattern: str) -> Optional[str]:
            for ln in body:
                if re.search(pattern, ln) and _unique_line(text, ln):
                    return ln
            return None

        if s.reduces:
            ln = first(r'"op": op\b|, op\)')
            if ln is not None:
                new = ln.replace('"op": op', '"op": ReduceOp.MAX', 1) if '"op": op' in ln else \
                    ln.replace(", op)", ", ReduceOp.MAX)", 1)
                out.append(Mutation(f"{name}: wrong op (always MAX)", ((path, ln, new),), test))
        if s.root:
            r = s.root
            pat = rf'\(.*(?<!")\b{r}\b(?!")'  # the root passed as an argument (not assigned)
            ln = first(pat)
            if ln is not None:
                i = ln.index("(")
                new = ln[:i] + re.sub(rf'(?<!")\b{r}\b(?!")', f"(cx.size - 1 - {r} if type({r}) is int else {r})",
                                      ln[i:], count=1)
                out.append(Mutation(f"{name}: wrong root (n - 1 - {r})", ((path, ln, new),), test))
        ln = first(r"_unpack\(|, post, |\bpost\b.*=.*lambda")
        if ln is not None:
            if "_unpack(" in ln:
                new = re.sub(r"_unpack\([^()]*(\([^()]*\))?[^()]*\)", "None", ln, count=1)
            elif ", post, " in ln:
                new = ln.replace(", post, ", ", None, ", 1)
            else:
                new = re.sub(r"=.*", "= None", ln, count=1) if not ln.rstrip().endswith(":") else None
            if new and new != ln:
                out.append(Mutation(f"{name}: post-op dropped", ((path, ln, new),), test))
        ln = first(r"return (Plan|cx\.p2p_group)\(")
        if ln is not None:
            new = re.sub(r", \((?:[a-z_]+, )*\*?[a-z_.]+,?\)(, \(?tuple\(|, \(\w)", r", ()\1", ln, count=1)
            if new != ln:
                out.append(Mutation(f"{name}: keep-alive skipped (the plan keeps no tensor)", ((path, ln, new),),
                                    KEEP_TEST.get(name, ()) + test))
    return out


# Derived breaks on the short list: a root and a post-op (a wrong op: process_group._op above).
CI_DERIVED = frozenset({"broadcast: wrong root (n - 1 - src)",
                        "all_gather: post-op dropped"})


def everything() -> List[Mutation]:
    return FIXED + [dataclasses.replace(m, ci=m.name in CI_DERIVED) for m in derived()]


# ------------------------------------------------------------------ running
def _copy_tree(dst: str) -> None:
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, capture_output=True,
                           text=True, check=True).stdout.split("\n")
    for rel in filter(None, files):
        src = os.path.join(ROOT, rel)
        if not os.path.isfile(src):
            continue
        os.makedirs(os.path.dirname(os.path.join(dst, rel)), exist_ok=True)
        shutil.copy2(src, os.path.join(dst, rel))


def _apply(tree: str, m: Mutation) -> Dict[str, str]:
    """Apply ``m`` in ``tree``; the original texts by path. Raises ValueError
    where it no longer applies (nothing is left changed then)."""
    saved: Dict[str, str] = {}
    cur: Dict[str, str] = {}
    for path, old, new in m.edits:
        if path not in cur:
            with open(os.path.join(tree, path)) as f:
                saved[path] = cur[path] = f.read()
        n = cur[path].count(old)
        if n != 1:
            raise ValueError(f"{path}: the text to break occurs {n} times (expected once): {old.strip()[:80]!r}")
        cur[path] = cur[path].replace(old, new, 1)
    for path, text in cur.items():
        with open(os.path.join(tree, path), "w") as f:
            f.write(text)
    return saved


def _restore(tree: str, saved: Dict[str, str]) -> None:
    for path, text in saved.items():
        with open(os.path.join(tree, path), "w") as f:
            f.write(text)


def run(mutations: Sequence[Mutation], timeout: float = 600.0, keep: bool = False,
        out=sys.stdout) -> List[Tuple[Mutation, str, float]]:
    """Run each mutation's tests in one temporary copy, one at a time.
    Verdicts: ``caught`` (the tests failed), ``SURVIVED`` (they passed),
    ``STALE`` (the break no longer applies), ``TIMEOUT`` (counted as caught:
    the tests did not pass; said so)."""
    tree = tempfile.mkdtemp(prefix="streamcoll-mutation-")
    results: List[Tuple[Mutation, str, float]] = []
    try:
        _copy_tree(tree)
        env = dict(os.environ, PYTHONPATH=tree + os.pathsep + os.environ.get("PYTHONPATH", ""))
        env.pop("PYTEST_ADDOPTS", None)
        env.pop("PYTEST_XDIST_WORKER", None)
        for m in mutations:
            t0 = time.monotonic()
            try:
                saved = _apply(tree, m)
            except ValueError as e:
                results.append((m, f"STALE ({e})", 0.0))
                print(f"STALE     {m.name}: {e}", file=out, flush=True)
                continue
            try:
                p = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-n", "0", "-x", "-q",
                                    "-o", "addopts=", *m.tests], cwd=tree, env=env, capture_output=True, text=True,
                                   timeout=timeout)
                # pytest: 1 = tests failed; anything else (0 passed, 2-5 errors/usage/no tests) is not a catch
                verdict = "caught" if p.returncode == 1 else ("SURVIVED" if p.returncode == 0
                                                              else f"ERROR (pytest exit {p.returncode})")
                tail = "" if verdict == "caught" else "\n" + p.stdout[-1500:] + p.stderr[-1500:]
            except subprocess.TimeoutExpired:
                verdict, tail = "caught (by a timeout)", ""
            finally:
                _restore(tree, saved)
            dt = time.monotonic() - t0
            results.append((m, verdict, dt))
            print(f"{verdict:<9} {m.name}  [{' '.join(m.tests)}] {dt:.0f} s{tail}", file=out, flush=True)
    finally:
        if keep:
            print(f"tree kept: {tree}", file=out)
        else:
            shutil.rmtree(tree, ignore_errors=True)
    return results


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ci", action="store_true", help="only the short list the test command runs")
    ap.add_argument("--list", action="store_true", help="print the mutations and exit")
    ap.add_argument("-k", default="", help="only mutations whose name contains this")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per mutation's tests")
    ap.add_argument("--keep", action="store_true", help="keep the temporary tree")
    a = ap.parse_args(argv)
    ms = [m for m in everything() if (m.ci or not a.ci) and a.k in m.name]
    if a.list:
        for m in ms:
            print(f"{'ci ' if m.ci else '   '}{m.name}: {' '.join(m.tests)}")
            for path, old, new in m.edits:
                print(f"      {path}: {old.strip()[:90]!r} -> {new.strip()[:90]!r}")
        return 0
    res = run(ms, a.timeout, a.keep)
    bad = [(m, v) for m, v, _ in res if not v.startswith("caught")]
    print(f"{len(res) - len(bad)} of {len(res)} breaks caught", flush=True)
    for m, v in bad:
        print(f"not caught: {m.name} ({v})")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
