#!/usr/bin/env bash
# One-time (idempotent, quick when done) set-up of everything streamcoll's
# demo, tests and benchmarks need on a fresh Debian machine with Python 3.11:
#   - Debian's libfabric1 (oneCCL's transport)
#   - torch (2.13.0 where no torch is installed; an existing torch is kept)
#   - the Python packages (numpy, cffi, pytest, ..., NCCL's wheel for the
#     binding tests and its header, CUDA runtime headers for the ABI check)
#   - the oneCCL CPU runtime in $STREAMCOLL_HOME/oneccl (default
#     ~/.cache/streamcoll/oneccl), by `python -m streamcoll install-runtime`
#     (streamcoll/startup/install.py: the one implementation, which users run too)
#   - streamcoll itself, editable, so spawned ranks and torchrun import this
#     checkout as it is edited (with setuptools >= 70.1 or `wheel`: older
#     setuptools cannot build an editable install without `wheel`, and a
#     fresh venv has neither). This is the test set-up, not a user's install:
#     an editable install points into the checkout, and once the checkout is
#     moved or deleted every `import torch` in this environment fails ("Failed
#     to load the backend extension: streamcoll": the torch.backends entry
#     point's module is gone; way out: TORCH_DEVICE_BACKEND_AUTOLOAD=0, then
#     `pip uninstall streamcoll`). Users install the wheel or `pip install .`
#     (README, "Install").
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
ONECCL_VERSION=2022.2.0
NCCL_WHEEL="nvidia-nccl-cu12==2.32.3"
RT_HOME="${STREAMCOLL_HOME:-${XDG_CACHE_HOME:-$HOME/.cache}/streamcoll}"
RT="$RT_HOME/oneccl"
say() { echo "[setup] $*"; }

# 1. libfabric (apt)
if ! ldconfig -p 2>/dev/null | grep -q 'libfabric\.so\.1 '; then
  say "installing libfabric1 (apt)"
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq libfabric1 >/dev/null
fi

# 2. torch: keep an existing one; otherwise the 2.13.0 CPU build.
if ! "$PY" -c "import torch" 2>/dev/null; then
  say "installing torch==2.13.0"
  "$PY" -m pip install -q torch==2.13.0
fi

# 3. Python packages, only those missing.
need=()
"$PY" - <<'PYEOF' > /tmp/streamcoll-missing.$$ || true
import importlib.util, sys
mods = {"numpy": "numpy", "cffi": "cffi>=1.16", "pytest": "pytest", "xdist": "pytest-xdist",
        "pytest_timeout": "pytest-timeout", "hypothesis": "hypothesis", "matplotlib": "matplotlib",
        "mypy": "mypy",
        "expecttest": "expecttest"}  # torch.testing._internal.common_utils (the _DistTestBase tier)
missing = [pkg for mod, pkg in mods.items() if importlib.util.find_spec(mod) is None]
import os, site
paths = [p for p in sys.path if p and os.path.isdir(p)]
def has(rel): return any(os.path.exists(os.path.join(p, rel)) for p in paths)
if not has("nvidia/nccl/lib/libnccl.so.2"): missing.append("nvidia-nccl-cu12==2.32.3")
# CUDA headers for the ABI check of nccl.h (no CUDA toolkit needed): the
# runtime wheel's cuda_runtime.h needs crt/ (nvcc wheel) and <nv/target> (cccl).
if not has("nvidia/cuda_runtime/include/cuda_runtime.h"): missing.append("nvidia-cuda-runtime-cu12")
if not has("nvidia/cuda_nvcc/include/crt/host_config.h"): missing.append("nvidia-cuda-nvcc-cu12")
if not has("nvidia/cuda_cccl/include/nv/target"): missing.append("nvidia-cuda-cccl-cu12")
# The editable install below runs without build isolation: it needs
# setuptools >= 64 here, and `wheel` where setuptools is older than 70.1
# ("invalid command 'bdist_wheel'" otherwise; a fresh 3.11 venv has 65.5).
try:
    import setuptools
    st = tuple(int(x) for x in setuptools.__version__.split(".")[:2])
except Exception:
    st = (0, 0)
if st < (64, 0):
    missing.append("setuptools>=70.1")
elif st < (70, 1) and importlib.util.find_spec("wheel") is None:
    missing.append("wheel")
print(" ".join(missing))
PYEOF
read -r -a need < /tmp/streamcoll-missing.$$ || true
rm -f /tmp/streamcoll-missing.$$
if [ "${#need[@]}" -gt 0 ]; then
  say "pip install ${need[*]}"
  "$PY" -m pip install -q "${need[@]}"
fi

# 4. The oneCCL CPU runtime: the same command a user runs (from this checkout:
#    `python -m` imports ./streamcoll). It downloads only what is missing and
#    checks the result with a one-rank communicator.
if [ ! -f "$RT/.complete-$ONECCL_VERSION" ]; then
  say "python -m streamcoll install-runtime (into $RT)"
  "$PY" -m streamcoll install-runtime --home "$RT_HOME"
fi

# 5. streamcoll itself (editable).
here="$(pwd)"
# Re-installed also where the install predates setup.cfg's torch.backends entry
# point (it lives in the install's metadata, not in the checkout).
if ! (cd / && "$PY" -c "import streamcoll, os, sys; from importlib.metadata import entry_points; sys.exit(0 if os.path.samefile(os.path.dirname(streamcoll.__file__), sys.argv[1]) and any(e.name == 'streamcoll' for e in entry_points(group='torch.backends')) else 1)" "$here/streamcoll") 2>/dev/null; then
  say "pip install -e . (streamcoll, editable: this checkout's test set-up; moving or deleting the checkout breaks \`import torch\` here until \`pip uninstall streamcoll\`)"
  "$PY" -m pip install -q --no-deps --no-build-isolation -e .
fi
# 6. The resolver: torch names both ends of every TCPStore connection by a
#    reverse lookup of the peer's address, ::ffff:127.0.0.1 on one host, which
#    a stock /etc/hosts does not answer: the query goes to the DNS server, and
#    one that drops it (this workplace's: about 1 in 25) makes the connect, and
#    every request to that store meanwhile, wait glibc's 5 s retry. The tests
#    open hundreds of stores and connections: answered from /etc/hosts here
#    (streamcoll itself reuses its connections: streamcoll/core/checks.py).
if [ "$(getent hosts ::ffff:127.0.0.1 2>/dev/null | wc -l)" = 0 ] && ! grep -q '^::ffff:127\.0\.0\.1[[:space:]]' /etc/hosts 2>/dev/null; then
  if [ -w /etc/hosts ]; then
    say "adding '::ffff:127.0.0.1 localhost-v4mapped' to /etc/hosts (a reverse lookup of it otherwise asks the DNS server)"
    echo "::ffff:127.0.0.1 localhost-v4mapped" >> /etc/hosts
  else
    say "note: /etc/hosts does not name ::ffff:127.0.0.1 and is not writable: a dropped DNS query stalls a store connection 5 s"
  fi
fi
say "ready: oneCCL runtime $RT, python $("$PY" -c 'import sys; print(sys.version.split()[0])')"
