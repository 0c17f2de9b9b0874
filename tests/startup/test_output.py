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
    """The watchdog's report is a ``streamcoll.diagnostics.watchdog`` log record (before:
    written to ``sys.stderr`` directly)."""
    from streamcoll.diagnostics import watchdog
    monkeypatch.setenv("STREAMCOLL_WATCHDOG", "fail")
    with caplog.at_level(logging.ERROR, logger="streamcoll"):
        with watchdog.guard("init of test thing", 0.1):
            deadline = time.monotonic() + 10
            while not any("init of test thing" in r.getMessage() for r in caplog.records):
                assert time.monotonic() < deadline, "the watchdog never reported"
                time.sleep(0.05)
    (rec,) = [r for r in caplog.records if "init of test thing" in r.getMessage()]
    assert rec.name == "streamcoll.diagnostics.watchdog" and rec.levelno == logging.ERROR
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


_CHILD_DURING_FIRST_CALL = r"""
import os, subprocess, sys, threading, time
import torch, torch.distributed as dist, streamcoll
original = os.readlink("/proc/self/fd/1")
spawned = []

def spawn_inside_the_first_call():
    # A child started by another thread while fd 1 is streamcoll's pipe (oneCCL's first call).
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if os.readlink("/proc/self/fd/1") != original:
            code = "import sys, time; time.sleep(2.5); sys.stdout.write('c' * 100000 + chr(10)); print('child done', flush=True)"
            spawned.append(subprocess.Popen([sys.executable, "-c", code]))
            return
        time.sleep(0.0005)

th = threading.Thread(target=spawn_inside_the_first_call)
th.start()
c = streamcoll.new_communicator(backend="oneccl", device="cpu", rank=0, world_size=1, store=dist.HashStore())
t = torch.ones(2)
c.all_reduce(t)
th.join()
print("inside", bool(spawned), flush=True)
if spawned:
    spawned[0].wait(30)  # blocks for good if nobody reads the child's pipe
print("parent done", flush=True)
c.destroy()
"""


@needs_oneccl
def test_a_child_started_during_the_first_call_keeps_its_output(tmp_path):
    """A subprocess started (by another thread) during oneCCL's first call
    inherits fd 1 while it is streamcoll's pipe. Its output, 100 KB written
    after the call returned, reaches stdout whole and it never blocks
    (before: the pump's fd was closed under it, 'Bad file descriptor', and
    a child writing over 64 KiB blocked for good)."""
    env = dict(os.environ)
    env.pop("CCL_LOG_LEVEL", None)
    env.setdefault("CCL_KVS_IFACE", "lo")
    p = subprocess.run([sys.executable, "-c", _CHILD_DURING_FIRST_CALL], env=env, capture_output=True, text=True,
                       timeout=120, cwd=str(tmp_path))
    assert "inside True" in p.stdout, (p.stdout[-500:], p.stderr[-3000:])  # the scenario happened
    assert p.returncode == 0, p.stderr[-3000:]
    assert "c" * 100000 + "\n" in p.stdout and "child done\n" in p.stdout, (len(p.stdout), p.stderr[-3000:])
    assert p.stdout.endswith("parent done\n"), p.stdout[-300:]
    assert "Bad file descriptor" not in p.stderr and "CCL_WARN" not in p.stdout, p.stderr[-3000:]


_DEBUG_TO_STDOUT = r"""
import logging, sys
logging.basicConfig(stream=sys.stdout, level=logging.DEBUG)
import torch, torch.distributed as dist, streamcoll
c = streamcoll.new_communicator(backend="oneccl", device="cpu", rank=0, world_size=1, store=dist.HashStore())
c.destroy()
print("done", flush=True)
"""


@needs_oneccl
def test_debug_logging_to_stdout_does_not_feed_back(tmp_path):
    """``logging.basicConfig(stream=sys.stdout, level=logging.DEBUG)``: the
    record about oneCCL's dropped line is logged once, after stdout is
    back (before: it went into the filtered pipe, was filtered and logged
    again, 527 nested prefixes in a 21.7 KB line)."""
    env = dict(os.environ)
    env.pop("CCL_LOG_LEVEL", None)
    env.setdefault("CCL_KVS_IFACE", "lo")
    p = subprocess.run([sys.executable, "-c", _DEBUG_TO_STDOUT], env=env, capture_output=True, text=True,
                       timeout=120, cwd=str(tmp_path))
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout.count("oneCCL (dropped from stdout)") == 1, p.stdout[-3000:]
    assert max(len(line) for line in p.stdout.splitlines()) < 1000, p.stdout[-3000:]
    assert p.stdout.endswith("done\n"), p.stdout[-300:]
