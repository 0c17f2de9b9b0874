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
# checks fail there instead of skipping (tests/test_abi.py).
export STREAMCOLL_REQUIRE_ABI=1
# Two cores: multi-process worlds run one module at a time (xdist_group), the
# rest spreads over two pytest workers.
exec "$PY" -m pytest -n 2 --dist loadgroup "$@"
