"""Destruction is safe at interpreter exit and after fork (issue 3).

Each case runs in a fresh interpreter with a one-rank oneCCL communicator
(HashStore: no network), so a crash or hang shows as an exit code or a
timeout here."""
from __future__ import annotations

import subprocess
import sys
import textwrap

from conftest import needs_oneccl

PRELUDE = textwrap.dedent("""
    import os, sys, torch, torch.distributed as dist
    import streamcoll
    comm = streamcoll.init(backend="oneccl", device="cpu", rank=0, world_size=1, store=dist.HashStore())
""")


def _run(body: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", PRELUDE + textwrap.dedent(body)],
                          capture_output=True, text=True, timeout=timeout)


@needs_oneccl
def test_exit_without_destroy_with_pending_async_work():
    r = _run("""
        ws = [streamcoll.all_reduce(torch.ones(1 << 16), async_op=True) for _ in range(50)]
        print("issued", len(ws), flush=True)
        # no wait, no destroy: the interpreter exits with the comm thread alive
    """)
    assert r.returncode == 0, r.stderr
    assert "issued 50" in r.stdout


@needs_oneccl
def test_exit_after_destroy_and_after_default_destroy():
    r = _run("""
        t = torch.full((3,), 2.0)
        streamcoll.all_reduce(t, async_op=True).wait()
        assert t.tolist() == [2.0, 2.0, 2.0]
        streamcoll.destroy()
        streamcoll.destroy()
        assert not streamcoll.is_initialized()
        print("ok", flush=True)
    """)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().endswith("ok")


@needs_oneccl
def test_fork_child_cannot_use_parent_communicator():
    r = _run("""
        streamcoll.all_reduce(torch.ones(2))
        pid = os.fork()
        if pid == 0:
            code = 3
            try:
                streamcoll.all_reduce(torch.ones(2))
            except streamcoll.CommunicatorError as e:
                code = 0 if "fork" in str(e) else 4
            comm.destroy()  # forgets the parent's communicator, no C call
            os._exit(code)
        _, status = os.waitpid(pid, 0)
        print("child", os.waitstatus_to_exitcode(status), flush=True)
        t = torch.ones(2)
        streamcoll.all_reduce(t)  # the parent's communicator is intact
        print("parent", t.tolist(), flush=True)
        streamcoll.destroy()
    """)
    assert r.returncode == 0, r.stderr
    assert "child 0" in r.stdout, r.stdout + r.stderr
    assert "parent [1.0, 1.0]" in r.stdout
