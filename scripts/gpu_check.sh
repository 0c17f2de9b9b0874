#!/usr/bin/env bash
# The first GPU run, as one prepared script (issue 12).
#
#   bash scripts/gpu_check.sh --download        # here (package index): fetch what must travel into .whl/
#   bash scripts/gpu_check.sh --dry-run         # here (no GPU): download, check everything is present, print the plan
#   bash scripts/gpu_check.sh --out DIR         # on the GPU machine: install, cuda tests, overhead bench, summary
#
# The validation machine (one H200; Python 3.12, torch 2.11.0+cu130 with its
# nvidia-nccl-cu13, pytest, no cffi, no package index) lacks only cffi and
# its pycparser: they travel as cp312 manylinux wheels in .whl/ (ignored by
# git; the device tool's `carry` takes it) and are installed into a private
# target (/tmp/streamcoll-site), never into the machine's Python. Then:
#   1. python -m pytest -m cuda on the GPU tests only (one-rank NCCL
#      communicators: one GPU cannot host two NCCL ranks);
#   2. python -m streamcoll.bench.overhead --device cuda: streamcoll sync,
#      async+wait, the raw NCCL call through the same binding and
#      torch.distributed nccl in the same one-rank world, interleaved;
#   3. DIR/summary.txt: what passed and failed, and the overhead ratios;
#      DIR/cuda_tests.log, DIR/cuda_junit.xml, DIR/overhead_cuda.{txt,json}.
# Bounded: the tests get 300 s, the benchmark 120 s, so the whole run ends
# within 8 minutes.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT="$(pwd)"
PY="${PYTHON:-python3}"
WHL="$ROOT/.whl"
SITE="${STREAMCOLL_GPU_SITE:-/tmp/streamcoll-site}"
MODE=run
OUT=""
while [ $# -gt 0 ]; do
  case "$1" in
    --download) MODE=download ;;
    --dry-run) MODE=dry ;;
    --out) OUT="$2"; shift ;;
    --out=*) OUT="${1#--out=}" ;;
    -h|--help) sed -n '2,22p' "$0"; exit 0 ;;
    *) echo "gpu_check: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
  shift
done
say() { echo "[gpu_check] $*"; }
CUDA_TESTS=(tests/core/test_cuda.py tests/diagnostics/test_reliability.py tests/integrations/test_compile.py
            tests/integrations/test_process_group.py tests/startup/test_cross_job_cuda.py)
PYTEST_FLAGS=(-m cuda -p no:cacheprovider -q -rA)
# Per-test timeouts need pytest-timeout (the GPU machine's image has it; an
# unknown --timeout would make pytest exit 4 having run nothing). Without it,
# each file runs under its own `timeout` instead. Decided by asking pytest
# itself (PYTEST_ADDOPTS="-p no:timeout" shows the fallback here).
if "$PY" -m pytest --help -p no:cacheprovider 2>/dev/null | grep -c -- '--timeout=' >/dev/null; then  # not -q: SIGPIPE under pipefail
  TIMEOUT_PLUGIN=1
else
  TIMEOUT_PLUGIN=0
fi
# The pytest command lines of the run, one per line: the dry run collects
# exactly these (every plugin and flag), the run executes them.
pytest_runs() {
  if [ "$TIMEOUT_PLUGIN" = 1 ]; then
    echo "300|cuda_junit.xml|${PYTEST_FLAGS[*]} --timeout 120 ${CUDA_TESTS[*]}"
  else
    local f
    for f in "${CUDA_TESTS[@]}"; do
      echo "120|cuda_junit_$(basename "$f" .py).xml|${PYTEST_FLAGS[*]} $f"
    done
  fi
}

download() {
  mkdir -p "$WHL"
  local need=()
  ls "$WHL"/cffi-*cp312*manylinux*.whl >/dev/null 2>&1 || need+=("cffi>=1.16")
  ls "$WHL"/pycparser-*.whl >/dev/null 2>&1 || need+=("pycparser")
  [ ${#need[@]} -eq 0 ] && { say "wheels already in .whl/: $(cd "$WHL" && ls | tr '\n' ' ')"; return 0; }
  say "downloading ${need[*]} for cp312 manylinux into .whl/"
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
      -d "$WHL" "${need[@]}" 2> >(grep -v "is ignored: it is neither" >&2)
}

plan() {
  say "plan on the GPU machine:"
  say "  install .whl/*.whl into $SITE (PYTHONPATH=$SITE:$ROOT)"
  if [ "$TIMEOUT_PLUGIN" = 1 ]; then say "  pytest-timeout present: per-test timeouts (--timeout 120)"
  else say "  pytest-timeout absent: each test file under its own timeout"; fi
  while IFS='|' read -r secs junit args; do
    say "  timeout $secs python -m pytest $args --junitxml=OUT/$junit"
  done < <(pytest_runs)
  say "  timeout 120 python -m streamcoll.bench.overhead --device cuda --calls 2000 --reps 15 --profile"
  say "  write summary.txt, cuda_tests.log, cuda_junit.xml, overhead_cuda.txt/.json under --out"
}

if [ "$MODE" = download ]; then
  download; exit $?
fi

if [ "$MODE" = dry ]; then
  ok=1
  download || ok=0
  for f in "$WHL"/cffi-*cp312*manylinux*.whl "$WHL"/pycparser-*.whl; do
    [ -f "$f" ] || { say "MISSING: $f"; ok=0; }
  done
  "$PY" -c "import zipfile, glob, sys
for w in glob.glob('$WHL/*.whl'):
    zipfile.ZipFile(w).testzip()" || { say "MISSING: a readable wheel in .whl/"; ok=0; }
  for t in "${CUDA_TESTS[@]}" streamcoll/bench/overhead.py; do
    [ -f "$t" ] || { say "MISSING: $t"; ok=0; }
  done
  n=0
  while IFS='|' read -r secs junit args; do
    # shellcheck disable=SC2086  # the flags are words
    log="$("$PY" -m pytest $args --collect-only 2>&1)"; rc=$?
    [ "$rc" = 0 ] || { say "MISSING: pytest refused the run's flags (exit $rc): $args"; echo "$log" | tail -3; ok=0; }
    n=$(( n + $(echo "$log" | grep -c '::' || true) ))
  done < <(pytest_runs)
  say "cuda tests collected: $n"
  [ "${n:-0}" -ge 12 ] || { say "MISSING: at least 12 cuda tests"; ok=0; }
  "$PY" -m streamcoll.bench.overhead --help >/dev/null || { say "MISSING: streamcoll.bench.overhead"; ok=0; }
  plan
  if [ "$ok" = 1 ]; then say "dry run: everything the GPU run needs is present"; exit 0; fi
  say "dry run: something is missing (above)"; exit 1
fi

# ---- the run on the GPU machine
[ -n "$OUT" ] || { echo "gpu_check: --out DIR is required" >&2; exit 2; }
mkdir -p "$OUT"
t0=$(date +%s)
if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  say "no CUDA GPU here: nothing to run (use --dry-run to check the set-up)" | tee "$OUT/summary.txt"
  exit 1
fi
if ! "$PY" -c "import cffi" 2>/dev/null; then
  say "installing $(cd "$WHL" 2>/dev/null && ls *.whl | tr '\n' ' ')into $SITE"
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "$WHL"/*.whl \
    || { say "could not install the carried wheels" | tee "$OUT/summary.txt"; exit 1; }
fi
export PYTHONPATH="$SITE:$ROOT${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 NCCL_SOCKET_IFNAME=lo MASTER_ADDR=127.0.0.1
"$PY" -c "import torch, cffi, streamcoll; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'gpu', torch.cuda.get_device_name(0), 'cffi', cffi.__version__)" \
  2>&1 | tee "$OUT/summary.txt"
"$PY" -m streamcoll info > "$OUT/info.txt" 2>&1
say "cuda tests"
trc=0
: > "$OUT/cuda_tests.log"
while IFS='|' read -r secs junit args; do
  # shellcheck disable=SC2086
  timeout "$secs" "$PY" -m pytest $args --junitxml="$OUT/$junit" >> "$OUT/cuda_tests.log" 2>&1
  rc=$?; [ "$rc" = 0 ] || trc=$rc
done < <(pytest_runs)
say "overhead benchmark"
timeout 120 "$PY" -m streamcoll.bench.overhead --device cuda --calls 2000 --reps 15 --profile \
  --out "$OUT/overhead_cuda" > "$OUT/overhead_stdout.log" 2>&1
brc=$?
"$PY" - "$OUT" "$trc" "$brc" "$(( $(date +%s) - t0 ))" <<'PYEOF' | tee -a "$OUT/summary.txt"
import json, os, sys
import xml.etree.ElementTree as ET
out, trc, brc, secs = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
try:
    import glob
    reports = sorted(glob.glob(os.path.join(out, "cuda_junit*.xml")))
    if not reports:
        raise FileNotFoundError("no cuda_junit*.xml")
    cases = [c for f in reports for c in ET.parse(f).getroot().iter("testcase")]
    res = {"passed": [], "failed": [], "skipped": []}
    for c in cases:
        name = f"{c.get('classname')}::{c.get('name')}"
        if c.find("failure") is not None or c.find("error") is not None:
            res["failed"].append(name)
        elif c.find("skipped") is not None:
            res["skipped"].append(name)
        else:
            res["passed"].append(name)
    print(f"cuda tests: {len(res['passed'])} passed, {len(res['failed'])} failed, {len(res['skipped'])} skipped "
          f"(pytest exit {trc})")
    for k in ("failed", "skipped"):
        for n in res[k]:
            print(f"  {k.upper()}: {n}")
except Exception as e:
    print(f"cuda tests: no junit report ({e}); pytest exit {trc}; see cuda_tests.log")
try:
    rec = json.load(open(os.path.join(out, "overhead_cuda.json")))
    for k, r in rec["results"].items():
        print(f"  {r['label']:58s} {r['time_us']['median']:9.2f} us  x raw {r['ratio_to_raw']:.2f}")
    for k, v in rec["ratios"].items():
        print(f"overhead {k}: " + ", ".join(f"{a} {b:.2f}" for a, b in v.items()))
except Exception as e:
    print(f"overhead benchmark: no result ({e}); exit {brc}; see overhead_stdout.log")
print(f"total {secs} s")
PYEOF
[ "$trc" = 0 ] && [ "$brc" = 0 ]
