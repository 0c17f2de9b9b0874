"""The binding layer against the real libraries: versions, unique ids, result
codes turned into exceptions, lazily missing functions, enum tables read from
the declarations, picklable exceptions, and no torch in ``_ffi``.

Checks that start a library's runtime (unique ids, a communicator) run in a
child interpreter (``run_child`` from test_loader): oneCCL reads its
environment at first use, and a communicator made here would leave
environment defaults in the pytest process that later worlds would inherit.
"""
from __future__ import annotations

import pickle
import re

import pytest

import streamcoll
from streamcoll._ffi._common import enum_values
from streamcoll._ffi.nccl import NCCL, _Nccl
from streamcoll._ffi.oneccl import ONECCL
from streamcoll.core.backends import get_backend
from streamcoll._ffi.errors import (
    CollectiveError,
    CollectiveTimeout,
    CommunicatorError,
    FunctionNotFoundError,
    LibraryError,
    LibraryNotFoundError,
    MismatchError,
    NcclError,
    OnecclError,
)

from conftest import needs_nccl, needs_oneccl
from test_loader import child_env, run_child


# ---- loading and versions -------------------------------------------------------
@needs_oneccl
def test_oneccl_loads_and_reports_its_version():
    assert ONECCL.version() == 20220200
    assert ONECCL.version_string() == "2022.2.0"
    assert ONECCL.path.endswith("libccl.so.2")
    assert ONECCL.tried[-1].endswith(": loaded")
    assert streamcoll.is_available("oneccl") is True


@needs_nccl
def test_nccl_loads_and_reports_its_version():
    assert NCCL.version() == 23203
    assert NCCL.version_string() == "2.32.3"
    assert NCCL.path.endswith("libnccl.so.2")
    assert NCCL.tried[-1].endswith(": loaded")
    assert streamcoll.is_available("nccl") is True


def test_is_available_never_raises():
    assert streamcoll.is_available("no-such-backend") is False


# ---- unique ids ------------------------------------------------------------------
@needs_nccl
def test_nccl_unique_id_is_128_bytes_and_fresh():
    res = run_child("""
from streamcoll._ffi.nccl import NCCL
ffi, lib = NCCL.ffi, NCCL.lib()
ids = []
for _ in range(2):
    u = ffi.new("ncclUniqueId *")
    rc = lib.ncclGetUniqueId(u)
    ids.append((rc, bytes(ffi.buffer(u))))
result = ids
""")
    (rc1, a), (rc2, b) = res
    assert rc1 == rc2 == 0
    assert len(a) == len(b) == 128
    assert any(a) and a != b


@needs_oneccl
def test_oneccl_unique_id_is_4096_bytes_holding_the_loopback_store_address():
    res = run_child("""
from streamcoll.core.backends import get_backend
result = get_backend("oneccl").unique_id()
""", env=child_env({"CCL_KVS_IFACE": "lo"}), bare=False)
    assert len(res) == 4096
    text = res.split(b"\0", 1)[0].decode()
    assert re.fullmatch(r"127\.0\.0\.1_\d+", text), text


# ---- a bad call raises the right exception ----------------------------------------
@needs_nccl
@pytest.mark.parametrize("what", ["count", "user_rank"])
def test_nccl_call_on_a_null_communicator_raises_ncclerror(what):
    b = get_backend("nccl")
    with pytest.raises(NcclError) as ei:
        b.query(b.ffi.NULL, what)
    e = ei.value
    fn = b.funcs[what]
    assert (e.library, e.function, e.code, e.code_name) == ("nccl", fn, 4, "ncclInvalidArgument")
    assert e.code == NCCL.const("ncclInvalidArgument")
    assert e.error_string.startswith("invalid argument")
    assert e.last_error == f"{fn[4:]} : comm argument is NULL"
    assert str(e).startswith(f"{fn} failed: ncclInvalidArgument (4): invalid argument")
    assert e.last_error in str(e)
    assert isinstance(e, LibraryError) and isinstance(e, CollectiveError)


# Runs in a child: a real one-rank oneCCL communicator made without the store
# machinery (a HashStore), then calls that fail inside oneCCL.
_ONECCL_ERRORS = """
import torch, torch.distributed as dist, streamcoll
from streamcoll._ffi.oneccl import ONECCL
from streamcoll.core.backends import get_backend
result = {}
c = streamcoll.new_communicator(backend="oneccl", device="cpu", rank=0, world_size=1, store=dist.HashStore())
result["rank_size"] = (c.rank, c.size)
x = torch.arange(4, dtype=torch.float32)
y = torch.full((4,), -1.0)  # out of place: a one-rank in-place all_reduce returns its input, run or not
c.all_gather_into_tensor(y, x)
result["all_gather"] = y.tolist()
b = get_backend("oneccl")
try:  # first failure of the process: oneCCL's last error is global and sticky
    b.query(ONECCL.ffi.NULL, "count")
except streamcoll.OnecclError as e:
    result["null_comm"] = e
ffi, lib = ONECCL.ffi, ONECCL.lib()
p = ffi.cast("void *", x.data_ptr())
f32, s = ONECCL.const("onecclFloat32"), ONECCL.const("onecclSum")
def call(case, fname, *args):  # as the Communicator does: raise binding.error(...)
    rc = getattr(lib, fname)(*args)
    result[case] = ONECCL.error(fname, rc, c.handle) if rc else rc
call("bad_dtype_allreduce", "onecclAllReduce", p, p, 4, 99, s, c.handle, ffi.NULL)
call("bad_op_allreduce", "onecclAllReduce", p, p, 4, f32, 77, c.handle, ffi.NULL)
call("bad_root_broadcast", "onecclBroadcast", p, p, 4, f32, 5, c.handle, ffi.NULL)
result["count_after"] = b.query(c.handle, "count")
c.destroy()
"""


@pytest.fixture(scope="module")
def oneccl_errors():
    if not ONECCL.is_available():
        pytest.skip("oneCCL not loadable")
    return run_child(_ONECCL_ERRORS, bare=False, timeout=180)


@needs_oneccl
def test_one_rank_oneccl_communicator_without_a_launcher(oneccl_errors):
    assert oneccl_errors["rank_size"] == (0, 1)
    assert oneccl_errors["all_gather"] == [0.0, 1.0, 2.0, 3.0]
    assert oneccl_errors["count_after"] == 1  # the failures left the communicator usable


@needs_oneccl
@pytest.mark.parametrize("case,message", [
    ("bad_dtype_allreduce", "Unsupported onecclDataType_t value"),
    ("bad_op_allreduce", "Unsupported onecclRedOp_t value"),
    ("bad_root_broadcast", "unexpected root 5, comm size 1"),
])
def test_oneccl_invalid_argument_inside_the_library(oneccl_errors, case, message):
    """oneCCL reports these as onecclPluginException (11) with the useless
    string "Unknown error code"; the message is in the last error."""
    e = oneccl_errors[case]
    assert isinstance(e, OnecclError), e
    assert e.function == ("onecclBroadcast" if "broadcast" in case else "onecclAllReduce")
    assert (e.library, e.code, e.code_name) == ("oneccl", 11, "onecclPluginException")
    assert e.code == ONECCL.const("onecclPluginException")
    assert e.error_string == "Unknown error code"
    assert message in e.last_error
    assert message in str(e) and "onecclPluginException (11)" in str(e)


@needs_oneccl
def test_oneccl_null_communicator(oneccl_errors):
    e = oneccl_errors["null_comm"]
    assert isinstance(e, OnecclError)
    assert (e.function, e.code, e.code_name) == ("onecclCommCount", 4, "onecclInvalidArgument")
    assert e.error_string == "Invalid argument"
    # oneCCL logs "comm cannot be nullptr" as a warning; it becomes the last
    # error only at CCL_LOG_LEVEL=warn, and streamcoll sets "error".
    assert e.last_error == ""
    assert str(e).startswith("onecclCommCount failed: onecclInvalidArgument (4): Invalid argument")


# ---- missing functions ------------------------------------------------------------
@needs_nccl
def test_a_function_the_library_lacks_fails_when_called_naming_it_and_the_version():
    b = _Nccl()
    # Declared (as a newer header would) but not exported by the loaded 2.32.3.
    b.ffi.cdef("ncclResult_t ncclFromTheFuture(int x);")
    b.min_versions = dict(b.min_versions, ncclFromTheFuture="2.99")
    lib = b.lib()  # loading does not touch it
    assert lib.has("ncclFromTheFuture") is False
    with pytest.raises(FunctionNotFoundError) as ei:
        lib.ncclFromTheFuture(1)
    e = ei.value
    assert (e.library, e.function, e.loaded_version, e.needed_version) == ("nccl", "ncclFromTheFuture", "2.32.3", "2.99")
    assert str(e) == "ncclFromTheFuture is not in the loaded nccl 2.32.3; it needs nccl 2.99 or newer"
    assert isinstance(e, AttributeError) and isinstance(e, CollectiveError)
    v = b.ffi.new("int *")
    assert lib.ncclGetVersion(v) == 0 and v[0] == 23203  # the rest still works


@needs_oneccl
def test_an_undeclared_name_is_function_not_found_with_the_declared_version():
    with pytest.raises(FunctionNotFoundError) as ei:
        ONECCL.lib().onecclNoSuchFunction
    e = ei.value
    assert (e.function, e.loaded_version, e.needed_version) == ("onecclNoSuchFunction", "2022.2.0", "2022.2.0")
    assert "onecclNoSuchFunction" in str(e) and "2022.2.0" in str(e)


# ---- enums from the declarations ---------------------------------------------------
def test_enum_values_come_from_the_declarations():
    assert NCCL.const("ncclBfloat16") == 9
    assert NCCL.const("ncclFloat8e5m2") == 11
    assert NCCL.const("ncclAvg") == 4
    assert ONECCL.const("onecclMin") == 3 and ONECCL.const("onecclMax") == 2
    assert ONECCL.const("onecclLegacyCPU") == 0xBAAAAAAE
    # The tables are exactly what cffi parsed from streamcoll/_native/*.h.
    for b in (NCCL, ONECCL):
        merged = {}
        for tname in b.ffi.list_types()[0]:
            if b.ffi.typeof(tname).kind == "enum":
                merged.update(enum_values(b.ffi, tname))
        assert b.constants == merged and len(merged) > 40
    with pytest.raises(KeyError, match="ncclNoSuchThing is not an enumerator in streamcoll/_native/nccl.h"):
        NCCL.const("ncclNoSuchThing")


def test_result_codes_are_named_from_the_result_enum():
    assert NCCL.code_name(4) == "ncclInvalidArgument"
    assert NCCL.code_name(8) == "ncclTimeout"
    assert ONECCL.code_name(11) == "onecclPluginException"
    assert ONECCL.code_name(12) == "onecclNotImplemented"
    assert NCCL.code_name(123) == "unknown result 123"


@pytest.mark.parametrize("backend", ["nccl", "oneccl"])
def test_backend_tables_use_the_declared_values(backend):
    import torch
    b = get_backend(backend)
    p = b.prefix
    assert b.dtypes[torch.bfloat16] == b.binding.const(p + "Bfloat16")
    assert b.dtypes[torch.float32] == b.binding.const(p + "Float32")
    assert b.ops["MIN"] == b.binding.const(p + "Min") == 3
    assert b.ops["MAX"] == b.binding.const(p + "Max") == 2


# ---- exceptions pickle with every attribute -----------------------------------------
_EXCEPTIONS = [
    NcclError("nccl", "ncclAllReduce", 4, "ncclInvalidArgument", "invalid argument", "comm is NULL"),
    OnecclError("oneccl", "onecclAllReduce", 11, "onecclPluginException", "Unknown error code",
                "Unsupported onecclDataType_t value"),
    LibraryError("nccl", "ncclSend", 2, "ncclSystemError"),
    LibraryNotFoundError("oneccl", ["$X: not set", "system loader: libccl.so.2: nope"], "python -m streamcoll install-runtime"),
    FunctionNotFoundError("nccl", "ncclGather", "2.27.1", "2.28"),
    CollectiveTimeout("all_reduce", 7, 2.5, [(4, 4)], rank=1, size=3, detail="rank 2 never arrived"),
    CommunicatorError("communicator was destroyed"),
    MismatchError("rank 0 called all_reduce, rank 1 broadcast"),
    CollectiveError("plain"),
]


@pytest.mark.parametrize("exc", _EXCEPTIONS, ids=[type(e).__name__ for e in _EXCEPTIONS])
def test_exceptions_pickle_round_trip_with_every_attribute(exc):
    back = pickle.loads(pickle.dumps(exc))
    assert type(back) is type(exc)
    assert str(back) == str(exc) and back.args == exc.args
    assert vars(back) == vars(exc)


@needs_oneccl
def test_library_errors_crossed_a_process_boundary(oneccl_errors):
    """The OnecclErrors above were raised in a child and pickled back."""
    e = oneccl_errors["bad_dtype_allreduce"]
    assert vars(pickle.loads(pickle.dumps(e))) == vars(e)


# ---- _ffi imports no torch ---------------------------------------------------------
@needs_nccl
@needs_oneccl
def test_ffi_works_with_torch_unimportable():
    """The real _ffi modules (and errors) run in a child where any import of
    torch raises and streamcoll/__init__.py (which imports torch) is never
    executed: load both libraries, ask versions, build an error, plan the
    ABI check."""
    res = run_child("""
import importlib, sys
mods = ["streamcoll._ffi", "streamcoll._ffi._common", "streamcoll._ffi.nccl", "streamcoll._ffi.oneccl",
        "streamcoll._ffi.abi", "streamcoll._ffi.errors"]
for m in mods:
    importlib.import_module(m)
from streamcoll._ffi.nccl import NCCL
from streamcoll._ffi.oneccl import ONECCL
from streamcoll._ffi import abi
try:
    import torch
    blocked = False
except ImportError:
    blocked = True
result = {
    "blocked": blocked,
    "versions": (NCCL.version(), ONECCL.version()),
    "error": NCCL.error("ncclCommCount", 4),
    "abi_items": len(abi.plan(ONECCL.ffi).items),
    "torch_modules": sorted(m for m in sys.modules if m == "torch" or m.startswith("torch.")),
    "package_init_ran": hasattr(sys.modules["streamcoll"], "__version__"),
}
""")
    assert res["blocked"] is True  # the guard is real
    assert res["package_init_ran"] is False
    assert res["torch_modules"] == []
    assert res["versions"] == (23203, 20220200)
    assert res["error"].code_name == "ncclInvalidArgument"
    assert res["abi_items"] > 100
