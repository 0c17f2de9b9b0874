"""Simulated hosts on one machine: Linux network namespaces, each process
started in private UTS, IPC, mount and PID namespaces with its own tmpfs on
``/dev/shm``. Two hosts are joined by a veth pair; more (or two, with
``switch=True``) by a switch: a Linux bridge inside a namespace of its own,
one veth from each host into it, as machines on one Ethernet switch. Such
hosts share nothing real machines would not share (no loopback, no shared
memory, no hostname), except the CPU cores and the file system.

Traffic stays on the machine: the addresses (``10.77.0.0/24`` by default) are
put on the hosts' veth ends inside their namespaces only, with no route out;
the bridge has no address and its namespace no route.

Needs root (``ip netns add``); :func:`unavailable` says why not where it
cannot work. Namespaces are named ``sc13-<pid>-<n>-<host>`` (the switch's
``sc13-<pid>-<n>-sw``); every ``Hosts`` deletes its own on exit, even after a
failure (deleting a namespace deletes the veths and the bridge in it), and
deletes those left by a process that no longer exists (a crashed run). Every
command that touches them has a timeout.
"""
from __future__ import annotations

import contextlib
import fcntl
import itertools
import os
import shutil
import subprocess
import sys
import threading
import time
from typing import Dict, Iterator, List, Optional, Sequence

PREFIX = "sc13-"
NETNS_DIR = "/var/run/netns"
ETC_NETNS = "/etc/netns"  # ip netns exec bind-mounts ETC_NETNS/<name>/hosts over /etc/hosts
_COUNTER = itertools.count()

# Variables a test must not pass to its simulated hosts: the suite's own
# loopback settings (scripts/test.sh) and anything else steering the libraries.
_DROP_PREFIXES = ("CCL_", "NCCL_", "FI_", "GLOO_", "MASTER_", "TORCHELASTIC_", "STREAMCOLL_", "PYTEST_", "OMP_")
_DROP = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK"}


LOCK = "/run/lock/streamcoll-netns.lock"  # scripts/slurm_two_nodes.sh takes it too
_HELD = threading.local()  # per thread: another thread of this process waits like another process


@contextlib.contextmanager
def _lock() -> Iterator[None]:
    """Namespaces are made and deleted one process at a time (the suite's two
    workers and the SLURM script: a veth's namespace argument once failed to
    open in CI while another worker made and deleted one). Re-entrant per
    thread (a failed ``__enter__`` closes what it made). Bounded: 60 s, then
    on without it, saying so."""
    if getattr(_HELD, "n", 0):
        yield
        return
    try:
        os.makedirs(os.path.dirname(LOCK), exist_ok=True)
        f = open(LOCK, "a")
    except OSError as e:
        print(f"[netns] no lock ({LOCK}: {e}): namespaces made without it", file=sys.stderr)
        yield
        return
    with f:  # closing the file releases the lock
        deadline = time.monotonic() + 60
        while True:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except OSError:
                if time.monotonic() > deadline:
                    print(f"[netns] {LOCK} busy for 60 s: going on without it", file=sys.stderr)
                    break
                time.sleep(0.05)
        _HELD.n = 1
        try:
            yield
        finally:
            _HELD.n = 0


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=20, check=check)


def unavailable() -> Optional[str]:
    """Why namespaces cannot be created here, or None."""
    for tool in ("ip", "unshare", "mount"):
        if shutil.which(tool) is None:
            return f"`{tool}` is not installed"
    if os.geteuid() != 0:
        return "creating network namespaces needs root (ip netns add)"
    name = f"{PREFIX}{os.getpid()}-probe"
    with _lock():
        return _probe(name)


def _probe(name: str) -> Optional[str]:
    try:
        r = _ip("netns", "add", name, check=False)
        if r.returncode:
            return f"`ip netns add` failed: {r.stderr.strip()}"
        r = subprocess.run(["ip", "netns", "exec", name, "unshare", "--uts", "--ipc", "--mount", "--propagation",
                            "private", "--pid", "--fork", "--mount-proc", "sh", "-c",
                            "hostname probe && mount -t tmpfs tmpfs /dev/shm"],
                           capture_output=True, text=True, timeout=20)
        if r.returncode:
            return f"private UTS/IPC/mount/PID namespaces are not available: {r.stderr.strip()}"
    except (OSError, subprocess.SubprocessError) as e:
        return f"namespaces cannot be created: {e}"
    finally:
        _ip("netns", "del", name, check=False)
    return None


def sweep_stale() -> List[str]:
    """Delete ``sc13-<pid>-...`` namespaces whose creating process is gone."""
    removed = []
    try:
        names = os.listdir(NETNS_DIR)
    except OSError:
        return removed
    for name in names:
        if not name.startswith(PREFIX):
            continue
        try:
            pid = int(name[len(PREFIX):].split("-", 1)[0])
        except ValueError:
            continue
        try:
            os.kill(pid, 0)
            continue  # its creator still runs
        except ProcessLookupError:
            pass
        except PermissionError:
            continue
        if _ip("netns", "del", name, check=False).returncode == 0:
            removed.append(name)
        shutil.rmtree(os.path.join(ETC_NETNS, name), ignore_errors=True)
    return removed


def clean_env(extra: Optional[Dict[str, str]] = None) -> Dict[str, str]:
    """This process's environment without the library, launcher and test
    variables (what a user's fresh shell on a host has), plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if k not in _DROP and not k.startswith(_DROP_PREFIXES)}
    env.update(extra or {})
    return env


class Hosts:
    """``len(hostnames)`` simulated hosts (2 to 250). Host ``i`` has address
    ``subnet.(i+1)`` on ``iface``. Two hosts are a veth pair unless
    ``switch`` is True; more are always on a switch (``switch=False`` is an
    error there). ``pid_shift[i]``: processes started and ended first in host
    ``i``'s fresh PID namespace (default none), so hosts started alike need
    not give their ranks equal pids."""

    def __init__(self, hostnames: Sequence[str] = ("node", "node"), iface: str = "mn0",
                 subnet: str = "10.77.0", pid_shift: Optional[Sequence[int]] = None,
                 switch: Optional[bool] = None) -> None:
        if not 2 <= len(hostnames) <= 250:
            raise ValueError(f"hostnames: 2 to 250 hosts, got {len(hostnames)}")
        if switch is False and len(hostnames) > 2:
            raise ValueError(f"switch=False: a veth pair joins two hosts, not {len(hostnames)}")
        shift = [0] * len(hostnames) if pid_shift is None else list(pid_shift)
        if len(shift) != len(hostnames):
            raise ValueError(f"pid_shift: one per host ({len(hostnames)}), got {len(shift)}")
        self.hostnames = list(hostnames)
        self.iface = iface
        self.subnet = subnet
        self.pid_shift = shift
        self.switch = len(hostnames) > 2 if switch is None else switch
        n = next(_COUNTER)
        self.names = [f"{PREFIX}{os.getpid()}-{n}-{i}" for i in range(len(hostnames))]
        self.switch_name = f"{PREFIX}{os.getpid()}-{n}-sw"
        self.created: List[str] = []

    def addr(self, i: int) -> str:
        return f"{self.subnet}.{i + 1}"

    def __enter__(self) -> "Hosts":
        with _lock():
            return self._make()

    def _make(self) -> "Hosts":
        sweep_stale()
        try:
            for i, name in enumerate(self.names):
                _ip("netns", "add", name)
                self.created.append(name)
                # Each host resolves its own hostname to its own address, as a real one does (gloo needs it).
                os.makedirs(os.path.join(ETC_NETNS, name), exist_ok=True)
                with open(os.path.join(ETC_NETNS, name, "hosts"), "w") as f:
                    f.write(f"127.0.0.1 localhost\n{self.addr(i)} {self.hostnames[i]}\n")
            if self.switch:
                self._cable_to_switch()
            else:
                a, b = self.names
                _ip("link", "add", self.iface, "netns", a, "type", "veth", "peer", "name", self.iface, "netns", b)
            for i, name in enumerate(self.names):
                _ip("-n", name, "addr", "add", f"{self.addr(i)}/24", "dev", self.iface)
                _ip("-n", name, "link", "set", "lo", "up")
                _ip("-n", name, "link", "set", self.iface, "up")
        except BaseException:
            self.close()
            raise
        return self

    def _cable_to_switch(self) -> None:
        """A bridge ``br0`` in the switch's namespace and one veth per host:
        ``iface`` in the host, ``p<i>`` on the bridge."""
        sw = self.switch_name
        _ip("netns", "add", sw)
        self.created.append(sw)
        _ip("-n", sw, "link", "add", "br0", "type", "bridge")
        for i, name in enumerate(self.names):
            _ip("link", "add", self.iface, "netns", name, "type", "veth", "peer", "name", f"p{i}", "netns", sw)
            _ip("-n", sw, "link", "set", f"p{i}", "master", "br0")
            _ip("-n", sw, "link", "set", f"p{i}", "up")
        _ip("-n", sw, "link", "set", "br0", "up")

    def command(self, i: int, argv: Sequence[str]) -> List[str]:
        """``argv`` run as a process of host ``i``: its network namespace,
        its hostname, its own IPC, PID namespace and ``/dev/shm``. Killing
        the returned process kills everything in that host (``--kill-child``
        ends the PID namespace's init, and with it the namespace)."""
        script = ('hostname "$0" && mount -t tmpfs -o size=1g tmpfs /dev/shm && '
                  f'i=0; while [ $i -lt {int(self.pid_shift[i])} ]; do /bin/true; i=$((i+1)); done; exec "$@"')
        return ["ip", "netns", "exec", self.names[i], "unshare", "--uts", "--ipc", "--mount", "--propagation",
                "private", "--pid", "--fork", "--mount-proc", "--kill-child", "sh", "-c", script,
                self.hostnames[i], *argv]

    def close(self) -> None:
        """Delete every namespace this ``Hosts`` made (bounded retries)."""
        with _lock():
            self._delete()

    def _delete(self) -> None:
        for name in reversed(self.created):
            for _ in range(5):  # bounded: a namespace still in use by a dying process may need a moment
                if _ip("netns", "del", name, check=False).returncode == 0 or not os.path.exists(
                        os.path.join(NETNS_DIR, name)):
                    break
                time.sleep(0.2)
            shutil.rmtree(os.path.join(ETC_NETNS, name), ignore_errors=True)
        self.created = []

    def __exit__(self, *exc) -> None:
        self.close()
