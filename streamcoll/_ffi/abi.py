"""The ABI check's Python half: compares what cffi computes from streamcoll's
declarations (``streamcoll/_native/*.h``, the package data the binding
parses) with what a C compiler computes from the real, installed header.

cffi in ABI mode checks nothing: a struct one field short or an enumerator
with the wrong value is a silent crash or a wrong answer. So this module walks
cffi's parsed declarations and turns every fact cffi relies on into an item:

- ``size T`` / ``align T``: every typedef and every complete struct;
- ``offset T.f`` / ``fsize T.f``: every field (nested structs and unions as
  ``T.a.b``), ``ftype T.f``: the field's declared type is the header's type;
- ``signed E`` and ``enum NAME``: every enum's signedness and every
  enumerator's value;
- ``typedef T``: pointer and scalar typedefs name the same type;
- ``func NAME``: every function's full signature (pointer types compared,
  const included).

:func:`plan` renders the items as C statements for ``native/abi_check.c``,
:func:`build` compiles that program against the real header (C or C++),
:func:`run` executes it and :func:`compare` lists every disagreement. The
type-identity items compare as 0/1 at run time (``std::is_same`` in C++,
``__builtin_types_compatible_p`` in C) so a mismatch is reported by name
instead of a compiler error.

Relies on cffi's parser model (``ffi._parser._declarations``, 'function NAME'
and 'typedef NAME' keys): the public API has no list of declared functions.

Nothing here imports torch; tests/binding/test_abi.py drives it.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple, cast

import cffi
from cffi import model

from ._common import prefixes, runtime_home, site_dirs

__all__ = [
    "Item", "Plan", "HeaderSet", "AbiCheckError",
    "plan", "compare", "build", "run", "check", "find_headers", "find_compiler",
]

# The C half lives in the source tree only (a wheel does not need it); the
# declarations it checks are the package data the binding parses.
SOURCE = Path(__file__).resolve().parents[2] / "native" / "abi_check.c"

# The header to include and its version macro, per library.
_HEADER = {"nccl": ("<nccl.h>", "NCCL_VERSION_CODE"), "oneccl": ("<oneapi/ccl.h>", "ONECCL_VERSION_CODE"),
           "cudart": ("<cuda_runtime_api.h>", "CUDART_VERSION")}


class AbiCheckError(RuntimeError):
    """The check program could not be built or run (compiler output attached)."""


@dataclass(frozen=True)
class Item:
    """One fact cffi relies on. ``expected`` is cffi's value (1 for the
    type-identity kinds ``ftype``, ``typedef``, ``func``)."""

    kind: str
    key: str
    expected: int

    @property
    def id(self) -> str:
        return f"{self.kind} {self.key}"


@dataclass
class Plan:
    """The items and the C statements that measure them."""

    items: List[Item] = field(default_factory=list)
    lines: List[str] = field(default_factory=list)

    @property
    def code(self) -> str:
        return "\n".join(self.lines) + "\n"

    def add(self, kind: str, key: str, expected: int) -> None:
        self.items.append(Item(kind, key, int(expected)))


def _c_name(tp, alias: str, quals: int = 0) -> Optional[str]:
    """C declaration of ``alias`` with type ``tp``, or None where the type has
    no name in C (an anonymous nested struct)."""
    try:
        text = tp.get_c_name(alias, quals=quals)
    except Exception:  # cffi.VerificationError: "cannot generate 'struct $1'"
        return None
    return None if "$" in text else text


class _Planner:
    def __init__(self, ffi: cffi.FFI) -> None:
        self.ffi = ffi
        self.decls = cast(Any, ffi)._parser._declarations  # cffi's parsed cdef (no public accessor)
        self.plan = Plan()
        self.n = 0
        self.enumerators_done: set = set()

    def alias(self, tp, quals: int = 0) -> Optional[str]:
        """A typedef for ``tp`` emitted into the program; its name."""
        self.n += 1
        name = f"abi_t{self.n}"
        text = _c_name(tp, name, quals)
        if text is None:
            return None
        self.plan.lines.append(f"typedef {text};")
        return name

    def size(self, cname: str) -> None:
        ffi = self.ffi
        key = _key(cname)
        self.plan.add("size", key, ffi.sizeof(cname))
        self.plan.add("align", key, ffi.alignof(cname))
        self.plan.lines.append(f'ABI_SIZE("{key}", {cname})')

    def enum(self, cname: str) -> None:
        ffi = self.ffi
        self.size(cname)
        self.plan.add("signed", _key(cname), int(ffi.cast(cname, -1)) < 0)
        self.plan.lines.append(f'ABI_SIGNED("{_key(cname)}", {cname})')
        for name, value in sorted(ffi.typeof(cname).relements.items(), key=lambda kv: (kv[1], kv[0])):
            if name in self.enumerators_done:
                continue
            self.enumerators_done.add(name)
            self.plan.add("enum", name, value)
            self.plan.lines.append(f"ABI_ENUM({name})")

    def fields(self, cname: str, ctype, mtype, path: str = "", base: int = 0) -> None:
        """Every field of struct/union ``ctype`` (cffi flattens anonymous
        members; ``mtype`` is the parser's model, for the declared types)."""
        declared = _model_fields(mtype)
        for fname, f in ctype.fields:
            p = f"{path}.{fname}" if path else fname
            key = f"{_key(cname)}.{p}"
            if f.bitsize >= 0:
                raise AbiCheckError(f"{key}: bit-fields are not supported by the ABI check")
            self.plan.add("offset", key, base + f.offset)
            self.plan.add("fsize", key, self.ffi.sizeof(f.type))
            self.plan.lines.append(f'ABI_FIELD("{key}", {cname}, {p})')
            ftp = declared.get(fname)
            if ftp is not None:
                a = self.alias(*ftp)
                if a is not None:
                    self.plan.add("ftype", key, 1)
                    self.plan.lines.append(f'ABI_FTYPE("{key}", {cname}, {p}, {a})')
            if f.type.kind in ("struct", "union") and ftp is not None:
                self.fields(cname, f.type, ftp[0], p, base + f.offset)

    def typedef(self, name: str) -> None:
        tp = self.decls[f"typedef {name}"][0]
        ffi = self.ffi
        if isinstance(tp, model.EnumType):
            self.enum(name)
            return
        if isinstance(tp, model.StructOrUnion):
            if tp.fldnames is None:  # opaque
                return
            self.size(name)
            self.fields(name, ffi.typeof(name), tp)
            return
        try:
            ffi.sizeof(name)
        except (cffi.CDefError, ValueError):  # function type (CDefError), void (ValueError)
            sized = False
        else:
            sized = True
        if sized:
            self.size(name)
        a = self.alias(tp)
        if a is not None:
            self.plan.add("typedef", name, 1)
            self.plan.lines.append(f'ABI_TYPEDEF("{name}", {name}, {a})')

    def tag(self, kind: str, tag: str) -> None:
        tp = self.decls.get(f"{kind} {tag}", (None,))[0]
        if tp is None or tp.fldnames is None:
            return
        cname = f"{kind} {tag}"
        self.size(cname)
        self.fields(cname, self.ffi.typeof(cname), tp)

    def function(self, name: str) -> None:
        tp = self.decls[f"function {name}"][0]
        ptr = tp if isinstance(tp, model.FunctionPtrType) else tp.as_function_pointer()
        a = self.alias(ptr)
        if a is None:
            raise AbiCheckError(f"function {name}: its type has no C spelling")
        self.plan.add("func", name, 1)
        self.plan.lines.append(f"ABI_FUNC({name}, {a})")


def _key(cname: str) -> str:
    """An item key without spaces ("struct ncclComm" -> "struct:ncclComm")."""
    return cname.replace(" ", ":")


def _model_fields(mtype) -> Dict[str, Tuple[object, int]]:
    """Field name -> (model type, qualifiers), anonymous members flattened
    the way cffi's ``ctype.fields`` flattens them."""
    out: Dict[str, Tuple[object, int]] = {}
    if not isinstance(mtype, model.StructOrUnion) or mtype.fldnames is None:
        return out
    quals = mtype.fldquals or (0,) * len(mtype.fldnames)
    for n, t, q in zip(mtype.fldnames, mtype.fldtypes, quals):
        if n == "":
            out.update(_model_fields(t))
        else:
            out[n] = (t, q)
    return out


def plan(ffi: cffi.FFI) -> Plan:
    """Every item of ``ffi``'s declarations, with the C statements for them."""
    p = _Planner(ffi)
    typedefs, structs, unions = ffi.list_types()
    covered = set()
    for name in typedefs:
        tp = p.decls[f"typedef {name}"][0]
        if isinstance(tp, model.StructOrUnion):
            covered.add(tp.name)
        p.typedef(name)
    for kind, tags in (("struct", structs), ("union", unions)):
        for tag in tags:
            if tag not in covered:
                p.tag(kind, tag)
    enums_done = {p.decls[f"typedef {n}"][0].name for n in typedefs
                  if isinstance(p.decls[f"typedef {n}"][0], model.EnumType)}
    for key in sorted(p.decls):
        kind, name = key.split(" ", 1)
        if kind == "function":
            p.function(name)
        elif kind == "enum" and name not in enums_done:
            p.enum(f"enum {name}")
        elif kind not in ("typedef", "struct", "union", "anonymous", "enum"):
            # A global variable, constant or macro: nothing here measures
            # it, and an unchecked declaration must not pass silently.
            raise AbiCheckError(f"declaration {key!r}: the ABI check does not cover {kind}s")
    return p.plan


def parse(output: str) -> Dict[str, int]:
    """``kind key value`` lines of the program's output -> {"kind key": value}."""
    out: Dict[str, int] = {}
    for line in output.splitlines():
        parts = line.split()
        if len(parts) == 3:
            out[f"{parts[0]} {parts[1]}"] = int(parts[2])
    return out


def compare(items: Sequence[Item], measured: Dict[str, int]) -> List[str]:
    """Every disagreement between cffi (``items``) and the header
    (``measured``), one line each; empty when the declarations are right."""
    bad: List[str] = []
    for it in items:
        got = measured.get(it.id)
        if got is None:
            bad.append(f"{it.id}: not measured by the check program")
        elif got != it.expected:
            if it.kind in ("ftype", "typedef", "func"):
                bad.append(f"{it.id}: the declared type differs from the header's")
            else:
                bad.append(f"{it.id}: cffi {it.expected}, header {got}")
    return bad


# ---- finding headers and a compiler ----------------------------------------
@dataclass
class HeaderSet:
    """Include folders that make the real header compile, or why none do."""

    library: str
    dirs: List[str]
    header: str
    version_macro: str
    tried: List[str]

    @property
    def found(self) -> bool:
        return bool(self.dirs)


def find_compiler(lang: str) -> Optional[str]:
    """``$CC``/gcc for C, ``$CXX``/g++ for C++; None where absent."""
    env, default = ("CC", "gcc") if lang == "c" else ("CXX", "g++")
    return shutil.which(os.environ.get(env) or default)


def _compiles(compiler: str, lang: str, dirs: Sequence[str], header: str) -> str:
    """'' if ``#include header`` compiles with ``dirs``, else the first error."""
    cmd = [compiler, "-x", "c++" if lang == "c++" else "c", "-fsyntax-only", "-"]
    cmd[1:1] = [f"-I{d}" for d in dirs]
    r = subprocess.run(cmd, input=f"#include {header}\n", capture_output=True, text=True, timeout=60)
    if r.returncode == 0:
        return ""
    errs = [ln for ln in r.stderr.splitlines() if "error" in ln]
    return (errs or r.stderr.splitlines() or ["failed"])[0].strip()


def _nccl_candidates() -> Tuple[List[Tuple[str, Path]], List[Tuple[str, List[Path]]]]:
    nccl = [(f"wheel {d}", d / "nvidia" / "nccl" / "include") for d in site_dirs()]
    if os.environ.get("NCCL_HOME"):
        nccl.append(("$NCCL_HOME/include", Path(os.environ["NCCL_HOME"]) / "include"))
    cuda: List[Tuple[str, List[Path]]] = []
    if os.environ.get("CUDA_HOME"):
        cuda.append(("$CUDA_HOME/include", [Path(os.environ["CUDA_HOME"]) / "include"]))
    cuda.append(("/usr/local/cuda/include", [Path("/usr/local/cuda/include")]))
    for d in site_dirs():
        nv = d / "nvidia"
        # The runtime wheel's cuda_runtime.h needs crt/host_config.h, which
        # the nvcc (CUDA 12) or crt (CUDA 13) wheel ships, and cuda_fp16.h
        # needs <nv/target> from the cccl wheel (scripts/setup.sh installs
        # nvidia-cuda-{runtime,nvcc,cccl}-cu12 so no CUDA toolkit is needed).
        extra = [p for p in (nv / "cuda_nvcc" / "include", nv / "cuda_crt" / "include",
                             nv / "cuda_cccl" / "include", nv / "cu13" / "include")
                 if p.is_dir()]
        cuda.append((f"wheel {d} nvidia/cuda_runtime", [nv / "cuda_runtime" / "include"] + extra))
    return nccl, cuda


def find_headers(library: str, lang: Optional[str] = None) -> HeaderSet:
    """The include folders for ``library``'s real header ("nccl": ``nccl.h``
    from the NCCL wheel plus CUDA's ``cuda_runtime.h``; "cudart":
    ``cuda_runtime_api.h`` from a CUDA toolkit or the runtime wheel; "oneccl":
    ``oneapi/ccl.h`` from ``$CCL_ROOT``, streamcoll's runtime folder or a
    wheel prefix). Each candidate is verified by compiling the include."""
    header, macro = _HEADER[library]
    lang = lang or ("c++" if library == "oneccl" else "c")
    cc = find_compiler(lang)
    tried: List[str] = []
    if cc is None:
        tried.append(f"no {lang} compiler (gcc/g++, $CC/$CXX)")
        return HeaderSet(library, [], header, macro, tried)
    if library == "cudart":
        for cdesc, cds in _nccl_candidates()[1]:
            if not any((c / "cuda_runtime_api.h").is_file() for c in cds):
                tried.append(f"cuda_runtime_api.h: {cdesc}: no such file")
                continue
            dirs = [str(c) for c in cds]
            err = _compiles(cc, lang, dirs, header)
            if not err:
                return HeaderSet(library, dirs, header, macro, tried)
            tried.append(f"{cdesc}: {err}")
        return HeaderSet(library, [], header, macro, tried)
    if library == "nccl":
        nccl, cuda = _nccl_candidates()
        for ndesc, nd in nccl:
            if not (nd / "nccl.h").is_file():
                tried.append(f"nccl.h: {ndesc}: {nd}/nccl.h: no such file")
                continue
            for cdesc, cds in cuda:
                if not any((c / "cuda_runtime.h").is_file() for c in cds):
                    tried.append(f"cuda_runtime.h: {cdesc}: no such file")
                    continue
                dirs = [str(nd)] + [str(c) for c in cds]
                err = _compiles(cc, lang, dirs, header)
                if not err:
                    return HeaderSet(library, dirs, header, macro, tried)
                tried.append(f"{ndesc} + {cdesc}: {err}")
        return HeaderSet(library, [], header, macro, tried)
    cands: List[Tuple[str, Path]] = []
    if os.environ.get("CCL_ROOT"):
        cands.append(("$CCL_ROOT/include", Path(os.environ["CCL_ROOT"]) / "include"))
    cands.append(("streamcoll runtime", runtime_home() / "oneccl" / "include"))
    cands += [(f"wheel prefix {p}", p / "include") for p in prefixes()]
    for desc, d in cands:
        if not (d / "oneapi" / "ccl.h").is_file():
            tried.append(f"{desc}: {d}/oneapi/ccl.h: no such file")
            continue
        err = _compiles(cc, lang, [str(d)], header)
        if not err:
            return HeaderSet(library, [str(d)], header, macro, tried)
        tried.append(f"{desc}: {err}")
    return HeaderSet(library, [], header, macro, tried)


# ---- building and running --------------------------------------------------
def build(p: Plan, headers: HeaderSet, lang: str, workdir: Path) -> Path:
    """Compile ``native/abi_check.c`` with ``p``'s statements against the real
    header; the executable's path. Warnings are errors."""
    cc = find_compiler(lang)
    if cc is None:
        raise AbiCheckError(f"no {lang} compiler")
    workdir = Path(workdir)
    items = workdir / "abi_items.inc"
    items.write_text(p.code)
    exe = workdir / f"abi_check_{headers.library}_{lang.replace('+', 'x')}"
    cmd = [cc, "-x", "c++" if lang == "c++" else "c", "-std=c++17" if lang == "c++" else "-std=gnu11",
           "-Wall", "-Werror", "-O0"]
    cmd += [f"-I{d}" for d in headers.dirs]
    cmd += [f"-DABI_HEADER={headers.header}", f"-DABI_VERSION_MACRO={headers.version_macro}",
            f'-DABI_ITEMS="{items}"', str(SOURCE), "-o", str(exe)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    if r.returncode != 0:
        raise AbiCheckError(f"compiling the ABI check failed:\n$ {' '.join(cmd)}\n{r.stderr[-8000:]}")
    return exe


def run(exe: Path) -> Tuple[Dict[str, int], str]:
    """Run the check program: ({"kind key": value}, its raw output)."""
    r = subprocess.run([str(exe)], capture_output=True, text=True, timeout=60)
    if r.returncode != 0:
        raise AbiCheckError(f"{exe} exited with {r.returncode}: {r.stderr[-2000:]}")
    return parse(r.stdout), r.stdout


def check(ffi: cffi.FFI, headers: HeaderSet, lang: str) -> Tuple[List[str], Plan, Dict[str, int]]:
    """The whole check: (disagreements, plan, measured values)."""
    p = plan(ffi)
    with tempfile.TemporaryDirectory(prefix="streamcoll-abi-") as tmp:
        measured, _ = run(build(p, headers, lang, Path(tmp)))
    return compare(p.items, measured), p, measured
