"""The ABI check: streamcoll's cffi declarations (streamcoll/_native/*.h) against the
real installed headers, compiled by gcc/g++ through native/abi_check.c.

Every size, alignment, field offset, field size and type, enum signedness,
enumerator value, typedef and function signature cffi relies on is measured by
the compiler and compared (streamcoll/_ffi/abi.py builds the item list from
cffi's parsed declarations). NCCL's header is compiled both as C and as C++
(C++ compares types exactly; C treats an enum as compatible with its integer
type); oneCCL's only as C++ (its v2/types.h includes <cstddef>).

Skips, with the reason, only where a compiler or header is missing; with
``CI`` or ``STREAMCOLL_REQUIRE_ABI`` set it fails instead, so CI cannot pass
it by skipping.

The mutation tests prove the check can fail: each feeds a deliberately wrong
declaration (the bugs of a public ctypes wrapper among them: a 1024-byte
unique id, ``int nranks``, Min and Max swapped) through the same machinery and
asserts exactly which items it reports.
"""
from __future__ import annotations

import functools
import os

import cffi
import pytest

from streamcoll._ffi import abi
from streamcoll._ffi._common import read_declarations
from streamcoll._ffi.cudart import CUDART
from streamcoll._ffi.nccl import NCCL
from streamcoll._ffi.oneccl import ONECCL

BINDINGS = {"nccl": NCCL, "oneccl": ONECCL, "cudart": CUDART}
# Version code of the header each _native/*.h was written from.
DECLARED_CODE = {"nccl": 23203, "oneccl": 20220200}
CASES = [("nccl", "c"), ("nccl", "c++"), ("oneccl", "c++"), ("cudart", "c"), ("cudart", "c++")]
# At least this many functions declared (a truncated file must not pass).
MIN_FUNCS = {"nccl": 40, "oneccl": 40, "cudart": 10}


def _required() -> bool:
    return any(os.environ.get(v, "") not in ("", "0", "false") for v in ("CI", "STREAMCOLL_REQUIRE_ABI"))


@functools.lru_cache(maxsize=None)
def _headers(lib: str, lang: str) -> abi.HeaderSet:
    return abi.find_headers(lib, lang)


def need_headers(lib: str, lang: str) -> abi.HeaderSet:
    h = _headers(lib, lang)
    if not h.found:
        why = f"{lib} header {h.header} not usable with a {lang} compiler; tried: " + "; ".join(h.tried)
        if _required():
            pytest.fail("ABI check required (CI) but cannot run: " + why)
        pytest.skip(why)
    return h


def _ffi(text: str) -> cffi.FFI:
    ffi = cffi.FFI()
    ffi.cdef(text)
    return ffi


@functools.lru_cache(maxsize=None)
def _real_check(lib: str, lang: str):
    h = need_headers(lib, lang)
    return abi.check(BINDINGS[lib].ffi, h, lang)


# ---- the check itself --------------------------------------------------------
@pytest.mark.parametrize("lib,lang", CASES, ids=[f"{l}-{g}" for l, g in CASES])
def test_declarations_match_the_real_header(lib, lang):
    bad, plan, measured = _real_check(lib, lang)
    assert bad == [], f"{len(bad)} ABI mismatches between streamcoll/_native/{lib}.h and the real header:\n" + "\n".join(bad)
    # Everything cffi relies on was measured, not just a sample.
    assert all(it.id in measured for it in plan.items)
    decls = BINDINGS[lib].ffi._parser._declarations
    funcs = {k.split(" ", 1)[1] for k in decls if k.startswith("function ")}
    assert {it.key for it in plan.items if it.kind == "func"} == funcs
    assert {it.key for it in plan.items if it.kind == "enum"} == set(BINDINGS[lib].constants)
    assert len(funcs) >= MIN_FUNCS[lib]


@pytest.mark.parametrize("lib,lang", [("nccl", "c"), ("oneccl", "c++")])
def test_header_is_the_declared_version(lib, lang):
    _, _, measured = _real_check(lib, lang)
    assert measured["version header"] == DECLARED_CODE[lib], (
        f"the {lib} header found is version {measured['version header']}; streamcoll/_native/{lib}.h declares "
        f"{BINDINGS[lib].declared_version} ({DECLARED_CODE[lib]})"
    )


def test_the_cuda_runtime_facts_streamcoll_relies_on():
    """The CUDA runtime header (12.x or 13.x: the declared text is the same
    in both) agrees on the values the helper threads and sync events use."""
    _, _, cu = _real_check("cudart", "c")
    assert 12000 <= cu["version header"] < 14000
    assert cu["enum cudaSuccess"] == 0 and cu["enum cudaErrorNotReady"] == 600
    assert cu["enum cudaStreamCaptureModeThreadLocal"] == 1
    assert cu["enum cudaStreamCaptureStatusNone"] == 0
    assert cu["func cudaThreadExchangeStreamCaptureMode"] == 1


def test_the_facts_the_issue_names():
    """Spot values, straight from the compiler's output for the real headers."""
    _, _, one = _real_check("oneccl", "c++")
    assert one["size onecclUniqueId"] == 4096
    assert one["align onecclUniqueId"] == 1
    assert one["offset onecclUniqueId.data"] == 0
    assert one["enum onecclMin"] == 3 and one["enum onecclMax"] == 2
    assert one["func onecclCommInitRank"] == 1  # size_t nranks, id by value
    _, _, nc = _real_check("nccl", "c")
    assert nc["size ncclUniqueId"] == 128
    assert nc["enum ncclBfloat16"] == 9


# ---- the check can fail --------------------------------------------------------
MUTATIONS = [
    # (id, lib, lang, old text, new text, exactly the items reported)
    ("oneccl-uid-1024", "oneccl", "c++", "char data[4096];", "char data[1024];",
     {"size onecclUniqueId", "fsize onecclUniqueId.data", "ftype onecclUniqueId.data"}),
    ("oneccl-int-nranks", "oneccl", "c++",
     "onecclCommInitRank(onecclComm_t *comm, size_t nranks", "onecclCommInitRank(onecclComm_t *comm, int nranks",
     {"func onecclCommInitRank"}),
    ("oneccl-min-max-swapped", "oneccl", "c++",
     "onecclMax = 2,\n    onecclMin = 3,", "onecclMax = 3,\n    onecclMin = 2,",
     {"enum onecclMax", "enum onecclMin"}),
    ("nccl-field-missing", "nccl", "c", "  int blocking;\n  int cgaClusterSize;", "  int cgaClusterSize;",
     # the ints after it move up by 4; netName's 8-byte alignment absorbs the rest
     {"offset ncclConfig_t.cgaClusterSize", "offset ncclConfig_t.minCTAs", "offset ncclConfig_t.maxCTAs"}),
    ("nccl-const-dropped-c", "nccl", "c", "ncclAllReduce(const void* sendbuff", "ncclAllReduce(void* sendbuff",
     {"func ncclAllReduce"}),
    ("nccl-const-dropped-cxx", "nccl", "c++", "ncclAllReduce(const void* sendbuff", "ncclAllReduce(void* sendbuff",
     {"func ncclAllReduce"}),
    ("nccl-wrong-enum-param-cxx", "nccl", "c++",
     "ncclAllReduce(const void* sendbuff, void* recvbuff, size_t count, ncclDataType_t datatype",
     "ncclAllReduce(const void* sendbuff, void* recvbuff, size_t count, ncclRedOp_t datatype",
     {"func ncclAllReduce"}),
    ("nccl-unsigned-field", "nccl", "c", "  unsigned int version;\n  int blocking;",
     "  unsigned int version;\n  unsigned int blocking;", {"ftype ncclConfig_t.blocking"}),
    ("nccl-enum-value", "nccl", "c", "ncclBfloat16   = 9,", "ncclBfloat16   = 10,", {"enum ncclBfloat16"}),
]


@pytest.mark.parametrize("case", MUTATIONS, ids=[m[0] for m in MUTATIONS])
def test_a_wrong_declaration_is_reported(case, tmp_path):
    _, lib, lang, old, new, expected = case
    h = need_headers(lib, lang)
    text = read_declarations(lib)
    assert text.count(old) == 1, f"mutation anchor not found once in streamcoll/_native/{lib}.h: {old!r}"
    bad, _, _ = abi.check(_ffi(text.replace(old, new)), h, lang)
    reported = {b.split(":", 1)[0] for b in bad}
    assert reported == expected, bad


# ---- the comparison logic and the C program, on a header made here ------------
TINY_REAL = """
#define TINY_VERSION 7
typedef struct { int a; short pad; char b[3]; } S;
typedef enum { X = 2, Y = -1 } E;
typedef struct tiny_opaque *H;
struct tagged { char c; double d; };
int f(char *p, unsigned n);
"""
TINY_CDEF = """
typedef struct { int a; char b[3]; } S;
typedef enum { X = 1, Y = 3 } E;
typedef struct tiny_opaque *H;
struct tagged { char c; double d; };
int f(const char *p, unsigned n);
"""


def test_compare_reports_each_kind_of_disagreement():
    plan = abi.plan(_ffi(TINY_CDEF))
    ids = {it.id for it in plan.items}
    assert {"size S", "align S", "offset S.a", "offset S.b", "fsize S.b", "ftype S.b", "signed E",
            "enum X", "enum Y", "typedef H", "func f"} <= ids
    measured = {it.id: it.expected for it in plan.items}
    assert abi.compare(plan.items, measured) == []
    measured["offset S.b"] = 6
    measured["func f"] = 0
    del measured["enum Y"]
    assert sorted(abi.compare(plan.items, measured)) == [
        "enum Y: not measured by the check program",
        "func f: the declared type differs from the header's",
        "offset S.b: cffi 4, header 6",
    ]


@pytest.mark.parametrize("lang", ["c", "c++"])
def test_check_program_against_a_header_made_here(lang, tmp_path):
    if abi.find_compiler(lang) is None:
        if _required():
            pytest.fail(f"no {lang} compiler")
        pytest.skip(f"no {lang} compiler (gcc/g++)")
    (tmp_path / "tiny.h").write_text(TINY_REAL)
    h = abi.HeaderSet("tiny", [str(tmp_path)], "<tiny.h>", "TINY_VERSION", [])
    bad, _, measured = abi.check(_ffi(TINY_CDEF), h, lang)
    assert measured["version header"] == 7
    reported = {b.split(":", 1)[0] for b in bad}
    assert reported == {
        "size S", "offset S.b",            # the header has a short before b
        "enum X", "enum Y", "signed E",    # different values; Y < 0 makes E signed
        "func f",                          # const char * vs char *
    }, bad
    assert measured["typedef H"] == 1
    assert measured["size struct:tagged"] == 16 and measured["offset struct:tagged.d"] == 8


def test_declarations_the_check_cannot_measure_are_refused():
    with pytest.raises(abi.AbiCheckError, match="global_var"):
        abi.plan(_ffi(TINY_CDEF + "extern int global_var;"))
    named = abi.plan(_ffi("enum color { RED = 1, BLUE = 4 };"))
    assert {it.id for it in named.items} >= {"size enum:color", "signed enum:color", "enum RED", "enum BLUE"}


def test_build_failure_carries_the_compiler_output(tmp_path):
    if abi.find_compiler("c") is None:
        pytest.skip("no C compiler")
    (tmp_path / "tiny.h").write_text(TINY_REAL)
    h = abi.HeaderSet("tiny", [str(tmp_path)], "<tiny.h>", "TINY_VERSION", [])
    # A function the real header lacks cannot be measured: the build fails, loudly.
    with pytest.raises(abi.AbiCheckError, match="not_in_header"):
        abi.check(_ffi(TINY_CDEF + "int not_in_header(void);"), h, "c")
