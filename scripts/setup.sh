#!/usr/bin/env bash
# One-time (idempotent, quick when done) set-up of everything streamcoll's
# demo, tests and benchmarks need on a fresh Debian machine with Python 3.11:
#   - Debian's libfabric1 (oneCCL's transport)
#   - torch (2.13.0 where no torch is installed; an existing torch is kept)
#   - the Python packages (numpy, cffi, pytest, ..., NCCL's wheel for the
#     binding tests and its header, CUDA runtime headers for the ABI check)
#   - the oneCCL CPU runtime, assembled from three wheels into
#     $STREAMCOLL_HOME/oneccl (default ~/.cache/streamcoll/oneccl):
#     libccl.so.1 from oneccl-cpu, libccl.so.2 + libccl_legacy_cpu.so from
#     oneccl, headers from oneccl-cpu-devel. (`pip install oneccl` fails: it
#     requires libfabric>=2.6, which PyPI does not have.)
#   - streamcoll itself, editable, so spawned ranks and torchrun import it.
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
print(" ".join(missing))
PYEOF
read -r -a need < /tmp/streamcoll-missing.$$ || true
rm -f /tmp/streamcoll-missing.$$
if [ "${#need[@]}" -gt 0 ]; then
  say "pip install ${need[*]}"
  "$PY" -m pip install -q "${need[@]}"
fi

# 4. The oneCCL CPU runtime.
if [ ! -f "$RT/.complete-$ONECCL_VERSION" ]; then
  say "assembling the oneCCL $ONECCL_VERSION CPU runtime in $RT"
  tmp="$(mktemp -d)"
  trap 'rm -rf "$tmp"' EXIT
  "$PY" -m pip download -q --no-deps -d "$tmp/w" \
      "oneccl==$ONECCL_VERSION" "oneccl-cpu==$ONECCL_VERSION" "oneccl-cpu-devel==$ONECCL_VERSION" \
      2> >(grep -v "is ignored: it is neither" >&2)
  "$PY" - "$tmp/w" "$RT" "$ONECCL_VERSION" <<'PYEOF'
import glob, os, shutil, sys, zipfile
src, rt, ver = sys.argv[1:]
pick = {
    "oneccl_cpu-": ["lib/libccl.so.1"],
    "oneccl-": ["lib/libccl.so.2", "lib/libccl_legacy_cpu.so"],
    "oneccl_cpu_devel-": ["include/"],
}
os.makedirs(os.path.join(rt, "lib"), exist_ok=True)
for whl in glob.glob(os.path.join(src, "*.whl")):
    base = os.path.basename(whl)
    for prefix, wanted in pick.items():
        if not base.startswith(prefix) or (prefix == "oneccl-" and base.startswith("oneccl_")):
            continue
        with zipfile.ZipFile(whl) as z:
            for name in z.namelist():
                if ".data/data/" not in name or name.endswith("/"):
                    continue
                rel = name.split(".data/data/", 1)[1]
                if any(rel == w or (w.endswith("/") and rel.startswith(w)) for w in wanted):
                    dest = os.path.join(rt, rel)
                    os.makedirs(os.path.dirname(dest), exist_ok=True)
                    with z.open(name) as f, open(dest, "wb") as g:
                        shutil.copyfileobj(f, g)
for need in ("lib/libccl.so.1", "lib/libccl.so.2", "lib/libccl_legacy_cpu.so", "include/oneapi/ccl.h"):
    if not os.path.exists(os.path.join(rt, need)):
        sys.exit(f"setup: {need} missing from the oneCCL wheels")
open(os.path.join(rt, f".complete-{ver}"), "w").write("ok\n")
PYEOF
fi

# 5. streamcoll itself (editable).
here="$(pwd)"
if ! (cd / && "$PY" -c "import streamcoll, os, sys; sys.exit(0 if os.path.samefile(os.path.dirname(streamcoll.__file__), sys.argv[1]) else 1)" "$here/streamcoll") 2>/dev/null; then
  say "pip install -e . (streamcoll)"
  "$PY" -m pip install -q --no-deps --no-build-isolation -e .
fi
say "ready: oneCCL runtime $RT, python $("$PY" -c 'import sys; print(sys.version.split()[0])')"
