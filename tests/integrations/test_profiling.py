"""torch.profiler sees every streamcoll collective and p2p op (issue 34):
a ``streamcoll:<op>`` event with NCCL's ``record_param_comms`` argument
names, direct and through ``dist.*``, only while a profiler records.

Before: a profiled 2-rank step had no event of a collective at all (only
the profiler's own).
"""
from __future__ import annotations

import json
import os
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

import streamcoll
from streamcoll.core import profiling

from conftest import get_world, needs_oneccl
from world import free_port

pytestmark = [needs_oneccl]


def _events(path):
    with open(path) as f:
        d = json.load(f)
    return [e for e in d["traceEvents"] if str(e.get("name", "")).startswith("streamcoll:")]


def _step(comm, port, tmp):
    """A profiled step: all_reduces of three sizes (one async), a broadcast,
    a send/recv, through dist.* on a streamcoll group and on the direct API."""
    from torch.profiler import ProfilerActivity, profile
    r = comm.rank
    dist.init_process_group("streamcoll", init_method=f"tcp://127.0.0.1:{port}", rank=r, world_size=comm.size,
                            timeout=timedelta(seconds=60))
    try:
        dist.all_reduce(torch.ones(1))  # the group's communicator exists before the profiled step
        with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as p:
            dist.all_reduce(torch.ones(1000))
            dist.all_reduce(torch.ones(5000, dtype=torch.float64))
            w = dist.all_reduce(torch.ones(40000), async_op=True)
            dist.broadcast(torch.ones(77), src=0)
            if r == 0:
                dist.send(torch.ones(33), dst=1)
            else:
                dist.recv(torch.empty(33), src=0)
            w.wait()
            comm.all_reduce(torch.ones(12))  # the direct API (the pooled world's communicator)
        path = os.path.join(tmp, f"trace{r}.json")
        p.export_chrome_trace(path)
        return [(e["name"], e["args"].get("In msg nelems"), e["args"].get("Out msg nelems"), e["args"].get("dtype"),
                 e["args"].get("async_op"), e["args"].get("Group size"), e["args"].get("Process Group Name"),
                 e["args"].get("Collective name")) for e in _events(path)]
    finally:
        dist.destroy_process_group()


@pytest.mark.world
def test_a_profiled_step_shows_every_op_with_its_sizes(tmp_path):
    w = get_world(2)
    res = w.run(_step, free_port(), str(tmp_path), timeout=120)
    for r, evs in enumerate(res):
        got = [(n, i, o, d, a) for n, i, o, d, a, _, _, _ in evs]
        # dist.send/recv post an isend/irecv on the group's communicator (and wait on it)
        p2p = ("streamcoll:isend", 33, 0, "Float", 1) if r == 0 else ("streamcoll:irecv", 0, 33, "Float", 1)
        assert got == [("streamcoll:all_reduce", 1000, 1000, "Float", 0),
                       ("streamcoll:all_reduce", 5000, 5000, "Double", 0),
                       ("streamcoll:all_reduce", 40000, 40000, "Float", 1),
                       ("streamcoll:broadcast", 77, 77, "Float", 0), p2p,
                       ("streamcoll:all_reduce", 12, 12, "Float", 0)], (r, evs)
        assert all(e[5] == 2 and e[7] == e[0].split(":")[1] for e in evs), evs
        assert evs[0][6].startswith("pg") and evs[-1][6] == w.run(_name)[r], evs


def _name(comm):
    return comm.name


def test_events_only_while_profiling_and_the_fast_path_comes_back():
    from streamcoll.bench.overhead import count_frames
    from torch.profiler import ProfilerActivity, profile
    c = streamcoll.new_communicator(backend="oneccl", device="cpu", rank=0, world_size=1, store=dist.HashStore())
    try:
        t = torch.ones(4)
        assert count_frames(c.all_reduce, t) == 1 and not profiling.enabled()
        with profile(activities=[ProfilerActivity.CPU]) as p:
            assert profiling.enabled()
            assert count_frames(c.all_reduce, t) > 1  # the general method records the event
        assert count_frames(c.all_reduce, t) == 1  # one attribute read, no frame
        names = [e.name for e in p.events() if e.name.startswith("streamcoll:")]
        assert names == ["streamcoll:all_reduce"] * 2, names  # no record_shapes: the event, without its args
    finally:
        c.destroy()
