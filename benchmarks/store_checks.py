"""How many ``check`` requests one TCPStore server answers a second (issue
46: the hang report's polling is one ``check`` per rank, communicator and
watchdog pass, all against the store of the job). One server in this
process; 1, 2 and 4 client processes, each on a connection of its own under
a PrefixStore (as a communicator's store is), checking a key that is not
there (what a poll finds nearly always), 20,000 requests in all per row.

    python benchmarks/store_checks.py

Prints, per number of clients, the requests a second of all of them
together and of each.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import time
from datetime import timedelta


def _client(port: int, n: int, q) -> None:
    import torch.distributed as dist
    s = dist.TCPStore("127.0.0.1", port, 1, False, wait_for_workers=False, timeout=timedelta(seconds=60))
    p = dist.PrefixStore("streamcoll/default/2/1/", s)
    t = time.perf_counter()
    for _ in range(n):
        p.check(["hang/default/2/alarm"])
    q.put((n, time.perf_counter() - t))


def main() -> int:
    import torch.distributed as dist
    srv = dist.TCPStore("127.0.0.1", 0, 1, True, wait_for_workers=False)
    print(f"# TCPStore check requests a second, load {os.getloadavg()[0]:.2f}")
    for k in (1, 2, 4):
        q = mp.Queue()
        ps = [mp.Process(target=_client, args=(srv.port, 20000 // k, q)) for _ in range(k)]
        for p in ps:
            p.start()
        res = [q.get() for _ in ps]
        for p in ps:
            p.join()
        total = sum(n for n, _ in res)
        span = max(d for _, d in res)
        print(f"{k} client(s): {total / span:.0f} checks/s together, {total / k / span:.0f}/s each")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
