"""cffi binding (ABI mode) to oneCCL's NCCL-like C API, ``libccl.so.2``.

Declarations: ``streamcoll/_native/oneccl.h`` (oneCCL 2022.2.0 headers). The stream
argument of every collective is ``void*``: a ``sycl::queue*`` for Intel GPU
buffers, NULL for host buffers (then the call returns after completion).

Library search order (first that loads and exports ``onecclGetVersion``):

1. ``$STREAMCOLL_ONECCL_LIBRARY``: a path to ``libccl.so.2`` or its folder.
2. A ``libccl.so.2`` already mapped into this process (by another binding,
   e.g. a torch build with oneCCL): sharing it avoids two oneCCLs in one process.
3. Python wheels: ``<prefix>/lib/libccl.so.2`` of this interpreter's
   prefixes (the ``oneccl`` wheel installs its libraries there).
4. An installed oneAPI: ``$CCL_ROOT/lib``, then ``/opt/intel/oneapi/ccl/latest/lib``.
5. The runtime streamcoll's set-up assembles (``scripts/setup.sh``):
   ``$STREAMCOLL_HOME/oneccl/lib`` (default ``~/.cache/streamcoll/oneccl/lib``).
6. The system loader: ``libccl.so.2`` by name (``LD_LIBRARY_PATH``, ldconfig).

On the CPU the C API front dispatches to the plugin ``libccl_legacy_cpu.so``,
which needs ``libccl.so.1`` from the ``oneccl-cpu`` wheel beside it, and the
transport needs libfabric (Debian: ``libfabric1``).
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import List, Tuple

from ..errors import OnecclError
from ._common import Binding, _loaded_in_process, prefixes, runtime_home

__all__ = ["ONECCL", "binding"]


class _Oneccl(Binding):
    name = "oneccl"
    soname = "libccl.so.2"
    env_var = "STREAMCOLL_ONECCL_LIBRARY"
    declarations = "oneccl"
    declared_version = "2022.2.0"
    install_hint = "bash scripts/setup.sh  (apt libfabric1 + the oneccl, oneccl-cpu wheels with --no-deps)"
    probe_symbol = "onecclGetVersion"
    result_enum = "onecclResult_t"
    error_string_symbol = "onecclGetErrorString"
    last_error_symbol = "onecclGetLastError"
    error_class = OnecclError
    # Every function in _native/oneccl.h is in 2022.2.0, the first release with
    # the C API.
    min_versions = {}

    def candidates(self) -> List[Tuple[str, str]]:
        out = self._env_candidates()
        loaded = _loaded_in_process(self.soname)
        if loaded:
            out.append(("already loaded in this process", loaded))
        for p in prefixes():
            out.append((f"wheel prefix {p}", str(p / "lib" / self.soname)))
        root = os.environ.get("CCL_ROOT")
        out.append(("$CCL_ROOT/lib", str(Path(root) / "lib" / self.soname) if root else ""))
        out.append(("oneAPI default", "/opt/intel/oneapi/ccl/latest/lib/" + self.soname))
        out.append(("streamcoll runtime", str(runtime_home() / "oneccl" / "lib" / self.soname)))
        out.append(("system loader", self.soname))
        return out


binding = ONECCL = _Oneccl()
