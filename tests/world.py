"""A pool of real rank processes for multi-process tests.

``World(n)`` spawns ``n`` processes once (per test module, see the
``world2``/``world3`` fixtures), each of which runs ``streamcoll.init`` over
real oneCCL with a free loopback port. ``world.run(fn, *args)`` executes the
module-level function ``fn(comm, *args)`` on every rank and returns the
per-rank results; an exception on any rank is re-raised in the parent with the
child's traceback. Every call has a timeout: a hang fails in seconds and the
world is torn down (the next test gets a fresh one).
"""
from __future__ import annotations

import contextlib
import functools
import multiprocessing as mp
import os
import signal
import socket
import subprocess
import sys
import time
import traceback
from typing import Any, Callable, Dict, Iterator, List, NamedTuple, Optional

# What torchrun puts in every rank's environment besides the rank variables,
# with its defaults (torch/distributed/run.py: --master-addr 127.0.0.1;
# OMP_NUM_THREADS=1 for more than one process per node unless set). Nothing
# else: the interfaces (CCL_KVS_IFACE, NCCL_SOCKET_IFNAME, ...) are
# streamcoll's own defaults to choose, as they are for a user.
TORCHRUN_ENV = {
    "MASTER_ADDR": "127.0.0.1",
    "OMP_NUM_THREADS": "1",
}


# The variables earlier versions of this suite set for every test; a user's
# shell and torchrun set none of them (OMP_NUM_THREADS: torchrun sets it in
# the ranks, not in the launcher's environment).
SUITE_ONLY = ("MASTER_ADDR", "MASTER_PORT", "CCL_KVS_IFACE", "NCCL_SOCKET_IFNAME", "OMP_NUM_THREADS")


def bare_env() -> Dict[str, str]:
    """This process's environment without :data:`SUITE_ONLY`: what a user's
    ``torchrun`` starts from."""
    return {k: v for k, v in os.environ.items() if k not in SUITE_ONLY}


def rank_env(rank: int, size: int, port: int) -> Dict[str, str]:
    """The variables torchrun gives rank ``rank`` of a one-node job of
    ``size`` ranks with its store at ``port``."""
    return dict(TORCHRUN_ENV, RANK=str(rank), WORLD_SIZE=str(size), LOCAL_RANK=str(rank),
                LOCAL_WORLD_SIZE=str(size), GROUP_RANK="0", MASTER_PORT=str(port))


def _port_band() -> range:
    """Ports below the kernel's ephemeral range: a port taken from there
    (``bind(0)``) can be handed to any outgoing connection on this host
    before the test's store binds it again (seen in CI: EADDRINUSE)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    top = max(min(low, 65536), 12000)
    return range(top - 10000, top)


_RESERVED = os.path.join(os.environ.get("TMPDIR", "/tmp"), "streamcoll-test-ports")
_RESERVE_S = 1800.0  # a port handed out is not handed out again for this long, by any worker


def _reserve(port: int) -> bool:
    """Claim ``port`` for this test session across processes (an O_EXCL file
    per port): two xdist workers drawing the same port before either bound
    it once made one world's store fail with EADDRINUSE."""
    os.makedirs(_RESERVED, exist_ok=True)
    path = os.path.join(_RESERVED, str(port))
    try:
        os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
        return True
    except FileExistsError:
        try:
            if time.time() - os.stat(path).st_mtime > _RESERVE_S:  # an old claim: take it over
                os.utime(path)
                return True
        except OSError:
            pass
        return False


def free_port() -> int:
    """A loopback port free now and outside the ephemeral range (so no
    outgoing connection takes it before the store binds it), drawn at
    random and claimed (:func:`_reserve`) so that no two tests of any
    worker get the same one."""
    import random
    band = _port_band()
    for _ in range(400):
        port = random.choice(band)
        if not _reserve(port):
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free loopback port in {band.start}..{band.stop - 1} after 400 tries")


def kill_sessions(procs: List[Any]) -> None:
    """SIGKILL each still-running ``subprocess.Popen`` of ``procs`` with its
    whole session (each was started with ``start_new_session=True``: the
    rank, or a simulated host, and nothing else), then reap it."""
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait(10)


class Processes:
    """Subprocesses of one test, each in a session of its own (so
    :func:`kill_sessions` ends it with all it started), logging to files in
    ``dir``, watched until they end: the one spawner of the subprocess
    harnesses (test_signals, test_reliability: ranks; test_multihost: one
    launcher per simulated host). ``ended[i]`` is the wall-clock time
    process ``i`` was seen to end; ``rank<r>.json`` in ``dir`` is what
    rank ``r`` reported (:meth:`result`)."""

    def __init__(self, dir: str) -> None:
        self.dir = str(dir)
        self.procs: List[subprocess.Popen] = []
        self.ended: Dict[int, float] = {}

    def start(self, argv: List[str], env: Dict[str, str], stdout: str, stderr: Optional[str] = None
              ) -> subprocess.Popen:
        """Start ``argv`` with exactly ``env``; its output goes to ``dir/stdout``
        (and ``dir/stderr``; None: both into the first)."""
        out = open(os.path.join(self.dir, stdout), "w")
        err = open(os.path.join(self.dir, stderr), "w") if stderr else None
        try:
            p = subprocess.Popen(argv, env=env, stdout=out, stderr=err or subprocess.STDOUT,
                                 start_new_session=True)
        finally:
            out.close()
            if err is not None:
                err.close()
        self.procs.append(p)
        return p

    def start_ranks(self, argv: List[str], size: int, env: Optional[Dict[str, str]] = None) -> None:
        """``size`` ranks of ``argv`` on this host, each with this process's
        environment plus what torchrun gives it (:func:`rank_env`) and
        ``env``; rank r logs to ``stdout<r>`` and ``stderr<r>``."""
        port = free_port()
        for r in range(size):
            e = dict(os.environ)
            e.update(rank_env(r, size, port))
            e.update(env or {})
            self.start(argv, e, f"stdout{r}", f"stderr{r}")

    def wait_all(self, timeout: float) -> None:
        """Until every process ended or ``timeout`` seconds passed."""
        deadline = time.monotonic() + timeout
        while len(self.ended) < len(self.procs) and time.monotonic() < deadline:
            for i, p in enumerate(self.procs):
                if i not in self.ended and p.poll() is not None:
                    self.ended[i] = time.time()
            time.sleep(0.05)

    def kill(self) -> None:
        kill_sessions(self.procs)

    def rc(self, i: int) -> Optional[int]:
        return self.procs[i].returncode

    def text(self, name: str) -> str:
        with open(os.path.join(self.dir, name)) as f:
            return f.read()

    def result(self, r: int) -> dict:
        import json
        path = os.path.join(self.dir, f"rank{r}.json")
        if not os.path.exists(path):
            return {}
        with open(path) as f:
            return json.load(f)

    def until(self, r: int, key: str, timeout: float = 90, poll: float = 0.02) -> Any:
        """Rank ``r``'s recorded ``key`` (``rank{r}.json``) once it is there;
        AssertionError (with :meth:`describe`) if ``r`` ends first or it is
        not there within ``timeout``."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            v = self.result(r).get(key)
            if v is not None:
                return v
            if self.procs[r].poll() is not None:
                break
            time.sleep(poll)
        raise AssertionError(f"rank {r} never wrote {key!r}\n{self.describe()}")

    def stderr(self, r: int) -> str:
        return self.text(f"stderr{r}")

    def until_ended(self, r: int, timeout: float) -> None:
        """Until rank ``r`` ended (``ended[r]`` set) or ``timeout`` s passed."""
        deadline = time.monotonic() + timeout
        while self.procs[r].poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        if self.procs[r].poll() is not None:
            self.ended[r] = time.time()

    def until_said(self, r: int, text: str, timeout: float) -> str:
        """Rank ``r``'s ``stderr<r>`` once ``text`` is in it (and 0.3 s for the
        rest of the message); AssertionError if ``r`` ends first without it
        or ``timeout`` s pass."""
        deadline = time.monotonic() + timeout
        while True:
            ended = self.procs[r].poll() is not None
            if text in self.stderr(r):
                time.sleep(0.3)
                return self.stderr(r)
            if ended or time.monotonic() >= deadline:
                raise AssertionError(f"rank {r} never said {text!r}\n{self.describe()}")
            time.sleep(0.05)

    def describe(self) -> str:
        """Each rank's exit status and the tail of its ``stderr<r>``."""
        out = []
        for r, p in enumerate(self.procs):
            try:
                err = self.text(f"stderr{r}")[-3000:]
            except OSError:
                err = ""
            out.append(f"--- rank {r}: exit {p.poll()}\n{err}")
        return "\n".join(out)


class ChildError(AssertionError):
    """An exception raised on a rank, with its traceback."""


def _worker(rank: int, size: int, port: int, conn, env: Dict[str, str], init_kwargs: Dict[str, Any]) -> None:
    import faulthandler
    import signal
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the parent asks for stacks on a hang
    os.environ.update(rank_env(rank, size, port))
    os.environ.update(env)
    comm: Any = None
    try:
        import streamcoll
        if init_kwargs is not None:
            comm = streamcoll.init(**init_kwargs)
        else:
            comm = FreshRank(rank, size)
        conn.send(("ok", None))
    except BaseException:
        conn.send(("error", traceback.format_exc()))
        return
    while True:
        try:
            msg = conn.recv()
        except EOFError:
            break
        if msg is None:
            break
        fn, args, kwargs = msg
        try:
            res = fn(comm, *args, **kwargs)
        except BaseException as e:  # noqa: BLE001 - everything goes back to the parent
            msg = f"{type(e).__name__}: {e}\n" + traceback.format_exc()  # before the clean-up, which may hang
            left = _left_default_group()
            conn.send(("error", msg + (f"\n(and {left})" if left else "")))
            if "hung" in left:
                os._exit(1)  # the rank is not reusable: the pool replaces it
            continue
        left = _left_default_group()
        if left:
            conn.send(("error", f"AssertionError: {left}"))
            if "hung" in left:
                os._exit(1)
        else:
            conn.send(("ok", res))
    try:
        if init_kwargs is not None:
            streamcoll.destroy()
    except Exception:
        pass
    os._exit(0)


def _left_default_group() -> str:
    """A pooled rank's scenarios share one process: one that leaves torch's
    default group initialized fails every later ``init_process_group``
    ("trying to initialize the default process group twice"), a cascade
    far from its cause. Destroy it here and name the scenario that left it."""
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return ""
    import threading
    raised: List[BaseException] = []

    def destroy() -> None:
        try:
            dist.destroy_process_group()
        except BaseException as e:  # noqa: BLE001 - the report below is what matters
            raised.append(e)

    th = threading.Thread(target=destroy, daemon=True)  # bounded: a group with a stuck call may never end
    th.start()
    th.join(10)
    if th.is_alive():
        return "the scenario left torch's default process group initialized; destroying it hung for 10 s"
    if raised:
        return f"the scenario left torch's default process group initialized; destroying it raised {raised[0]!r}"
    return "the scenario left torch's default process group initialized (destroyed here)"


class FreshRank(NamedTuple):
    """What a fresh world's rank functions get instead of a communicator:
    the rank and size a scenario that makes its own groups needs."""

    rank: int
    size: int


class World:
    def __init__(self, size: int, timeout: float = 60.0, env: Optional[Dict[str, str]] = None,
                 init_kwargs: Optional[Dict[str, Any]] = None, fresh: bool = False) -> None:
        """``fresh``: the ranks make no communicator (``comm`` is a
        :class:`FreshRank` in :meth:`run`'s functions): a process's first
        communicators are what a scenario tests (issue 32), which a pooled
        world, made with a communicator over every rank, hides."""
        self.size = size
        self.timeout = timeout
        ctx = mp.get_context("spawn")
        port = free_port()
        e = dict(env or {})
        self.conns = []
        self.procs = []
        kw = None if fresh else ({} if init_kwargs is None else init_kwargs)
        for r in range(size):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=_worker, args=(r, size, port, child, e, kw), daemon=True)
            p.start()
            self.conns.append(parent)
            self.procs.append(p)
        self._collect(timeout, "init")

    def _collect(self, timeout: float, what: str) -> List[Any]:
        from multiprocessing.connection import wait as mp_wait
        deadline = time.monotonic() + timeout
        results: List[Any] = [None] * self.size
        errors: Dict[int, str] = {}
        waiting = dict(enumerate(self.conns))
        while waiting:
            left = deadline - time.monotonic()
            ready = mp_wait(list(waiting.values()), timeout=max(left, 0)) if left > 0 else []
            if not ready:
                stuck = sorted(waiting)
                self.dump_stacks()
                self.close(kill=True)
                msg = f"{what}: rank(s) {stuck} did not answer within {timeout:g} s (hang?)"
                if errors:
                    msg += "; meanwhile other ranks failed:\n" + "\n".join(
                        f"--- rank {r} ---\n{e}" for r, e in sorted(errors.items()))
                raise TimeoutError(msg)
            for c in ready:
                r = self.conns.index(c)
                del waiting[r]
                try:
                    status, val = c.recv()
                except EOFError:
                    proc = self.procs[r]
                    proc.join(5)  # its exit code (close() forgets the processes)
                    code = proc.exitcode
                    self.close(kill=True)
                    raise ChildError(f"{what}: rank {r} died (exit code {code})")
                if status == "error":
                    errors[r] = val
                results[r] = val
        if errors:
            raise ChildError(f"{what} failed on {len(errors)} rank(s):\n" + "\n".join(
                f"--- rank {r} ---\n{e}" for r, e in sorted(errors.items())))
        return results

    def run(self, fn: Callable, *args, timeout: Optional[float] = None, **kwargs) -> List[Any]:
        """Run ``fn(comm, *args, **kwargs)`` on every rank; per-rank results."""
        for c in self.conns:
            c.send((fn, args, kwargs))
        return self._collect(timeout or self.timeout, fn.__name__)

    def dump_stacks(self) -> None:
        """Make every rank print its Python stacks to stderr (on a hang)."""
        import signal
        for p in self.procs:
            try:
                os.kill(p.pid, signal.SIGUSR1)
            except OSError:
                pass
        time.sleep(1.0)

    @property
    def alive(self) -> bool:
        return all(p.is_alive() for p in self.procs)

    def close(self, kill: bool = False) -> None:
        for c in self.conns:
            try:
                if not kill:
                    c.send(None)
            except Exception:
                pass
        for p in self.procs:
            if kill:
                p.kill()
            p.join(5)
            if p.is_alive():
                p.kill()
                p.join(5)
        self.conns = []
        self.procs = []


@contextlib.contextmanager
def comm_thread(comm: Any) -> Iterator[Any]:
    """``comm`` with every async call on its comm thread at once (none
    queued quietly for ``wait()`` to run, ``Communicator.inline_async_bytes``
    0) for the ``with`` body: for
    scenarios whose subject is queued work (a late or dead peer, pending
    Works), whatever their tensors' size."""
    old = comm.inline_async_bytes
    comm.inline_async_bytes = 0
    try:
        yield comm
    finally:
        comm.inline_async_bytes = old


def on_comm_thread(fn: Callable[..., Any]) -> Callable[..., Any]:
    """A rank scenario ``fn(comm, ...)`` run under :func:`comm_thread`."""
    @functools.wraps(fn)
    def run(comm: Any, *args: Any, **kwargs: Any) -> Any:
        with comm_thread(comm):
            return fn(comm, *args, **kwargs)
    return run


def settle_gloo() -> None:
    """torch 2.13 + gloo: works DDP launches during backward carry a Python
    object in their thread-local state (the context backward() stashes), and
    a gloo worker thread needs the GIL to free them. When the DDP module is
    freed, ~ProcessGroupGloo joins those workers with the GIL held, so a
    worker still freeing such a work deadlocks the rank (seen here, about
    one run in five). A barrier (waited with the GIL released) and a short
    sleep let the workers finish first."""
    import torch.distributed as dist
    dist.barrier()
    time.sleep(0.1)
