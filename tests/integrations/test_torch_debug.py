"""torch's debugging switches reach streamcoll groups (issue 34):
``dist.breakpoint()``/``_set_pg_timeout`` extend the group's timeout,
``group._get_backend(device)`` returns the backend object,
``TORCH_NCCL_ASYNC_ERROR_HANDLING`` chooses the watchdog's mode, and the
C++ ``Backend`` class still cannot be subclassed from Python (why the
backend is a ProcessGroup subclass).

Before: a rank waiting 10 s in ``dist.breakpoint`` with a 5 s group timeout
was ended by its watchdog at 5 s (exit 86; torch warned "Set timeout is now
only supported for either nccl or gloo"); ``_get_backend`` raised "No
backend type associated with device type cpu".
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import needs_oneccl
from world import free_port

_BREAKPOINT = r"""
import json, os, sys, time, datetime, torch, torch.distributed as dist
import streamcoll
backend = sys.argv[1]
rank = int(os.environ["RANK"])
dist.init_process_group(backend, timeout=datetime.timedelta(seconds=5))
t = torch.ones(2)
dist.all_reduce(t)
be = dist.group.WORLD._get_backend(torch.device("cpu"))
class _Pdb:  # what dist.breakpoint's rank 0 runs: a debugger session of 10 s
    def message(self, m): pass
    def set_trace(self): time.sleep(10)
dist._make_distributed_pdb = lambda: _Pdb()
t0 = time.monotonic()
dist.breakpoint(rank=0)
waited = time.monotonic() - t0
dist.all_reduce(t)
out = {"waited": waited, "value": t.tolist(), "backend": type(be).__name__,
       "is_group": be is dist.group.WORLD}
if backend == "streamcoll":
    out["comm_timeout"] = dist.group.WORLD.communicator(torch.device("cpu")).timeout
print("RES", json.dumps(out), flush=True)
dist.destroy_process_group()
"""


def _pair(tmp_path, backend):
    port = free_port()
    procs = []
    for r in range(2):
        e = dict(os.environ, RANK=str(r), WORLD_SIZE="2", LOCAL_RANK=str(r), LOCAL_WORLD_SIZE="2",
                 MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        e.pop("STREAMCOLL_WATCHDOG", None)  # the default: exit at the timeout
        procs.append(subprocess.Popen([sys.executable, "-c", _BREAKPOINT, backend], env=e, cwd=str(tmp_path),
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    res = []
    try:
        for p in procs:
            o, err = p.communicate(timeout=120)
            line = [x for x in o.splitlines() if x.startswith("RES ")]
            assert p.returncode == 0 and line, (backend, p.returncode, o[-2000:], err[-3000:])
            res.append(json.loads(line[0][4:]))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return res


@needs_oneccl
@pytest.mark.world
def test_breakpoint_extends_the_group_timeout_like_gloo(tmp_path):
    # the reference once aborted at its exit, after printing its result (gloo: "terminate called
    # without an active exception", a C++ thread left joinable at teardown; not reproduced in
    # 8 runs alone): the reference is run again then, streamcoll never
    for attempt in range(3):
        try:
            gloo = _pair(tmp_path, "gloo")
            break
        except AssertionError as e:
            if attempt == 2 or "terminate called" not in str(e):
                raise
    sc = _pair(tmp_path, "streamcoll")
    for res in (gloo, sc):
        assert res[1]["waited"] > 9.0, res  # rank 1 waited for rank 0's 10 s session, past the 5 s timeout
        assert all(x["value"] == [4.0, 4.0] for x in res), res
    assert [x["backend"] for x in gloo] == ["ProcessGroupGloo"] * 2, gloo
    assert all(x["is_group"] and x["backend"] == "ProcessGroupStreamcoll" for x in sc), sc
    assert all(x["comm_timeout"] == 3600.0 for x in sc), sc


def test_set_pg_timeout_and_backend_api_without_a_world(monkeypatch):
    import torch
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d
    import streamcoll  # noqa: F401  (registers, installs the hook)
    from streamcoll.integrations.process_group import ProcessGroupStreamcoll
    assert getattr(c10d._set_pg_timeout, "_streamcoll", False)
    pg = ProcessGroupStreamcoll(dist.HashStore(), 0, 1)
    c10d._set_pg_timeout(dist.default_pg_timeout, pg)
    assert pg._timeout == dist.default_pg_timeout
    pg.set_timeout(__import__("datetime").timedelta(seconds=7))
    assert pg._timeout.total_seconds() == 7
    with pytest.raises(ValueError, match="timeout"):
        pg._set_default_timeout(__import__("datetime").timedelta(seconds=0))
    assert pg._get_backend(torch.device("cpu")) is pg and pg._get_backend("cuda") is pg
    assert not pg.supports_splitting and not pg.supports_coalescing and not pg.supports_tensor_alloc("cpu")


@pytest.mark.parametrize("value, mode", [("0", "fail"), ("1", "exit"), ("2", "fail"), ("3", "exit"), ("", "exit")])
def test_torch_async_error_handling_chooses_the_watchdog_mode(monkeypatch, value, mode):
    from streamcoll.diagnostics import watchdog
    monkeypatch.delenv("STREAMCOLL_WATCHDOG", raising=False)
    monkeypatch.setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", value)
    assert watchdog.mode() == mode
    monkeypatch.setenv("STREAMCOLL_WATCHDOG", "off")  # streamcoll's own switch wins
    assert watchdog.mode() == "off"


def test_cpp_backend_cannot_be_subclassed_from_python():
    """Why the registration shape stays a ProcessGroup subclass (torch 2.13:
    "No constructor defined"); if a torch release allows it, this fails and
    the decision is to be measured again."""
    import torch._C._distributed_c10d as c10d

    class B(c10d.Backend):
        pass

    with pytest.raises(TypeError, match="No constructor defined"):
        B(0, 1)
