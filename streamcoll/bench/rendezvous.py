"""Communicator creation's store part at scale, with simulated ranks.

Every simulated rank is a thread with its own TCPStore client, the threads
spread over a few processes, all talking to one TCPStore server (libuv, as
torch's) in the parent: what one store server sees from N ranks. Each
rank's client sits under a :class:`CountingStore`, which counts the requests
the rank makes and the bytes it sends and receives. Two patterns run in the
same session, on the same server:

- ``torch``: torch's own for a NCCL group: rank 0 sets a 128-byte key,
  every other rank gets it once.
- ``streamcoll``: the real code, :func:`streamcoll.startup.bootstrap.rendezvous`
  (namespace counter, facts, rank 0's layout and unique id), plus the two
  keys ``new_communicator`` sets around the native init (``init/<rank>``,
  ``ready/<rank>``). Facts are synthetic: 8 ranks per host, a host per
  machine, 8 CPUs per rank.

    python -m streamcoll.bench.rendezvous                  # 64..4096 ranks
    python -m streamcoll.bench.rendezvous --ranks 1024 --procs 8

No native library is loaded (``make_uid`` returns fixed bytes).

The server and the ranks run in spawned processes with
``RES_OPTIONS=use-vc``: torch's sockets look up the peer's name for their
log lines (``getnameinfo``), and this machine's DNS server drops about 3%
of UDP queries, each a 5 s stall (at the server: for everyone); over TCP
none stalled in 300.
"""
from __future__ import annotations

import argparse
import contextlib
import itertools
import logging
import multiprocessing as mp
import os
import resource
import sys
import threading
import time
from datetime import timedelta
from typing import Any, Callable, Dict, List, Optional, Sequence

__all__ = ["CountingStore", "Server", "synthetic_facts", "simulate", "main"]


class _Count:
    __slots__ = ("requests", "bytes_in", "bytes_out", "lock")

    def __init__(self) -> None:
        self.requests = self.bytes_in = self.bytes_out = 0
        self.lock = threading.Lock()

    def add(self, out: int = 0, got: int = 0) -> None:
        with self.lock:
            self.requests += 1
            self.bytes_out += out
            self.bytes_in += got


def _size(v: Any) -> int:
    return len(v) if isinstance(v, (bytes, str)) else 8


def _store_base() -> Any:
    import torch.distributed as dist
    return dist.Store


class CountingStore(_store_base()):  # type: ignore[misc]  # a torch Store whose requests are counted
    """A torch.distributed Store over ``inner`` that counts each request
    (one per method call: what one client sends the server) and the bytes
    of keys and values sent and of values received. ``clone()`` (a second
    connection, which rendezvous opens only when a wait outlasts a progress
    interval) counts into the same totals."""

    def __init__(self, inner: Any, count: Optional[_Count] = None) -> None:
        super().__init__()
        self.inner = inner
        self.count = count or _Count()

    @property
    def requests(self) -> int:
        return self.count.requests

    @property
    def bytes_in(self) -> int:
        return self.count.bytes_in

    @property
    def bytes_out(self) -> int:
        return self.count.bytes_out

    def set(self, key: str, value: Any) -> None:
        self.count.add(len(key) + _size(value))
        self.inner.set(key, value)

    def get(self, key: str) -> bytes:
        v = self.inner.get(key)
        self.count.add(len(key), len(v))
        return v

    def add(self, key: str, value: int) -> int:
        self.count.add(len(key) + 8, 8)
        return self.inner.add(key, value)

    def compare_set(self, key: str, expected: Any, desired: Any) -> bytes:
        v = self.inner.compare_set(key, expected, desired)
        self.count.add(len(key) + _size(expected) + _size(desired), len(v))
        return v

    def check(self, keys: List[str]) -> bool:
        self.count.add(sum(map(len, keys)), 1)
        return self.inner.check(keys)

    def wait(self, keys: List[str], timeout: Optional[timedelta] = None) -> None:
        self.count.add(sum(map(len, keys)))
        if timeout is None:
            self.inner.wait(keys)
        else:
            self.inner.wait(keys, timeout)

    def multi_get(self, keys: List[str]) -> List[bytes]:
        vs = self.inner.multi_get(keys)
        self.count.add(sum(map(len, keys)), sum(map(len, vs)))
        return vs

    def multi_set(self, keys: List[str], values: List[Any]) -> None:
        self.count.add(sum(map(len, keys)) + sum(map(_size, values)))
        self.inner.multi_set(keys, values)

    def delete_key(self, key: str) -> bool:
        self.count.add(len(key))
        return self.inner.delete_key(key)

    def num_keys(self) -> int:
        self.count.add()
        return self.inner.num_keys()

    def set_timeout(self, timeout: timedelta) -> None:
        self.inner.set_timeout(timeout)

    @property
    def timeout(self) -> timedelta:  # type: ignore[override]
        return self.inner.timeout

    def clone(self) -> "CountingStore":
        return CountingStore(self.inner.clone(), self.count)


def synthetic_facts(rank: int, per_host: int = 8) -> Any:
    """Facts of a rank on host ``rank // per_host`` of a cluster (one host
    per machine, 8 CPUs per rank, a route over eth0)."""
    from streamcoll.startup.topology import RankFacts, Route
    h, local = divmod(rank, per_host)
    boot = f"{h:08x}-0000-4000-8000-{h:012x}"
    net = f"boot={boot} net=4026531840"
    ident = f"{net} ipc=4026531839 pid=4026531836 shm=27:1"
    route = Route("10.0.0.1", "10.0.0.1", f"10.{h // 65536}.{h // 256 % 256}.{h % 256}", "eth0")
    return RankFacts(rank, ident, boot, net, f"node{h:05d}", 1000 + local, h,
                     tuple(range(8 * local, 8 * local + 8)), route)


# ------------------------------------------------------------------ workers
def _rank_body(pattern: str, store: Any, rank: int, n: int, timeout: float, per_host: int,
               keep_topology: bool, facts: Any = None) -> Dict[str, Any]:
    from streamcoll.startup import bootstrap, topology
    out: Dict[str, Any] = {"rank": rank}
    if pattern == "torch":
        if rank == 0:
            store.set("nccl_uid", b"u" * 128)
        else:
            store.get("nccl_uid")
        return out
    mine = facts(rank) if facts is not None else synthetic_facts(rank, per_host)
    m = bootstrap.rendezvous(store, rank, n, timeout=timeout, facts=mine,
                             make_uid=lambda topo, name: b"simulated-unique-id".ljust(256, b"\0"))
    m.store.set(f"init/{rank}", "{}")   # new_communicator's two keys around the native init
    m.store.set(f"ready/{rank}", "1")
    if keep_topology:
        out["topology"] = topology.to_plain(m.topology.layout)
        out["me"] = m.topology.me.to_json()
    return out


def _context() -> Any:
    """forkserver with torch preloaded: a spawned process imports torch again
    (seconds each on a loaded 2-core machine), and plain fork copies a parent
    whose other threads (a test session's watchdog, loggers) may hold locks."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch.distributed", "streamcoll.startup.bootstrap", __name__])
    return ctx


def _quiet_dns() -> None:
    os.environ["RES_OPTIONS"] = "use-vc"  # read by glibc at this process's first lookup (see above)


def _serve(conn: Any, timeout: float) -> None:
    """The store server's process: serves until the pipe closes; on
    ``("go", ns)`` sets ``<ns>go`` and answers the time it did."""
    _quiet_dns()
    _raise_fd_limit()
    import torch.distributed as dist
    server = dist.TCPStore("127.0.0.1", 0, 1, True, timedelta(seconds=timeout + 60), wait_for_workers=False,
                           multi_tenant=True)
    conn.send(server.port)
    while True:
        try:
            msg = conn.recv()
        except EOFError:
            return
        if msg[0] == "go":
            t0 = time.time()
            dist.PrefixStore(msg[1], server).set("go", "1")
            conn.send(t0)
        else:
            return


class Server:
    """A TCPStore server (libuv, torch's default) in a process of its own."""

    def __init__(self, timeout: float = 300.0) -> None:
        ctx: Any = _context()
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_serve, args=(child, timeout), daemon=True)
        self._proc.start()
        if not self._conn.poll(120):
            raise RuntimeError("the simulation's store server did not start")
        self.port: int = self._conn.recv()

    def go(self, ns: str) -> float:
        self._conn.send(("go", ns))
        return float(self._conn.recv())

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._conn.send(("stop",))
        self._proc.join(10)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join(5)

    def __enter__(self) -> "Server":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _worker(conn: Any, port: int, ranks: Sequence[int], n: int, pattern: str, timeout: float,
            per_host: int, keep_topology: bool, ns: str, facts: Any) -> None:
    _quiet_dns()
    _raise_fd_limit()
    import torch.distributed as dist
    records: List[str] = []

    class _Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record.getMessage())

    logging.getLogger("streamcoll").addHandler(_Keep())
    logging.getLogger("streamcoll").propagate = False
    results: Dict[int, Dict[str, Any]] = {}
    created = threading.Barrier(len(ranks) + 1)

    def run(r: int) -> None:
        # Each thread makes its own client: made one after another, about 1 in 30 TCPStore
        # connections here stalls 5 s, in parallel the stalls overlap.
        s = CountingStore(dist.PrefixStore(ns, dist.TCPStore("127.0.0.1", port, n, False,
                                                             timedelta(seconds=timeout + 60))))
        created.wait()
        s.inner.wait(["go"])  # not counted: the start line
        try:
            res = _rank_body(pattern, s, r, n, timeout, per_host, keep_topology, facts)
        except Exception as e:
            res = {"rank": r, "error": type(e).__name__, "message": str(e), "missing": getattr(e, "missing", None)}
        res.update(end=time.time(), requests=s.requests, bytes_in=s.bytes_in, bytes_out=s.bytes_out)
        results[r] = res

    threads = [threading.Thread(target=run, args=(r,), daemon=True) for r in ranks]
    for t in threads:
        t.start()
    created.wait()
    conn.send("ready")
    for t in threads:
        t.join()
    conn.send((results, records))
    conn.close()


_RUNS = itertools.count()


def _raise_fd_limit() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def simulate(n: int, pattern: str = "streamcoll", procs: int = 4, timeout: float = 120.0,
             absent: Sequence[int] = (), per_host: int = 8, keep_topology: bool = False,
             server: Optional[Server] = None, ns: Optional[str] = None,
             facts: Optional[Callable[[int], Any]] = None) -> Dict[str, Any]:
    """Run ``pattern`` over ``n`` simulated ranks (minus ``absent``, which
    never come) in ``procs`` processes against one TCPStore server
    (``server``, or a new one). Returns ``wall_s`` (the go key to the last
    rank done), the per-rank results (``ranks``: requests, bytes in/out, an
    error's type, message and missing ranks) and the ``logs`` of every
    process. ``facts(rank)`` gives a rank's facts (default
    :func:`synthetic_facts`)."""
    if server is None:
        with Server(timeout) as own:
            return simulate(n, pattern, procs, timeout, absent, per_host, keep_topology, own, ns, facts)
    ns = ns or f"sim-{os.getpid()}-{next(_RUNS)}/"
    ranks = [r for r in range(n) if r not in set(absent)]
    procs = max(1, min(procs, len(ranks)))
    ctx: Any = _context()
    pipes, children = [], []
    for i in range(procs):
        parent, child = ctx.Pipe()
        p = ctx.Process(target=_worker, args=(child, server.port, ranks[i::procs], n, pattern, timeout,
                                              per_host, keep_topology, ns, facts), daemon=True)
        p.start()
        pipes.append(parent)
        children.append(p)
    try:
        for c in pipes:
            if not c.poll(timeout + 120) or c.recv() != "ready":
                raise RuntimeError("a simulation process did not start")
        time.sleep(0.2)  # the threads reach their wait for the go key
        t0 = server.go(ns)
        results: Dict[int, Dict[str, Any]] = {}
        logs: List[str] = []
        for c in pipes:
            if not c.poll(2 * timeout + 120):
                raise RuntimeError("a simulation process did not finish")
            res, recs = c.recv()
            results.update(res)
            logs.extend(recs)
    finally:
        for p in children:
            p.join(5)
            if p.is_alive():
                p.kill()
    wall = max(r["end"] for r in results.values()) - t0
    return {"wall_s": wall, "ranks": results, "logs": logs}


def _row(name: str, n: int, res: Dict[str, Any]) -> str:
    rs = list(res["ranks"].values())
    req = max(r["requests"] for r in rs)
    mean_req = sum(r["requests"] for r in rs) / len(rs)
    bin_ = sum(r["bytes_in"] for r in rs) / len(rs)
    bmax = max(r["bytes_in"] for r in rs)
    errors = sum(1 for r in rs if "error" in r)
    return (f"| {n} | {name} | {res['wall_s']:.2f} s | {req} (mean {mean_req:.2f}) | {bin_ / 1024:.1f} KiB "
            f"(max {bmax / 1024:.1f} KiB) |" + (f" {errors} errors |" if errors else ""))


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Print the table: per world size, torch's pattern and streamcoll's
    rendezvous in the same run, against the same server."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", default="64,256,1024,4096", help="world sizes, comma separated")
    ap.add_argument("--procs", type=int, default=8, help="processes the simulated ranks are spread over")
    ap.add_argument("--per-host", type=int, default=8, help="simulated ranks per host")
    ap.add_argument("--timeout", type=float, default=300.0)
    a = ap.parse_args(argv)
    _raise_fd_limit()
    print(f"# {os.cpu_count()} cores, load {os.getloadavg()[0]:.2f}, {a.procs} processes, "
          f"{a.per_host} ranks per host; max requests per rank (mean), mean bytes received per rank (max)")
    print("| ranks | pattern | wall time | requests/rank | received/rank |")
    print("|---|---|---|---|---|")
    with Server(a.timeout) as server:
        for n in (int(x) for x in a.ranks.split(",")):
            for pattern in ("torch", "streamcoll"):
                res = simulate(n, pattern, a.procs, a.timeout, per_host=a.per_host, server=server)
                print(_row(pattern, n, res), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
