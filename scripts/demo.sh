#!/usr/bin/env bash
# The main job: a custom training loop averaging gradients with streamcoll
# (bucketed, async, overlapping backward) on 2 CPU ranks under torchrun, then
# checked against the same loop with torch.distributed (gloo).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
PY="${PYTHON:-python3}"
export MASTER_ADDR=127.0.0.1 CCL_KVS_IFACE=lo NCCL_SOCKET_IFNAME=lo OMP_NUM_THREADS=1
PORT="$("$PY" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')"
exec "$PY" -m torch.distributed.run --nproc-per-node 2 --master-addr 127.0.0.1 --master-port "$PORT" \
    examples/train.py "$@"
