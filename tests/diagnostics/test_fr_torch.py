"""torch's flight-recorder tools read streamcoll's hangs (issue 34):
with ``TORCH_FR_DUMP_TEMP_FILE`` set, a hang's dumps are also written as
the pickles ``python -m torch.distributed.flight_recorder.fr_trace DIR``
reads, and it names the culprit. Before: fr_trace could not read
streamcoll's JSON dumps (no ``<prefix><rank>`` name, not a pickle) and
torch's variables were ignored.
"""
from __future__ import annotations

import os
import pickle
import re
import subprocess
import sys

import pytest

from conftest import needs_oneccl
from world import free_port

_HANG = r"""
import os, sys, time, datetime, torch, torch.distributed as dist, streamcoll, streamcoll.flight
rank = int(os.environ["RANK"]); port = int(os.environ["MASTER_PORT"])
store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, datetime.timedelta(seconds=60))
c = streamcoll.new_communicator(backend="oneccl", device="cpu", store=store, rank=rank, world_size=2,
                                name="world", timeout=3)
assert c.flight.capacity == 64, c.flight.capacity  # TORCH_FR_BUFFER_SIZE
t = torch.ones(8)
for _ in range(3):
    c.all_reduce(t)
c.broadcast(torch.ones(5), 0)
if rank == 1:
    time.sleep(6)           # skips the next all_reduce: rank 0's watchdog dumps and ends it
    streamcoll.diagnostics.flight.dump(c, reason="on request")
    os._exit(0)
c.all_reduce(t)              # never matched
"""


@needs_oneccl
@pytest.mark.world
def test_fr_trace_names_the_rank_that_never_joined(tmp_path):
    port = free_port()
    d = tmp_path / "fr"
    d.mkdir()
    procs = []
    for r in range(2):
        env = dict(os.environ, RANK=str(r), MASTER_PORT=str(port), TORCH_FR_DUMP_TEMP_FILE=f"{d}/fr_rank_",
                   TORCH_FR_BUFFER_SIZE="64", STREAMCOLL_FLIGHT_DIR=str(tmp_path / "json"))
        env.pop("STREAMCOLL_WATCHDOG", None)
        env.pop("STREAMCOLL_FLIGHT_SIZE", None)
        procs.append(subprocess.Popen([sys.executable, "-c", _HANG], env=env, cwd=str(tmp_path),
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outs = []
    try:
        for p in procs:
            outs.append((p.wait(timeout=90), p.stdout.read()))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert [rc for rc, _ in outs] == [86, 0], outs  # rank 0: the watchdog's exit
    assert sorted(os.listdir(d)) == ["fr_rank_0", "fr_rank_1"], outs
    with open(d / "fr_rank_0", "rb") as f:
        dump = pickle.load(f)
    assert set(dump) >= {"version", "pg_config", "entries"} and dump["pg_config"]["world"]["ranks"] == "[0, 1]"
    assert [e["profiling_name"] for e in dump["entries"]] == ["xccl:all_reduce"] * 3 + ["xccl:broadcast",
                                                                                      "xccl:all_reduce"]
    p = subprocess.run([sys.executable, "-m", "torch.distributed.flight_recorder.fr_trace", str(d)],
                       capture_output=True, text=True, timeout=120)
    text = p.stdout + p.stderr
    assert p.returncode == 0, text
    assert "Not all ranks joining collective, sequence number: 5" in text, text
    assert "collective: xccl:all_reduce" in text and "missing ranks: {1}" in text, text
    assert "input sizes: [[8]]" in text, text


_MIXED = r"""
import os, sys, time, datetime, torch, torch.distributed as dist, streamcoll, streamcoll.flight
rank = int(os.environ["RANK"]); out = sys.argv[1]
dist.init_process_group("streamcoll", timeout=datetime.timedelta(seconds=30))
side = dist.new_group([0, 1], backend="gloo")
t = torch.ones(8)
for _ in range(2):
    dist.all_reduce(t)
    dist.all_reduce(t, group=side)
if rank == 0:
    dist.all_reduce(t, group=side, async_op=True)   # rank 1 never joins the gloo group's third
time.sleep(1)
with open(os.path.join(out, f"gloo_rank_{rank}"), "wb") as f:
    f.write(torch._C._distributed_c10d._dump_fr_trace())   # torch's own dump of the gloo group
streamcoll.diagnostics.flight.dump(dist.group.WORLD.communicator(torch.device("cpu")), os.path.join(out, ""))
print("ok", flush=True)
os._exit(0)
"""


@needs_oneccl
@pytest.mark.world
def test_one_analysis_reads_a_gloo_side_group_and_a_streamcoll_group(tmp_path):
    """``streamcoll.flight analyze DIR`` reads torch's dumps too: a job
    with a gloo side group (torch's pickle) and the streamcoll world group
    (streamcoll's JSON) is analysed in one command. torch 2.13's own
    fr_trace raises ``KeyError: ('1', <rank>)`` on gloo's dumps (their
    ``pg_config`` is keyed ``""`` while the entries name group ``'1'``);
    re-keyed, it reads them and finds the same culprit."""
    port = free_port()
    d = tmp_path / "dumps"
    d.mkdir()
    procs = []
    for r in range(2):
        env = dict(os.environ, RANK=str(r), WORLD_SIZE="2", LOCAL_RANK=str(r), LOCAL_WORLD_SIZE="2",
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), TORCH_FR_BUFFER_SIZE="100",
                   TORCH_FR_DUMP_TEMP_FILE=f"{tmp_path}/sc_rank_")
        procs.append(subprocess.Popen([sys.executable, "-c", _MIXED, str(d)], env=env, cwd=str(tmp_path),
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    try:
        outs = [(p.wait(timeout=90), p.stdout.read()) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert [rc for rc, _ in outs] == [0, 0], outs
    p = subprocess.run([sys.executable, "-m", "streamcoll.flight", "analyze", str(d)], capture_output=True,
                       text=True, timeout=60)
    text = p.stdout + p.stderr
    assert "communicator 'pgworld-cpu': 2 ranks, dumps from ranks 0, 1" in text, text
    assert ("communicator '1:undefined': first problem at sequence number 3 (collective #3): rank 1 never "
            "arrived") in text and "gloo (torch)" in text, text
    # torch's reader on gloo's own dumps: its KeyError, then the work-around (pg_config re-keyed)
    gl = tmp_path / "gloo"
    gl.mkdir()
    for r in range(2):
        with open(d / f"gloo_rank_{r}", "rb") as f:
            dump = pickle.load(f)
        assert list(dump["pg_config"]) == [""], dump["pg_config"]
        with open(gl / f"gloo_rank_{r}", "wb") as f:
            pickle.dump(dump, f)
    fr = [sys.executable, "-m", "torch.distributed.flight_recorder.fr_trace", str(gl)]
    p = subprocess.run(fr, capture_output=True, text=True, timeout=120)
    assert p.returncode != 0 and re.search(r"KeyError: \('1', [01]\)", p.stderr), p.stdout + p.stderr
    for r in range(2):
        with open(gl / f"gloo_rank_{r}", "rb") as f:
            dump = pickle.load(f)
        name = dump["entries"][0]["process_group"][0]
        dump["pg_config"] = {name: dict(dump["pg_config"][""], name=name)}
        with open(gl / f"gloo_rank_{r}", "wb") as f:
            pickle.dump(dump, f)
    p = subprocess.run(fr, capture_output=True, text=True, timeout=120)
    text = p.stdout + p.stderr
    assert "Not all ranks joining collective, sequence number: 3" in text and "missing ranks: {1}" in text, text
    # streamcoll's own group, in torch's format too (TORCH_FR_DUMP_TEMP_FILE's prefix)
    assert sorted(f for f in os.listdir(tmp_path) if f.startswith("sc_rank_")) == ["sc_rank_0", "sc_rank_1"]
