#!/usr/bin/env bash
# The sweep on NPROC (default 2) local ranks, loopback only, on a free port.
# Arguments go to `python -m streamcoll.bench`, e.g.
#   bash benchmarks/sweep.sh --max-bytes 64M                 # -> bench-results/ (untracked)
#   bash benchmarks/sweep.sh --format nccl-tests --collectives all_reduce
#   NPROC=3 bash benchmarks/sweep.sh --collectives all_reduce
# Launcher: mpiexec when the MPI venv (benchmarks/setup_mpi.sh; default
# .venv-mpi, or $STREAMCOLL_MPI_VENV) exists, so the MPI column is measured;
# else torchrun. LAUNCHER=torchrun or LAUNCHER=mpiexec forces one
# (mpiexec runs setup_mpi.sh first).
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
NPROC="${NPROC:-2}"
V="${STREAMCOLL_MPI_VENV:-$PWD/.venv-mpi}"
LAUNCHER="${LAUNCHER:-$([ -x "$V/bin/mpiexec" ] && echo mpiexec || echo torchrun)}"
export MASTER_ADDR=127.0.0.1 CCL_KVS_IFACE=lo NCCL_SOCKET_IFNAME=lo GLOO_SOCKET_IFNAME=lo OMP_NUM_THREADS=1
PORT="$("$PY" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')"
case "$LAUNCHER" in
  mpiexec)
    VPY="$(bash benchmarks/setup_mpi.sh)"
    # Intel MPI pins each rank to one core by default: streamcoll.startup.env_defaults would then
    # see one usable core per rank and pick its oversubscribed settings.
    export MASTER_PORT="$PORT" I_MPI_PIN="${I_MPI_PIN:-off}"
    # hydra passes the whole environment to the ranks; -bind-to none: the
    # kernel places the ranks, as under torchrun.
    exec "$(dirname "$VPY")/mpiexec" -n "$NPROC" -bind-to none "$VPY" -m streamcoll.bench "$@" ;;
  torchrun)
    exec "$PY" -m torch.distributed.run --nproc-per-node "$NPROC" --master-addr 127.0.0.1 --master-port "$PORT" \
        -m streamcoll.bench "$@" ;;
  *) echo "sweep.sh: LAUNCHER must be mpiexec or torchrun, got $LAUNCHER" >&2; exit 2 ;;
esac
