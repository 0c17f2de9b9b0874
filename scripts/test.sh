#!/usr/bin/env bash
# The test command: set-up (idempotent), then the whole suite.
# Extra arguments go to pytest (e.g. -k all_reduce, -m "not slow").
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# The benchmarks' MPI column is tested against real MPI (mpi4py + the MPICH
# wheel, a venv of 66 MB made in about 7 s; streamcoll itself never needs it).
# If it cannot be made, those tests skip and say why.
bash benchmarks/setup_mpi.sh >/dev/null || echo "[test] benchmarks/setup_mpi.sh failed: MPI column tests will skip" >&2
# The launchers tier (srun, mpiexec, Ray Train, Lightning, accelerate) runs in
# a venv of its own that sees the system's torch (.venv-launchers); a one-node
# SLURM is brought up by the tier itself (scripts/slurm_local.sh).
bash scripts/setup_launchers.sh >/dev/null || echo "[test] scripts/setup_launchers.sh failed: launchers tier will skip" >&2
PY="${PYTHON:-python3}"
# No networking variables: the tests run with the user's environment, and
# their ranks get what torchrun gives (tests/world.py); streamcoll's own
# defaults choose the interfaces. The test command is what CI runs: the ABI
# checks fail there instead of skipping (tests/binding/test_abi.py).
export STREAMCOLL_REQUIRE_ABI=1
# Two cores: multi-process worlds run one module at a time (xdist_group), the
# rest spreads over two pytest workers.
#
# Then the version matrix (scripts/matrix.sh: the declared Python x torch
# range, each pair in a venv of its own, made once per machine under
# $STREAMCOLL_HOME/matrix: 8.5 min here once they exist, about 7 min and
# 17 GB more to make them the first time; docs/versions.md). It runs for
# the full command (no arguments: what CI runs) unless STREAMCOLL_MATRIX=0,
# and for a run with pytest arguments only with STREAMCOLL_MATRIX=1. The
# exit status is pytest's where pytest failed, else the matrix's. pytest is
# no longer exec'd (the matrix runs after it): Ctrl-C still reaches pytest
# (the terminal's process group) and stops the script; a SIGTERM for this
# script's pid alone takes effect when the running step ends: signal the
# process group (kill -- -PGID), as CI's timeouts do.
matrix="${STREAMCOLL_MATRIX:-}"
case "$matrix" in
  0|1|"") ;;
  *) echo "[test] STREAMCOLL_MATRIX=$matrix: expected 0 (leave the version matrix out) or 1 (run it)" >&2; exit 2 ;;
esac
if [ -z "$matrix" ]; then matrix=$([ "$#" = 0 ] && echo 1 || echo 0); fi
[ "$matrix" = 0 ] && [ "$#" = 0 ] && echo "[test] the version matrix is NOT RUN (STREAMCOLL_MATRIX=0)" >&2
set +e
"$PY" -m pytest -n 2 --dist loadgroup "$@"
rc=$?
set -e
# Interrupted (2), killed by a signal (>128), a usage error (4): stop here.
if [ "$matrix" != 1 ] || [ "$rc" = 2 ] || [ "$rc" = 4 ] || [ "$rc" -gt 128 ]; then
  [ "$matrix" = 1 ] && echo "[test] pytest exited $rc: the version matrix was not run" >&2
  exit "$rc"
fi
set +e
bash scripts/matrix.sh
mrc=$?
set -e
[ "$rc" = 0 ] || { echo "[test] pytest exited $rc (the version matrix exited $mrc)" >&2; exit "$rc"; }
exit "$mrc"
