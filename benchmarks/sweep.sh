#!/usr/bin/env bash
# The sweep on NPROC (default 2) local ranks under torchrun, loopback only,
# on a free port. Arguments go to `python -m streamcoll.bench`, e.g.
#   bash benchmarks/sweep.sh --max-bytes 64M --out benchmarks/results/sweep_2ranks
#   NPROC=3 bash benchmarks/sweep.sh --collectives all_reduce
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
NPROC="${NPROC:-2}"
export MASTER_ADDR=127.0.0.1 CCL_KVS_IFACE=lo NCCL_SOCKET_IFNAME=lo GLOO_SOCKET_IFNAME=lo OMP_NUM_THREADS=1
PORT="$("$PY" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')"
exec "$PY" -m torch.distributed.run --nproc-per-node "$NPROC" --master-addr 127.0.0.1 --master-port "$PORT" \
    -m streamcoll.bench "$@"
