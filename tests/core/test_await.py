"""``await work`` (issue 45): a Work (and the process group's Work) is
awaitable from asyncio. The loop runs on while the collective is in flight
(a ticker coroutine's gaps measured during the await, against the control of
a blocking ``wait()`` inside the same coroutine), the values equal gloo's in
the same ranks, a failed Work raises its error at the await, and cancelling
the awaiting task (``asyncio.wait_for`` past its timeout, a loop closed
before the completion) leaves the collective whole."""
from __future__ import annotations

import asyncio
import logging
import time
from datetime import timedelta
from typing import Any, Dict, List

import pytest
import torch

import streamcoll

from conftest import get_world, needs_oneccl
from world import free_port

pytestmark = [needs_oneccl, pytest.mark.world]

LATE_S = 0.8  # how late rank 1 joins each collective


def _gloo(comm: Any, port: int) -> None:
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=comm.rank,
                            world_size=comm.size, timeout=timedelta(seconds=60))


async def _ticking(step: Any) -> Dict[str, Any]:
    """Run coroutine ``step()`` beside a ticker of 5 ms: the longest gap
    between its ticks while ``step`` ran, and what ``step`` returned."""
    gaps: List[float] = []
    stop = False

    async def ticker() -> None:
        last = time.monotonic()
        while not stop:
            await asyncio.sleep(0.005)
            now = time.monotonic()
            gaps.append(now - last)
            last = now

    t = asyncio.get_running_loop().create_task(ticker())
    await asyncio.sleep(0.05)
    gaps.clear()
    try:
        value = await step()
    finally:
        stop = True
        await t
    return {"gap": max(gaps, default=0.0), "value": value}


def _ticker(comm: Any, port: int, numel: int, how: str) -> Dict[str, Any]:
    """Rank 1 joins ``LATE_S`` late; rank 0 awaits (or, the control, blocks
    in ``wait()``) inside a coroutine beside a ticker."""
    import torch.distributed as dist
    _gloo(comm, port)
    try:
        x = torch.arange(numel, dtype=torch.float32) * (comm.rank + 1)
        ref = x.clone()
        dist.all_reduce(ref)
        dist.barrier()
        if comm.rank == 1:
            time.sleep(LATE_S)
            comm.all_reduce(x, async_op=True).wait()
            return {"equal": torch.equal(x, ref)}

        async def step() -> Any:
            w = comm.all_reduce(x, async_op=True)
            if how == "await":
                out = await w
                return [o is x for o in out]
            w.wait()  # the control: a blocking wait inside the coroutine
            return [True]

        res = asyncio.run(_ticking(step))
        res["equal"] = torch.equal(x, ref)
        return res
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("numel", [4096, 1 << 20], ids=["16KB-quiet", "4MB"])
def test_await_keeps_the_loop_ticking_and_gives_glooss_values(numel):
    w = get_world(2)
    aw = w.run(_ticker, free_port(), numel, "await", timeout=120)
    block = w.run(_ticker, free_port(), numel, "block", timeout=120)
    assert all(r["equal"] for r in aw + block), (aw, block)
    assert aw[0]["value"] == [True], aw  # the outputs: the tensor reduced in place
    # the control: a blocking wait stops the loop for rank 1's lateness; the await does not
    assert block[0]["gap"] > LATE_S * 0.6, block
    assert aw[0]["gap"] < 0.15, (aw, block)


def _failed(comm: Any) -> Dict[str, Any]:
    """A mismatch (rank 0: 4 floats, rank 1: 8) on a split of its own: the
    first-call check fails the Work on both ranks; the await raises it; the
    communicator stays usable."""
    c = comm.split(0)
    try:
        x = torch.ones(4 if comm.rank == 0 else 8)

        async def go() -> str:
            try:
                await c.all_reduce(x, async_op=True)
            except streamcoll.MismatchError as e:
                return type(e).__name__
            return "no error"

        err = asyncio.run(go())
        y = torch.ones(3)
        asyncio.run(_run(c.all_reduce(y, async_op=True)))
        return {"err": err, "after": y.tolist()}
    finally:
        c.destroy()


async def _run(w: Any) -> Any:
    return await w


def test_await_on_a_failed_work_raises_its_error():
    res = get_world(2).run(_failed, timeout=120)
    for r in res:
        assert r == {"err": "MismatchError", "after": [2.0] * 3}, res


def _cancelled(comm: Any, port: int) -> Dict[str, Any]:
    """Rank 0's awaiting task is cancelled (``wait_for`` of 0.1 s, rank 1
    is ``LATE_S`` late), then the Work is awaited again; a second Work is
    left pending when its loop closes (``asyncio.run`` returns), then waited
    on outside any loop. Values against gloo's; errors logged by streamcoll
    (the callback thread's completion into a closed loop) collected."""
    import torch.distributed as dist
    _gloo(comm, port)
    logged: List[str] = []

    class Catch(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.levelno >= logging.WARNING:
                logged.append(record.getMessage())

    h = Catch()
    logging.getLogger("streamcoll").addHandler(h)
    try:
        a = torch.full((1 << 16,), float(comm.rank + 1))
        b = torch.full((5,), float(comm.rank + 1))
        ra, rb = a.clone(), b.clone()
        dist.all_reduce(ra)
        dist.all_reduce(rb)
        dist.barrier()
        out: Dict[str, Any] = {}
        if comm.rank == 1:
            time.sleep(LATE_S)
            comm.all_reduce(a, async_op=True).wait()
            time.sleep(LATE_S)
            comm.all_reduce(b, async_op=True).wait()
        else:
            w = comm.all_reduce(a, async_op=True)

            async def first() -> str:
                try:
                    await asyncio.wait_for(_run(w), 0.1)
                except asyncio.TimeoutError:
                    pass
                else:
                    return "completed within 0.1 s"
                done_early = w.is_completed()
                await w  # awaited again: completes
                return f"early={done_early}"

            out["first"] = asyncio.run(first())
            w2 = comm.all_reduce(b, async_op=True)

            async def leave() -> None:
                t = asyncio.get_running_loop().create_task(_run(w2))
                await asyncio.sleep(0.05)
                t.cancel()

            asyncio.run(leave())  # the loop is closed with w2 pending
            w2.wait()
            time.sleep(0.2)  # its completion reached the callback thread, which found the loop closed
        out["a"], out["b"] = torch.equal(a, ra), torch.equal(b, rb)
        c = torch.ones(2)
        comm.all_reduce(c)
        out["after"] = c.tolist()
        out["logged"] = logged
        return out
    finally:
        logging.getLogger("streamcoll").removeHandler(h)
        dist.destroy_process_group()


def test_cancelling_the_awaiting_task_leaves_the_collective_whole():
    res = get_world(2).run(_cancelled, free_port(), timeout=120)
    assert res[0]["first"] == "early=False", res
    for r in res:
        assert r["a"] and r["b"] and r["after"] == [2.0, 2.0] and r["logged"] == [], res


def _pg(comm: Any, port: int) -> Dict[str, Any]:
    """``await dist.all_reduce(t, group=<streamcoll group>, async_op=True)``
    beside gloo's result for the same tensor, rank 1 late."""
    import torch.distributed as dist
    _gloo(comm, port)
    try:
        g = dist.new_group(backend="streamcoll")
        dist.all_reduce(torch.ones(1), group=g)  # its communicator made (a first call waits for every rank)
        x = torch.arange(8, dtype=torch.float32) + comm.rank
        ref = x.clone()
        dist.all_reduce(ref)
        dist.barrier()
        if comm.rank == 1:
            time.sleep(LATE_S)

        async def step() -> Any:
            out = await dist.all_reduce(x, group=g, async_op=True)
            return [o is x for o in out]

        res = asyncio.run(_ticking(step))
        res["equal"] = torch.equal(x, ref)
        dist.destroy_process_group(g)
        return res
    finally:
        dist.destroy_process_group()


def test_the_process_groups_work_is_awaitable():
    res = get_world(2).run(_pg, free_port(), timeout=120)
    for r in res:
        assert r["equal"] and r["value"] == [True], res
    assert res[0]["gap"] < 0.15, res


def test_a_completion_into_a_closed_loop_is_dropped_quietly(capfd):
    """The pure logic of :func:`streamcoll.core.work.awaited`: a torch future
    completed (on another thread) after the awaiting loop closed neither
    raises nor prints (torch prints an exception raised in a done
    callback); one completed before the await returns at once."""
    import threading
    from streamcoll.core.work import awaited
    fut: torch.futures.Future = torch.futures.Future()

    class Held:  # what awaited() needs of a Work: its Awaiters slot
        _awaiters = None

    def expired(t: float) -> BaseException:
        return TimeoutError(t)

    async def leave() -> None:
        t = asyncio.get_running_loop().create_task(awaited(Held(), lambda: fut, None, expired, lambda: "x"))
        await asyncio.sleep(0.01)
        t.cancel()

    asyncio.run(leave())
    th = threading.Thread(target=fut.set_result, args=([1],))
    th.start()
    th.join(10)
    done: torch.futures.Future = torch.futures.Future()
    done.set_result(None)
    assert asyncio.run(asyncio.wait_for(awaited(Held(), lambda: done, None, expired, lambda: "x"), 5)) == "x"
    never: torch.futures.Future = torch.futures.Future()
    with pytest.raises(TimeoutError):
        asyncio.run(awaited(Held(), lambda: never, 0.05, expired, lambda: "x"))
    out, err = capfd.readouterr()
    assert "Error" not in err and "Traceback" not in err and "closed" not in err, err
