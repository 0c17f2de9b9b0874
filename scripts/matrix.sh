#!/usr/bin/env bash
# The version matrix tier (issue 43): the Python x torch pairs streamcoll
# declares (setup.cfg, README "Install", docs/versions.md), each in a venv
# made from the package index, with streamcoll installed into it the way a
# user installs it (the wheel built from this checkout), then a selection of
# the suite run there against that install, from a copy of tests/ outside
# the checkout (so the checkout's streamcoll/ is not on sys.path).
#
#   scripts/matrix.sh             make missing venvs, then run the tier
#   scripts/matrix.sh --make      only make the missing venvs
#   scripts/matrix.sh --list      print the pairs and their venvs
#
# Pairs (python:torch): the floor (the oldest torch that passes, with the
# oldest Python it supports), the GPU machine's pair (Python 3.12, torch
# 2.11: scripts/gpu_check.sh runs there), the newest torch this machine's pip
# allows with the newest Python. The main suite covers 3.11 + 2.13.
#
# Venvs: ${STREAMCOLL_HOME:-~/.cache/streamcoll}/matrix/<py>-torch<ver>, made
# once per machine and reused: a venv counts only when its marker
# (.streamcoll-matrix-complete, written last) is there; one without it (an
# interrupted make) is deleted and made again. PyPI serves torch's CUDA builds
# for these Pythons: 4.6-4.9 GB and about 1-1.5 min per venv.
#
# No silent passes: a venv that cannot be made (no network, no such Python)
# fails the tier. STREAMCOLL_MATRIX_SKIP_UNAVAILABLE=1 turns that into a loud
# "SKIPPED" line per pair (exit status still 0 for those pairs);
# STREAMCOLL_MATRIX=0 leaves the whole tier out (scripts/test.sh says so).
# STREAMCOLL_MATRIX_PAIRS="3.12:2.11.0" runs a subset.
set -uo pipefail
cd "$(dirname "$0")/.."
REPO="$(pwd)"
PAIRS="${STREAMCOLL_MATRIX_PAIRS:-3.10:2.10.0 3.12:2.11.0 3.13:2.14.1}"
HOME_DIR="${STREAMCOLL_HOME:-${XDG_CACHE_HOME:-$HOME/.cache}/streamcoll}"
MATRIX="$HOME_DIR/matrix"
MARKER=".streamcoll-matrix-complete"
# What the selected tests import besides torch and streamcoll's own
# requirements (numpy, cffi: installed with the wheel).
TEST_DEPS=(pytest pytest-timeout hypothesis expecttest)
PER_PAIR_TIMEOUT="${STREAMCOLL_MATRIX_TIMEOUT:-600}"
say() { echo "[matrix] $*"; }

find_python() {  # $1 = 3.12 -> an interpreter of that version, or nothing
  local v="$1" c
  for c in "python$v" "${PYENV_ROOT:-$HOME/.pyenv}"/versions/"$v".*/bin/python"$v" /usr/bin/python"$v" /usr/local/bin/python"$v"; do
    if command -v "$c" >/dev/null 2>&1 && "$c" -c 'import sys, venv' >/dev/null 2>&1; then
      command -v "$c"; return 0
    fi
  done
  return 1
}

venv_of() { echo "$MATRIX/${1%%:*}-torch${1##*:}"; }

make_venv() {  # $1 = py:torch; 0 when the venv is complete afterwards
  local pair="$1" py="${1%%:*}" torch="${1##*:}" dir base t0
  dir="$(venv_of "$pair")"
  [ -f "$dir/$MARKER" ] && return 0
  base="$(find_python "$py")" || { say "$pair: no Python $py found (PATH, \$PYENV_ROOT/versions)"; return 1; }
  rm -rf "$dir"
  mkdir -p "$MATRIX"
  t0=$SECONDS
  say "$pair: making $dir (torch==$torch from the package index: several GB, about 1-2 min)"
  local log="$dir.make.log"
  # --no-cache-dir: the venv is the cache (the wheel would be a second copy).
  if ! { "$base" -m venv "$dir" &&
         "$dir/bin/python" -m pip install -q --no-cache-dir --upgrade pip &&
         "$dir/bin/python" -m pip install -q --no-cache-dir "torch==$torch" numpy "cffi>=1.16" "${TEST_DEPS[@]}" &&
         "$dir/bin/python" -c "import torch, sys; assert torch.__version__.split('+')[0] == sys.argv[1], torch.__version__" "$torch"
       } >"$log" 2>&1; then
    grep -v "^WARNING: Location" "$log" | tail -15 >&2
    say "$pair: making the venv failed (log $log)"
    return 1
  fi
  date -u +%FT%TZ > "$dir/$MARKER"
  say "$pair: made in $((SECONDS - t0)) s, $(du -sh "$dir" | cut -f1)"
}

# What each pair runs (from a copy of tests/, against the installed wheel),
# chosen to catch what breaks between torch releases: the README's jobs, the
# direct API, torch.distributed's process group (DDP, FSDP2, DTensor,
# functional collectives: values compared with gloo's in the same venv),
# torch.compile with both op spellings, the profiler, the async Work
# contract, and the floor's refusals. scripts/matrix_table.py maps the tests
# to the features of docs/versions.md's table.
SELECTION=(
  tests/repo/test_readme.py::test_the_readme_has_its_snippets
  "tests/repo/test_readme.py::test_readme_snippet_runs_on_two_ranks[README.md-0]"
  "tests/repo/test_readme.py::test_readme_snippet_runs_on_two_ranks[README.md-1]"
  tests/core/test_collectives.py tests/integrations/test_process_group.py
  tests/integrations/test_torch_integration.py tests/integrations/test_compile.py
  tests/integrations/test_profiling.py tests/core/test_async_contract.py
  # the floor's refusals: the first part of test_torch_version.py (its second,
  # the review of the version mechanisms, is the main suite's)
  tests/integrations/test_torch_version.py::test_release_of_torch_version_strings
  tests/integrations/test_torch_version.py::test_the_running_torch_is_supported
  tests/integrations/test_torch_version.py::test_below_the_floor_the_error_names_both_releases
  tests/integrations/test_torch_version.py::test_the_floor_is_setup_cfgs_and_the_readmes
  tests/integrations/test_torch_version.py::test_process_group_refuses_an_older_torch
  tests/integrations/test_torch_version.py::test_compile_refuses_an_older_torch
)
# The GPU machine's pair also runs the CPU side of its GPU run: the cuda
# tests of test_cuda.py set up (they skip without a GPU), and
# scripts/gpu_check.sh's dry run with this venv's python from a copy of the
# checkout, as the GPU machine runs it (streamcoll from the checkout; it
# collects every cuda test of the run's files and checks what must travel:
# it downloads the cffi/pycparser wheels for cp312 into the copy's .whl/
# unless this checkout has them).
GPU_PAIR="3.12:2.11.0"
GPU_EXTRA=(tests/core/test_cuda.py)

# --------------------------------------------------------------- main
main() {
  local mode="run" pair
  case "${1:-}" in
    --make) mode="make" ;;
    --list) for pair in $PAIRS; do echo "$pair $(venv_of "$pair")"; done; return 0 ;;
    "") ;;
    *) echo "usage: scripts/matrix.sh [--make|--list]" >&2; return 2 ;;
  esac
  local t_all=$SECONDS failed=0 ready=() skipped=()
  for pair in $PAIRS; do
    if make_venv "$pair"; then
      ready+=("$pair")
    elif [ "${STREAMCOLL_MATRIX_SKIP_UNAVAILABLE:-0}" = 1 ]; then
      say "SKIPPED $pair: its venv could not be made (STREAMCOLL_MATRIX_SKIP_UNAVAILABLE=1); NOT TESTED"
      skipped+=("$pair")
    else
      say "FAILED $pair: its venv could not be made (network? STREAMCOLL_MATRIX_SKIP_UNAVAILABLE=1 skips it, loudly)"
      failed=1
    fi
  done
  [ "$mode" = make ] && return $failed
  [ "${#ready[@]}" -gt 0 ] || { say "no venv to run"; return 1; }

  # The checkout as a fresh clone has it (tracked and new files, nothing
  # ignored): the wheel is built from it, and the tests run from it with
  # streamcoll/ removed, so they import the installed wheel.
  local stage
  stage="$(mktemp -d "${TMPDIR:-/tmp}/streamcoll-matrix.XXXXXX")"
  local out="${STREAMCOLL_MATRIX_OUT:-$stage/out}"
  mkdir -p "$stage/src" "$stage/checkout" "$stage/dist" "$out"
  git ls-files -co --exclude-standard -z | tar --null -T - -cf - | tar -xf - -C "$stage/checkout" || return 1
  [ -d .whl ] && cp -r .whl "$stage/checkout/"
  cp -a "$stage/checkout/." "$stage/src/"
  # Built offline by the machine's Python (scripts/setup.sh gave it a
  # setuptools that builds it): the same wheel goes into every venv.
  local builder="${PYTHON:-python3}"
  if ! (cd "$stage/src" && "$builder" -m pip wheel -q --no-deps --no-build-isolation -w "$stage/dist" .) >"$out/wheel.log" 2>&1; then
    say "FAILED: building the wheel ($out/wheel.log)"; cat "$out/wheel.log" >&2; return 1
  fi
  local wheel
  wheel="$(ls "$stage/dist"/streamcoll-*.whl)"
  say "wheel: $(basename "$wheel")"
  rm -rf "$stage/src/streamcoll" "$stage/src/streamcoll_autoload.py" "$stage/src/build"

  for pair in "${ready[@]}"; do
    run_pair "$pair" "$wheel" "$stage/src" "$out" || failed=1
  done
  "$builder" "$REPO/scripts/matrix_table.py" "$out" ${ready[@]+"${ready[@]}"} | tee "$out/table.md"
  [ "${#skipped[@]}" = 0 ] || say "NOT TESTED (venv unavailable, skipped on request): ${skipped[*]}"
  say "total $((SECONDS - t_all)) s; results in $out"
  [ -n "${STREAMCOLL_MATRIX_OUT:-}" ] || [ $failed = 1 ] || rm -rf "$stage"
  return $failed
}

run_pair() {  # $1 pair, $2 wheel, $3 tests' folder, $4 results folder
  local pair="$1" wheel="$2" src="$3" out="$4" dir py t0 rc=0 sel
  dir="$(venv_of "$pair")"; py="$dir/bin/python"; t0=$SECONDS
  local log="$out/$pair.log"
  : >"$log"
  # A user's install: the wheel into the venv (its dependencies are there:
  # pip check says so without the network), then the runtime where missing.
  "$py" -m pip install -q --no-deps --force-reinstall "$wheel" >>"$log" 2>&1 &&
    "$py" -m pip check >>"$log" 2>&1 || { say "FAILED $pair: installing the wheel ($log)"; tail -20 "$log" >&2; return 1; }
  if [ ! -f "$HOME_DIR/oneccl/.complete-2022.2.0" ]; then
    say "$pair: python -m streamcoll install-runtime (no runtime in $HOME_DIR/oneccl)"
    (cd "$src" && "$py" -m streamcoll install-runtime --home "$HOME_DIR") >>"$log" 2>&1 ||
      { say "FAILED $pair: install-runtime ($log)"; tail -20 "$log" >&2; return 1; }
  fi
  # info: which NCCL (torch's own) against which declarations.
  (cd "$src" && env -u PYTHONPATH "$py" -m streamcoll info) >"$out/$pair.info" 2>&1 || rc=1
  grep -q "^  against: nccl .* loaded, declarations of" "$out/$pair.info" || rc=1
  echo "info ${rc}" >"$out/$pair.info.result"
  sel=("${SELECTION[@]}")
  [ "$pair" = "$GPU_PAIR" ] && sel+=("${GPU_EXTRA[@]}")
  say "$pair: $(grep -m1 "^  python" "$out/$pair.info" | sed 's/^ *//'); $(grep -m1 "^  against: nccl" "$out/$pair.info" | sed 's/^ *//')"
  # The user's shell with the venv active; nothing of this checkout on the path.
  (cd "$src" && env -u PYTHONPATH -u VIRTUAL_ENV PATH="$dir/bin:$PATH" STREAMCOLL_REQUIRE_ABI=0 OMP_NUM_THREADS=1 \
     timeout --kill-after=30 "$PER_PAIR_TIMEOUT" "$py" -m pytest -p no:cacheprovider -p no:xdist -q \
     --timeout 300 -rfEs --junitxml="$out/$pair.xml" "${sel[@]}") >>"$log" 2>&1 || rc=1
  if [ "$pair" = "$GPU_PAIR" ]; then
    local g=0
    (cd "$src/../checkout" && env -u PYTHONPATH PATH="$dir/bin:$PATH" PYTHON="$py" \
       timeout 300 bash scripts/gpu_check.sh --dry-run) >"$out/$pair.gpu_check.log" 2>&1 || g=1
    echo "gpu_check_dry_run $g" >"$out/$pair.gpu_check.result"
    say "$pair: scripts/gpu_check.sh --dry-run: $([ $g = 0 ] && echo ok || echo FAILED), $(grep -o 'cuda tests collected: [0-9]*' "$out/$pair.gpu_check.log")"
    [ $g = 0 ] || { rc=1; tail -15 "$out/$pair.gpu_check.log" >&2; }
  fi
  say "$pair: $(tail -1 "$log" | sed 's/=//g;s/^ *//') ($((SECONDS - t0)) s, log $log)"
  [ $rc = 0 ] || { grep -E "^(FAILED|ERROR)" "$log" | head -20 >&2; say "FAILED $pair"; }
  return $rc
}

if [ "${BASH_SOURCE[0]}" = "$0" ]; then
  main "$@"
fi
