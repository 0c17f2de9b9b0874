"""cffi binding (ABI mode) to oneCCL's NCCL-like C API, ``libccl.so.2``.

Declarations: ``streamcoll/_native/oneccl.h`` (oneCCL 2022.2.0 headers). The stream
argument of every collective is ``void*``: a ``sycl::queue*`` for Intel GPU
buffers, NULL for host buffers (then the call returns after completion).

A candidate works when ``onecclGetVersion`` succeeds (it does only once a
plugin loaded) and ``libfabric.so.1``, the transport, loads; one that fails
either is rejected with the reason and the search goes on.

Library search order (the first that works):

1. ``$STREAMCOLL_ONECCL_LIBRARY``: a path to ``libccl.so.2`` or its folder.
2. A ``libccl.so.2`` already mapped into this process (by another binding,
   e.g. a torch build with oneCCL): sharing it avoids two oneCCLs in one process.
3. Python wheels: ``<prefix>/lib/libccl.so.2`` of this interpreter's
   prefixes (the ``oneccl`` wheel installs its libraries there).
4. An installed oneAPI: ``$CCL_ROOT/lib``, then ``/opt/intel/oneapi/ccl/latest/lib``.
5. The runtime ``python -m streamcoll install-runtime`` assembles (and
   ``scripts/setup.sh`` through it): ``$STREAMCOLL_HOME/oneccl/lib``
   (default ``~/.cache/streamcoll/oneccl/lib``).
6. The system loader: ``libccl.so.2`` by name (``LD_LIBRARY_PATH``, ldconfig).

On the CPU the C API front dispatches to the plugin ``libccl_legacy_cpu.so``,
which needs ``libccl.so.1`` from the ``oneccl-cpu`` wheel beside it, and the
transport needs libfabric (Debian: ``libfabric1``, or the copy from the
``mpich`` wheel that ``install-runtime`` puts beside ``libccl.so.1``). The
``oneccl`` wheel's own ``libccl.so.1`` is the SYCL build: without Intel's
``libsycl.so`` no plugin loads, so ``pip install oneccl oneccl-cpu`` into one
prefix gives a runtime this search rejects.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import List, Tuple

from .errors import OnecclError
from ._common import Binding, _loaded_in_process, prefixes, runtime_home

INSTALL_COMMAND = "python -m streamcoll install-runtime"
LIBFABRIC = "libfabric.so.1"
# The plugins libccl.so.2 dispatches to, CPU first (libccl_legacy.so is the
# GPU one, which needs SYCL).
PLUGINS = ("libccl_legacy_cpu.so", "libccl_legacy.so")

__all__ = ["ONECCL", "binding", "mapped_libfabric"]


class _Oneccl(Binding):
    name = "oneccl"
    soname = "libccl.so.2"
    env_var = "STREAMCOLL_ONECCL_LIBRARY"
    declarations = "oneccl"
    declared_version = "2022.2.0"
    install_hint = (f"{INSTALL_COMMAND}   (assembles the oneCCL 2022.2.0 CPU runtime in "
                    "$STREAMCOLL_HOME/oneccl, default ~/.cache/streamcoll/oneccl, and checks it)")
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

    def verify(self, raw, path: str) -> str:
        """'' when this libccl.so.2 works, else why not.

        oneCCL loads its plugin when first called: ``onecclGetVersion``
        fails and the last error lists each ``dlopen`` tried when none loads
        (only libccl.so.2 on its own; or the SYCL libccl.so.1 of the
        ``oneccl`` wheel, which needs libsycl). Then the transport library:
        without it the front and the plugin load and ``onecclGetUniqueId``
        fails ("could not initialize the requested transport library"), so
        a communicator could not be made either."""
        v = self.ffi.new("int *")
        rc = raw.onecclGetVersion(v)
        if rc != 0:
            return self._plugin_failure(raw, rc, path)
        if os.environ.get("CCL_ATL_TRANSPORT", "ofi").lower() == "mpi":
            return ""  # the MPI transport: libfabric is MPI's business
        return _libfabric_problem(Path(_resolved_dir(path)))

    def _plugin_failure(self, raw, rc: int, path: str) -> str:
        """Why no plugin loads. oneCCL's last error lists its dlopen tries
        but is cut at 256 characters, usually before the CPU plugin's line,
        so each plugin file beside the library is loaded here to get the
        loader's own reason."""
        import ctypes

        folder = Path(_resolved_dir(path))
        why = f"onecclGetVersion returned {self.code_name(rc)}: no oneCCL plugin loads"
        tries = []
        for plugin in PLUGINS:
            f = folder / plugin
            if not f.exists():
                continue
            try:
                ctypes.CDLL(str(f))
            except OSError as e:
                tries.append(f"{f}: {e}")
            else:  # pragma: no cover - oneCCL could not load it, so neither can we
                tries.append(f"{f}: loads here, not from oneCCL")
        if tries:
            why += f" ({'; '.join(tries)})"
        else:
            text = self._cstr(raw.onecclGetLastError(self.ffi.NULL))
            why += f" ({text.splitlines()[0] if text else 'no message'})"
            why += f"; no plugin ({PLUGINS[0]}) beside it"
        if "libsycl" in why:
            why += ("; its libccl.so.1 is the SYCL build of the oneccl wheel, the CPU one is in "
                    "oneccl-cpu")
        return why + f": {INSTALL_COMMAND} assembles a working set"


def _resolved_dir(path: str) -> str:
    """The folder of the library file ``path`` names (by path or by name)."""
    if os.sep in path:
        return os.path.dirname(os.path.realpath(path))
    found = _loaded_in_process(os.path.basename(path))
    return os.path.dirname(found) if found else ""


def _libfabric_problem(folder: Path) -> str:
    """'' when oneCCL's transport library loads as oneCCL would load it, else
    why not. oneCCL (libccl.so.1, RUNPATH ``$ORIGIN``) dlopens it by name:
    ``LD_LIBRARY_PATH``, then the folder of libccl.so.1, then the system's
    loader cache. Loading it here maps the same file oneCCL would map."""
    import ctypes

    places = [Path(d) for d in os.environ.get("LD_LIBRARY_PATH", "").split(":") if d]
    if folder:
        places.append(folder)
    for d in places:
        f = d / LIBFABRIC
        if f.exists():
            try:
                ctypes.CDLL(str(f))
                return ""
            except OSError as e:
                return f"{f} does not load: {e}"
    try:
        ctypes.CDLL(LIBFABRIC)
        return ""
    except OSError as e:
        return (f"{LIBFABRIC} (oneCCL's transport) not found ({e}): run {INSTALL_COMMAND} "
                "(it adds a libfabric from the mpich wheel), or: sudo apt-get install -y libfabric1")


def mapped_libfabric() -> str:
    """The libfabric mapped in this process (oneCCL's transport once its
    init has begun) as ``"MAJOR.MINOR PATH"`` (the version from its
    ``fi_version()``), ``''`` where none is. oneCCL opens ``libfabric.so.1``
    by name, so it runs on whichever is mapped first: an MPI's own (mpi4py's
    ``MPI_Init`` maps the ``mpich`` wheel's 2.5) or the system's."""
    try:
        with open("/proc/self/maps") as f:
            maps = [ln.split(maxsplit=5) for ln in f if "/libfabric.so" in ln and ln.count(" ") >= 5]
    except OSError:
        return ""
    paths = list(dict.fromkeys(m[-1].strip() for m in maps))
    if not paths:
        return ""
    import ctypes
    path = paths[0]
    try:  # the one a by-name open gets (oneCCL's), not the lowest mapping: two can be mapped (one by path)
        fn = ctypes.CDLL("libfabric.so.1", mode=getattr(os, "RTLD_NOLOAD", 4)).fi_version
        at = ctypes.cast(fn, ctypes.c_void_p).value or 0
        path = next((m[-1].strip() for m in maps
                     if int(m[0].split("-")[0], 16) <= at < int(m[0].split("-")[1], 16)), path)
    except (OSError, AttributeError, ValueError):
        pass
    also = f" (also mapped: {', '.join(p for p in paths if p != path)})" if len(paths) > 1 else ""
    try:
        fn = ctypes.CDLL(path).fi_version  # mapped already: the same handle, nothing loaded
        fn.restype = ctypes.c_uint32
        n = int(fn())
        return f"{n >> 16}.{n & 0xFFFF} {path}{also}"
    except (OSError, AttributeError):
        return f"? {path}{also}"


binding = ONECCL = _Oneccl()
