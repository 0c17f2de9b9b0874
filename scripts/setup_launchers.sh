#!/usr/bin/env bash
# The launchers tier's own set-up (tests/startup/test_launchers.py): a venv that sees
# the system's packages (torch, streamcoll's dependencies: torch is not
# replaced) and adds the frameworks the tier starts jobs with. They are test
# dependencies, never the library's. Idempotent; prints the venv's python on
# its last line.
#   bash scripts/setup_launchers.sh          # -> .venv-launchers/bin/python
#   STREAMCOLL_LAUNCHERS_VENV=/somewhere bash scripts/setup_launchers.sh
# - ray[train]: Ray Train's TorchTrainer (2.60's Train V2 needs
#   RAY_TRAIN_V2_ENABLED=1; the tests set it);
# - lightning: Trainer with DDPStrategy(process_group_backend="streamcoll");
# - accelerate: what a CPU user can do (docs/integration.md, "Frameworks");
# - mpi4py + mpich: mpiexec (MPICH's hydra) and the mpi4py rendezvous.
# streamcoll itself is installed into the venv without dependencies (a
# regular install, not editable): its torch.backends entry point, which makes
# backend="streamcoll" known in processes that never import streamcoll (Ray's
# workers), lives in the install's metadata; the tests put the checkout first
# on PYTHONPATH, so the code that runs is the checkout's.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
V="${STREAMCOLL_LAUNCHERS_VENV:-$PWD/.venv-launchers}"
PKGS=("ray[train]==2.60.0" "lightning==2.6.6" "accelerate==1.15.0" mpi4py mpich)
if [ ! -x "$V/bin/python" ]; then
  echo "[setup_launchers] creating $V" >&2
  "$PY" -m venv --system-site-packages "$V"
fi
if ! "$V/bin/python" -c "import ray.train.torch, lightning, accelerate, mpi4py" 2>/dev/null \
    || [ ! -x "$V/bin/mpiexec" ]; then
  echo "[setup_launchers] pip install ${PKGS[*]}" >&2
  "$V/bin/python" -m pip install -q "${PKGS[@]}" >&2
fi
# The entry point: a fresh regular install of this checkout whenever the
# installed one lacks it or is older than the checkout's setup.cfg.
if ! "$V/bin/python" - "$PWD/setup.cfg" <<'PYEOF' 2>/dev/null
import sys, os
from importlib import metadata
d = metadata.distribution("streamcoll")
eps = [e for e in d.entry_points if e.group == "torch.backends" and e.name == "streamcoll"]
files = [f for f in (d.files or []) if f.name == "entry_points.txt"]
stamp = os.path.getmtime(d.locate_file(files[0])) if files else 0
sys.exit(0 if eps and str(d.locate_file("")).startswith(sys.prefix) and stamp >= os.path.getmtime(sys.argv[1]) else 1)
PYEOF
then
  echo "[setup_launchers] pip install --no-deps $PWD (the torch.backends entry point)" >&2
  "$V/bin/python" -m pip install -q --no-deps --force-reinstall "$PWD" >&2
fi
echo "$V/bin/python"
