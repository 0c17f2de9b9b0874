#!/usr/bin/env bash
# The MPI column's own set-up (streamcoll itself never needs MPI): a venv
# that sees the system's packages (torch, streamcoll's dependencies) and adds
# mpi4py with the MPICH wheel from the package index. Idempotent; prints the
# venv's python on its last line.
#   bash benchmarks/setup_mpi.sh            # -> .venv-mpi/bin/python
#   STREAMCOLL_MPI_VENV=/somewhere bash benchmarks/setup_mpi.sh
# Why a venv: `pip install --target` puts MPICH's libraries one folder above
# the target, where mpi4py does not look for them; the wheels need a prefix.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
V="${STREAMCOLL_MPI_VENV:-$PWD/.venv-mpi}"
MPI_PKGS=(mpi4py mpich)
if [ ! -x "$V/bin/python" ]; then
  echo "[setup_mpi] creating $V" >&2
  "$PY" -m venv --system-site-packages "$V"
fi
if ! "$V/bin/python" -c "import mpi4py" 2>/dev/null || [ ! -x "$V/bin/mpiexec" ]; then
  echo "[setup_mpi] pip install ${MPI_PKGS[*]}" >&2
  "$V/bin/python" -m pip install -q "${MPI_PKGS[@]}" >&2
fi
echo "$V/bin/python"
