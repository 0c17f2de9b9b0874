"""Machinery shared by the per-library bindings: finding and loading a shared
library, lazily resolved symbols, and turning result codes into exceptions.

Nothing here imports torch.
"""
from __future__ import annotations

import os
import sys
import threading
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple

import cffi

from .errors import FunctionNotFoundError, LibraryNotFoundError

__all__ = ["NATIVE_DIR", "Binding", "read_declarations", "enum_values"]


NATIVE_DIR = Path(__file__).resolve().parent.parent / "_native"
"""The C declarations cffi parses (``streamcoll/_native/*.h``). They are
package data, so a wheel or sdist carries them; the ABI check
(``native/abi_check.c`` in the source tree) reads these same files."""


def read_declarations(name: str) -> str:
    """The cdef text of ``streamcoll/_native/<name>.h``.

    A missing file means a broken installation (a wheel built without its
    package data): say so instead of a bare FileNotFoundError."""
    path = NATIVE_DIR / f"{name}.h"
    try:
        return path.read_text()
    except FileNotFoundError:
        raise FileNotFoundError(
            f"streamcoll's C declarations {path} are missing: this installation of streamcoll is "
            "incomplete (reinstall it from a wheel or sdist that carries streamcoll/_native/*.h)"
        ) from None


def enum_values(ffi: cffi.FFI, enum_ctype: str) -> Dict[str, int]:
    """Every ``name: value`` of an enum type, read back from the declarations."""
    return dict(ffi.typeof(enum_ctype).relements)


def _loaded_in_process(soname: str) -> Optional[str]:
    """Path of ``soname`` if some library already mapped it into this process
    (torch's CUDA build loads NCCL from its wheel, for instance)."""
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                path = line.rstrip("\n").split(maxsplit=5)[-1] if line.count(" ") >= 5 else ""
                if path.endswith("/" + soname):
                    return path
    except OSError:
        pass
    return None


class _LazyLib:
    """Attribute access to a dlopened library that resolves each symbol on
    first use. A symbol the library lacks raises FunctionNotFoundError naming
    the function and the version that has it, at call time, never at import.
    Resolved functions are cached in the instance dict, so later lookups are a
    plain attribute read."""

    def __init__(self, binding: "Binding", lib) -> None:
        self.__dict__["_binding"] = binding
        self.__dict__["_lib"] = lib

    def __getattr__(self, name: str):
        lib = self.__dict__["_lib"]
        try:
            fn = getattr(lib, name)
        except AttributeError:
            b = self.__dict__["_binding"]
            raise FunctionNotFoundError(
                b.name, name, b.version_string(), b.min_versions.get(name, b.declared_version)
            ) from None
        self.__dict__[name] = fn
        return fn

    def has(self, name: str) -> bool:
        try:
            getattr(self, name)
        except FunctionNotFoundError:
            return False
        return True


class Binding:
    """One native library: its declarations, how to find it, and its errors.

    Subclasses fill in the class attributes; :meth:`lib` loads on first use and
    caches the result (success or the aggregated failure).
    """

    name: str = ""
    soname: str = ""
    env_var: str = ""
    declarations: str = ""
    declared_version: str = ""
    install_hint: str = ""
    probe_symbol: str = ""
    result_enum: str = ""
    error_string_symbol: str = ""
    last_error_symbol: str = ""
    min_versions: Dict[str, str] = {}
    error_class: type = Exception
    # Enums declared by tag only (``enum X {...};`` with no typedef), whose
    # enumerators :meth:`const` also knows.
    named_enums: Tuple[str, ...] = ()

    def __init__(self) -> None:
        self.ffi = cffi.FFI()
        self.ffi.cdef(read_declarations(self.declarations))
        self._lock = threading.Lock()
        self._lib: Optional[_LazyLib] = None
        self._raw: Any = None  # the cffi Lib (typed by types-cffi's stubs where installed)
        self._error: Optional[LibraryNotFoundError] = None
        self.path: Optional[str] = None
        self.tried: List[str] = []
        # Every enumerator of every enum in the declarations: name -> value.
        self.constants: Dict[str, int] = {}
        for tname in self.ffi.list_types()[0]:
            t = self.ffi.typeof(tname)
            if t.kind == "enum":
                self.constants.update(t.relements)
        for tag in self.named_enums:
            self.constants.update(self.ffi.typeof(tag).relements)
        self.result_names: Dict[int, str] = {}
        for n, v in enum_values(self.ffi, self.result_enum).items():
            self.result_names.setdefault(v, n)

    # ---- finding -------------------------------------------------------
    def candidates(self) -> List[Tuple[str, str]]:
        """(description, path-or-soname) in search order. Overridden."""
        raise NotImplementedError

    def _env_candidates(self) -> List[Tuple[str, str]]:
        val = os.environ.get(self.env_var)
        if not val:
            return [(f"${self.env_var}", "")]
        p = Path(val)
        if p.is_dir():
            p = p / self.soname
        return [(f"${self.env_var}", str(p))]

    def before_load(self) -> None:
        """Hook run once before the first dlopen (environment defaults)."""

    def lib(self) -> _LazyLib:
        lib = self._lib
        if lib is not None:
            return lib
        with self._lock:
            if self._lib is not None:
                return self._lib
            if self._error is not None:
                raise self._error
            self.before_load()
            tried: List[str] = []
            for desc, path in self.candidates():
                if not path:
                    tried.append(f"{desc}: not set")
                    continue
                if os.sep in path and not os.path.exists(path):
                    tried.append(f"{desc}: {path}: no such file")
                    continue
                try:
                    raw = self.ffi.dlopen(path)
                    getattr(raw, self.probe_symbol)
                except (OSError, AttributeError) as e:
                    tried.append(f"{desc}: {path}: {e}")
                    continue
                why = self.verify(raw, path)
                if why:
                    tried.append(f"{desc}: {path}: rejected: {why}")
                    self._close(raw)
                    continue
                self._raw = raw
                self.path = _resolved_path(path, self.soname)
                tried.append(f"{desc}: {path}: loaded")
                self.tried = tried
                self._lib = _LazyLib(self, raw)
                return self._lib
            self.tried = tried
            self._error = LibraryNotFoundError(self.name, tried, self.install_hint)
            raise self._error

    def verify(self, raw, path: str) -> str:
        """Why the freshly opened candidate ``raw`` would not work ('' when
        it does). Exporting the version function is not enough: oneCCL's
        front library exports it and still fails every call when its plugin
        does not load. The base check calls it and wants success and a
        version; subclasses add what their library needs."""
        v = self.ffi.new("int *")
        try:
            rc = getattr(raw, self.probe_symbol)(v)
        except Exception as e:  # pragma: no cover - a C call does not raise
            return f"{self.probe_symbol} failed: {type(e).__name__}: {e}"
        if rc != 0:
            return f"{self.probe_symbol} returned {self.code_name(rc)}"
        if v[0] <= 0:
            return f"{self.probe_symbol} gave version {v[0]}"
        return ""

    def _close(self, raw) -> None:
        """Let go of a rejected candidate. glibc may keep it mapped (a C++
        library with unique symbols cannot be unloaded); it is never called
        again, and libraries found later load by path beside it."""
        try:
            self.ffi.dlclose(raw)
        except Exception:
            pass

    def const(self, name: str) -> int:
        """The value of enumerator ``name`` from the declarations."""
        try:
            return self.constants[name]
        except KeyError:
            raise KeyError(f"{name} is not an enumerator in streamcoll/_native/{self.declarations}.h") from None

    def is_available(self) -> bool:
        """Whether a candidate loads and passes :meth:`verify`; never raises.
        It is the search :meth:`lib` runs for a communicator, cached, so the
        answer agrees with what creating one would find."""
        try:
            self.lib()
            return True
        except Exception:
            return False

    # ---- errors -----------------------------------------------------------
    def code_name(self, code: int) -> str:
        return self.result_names.get(code, f"unknown result {code}")

    def error(self, function: str, code: int, comm=None):
        """The exception for ``function`` returning ``code``.

        Both libraries keep one process-wide last-error text that no call
        clears, so a failure that does not set it would carry the previous
        one's text: when the text is the same as at the previous error, it is
        marked as possibly stale."""
        last = self._last_error(comm)
        if last and last == self._prev_last_error:
            last += " (unchanged since the previous error: may be stale)"
        else:
            self._prev_last_error = last
        return self.error_class(
            self.name, function, int(code), self.code_name(code),
            self._error_string(code), last,
        )

    _prev_last_error = ""

    def _error_string(self, code: int) -> str:
        lib = self._lib
        if lib is None:
            return ""
        return self._cstr(getattr(lib, self.error_string_symbol)(code))

    def _last_error(self, comm) -> str:
        lib = self._lib
        if lib is None or not lib.has(self.last_error_symbol):
            return ""
        return self._cstr(getattr(lib, self.last_error_symbol)(comm if comm is not None else self.ffi.NULL))

    def _cstr(self, p) -> str:
        if p == self.ffi.NULL:
            return ""
        s = self.ffi.string(p)  # bytes for char *
        return (s.decode("utf-8", "replace") if isinstance(s, bytes) else s).strip()

    def version(self) -> int:
        """The library's version code (``probe_symbol`` is its GetVersion)."""
        lib = self.lib()
        v = self.ffi.new("int *")
        rc = getattr(lib, self.probe_symbol)(v)
        if rc:
            raise self.error(self.probe_symbol, rc)
        return v[0]

    @staticmethod
    def split_version(code: int) -> Tuple[int, int, int]:
        """(major, minor, patch) of a version code major*10000+minor*100+patch."""
        return code // 10000, code // 100 % 100, code % 100

    def version_string(self) -> str:
        if self._lib is None:
            return "(not loaded)"
        return "%d.%d.%d" % self.split_version(self.version())


def _resolved_path(path: str, soname: str) -> str:
    """The file the loader actually mapped for ``path``."""
    if os.sep in path:
        return os.path.realpath(path)
    found = _loaded_in_process(soname)
    return found or path


def site_dirs() -> List[Path]:
    """Python prefixes and site-packages folders, in import order."""
    import site
    dirs: List[Path] = []
    for p in list(sys.path) + (site.getsitepackages() if hasattr(site, "getsitepackages") else []) + [site.getusersitepackages()]:
        if p and os.path.isdir(p):
            q = Path(p)
            if q not in dirs:
                dirs.append(q)
    return dirs


def prefixes() -> List[Path]:
    """Install prefixes where wheels put ``<prefix>/lib`` data files."""
    import site
    out: List[Path] = []
    for p in (sys.prefix, sys.base_prefix, site.USER_BASE or ""):
        if p and Path(p) not in out:
            out.append(Path(p))
    return out


def runtime_home() -> Path:
    """Where streamcoll's own set-up assembles native runtimes
    (``$STREAMCOLL_HOME``, default ``~/.cache/streamcoll``)."""
    home = os.environ.get("STREAMCOLL_HOME")
    if home:
        return Path(home)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return Path(xdg) / "streamcoll" if xdg else Path.home() / ".cache" / "streamcoll"
