"""Issue 45 on NCCL: a trainer (torchrun, its own streamcoll world first, on
``cuda:0``) and a server started with ``python`` (on ``cuda:1``) make one
2-rank NCCL communicator through a store address; the trainer broadcasts
the weights (equal to gloo's on the same store), then the server dies: the
trainer's next broadcast ends at its own ``timeout=``, NCCL aborts that
communicator only, the trainer's world goes on and a restarted server joins
a new communicator. NCCL has no first-communicator rule (no ``CCL_*``
needed). Two GPUs: one GPU cannot host two NCCL ranks ("Duplicate GPU
detected"), so with fewer the tests skip naming why.

The script is device-generic (``cpu`` runs it on oneCCL over TCP, as
``test_cross_job.py`` does): ``python tests/startup/test_cross_job_cuda.py
cpu`` runs the same scenario on the CPU (a check of the script itself when
no GPU is there; not collected as a test).
"""
from __future__ import annotations

import json
import os
import sys
import time
from typing import Dict

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if TESTS not in sys.path:
    sys.path.insert(0, TESTS)

from world import Processes, bare_env, free_port  # noqa: E402

_JOB = r"""
import json, os, sys, time
from datetime import timedelta
import torch, torch.distributed as dist
import streamcoll
role, addr, out, kind = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4]
backend = "nccl" if kind == "cuda" else "oneccl"
dev = torch.device(f"cuda:{0 if role == 'trainer' else 1}") if kind == "cuda" else torch.device("cpu")
host, port = addr.rsplit(":", 1)
res = {}


def weights(k):
    return torch.arange(4096, dtype=torch.float32, device=dev) * 0.5 + k


def comm(name, rank):
    return streamcoll.new_communicator(backend=backend, device=dev, store=addr, rank=rank, world_size=2,
                                       name=name, timeout=20)


if role == "trainer":
    if kind == "cuda":
        torch.cuda.set_device(dev)
    dist.init_process_group("streamcoll", timeout=timedelta(seconds=30))
    t = torch.ones(4, device=dev); dist.all_reduce(t); res["world"] = t.tolist()
    t0 = time.monotonic()
    c = comm("weights", 0)
    w = weights(1)
    c.broadcast(w, src=0)
    res["first"] = [float(w.sum()), time.monotonic() - t0]
    store = dist.TCPStore(host, int(port), None, False, timedelta(seconds=30))
    g = dist.ProcessGroupGloo(dist.PrefixStore("gloo", store), 0, 2, timedelta(seconds=30))
    g.broadcast([weights(1).cpu()]).wait()
    store.wait(["server-gone"])
    big = torch.ones(1 << 24, device=dev)  # 64 MB: more than the transport buffers a root could fill alone
    t0 = time.monotonic()
    try:
        c.broadcast(big, src=0, timeout=3)
        if kind == "cuda":  # enqueued, returned; past 3 s the watchdog aborts the communicator and the kernel ends
            torch.cuda.synchronize(dev)
            c.broadcast(big, src=0)  # a failed communicator raises its failure at once
        res["second"] = ["returned", time.monotonic() - t0, ""]
    except Exception as e:
        res["second"] = [type(e).__name__, time.monotonic() - t0, str(e)]
    t = torch.ones(4, device=dev); dist.all_reduce(t); res["world_after"] = t.tolist()
    d = comm("weights2", 0)  # the server restarted: a new communicator under a new name
    w = weights(3)
    d.broadcast(w, src=0)
    res["restarted"] = float(w.sum())
    with open(os.path.join(out, "trainer.json"), "w") as f:
        json.dump(res, f)
else:
    if kind == "cuda":
        torch.cuda.set_device(dev)
    c = comm(role, 1)
    w = torch.zeros(4096, device=dev)
    c.broadcast(w, src=0)
    res["got"] = float(w.sum())
    if role == "weights":
        store = dist.TCPStore(host, int(port), None, False, timedelta(seconds=30))
        g = dist.ProcessGroupGloo(dist.PrefixStore("gloo", store), 1, 2, timedelta(seconds=30))
        ref = torch.zeros(4096)
        g.broadcast([ref]).wait()
        res["gloo"] = float(ref.sum())
        res["equal"] = bool(torch.equal(w.cpu(), ref))
    with open(os.path.join(out, f"{role}.json"), "w") as f:
        json.dump(res, f)
"""

TCP = {"CCL_ATL_SHM": "0", "FI_PROVIDER": "tcp"}


def run(tmp_path, kind: str) -> Dict[str, dict]:
    """The scenario on ``kind`` (``cuda``: NCCL on two GPUs; ``cpu``:
    oneCCL over TCP): each party's record."""
    job = os.path.join(str(tmp_path), "job.py")
    with open(job, "w") as f:
        f.write(_JOB)
    port, master = free_port(), free_port()
    addr = f"127.0.0.1:{port}"
    e = bare_env()
    e.update(TCP if kind == "cpu" else {"NCCL_SOCKET_IFNAME": "lo"}, STREAMCOLL_WATCHDOG="fail")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "GROUP_RANK"):
        e.pop(k, None)
    ps = Processes(str(tmp_path))
    try:
        ps.start([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1", "--master-addr",
                  "127.0.0.1", "--master-port", str(master), job, "trainer", addr, str(tmp_path), kind], e,
                 "trainer.out")
        server = ps.start([sys.executable, job, "weights", addr, str(tmp_path), kind], e, "server.out")
        server.wait(90)
        from torch.distributed import TCPStore
        TCPStore("127.0.0.1", port, None, False).set("server-gone", "1")  # the server process has ended
        ps.start([sys.executable, job, "weights2", addr, str(tmp_path), kind], e, "server2.out")  # restarted
        ps.wait_all(90)
        logs = "\n".join(f"--- {n}\n" + ps.text(n)[-3000:] for n in ("trainer.out", "server.out", "server2.out"))
        got = {}
        for name in ("trainer", "weights", "weights2"):
            path = os.path.join(str(tmp_path), f"{name}.json")
            assert os.path.exists(path), f"{name} wrote no result\n{logs}"
            with open(path) as f:
                got[name] = json.load(f)
        assert ps.procs[0].returncode == 0, logs
        return got
    finally:
        ps.kill()


def check(got: Dict[str, dict], limit: float) -> None:
    """``limit``: when the failed call must have raised (on CUDA after the
    watchdog's pass that aborts it, so later than on the CPU)."""
    full = sum(i * 0.5 + 1 for i in range(4096))
    t, s, s2 = got["trainer"], got["weights"], got["weights2"]
    assert t["world"] == t["world_after"] == [1.0] * 4, t  # the trainer's own world, before and after
    assert t["first"][0] == s["got"] == s["gloo"] == full and s["equal"], (t, s)  # gloo's values
    assert t["first"][1] < 5.0, t
    kind, took, msg = t["second"]
    assert kind == "CollectiveTimeout" and 2.9 < took < limit and "its own timeout (3 s" in msg, t
    assert t["restarted"] == s2["got"] == sum(i * 0.5 + 3 for i in range(4096)), (t, s2)


if __name__ == "__main__":  # the script checked on the CPU: python tests/startup/test_cross_job_cuda.py cpu
    import tempfile
    with tempfile.TemporaryDirectory() as d:
        got = run(d, sys.argv[1] if len(sys.argv) > 1 else "cpu")
        print(json.dumps(got, indent=1))
        check(got, 4.5 if sys.argv[1:2] != ["cuda"] else 6.5)
        print("OK")
else:
    import pytest

    pytestmark = pytest.mark.cuda

    @pytest.mark.timeout(240)
    def test_weights_to_a_server_and_a_dead_server_on_nccl(tmp_path):
        import torch
        if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
            pytest.skip("needs two CUDA GPUs (one GPU cannot host two NCCL ranks)")
        check(run(tmp_path, "cuda"), 6.5)
