"""The cost of the hang report's polling (issue 46): one ``store.check`` of
each communicator's alarm key per watchdog pass, on the hang report's own
thread and store connection (``streamcoll/diagnostics/hang_report.py``).

A hot loop of small synchronous all_reduces (4 floats) with the polling on
(``STREAMCOLL_HANG_REPORT_S=2``, the default) against the same loop with it
off (``0``: the thread is not woken, no request), in the same processes,
alternating round by round (the order flips every round), with the
watchdog running in both. ``--timeout`` sets the communicator's timeout and
with it the pass interval (``min(0.5 s, timeout / 10)``): the default 600 s
polls twice a second; 1 s polls ten times a second, a short-timeout
worst case. Each block also counts the store requests the hang report made
(``hang_report.requests_made()``), so "off" is seen to be off. On a loaded
machine the loop's time varies far more than the polling could change it,
so the benchmark also times one poll on its own (with its request, and its
Python part alone: what it holds the GIL for) and the watchdog's share per
pass, which bound the cost whatever the noise.

    PYTHONPATH=. torchrun --nproc-per-node 2 benchmarks/hang_poll.py
    PYTHONPATH=. torchrun --nproc-per-node 2 benchmarks/hang_poll.py --timeout 1 --out benchmarks/results/hang_poll/2ranks_t1

Prints (rank 0) per variant the median over rounds of the per-call time in
microseconds, the paired differences (on - off) per round and their median,
and the requests per block; ``--out PREFIX`` also writes PREFIX.txt and
PREFIX.json.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

from common import per_call_us, single_process_defaults, write_out  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--seconds", type=float, default=1.5, help="time per block (variant, round), about")
    ap.add_argument("--timeout", type=float, default=600.0, help="the communicator's timeout (sets the pass)")
    ap.add_argument("--out", default="", help="write PREFIX.txt and PREFIX.json")
    a = ap.parse_args(argv)
    single_process_defaults(29573)
    import torch
    import streamcoll
    from streamcoll.diagnostics import hang_report
    from streamcoll.diagnostics.watchdog import WATCHDOG

    comm = streamcoll.init(timeout=a.timeout)
    rank, n = comm.rank, comm.size
    t = torch.ones(4)
    for _ in range(200):
        comm.all_reduce(t)
    per = per_call_us(lambda: comm.all_reduce(t), 500)
    c = torch.tensor([max(200, int(a.seconds * 1e6 / max(per, 1e-3)))])
    comm.all_reduce(c, op=streamcoll.ReduceOp.MIN)
    calls = int(c.item())
    interval = min(0.5, max(0.05, a.timeout / 10))
    times = {"on": [], "off": []}
    reqs = {"on": [], "off": []}
    passes = {"on": [], "off": []}
    for r in range(a.rounds):
        order = ("on", "off") if r % 2 == 0 else ("off", "on")
        for v in order:
            os.environ["STREAMCOLL_HANG_REPORT_S"] = "2" if v == "on" else "0"
            time.sleep(2 * interval)  # the thread follows the setting from the next pass on
            comm.barrier()
            q0, p0 = hang_report.requests_made(), WATCHDOG.passes
            x = torch.tensor([per_call_us(lambda: comm.all_reduce(t), calls)])
            reqs[v].append(hang_report.requests_made() - q0)
            passes[v].append(WATCHDOG.passes - p0)
            comm.all_reduce(x)
            times[v].append(x.item() / n)
    # one poll's request, timed on the hang report's own connection (this thread; its own thread idle: off)
    os.environ["STREAMCOLL_HANG_REPORT_S"] = "0"
    time.sleep(2 * interval)
    conn = hang_report._conn(comm)
    st = hang_report._state(comm)

    def one_poll() -> None:
        st.next_poll = 0.0  # due now (poll_period)
        hang_report._poll(comm)

    poll_us = per_call_us(one_poll, 500)  # one poll: state, key, the socket's state, one check request

    class NoRequest:  # the poll's Python part alone: what it holds the GIL for (plus the request's own)
        def check(self, keys):
            return False

    real, conn.store = conn.store, NoRequest()
    try:
        fd, conn.fd = conn.fd, None  # the dummy has no socket
        try:
            python_us = per_call_us(one_poll, 2000)
        finally:
            conn.fd = fd
    finally:
        conn.store = real
    os.environ.pop("STREAMCOLL_HANG_REPORT_S", None)
    pass_us = per_call_us(lambda: hang_report.after_pass([comm]), 2000)  # the watchdog thread's part per pass
    if rank == 0:
        load = os.getloadavg()[0]
        diffs = [on - off for on, off in zip(times["on"], times["off"])]
        m = {v: statistics.median(times[v]) for v in times}
        lines = [f"# hang report polling on vs off, {n} ranks, timeout {a.timeout:g} s (pass {interval:g} s), "
                 f"load {load:.2f}, {a.rounds} rounds of {calls} calls, 4-float all_reduce, us per call",
                 f"on  median {m['on']:.2f}  rounds {[round(x, 2) for x in times['on']]}",
                 f"off median {m['off']:.2f}  rounds {[round(x, 2) for x in times['off']]}",
                 f"on - off, paired by round: median {statistics.median(diffs):+.2f} us "
                 f"({statistics.median(diffs) / m['off'] * 100:+.2f} %), rounds {[round(x, 2) for x in diffs]}",
                 f"hang-report store requests per block: on {reqs['on']}, off {reqs['off']} "
                 f"(watchdog passes per block: on {passes['on']}, off {passes['off']})",
                 f"one poll (rank 0, timed alone on this thread): {poll_us:.1f} us with its check request, "
                 f"{python_us:.2f} us of Python without it; the watchdog's after_pass: {pass_us:.2f} us; "
                 f"at {1 / interval:g} polls/s: {poll_us / interval:.0f} us of one thread per second "
                 f"({poll_us / interval / 1e4:.4f} % of a core), {python_us / interval:.1f} us/s holding the GIL "
                 "(the request itself releases it)"]
        text = "\n".join(lines)
        print(text, flush=True)
        if a.out:
            write_out(a.out, text, {"world_size": n, "load": load, "timeout": a.timeout, "interval": interval,
                                    "calls": calls, "times": times, "diffs": diffs, "requests": reqs,
                                    "passes": passes, "poll_us": poll_us, "poll_python_us": python_us,
                                    "after_pass_us": pass_us})
    streamcoll.destroy()
    return 0


if __name__ == "__main__":
    sys.exit(main())
