"""The figures the README and docs/ show were measured on a quiet machine (issue 26):
the sweep refuses to write a plot into ``benchmarks/results/`` (the quoted
figures) when the load average it records says other processes had the
cores, and every image those pages embed carries, in the JSON beside it, a
load that the same rule accepts."""
from __future__ import annotations

import glob
import json
import os
import re

from streamcoll.bench.sweep import QUIET_LOAD, QUOTED_DIR, figure_refusal

from conftest import ROOT


def test_quoted_figures_need_a_quiet_machine(tmp_path):
    png = os.path.join(QUOTED_DIR, "sweep_2ranks_mpi.png")
    assert os.path.realpath(QUOTED_DIR) == os.path.realpath(os.path.join(ROOT, "benchmarks", "results"))
    why = figure_refusal(png, [7.61, 7.5, 8.56], [10.2, 8.21, 8.75], 2)
    assert "7.61 before the run" in why and f"at most {QUIET_LOAD:g}" in why, why
    # the ranks' own busy cores count after the run, outside load does not
    assert figure_refusal(png, [0.4, 0.3, 0.2], [1.9, 0.8, 0.4], 2) == ""
    assert "after the run" in figure_refusal(png, [0.4, 0.3, 0.2], [3.5, 1.0, 0.5], 2)
    assert "unknown" in figure_refusal(png, None, [1.0, 1.0, 1.0], 2)
    # anywhere else (bench-results/, a path of the user's) a plot is written whatever the load
    assert figure_refusal(str(tmp_path / "sweep.png"), [9.0, 9.0, 9.0], [9.0, 9.0, 9.0], 2) == ""
    assert figure_refusal(os.path.join(ROOT, "bench-results", "x.png"), [9.0] * 3, [9.0] * 3, 2) == ""


def test_readme_figures_were_made_on_a_quiet_machine():
    shown = []
    pages = ["README.md", os.path.join("benchmarks", "README.md")] + sorted(
        os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "docs", "*.md")))
    for readme in pages:
        with open(os.path.join(ROOT, readme)) as f:
            text = f.read()
        for img in re.findall(r"!\[[^\]]*\]\(([^)]+\.png)\)", text):
            png = os.path.normpath(os.path.join(ROOT, os.path.dirname(readme), img))
            shown.append(png)
            meta = os.path.splitext(png)[0] + ".json"
            assert os.path.exists(meta), f"{readme} shows {img} without the JSON of its run ({meta})"
            with open(meta) as f:
                m = json.load(f)["meta"]
            mach = m["machine"]
            why = figure_refusal(png, mach.get("loadavg_before"), mach.get("loadavg_after"), m["world_size"])
            assert not why, f"{readme} shows {img}, measured on a loaded machine: {why}"
    assert all(os.path.exists(p) for p in shown), shown
    assert shown, "no page shows a figure: the check checked nothing"
