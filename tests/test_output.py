"""What a normal run prints (issue 15): nothing on stdout from the library,
library messages through the ``streamcoll`` logger."""
from __future__ import annotations

import logging
import os
import subprocess
import sys
import time

import pytest

from conftest import needs_oneccl

_SCRIPT = r"""
import threading, torch, torch.distributed as dist, streamcoll
print("before", flush=True)
c = streamcoll.new_communicator(backend="oneccl", device="cpu", rank=0, world_size=1, store=dist.HashStore())
t = torch.ones(4)
c.all_reduce(t)
c2 = streamcoll.new_communicator(backend="oneccl", device="cpu", rank=0, world_size=1, store=dist.HashStore())
c2.all_reduce(t)
print("after", t.tolist(), flush=True)
c2.destroy(); c.destroy()
"""


@needs_oneccl
@pytest.mark.parametrize("level", [None, "error"], ids=["default", "user_error"])
def test_nothing_on_stdout_from_the_library(level, tmp_path):
    """Before: oneCCL printed ``|CCL_WARN| value of CCL_LOG_LEVEL changed to be
    error (default:warn)`` on stdout in every process, caused by streamcoll's
    own ``CCL_LOG_LEVEL=error`` and printed for the user's own setting too."""
    env = dict(os.environ)
    env.pop("CCL_LOG_LEVEL", None)
    if level:
        env["CCL_LOG_LEVEL"] = level
    p = subprocess.run([sys.executable, "-c", _SCRIPT], env=env, capture_output=True, text=True,
                       timeout=120, cwd=str(tmp_path))  # cwd: streamcoll from PYTHONPATH/site, not ./
    assert p.returncode == 0, p.stderr
    assert p.stdout == "before\nafter [1.0, 1.0, 1.0, 1.0]\n", (p.stdout, p.stderr)
    assert "CCL_WARN" not in p.stderr, p.stderr


def test_watchdog_reports_through_the_logger(monkeypatch, caplog):
    """The watchdog's report is a ``streamcoll.watchdog`` log record (before:
    written to ``sys.stderr`` directly)."""
    from streamcoll import watchdog
    monkeypatch.setenv("STREAMCOLL_WATCHDOG", "fail")
    with caplog.at_level(logging.ERROR, logger="streamcoll"):
        with watchdog.guard("init of test thing", 0.1):
            deadline = time.monotonic() + 10
            while not any("init of test thing" in r.getMessage() for r in caplog.records):
                assert time.monotonic() < deadline, "the watchdog never reported"
                time.sleep(0.05)
    (rec,) = [r for r in caplog.records if "init of test thing" in r.getMessage()]
    assert rec.name == "streamcoll.watchdog" and rec.levelno == logging.ERROR
    assert "has not completed after" in rec.getMessage()


_GATHER = r"""
import os, torch, streamcoll
c = streamcoll.init(backend="oneccl", device="cpu", timeout=60)
r, n = c.rank, c.size
for _ in range(3):
    g = [torch.empty(2) for _ in range(n)] if r == 0 else None
    c.gather(torch.full((2,), float(r)), g, dst=0)
    if r == 0:
        assert [x.tolist() for x in g] == [[float(i)] * 2 for i in range(n)], g
streamcoll.destroy()
print("ok", r)
"""


@needs_oneccl
@pytest.mark.world
def test_two_rank_gather_prints_no_ccl_error(tmp_path):
    """oneCCL prints ``not completed event is destroyed`` for each Send/Recv
    issued in a group; a rank with a single transfer now issues it ungrouped
    (before: one line per gather and rank at 2 ranks)."""
    from world import TORCHRUN_ENV, free_port
    port = free_port()
    procs = []
    for r in range(2):
        env = dict(os.environ)
        env.update(TORCHRUN_ENV)
        env.update(RANK=str(r), WORLD_SIZE="2", LOCAL_RANK=str(r), LOCAL_WORLD_SIZE="2", MASTER_PORT=str(port))
        procs.append(subprocess.Popen([sys.executable, "-c", _GATHER], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True, cwd=str(tmp_path), start_new_session=True))
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=120))
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, 9)
                p.wait(10)
    for r, (p, (out, err)) in enumerate(zip(procs, outs)):
        assert p.returncode == 0, err
        assert out == f"ok {r}\n", (out, err)
        assert "not completed event is destroyed" not in err, err
