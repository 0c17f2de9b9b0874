"""cffi binding (ABI mode) to the CUDA runtime, ``libcudart.so.<major>``.

Declarations: ``streamcoll/_native/cudart.h`` (CUDA 13.0; 12.x has the same
text). Not a CUDA binding: torch owns devices, streams and memory. These are
the few calls streamcoll makes on threads of its own, and on its hot path,
where going through torch would cost more or is not offered:

- ``cudaThreadExchangeStreamCaptureMode``: streamcoll's helper threads
  (watchdog, reaper, future pollers) switch themselves to thread-local
  capture mode, so their event queries cannot invalidate a user's
  ``torch.cuda.graph`` capture in the default global mode (what PyTorch's
  NCCL watchdog does since pytorch/pytorch#148594); torch has no Python API
  for it.
- ``cudaEventCreateWithFlags``/``cudaEventRecord``/``cudaEventQuery``/
  ``cudaEventDestroy`` and ``cudaStreamIsCapturing``: the completion events
  of synchronous GPU collectives, about a microsecond through cffi where a
  ``torch.cuda.Event().record()`` costs several.

Library search order (the first that loads and whose
``cudaRuntimeGetVersion`` succeeds):

1. ``$STREAMCOLL_CUDART_LIBRARY``: a path to ``libcudart.so.<N>`` or its folder.
2. A ``libcudart.so.<N>`` already mapped into this process (torch's CUDA
   build loads the one it was built with): the same runtime as torch's.
3. Python wheels: ``nvidia/cu13/lib`` and ``nvidia/cuda_runtime/lib`` in each
   site-packages folder (``nvidia-cuda-runtime-cu12``/``-cu13``).
4. ``$CUDA_HOME/lib64``.
5. The system loader: ``libcudart.so.13``, then ``libcudart.so.12``.

The capture mode is per-thread state of the CUDA driver, so a runtime other
than torch's (found later in the order) still sets it for the thread.
"""
from __future__ import annotations

import glob
import os
from pathlib import Path
from typing import List, Optional, Tuple

from .errors import CudaError
from ._common import Binding, site_dirs

__all__ = ["CUDART", "binding", "EVENT_DISABLE_TIMING"]

# driver_types.h: #define cudaEventDisableTiming 0x02 (a macro: cffi's cdef
# and the ABI check cover enums and functions, so it lives here).
EVENT_DISABLE_TIMING = 0x02

_SONAMES = ("libcudart.so.13", "libcudart.so.12")


def _loaded_cudart() -> Optional[str]:
    """Path of a ``libcudart.so.<N>`` mapped into this process, if any."""
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                parts = line.split(maxsplit=5)
                if len(parts) == 6:
                    path = parts[5].strip()
                    base = os.path.basename(path)
                    if base.startswith("libcudart.so.") and base[len("libcudart.so."):].split(".")[0].isdigit():
                        return path
    except OSError:
        pass
    return None


class _Cudart(Binding):
    name = "cudart"
    soname = "libcudart.so.13"
    env_var = "STREAMCOLL_CUDART_LIBRARY"
    declarations = "cudart"
    declared_version = "13.0"
    install_hint = "pip install nvidia-cuda-runtime-cu12   (torch's CUDA build brings its own)"
    probe_symbol = "cudaRuntimeGetVersion"
    result_enum = "cudaError_t"
    error_string_symbol = "cudaGetErrorString"
    last_error_symbol = ""
    error_class = CudaError
    named_enums = ("enum cudaStreamCaptureMode", "enum cudaStreamCaptureStatus")
    min_versions = {"cudaThreadExchangeStreamCaptureMode": "10.1", "cudaStreamIsCapturing": "10.0"}

    def _env_candidates(self) -> List[Tuple[str, str]]:
        val = os.environ.get(self.env_var)
        if not val:
            return [(f"${self.env_var}", "")]
        if os.path.isdir(val):
            found = sorted(glob.glob(os.path.join(val, "libcudart.so.[0-9]*")))
            return [(f"${self.env_var}", found[0] if found else os.path.join(val, self.soname))]
        return [(f"${self.env_var}", val)]

    def candidates(self) -> List[Tuple[str, str]]:
        out = self._env_candidates()
        out.append(("already loaded in this process", _loaded_cudart() or ""))
        for d in site_dirs():
            for sub, so in (("cu13", "libcudart.so.13"), ("cuda_runtime", "libcudart.so.13"),
                            ("cuda_runtime", "libcudart.so.12")):
                p = d / "nvidia" / sub / "lib" / so
                if p.exists():
                    out.append((f"wheel {d} nvidia/{sub}", str(p)))
        root = os.environ.get("CUDA_HOME")
        if root:
            found = sorted(glob.glob(os.path.join(root, "lib64", "libcudart.so.[0-9]*")))
            out.append(("$CUDA_HOME/lib64", found[-1] if found else str(Path(root) / "lib64" / self.soname)))
        else:
            out.append(("$CUDA_HOME/lib64", ""))
        out += [("system loader", so) for so in _SONAMES]
        return out

    def _last_error(self, comm) -> str:
        return ""  # the runtime has no last-error text beyond the code's string

    @staticmethod
    def split_version(code: int) -> Tuple[int, int, int]:
        return code // 1000, code // 10 % 100, code % 10  # CUDART_VERSION: 1000*major + 10*minor


binding = CUDART = _Cudart()
