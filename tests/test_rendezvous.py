"""Rendezvous failures give a clear streamcoll error within the timeout
(issue 15), on real processes: rank 0 alone with WORLD_SIZE=2; a rank whose
MASTER_PORT has no server; world_size=3 under a 2-rank torchrun."""
from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from conftest import needs_oneccl
from world import TORCHRUN_ENV, bare_env, free_port

pytestmark = [needs_oneccl, pytest.mark.world]

_INIT = r"""
import sys, time, streamcoll
t0 = time.monotonic()
try:
    streamcoll.init(backend="oneccl", device="cpu", timeout=float(sys.argv[1]))
except streamcoll.CollectiveError as e:
    print(f"RAISED {type(e).__name__} {time.monotonic() - t0:.2f}", flush=True)
    print(f"MISSING {e.missing} PORT {e.port}", flush=True)
    print(e, file=sys.stderr, flush=True)
    sys.exit(3)
"""


def _run(tmp_path, rank: int, world: int, timeout: float, port: int):
    env = dict(os.environ)
    env.update(TORCHRUN_ENV)
    env.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
               MASTER_PORT=str(port))
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, "-c", _INIT, str(timeout)], env=env, capture_output=True, text=True,
                       timeout=timeout + 60, cwd=str(tmp_path))
    return p, time.monotonic() - t0


def _no_cpp(text: str) -> None:
    assert "frame #" not in text and "Exception raised from" not in text and "socket.cpp" not in text, text


def test_rank_0_alone_names_the_missing_rank(tmp_path):
    """Before: silent for 601 s, then ``DistStoreError: Timed out after 601
    seconds waiting for clients. 1/2 clients joined.``"""
    port = free_port()
    p, took = _run(tmp_path, 0, 2, 5.0, port)
    assert p.returncode == 3, p.stdout + p.stderr
    raised, secs = p.stdout.splitlines()[0].split()[1:]
    assert raised == "RendezvousError" and 5.0 <= float(secs) <= 7.0, p.stdout
    assert f"MISSING [1] PORT {port}" in p.stdout, p.stdout
    err = p.stderr
    assert f"rank 1 never joined within 5 s (store at 127.0.0.1:{port}; world size 2, WORLD_SIZE=2)" in err, err
    progress = [line for line in err.splitlines() if "waiting for rank 1 to join communicator 'default'" in line]
    assert len(progress) >= 2, err  # a progress line every timeout/5 (at least 1 s)
    _no_cpp(err)


def test_unreachable_port_within_the_timeout(tmp_path):
    """Before: 20.6 s for ``timeout=10`` and 42 lines with 30 C++ frames."""
    port = free_port()  # nobody listens there
    p, took = _run(tmp_path, 1, 2, 10.0, port)
    assert p.returncode == 3, p.stdout + p.stderr
    raised, secs = p.stdout.splitlines()[0].split()[1:]
    assert raised == "RendezvousError" and 10.0 <= float(secs) <= 11.0, p.stdout
    assert f"MISSING [0] PORT {port}" in p.stdout
    err = p.stderr
    assert f"the store server of rank 0 at 127.0.0.1:{port} did not answer within 10 s" in err, err
    assert "Connection refused" in err and "waiting for the store server of rank 0" in err, err
    _no_cpp(err)
    assert len(err.splitlines()) < 25, err


_TORCHRUN = r"""
import streamcoll
try:
    streamcoll.init(backend="oneccl", device="cpu", world_size=3, timeout=30)
except ValueError as e:
    print("VALUEERROR", e, flush=True)
"""


def test_world_size_disagreeing_with_torchrun(tmp_path):
    """Before: a timeout naming an internal key (``/streamcoll/default/1//host/2``)."""
    script = tmp_path / "ws3.py"
    script.write_text(_TORCHRUN)
    env = dict(os.environ)
    env.update(TORCHRUN_ENV)
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                        "--master-port", str(free_port()), str(script)], env=env, capture_output=True,
                       text=True, timeout=120, cwd=str(tmp_path))
    took = time.monotonic() - t0
    assert p.returncode == 0, p.stdout + p.stderr
    lines = [line for line in p.stdout.splitlines() if "VALUEERROR" in line]
    assert len(lines) == 2, p.stdout + p.stderr
    assert "world_size: 3 disagrees with WORLD_SIZE=2 (set by torchrun)" in lines[0], lines
    assert took < 60, took


def test_world_size_cross_check_in_process(monkeypatch):
    import streamcoll
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(ValueError, match="world_size: 3 disagrees with WORLD_SIZE=2"):
        streamcoll.new_communicator(backend="oneccl", device="cpu", world_size=3)


_TORCHRUN_OK = r"""
import torch, streamcoll
c = streamcoll.init(backend="oneccl", device="cpu", timeout=60)
t = torch.full((4,), float(c.rank + 1))
c.all_reduce(t)
g = [torch.empty(1) for _ in range(c.size)] if c.rank == 0 else None
c.gather(torch.full((1,), float(c.rank)), g, dst=0)
import os
os.write(1, f"rank {c.rank}: {t.tolist()}\n".encode())  # one write: the ranks share torchrun's stdout
streamcoll.destroy()
"""


def test_torchrun_agent_store_and_quiet_stdout(tmp_path):
    """Under torchrun every rank is a client of the agent's store (created
    here as torch's env:// rendezvous creates it); the run prints only the
    script's own lines on stdout."""
    script = tmp_path / "ok.py"
    script.write_text(_TORCHRUN_OK)
    env = dict(os.environ)
    env.update(TORCHRUN_ENV)
    env.pop("CCL_LOG_LEVEL", None)
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                        "--master-port", str(free_port()), str(script)], env=env, capture_output=True,
                       text=True, timeout=120, cwd=str(tmp_path))
    assert p.returncode == 0, p.stdout + p.stderr
    assert sorted(p.stdout.splitlines()) == ["rank 0: [3.0, 3.0, 3.0, 3.0]", "rank 1: [3.0, 3.0, 3.0, 3.0]"], (p.stdout, p.stderr)
    assert "CCL_" not in p.stderr and "frame #" not in p.stderr, p.stderr


_TORCHRUN_BARE = r"""
import os, torch, streamcoll
from streamcoll import env
c = streamcoll.init(backend="oneccl", device="cpu", timeout=60)
t = torch.full((3,), float(c.rank + 1))
c.all_reduce(t, op=streamcoll.ReduceOp.AVG)
w = c.all_reduce(torch.full((2,), float(c.rank)), async_op=True)
w.wait()
os.write(1, (f"rank {c.rank}: {t.tolist()} {w.result()[0].tolist()} "
             f"kvs={os.environ.get('CCL_KVS_IFACE')} applied={env.APPLIED.get('CCL_KVS_IFACE')}\n").encode())
streamcoll.destroy()
"""


def test_torchrun_job_with_none_of_the_suites_variables(tmp_path):
    """A user's job: ``torchrun --nproc-per-node 2`` from an environment with
    no MASTER_ADDR, CCL_KVS_IFACE, NCCL_SOCKET_IFNAME or OMP_NUM_THREADS
    (world.bare_env). streamcoll's own single-host default chooses the
    oneCCL interface (``CCL_KVS_IFACE=lo``, applied by streamcoll.env), and
    the values are right."""
    script = tmp_path / "bare.py"
    script.write_text(_TORCHRUN_BARE)
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                        "--master-port", str(free_port()), str(script)], env=bare_env(), capture_output=True,
                       text=True, timeout=120, cwd=str(tmp_path))
    assert p.returncode == 0, p.stdout + p.stderr
    assert sorted(line for line in p.stdout.splitlines() if line.startswith("rank ")) == [
        f"rank {r}: [1.5, 1.5, 1.5] [1.0, 1.0] kvs=lo applied=lo" for r in range(2)], (p.stdout, p.stderr)
