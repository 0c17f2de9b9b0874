"""cffi binding (ABI mode) to NCCL, ``libnccl.so.2``.

Declarations: ``streamcoll/_native/nccl.h`` (NCCL 2.32.3). Functions newer than the loaded
library resolve lazily and fail when called, naming the version they need.

A candidate is taken when it loads and its ``ncclGetVersion`` succeeds; one
that fails is passed over with the reason.

Library search order (the first taken):

1. ``$STREAMCOLL_NCCL_LIBRARY``: a path to ``libnccl.so.2`` or its folder.
2. A ``libnccl.so.2`` already mapped into this process (torch's CUDA build
   loads the one from its ``nvidia-nccl-cu*`` wheel): sharing it avoids two
   NCCLs in one process.
3. Python wheels: ``nvidia/nccl/lib/libnccl.so.2`` in each site-packages
   folder (``nvidia-nccl-cu12``, ``nvidia-nccl-cu13``).
4. ``$NCCL_HOME/lib``, then ``$CUDA_HOME/lib64``.
5. The system loader: ``libnccl.so.2`` by name.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import List, Tuple

from .errors import NcclError
from ._common import Binding, _loaded_in_process, site_dirs

__all__ = ["NCCL", "binding"]

# First NCCL release exporting each function that is not in every NCCL 2.x.
# Functions absent from this table and from old releases are reported as
# needing the declared version (2.32.3), an upper bound.
_MIN_VERSIONS = {
    "ncclCommAbort": "2.4",
    "ncclCommGetAsyncError": "2.4",
    "ncclSend": "2.7",
    "ncclRecv": "2.7",
    "ncclRedOpCreatePreMulSum": "2.11",
    "ncclRedOpDestroy": "2.11",
    "ncclGetLastError": "2.13",
    "ncclCommInitRankConfig": "2.14",
    "ncclCommFinalize": "2.14",
    "ncclCommSplit": "2.18",
    "ncclCommRegister": "2.19",
    "ncclCommDeregister": "2.19",
    "ncclMemAlloc": "2.19",
    "ncclMemFree": "2.19",
    "ncclGroupSimulateEnd": "2.22",
    "ncclCommInitRankScalable": "2.23",
    "ncclCommWindowRegister": "2.27",
    "ncclCommWindowDeregister": "2.27",
    "ncclCommShrink": "2.27",
    "ncclAlltoAll": "2.28",
    "ncclGather": "2.28",
    "ncclScatter": "2.28",
    "ncclAllReduceConfig": "2.32",
    "ncclBroadcastConfig": "2.32",
    "ncclReduceConfig": "2.32",
    "ncclAllGatherConfig": "2.32",
    "ncclReduceScatterConfig": "2.32",
    "ncclAlltoAllConfig": "2.32",
    "ncclGatherConfig": "2.32",
    "ncclScatterConfig": "2.32",
    "ncclSetEncryption": "2.32",
}


class _Nccl(Binding):
    name = "nccl"
    soname = "libnccl.so.2"
    env_var = "STREAMCOLL_NCCL_LIBRARY"
    declarations = "nccl"
    declared_version = "2.32.3"
    install_hint = "pip install nvidia-nccl-cu12   (or nvidia-nccl-cu13 for CUDA 13)"
    probe_symbol = "ncclGetVersion"
    result_enum = "ncclResult_t"
    error_string_symbol = "ncclGetErrorString"
    last_error_symbol = "ncclGetLastError"
    error_class = NcclError
    min_versions = _MIN_VERSIONS

    def candidates(self) -> List[Tuple[str, str]]:
        out = self._env_candidates()
        loaded = _loaded_in_process(self.soname)
        out.append(("already loaded in this process", loaded or ""))
        for d in site_dirs():
            p = d / "nvidia" / "nccl" / "lib" / self.soname
            if p.exists():
                out.append((f"wheel {d}", str(p)))
        for var, sub in (("NCCL_HOME", "lib"), ("CUDA_HOME", "lib64")):
            root = os.environ.get(var)
            out.append((f"${var}/{sub}", str(Path(root) / sub / self.soname) if root else ""))
        out.append(("system loader", self.soname))
        return out

    @staticmethod
    def split_version(code: int):
        if code < 10000:  # NCCL_VERSION before 2.9: X*1000 + Y*100 + Z
            return code // 1000, code // 100 % 10, code % 100
        return code // 10000, code // 100 % 100, code % 100


binding = NCCL = _Nccl()
