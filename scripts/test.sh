#!/usr/bin/env bash
# The test command: set-up (idempotent), then the whole suite.
# Extra arguments go to pytest (e.g. -k all_reduce, -m "not slow").
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
PY="${PYTHON:-python3}"
export MASTER_ADDR=127.0.0.1 CCL_KVS_IFACE=lo NCCL_SOCKET_IFNAME=lo
# Two cores: multi-process worlds run one module at a time (xdist_group), the
# rest spreads over two pytest workers.
exec "$PY" -m pytest -n 2 --dist loadgroup "$@"
