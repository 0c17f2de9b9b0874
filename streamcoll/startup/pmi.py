"""hydra's PMI (the simple PMI-1 wire protocol on ``PMI_FD``), just enough
for the rendezvous of a job started by MPICH's or Intel MPI's ``mpiexec``:
rank 0's address and a free port, with no MPI library in the process.

Why not mpi4py there: its ``MPI_Init`` maps the MPI's own libfabric (the
``mpich`` wheel bundles libfabric 2.5.1) before oneCCL loads, and oneCCL
then runs on it (it opens ``libfabric.so.1`` by name, and the loader hands
it the one already mapped). A process started without mpiexec (a server
beside the trainer) runs oneCCL on the system's libfabric (Debian's 1.17),
whose ``tcp`` provider does not speak 2.5.1's: a communicator between them
never finished its creation (measured: docs/failures.md, "A trainer under
mpiexec and a server"). PMI keeps the process's libfabric the one oneCCL
would load anyway.

The protocol (MPICH's ``src/pmi/simple``): one line per command,
``cmd=NAME key=value ...\\n``, one line per answer. The rendezvous sends
``init``, ``get_my_kvsname``, ``put``, ``barrier_in``, ``get``, and
``finalize`` only at the process's exit (:func:`finalize_at_exit`), so an
MPI the program starts later (mpi4py, oneCCL's MPI transport) initialises
on the same connection (measured with MPICH 5.0.2's hydra: ``MPI_Init``
after it works, and the job exits 0). The finalize is needed: hydra takes
the exit of a process that sent ``init`` and no ``finalize`` as an abort
and SIGKILLs the rest of the job (measured: the first rank to end killed
the others, 1 of 4 ranks finished and mpiexec exited 9).
"""
from __future__ import annotations

import atexit
import hashlib
import os
import select
import socket
import sys
from typing import Callable, Dict, List, Mapping, Optional, Tuple

__all__ = ["PmiError", "Pmi", "connect", "rendezvous", "finalize_at_exit"]

TIMEOUT = 300.0
"""Seconds one PMI answer may take (a barrier waits for the slowest rank's
start): past it the rendezvous fails naming PMI, not hangs for good."""

_ROUND = [0]  # rendezvous made in this process: each uses its own keys
_AT_EXIT: List[Tuple[int, "Pmi"]] = []  # (pid, connection) finalize_at_exit finalises


class PmiError(RuntimeError):
    """hydra's PMI answered something else than the protocol's answer."""


class Pmi:
    """One process's PMI connection (a duplicate of ``PMI_FD``: closing it
    leaves the launcher's descriptor to the MPI library)."""

    def __init__(self, fd: int, timeout: float = TIMEOUT) -> None:
        # Blocking, waits bounded with select: a socket timeout would set
        # O_NONBLOCK on the descriptor's file description, which the dup
        # shares with PMI_FD, and MPICH's PMI_Init, reading it later,
        # failed with EAGAIN ("PMI_Init returned -1", measured).
        self.sock = socket.socket(fileno=os.dup(fd))
        self.sock.setblocking(True)
        self.timeout = timeout
        self._buf = b""
        self.kvs = ""

    def close(self) -> None:
        self.sock.close()

    def _line(self) -> str:
        while b"\n" not in self._buf:
            if not select.select([self.sock], [], [], self.timeout)[0]:
                raise socket.timeout(f"PMI_FD: no answer from the launcher in {self.timeout:g} s")
            got = self.sock.recv(4096)
            if not got:
                raise PmiError("PMI_FD: the launcher closed the connection")
            self._buf += got
        line, self._buf = self._buf.split(b"\n", 1)
        return line.decode("utf-8", "replace").strip()

    def command(self, line: str, answer: str) -> Dict[str, str]:
        """Send ``cmd=...`` line ``line``; the answer's fields (``cmd``
        ``answer``, ``rc`` 0 where it has one), else :class:`PmiError`."""
        self.sock.sendall(line.encode() + b"\n")
        got = self._line()
        fields = dict(p.split("=", 1) for p in got.split() if "=" in p)
        if fields.get("cmd") != answer or fields.get("rc", "0") != "0":
            raise PmiError(f"PMI: {line.split()[0]} answered {got!r} (expected cmd={answer} rc=0)")
        return fields

    def init(self) -> None:
        self.command("cmd=init pmi_version=1 pmi_subversion=1", "response_to_init")
        self.kvs = self.command("cmd=get_my_kvsname", "my_kvsname")["kvsname"]

    def put(self, key: str, value: str) -> None:
        self.command(f"cmd=put kvsname={self.kvs} key={key} value={value}", "put_result")

    def get(self, key: str) -> str:
        return self.command(f"cmd=get kvsname={self.kvs} key={key}", "get_result")["value"]

    def barrier(self) -> None:
        self.command("cmd=barrier_in", "barrier_out")


def connect(env: Mapping[str, str], timeout: float = TIMEOUT) -> Optional[Pmi]:
    """The PMI connection ``PMI_FD`` names (None: unset); a malformed value
    is a ValueError naming it."""
    raw = env.get("PMI_FD", "").strip()
    if not raw:
        return None
    try:
        fd = int(raw)
    except ValueError:
        raise ValueError(f"PMI_FD: expected a file descriptor number, got {raw!r}") from None
    try:
        return Pmi(fd, timeout)
    except OSError as e:
        raise ValueError(f"PMI_FD={raw}: not an open socket ({e})") from None


def _token(text: str) -> str:
    """``text`` as a PMI value (no spaces): a digest, compared for equality only."""
    return hashlib.sha1(text.encode()).hexdigest()[:20]


def rendezvous(pmi: Pmi, rank: int, size: int, network: str,
               choose: Callable[[bool], Tuple[str, str]]) -> Tuple[str, str]:
    """Rank 0's (address, port) on every rank: each rank puts its
    ``network`` (boot id and network namespace), rank 0 reads them all,
    calls ``choose(same_network)`` for (address, port) and puts it; two
    barriers. Every rank of the launcher's world must call it."""
    _ROUND[0] += 1
    tag = f"streamcoll{_ROUND[0]}"
    pmi.init()
    pmi.put(f"{tag}-net{rank}", _token(network))
    pmi.barrier()
    if rank == 0:
        nets: List[str] = [pmi.get(f"{tag}-net{r}") for r in range(size)]
        addr, port = choose(all(n == nets[0] for n in nets))
        if " " in addr or "|" in addr:
            raise PmiError(f"PMI: rank 0's address {addr!r} cannot travel as a PMI value")
        pmi.put(f"{tag}-addr", f"{addr}|{port}")
    pmi.barrier()
    addr, _, port = pmi.get(f"{tag}-addr").partition("|")
    return addr, port


def _mpi_took_over() -> bool:
    """Whether an MPI initialised in this process (through mpi4py): its
    ``MPI_Finalize`` sends PMI's finalize on the same connection."""
    MPI = sys.modules.get("mpi4py.MPI")
    try:
        return MPI is not None and bool(MPI.Is_initialized())
    except Exception:
        return False


def _failed() -> bool:
    """Whether this process ends on a failure hydra should end the job for:
    an uncaught exception, or a native call that never returns (a stuck
    collective: :func:`streamcoll.diagnostics.failure.skip_native_teardown`).
    Without PMI's finalize hydra takes the exit as an abort and ends the
    other ranks (a finalised rank's non-zero exit ends nothing: measured,
    the other rank slept on for 30 s)."""
    if getattr(sys, "last_value", None) is not None:
        return True
    try:
        from ..diagnostics import failure
        return bool(failure._SKIP_REGISTERED)
    except Exception:
        return False


def _finalize() -> None:
    if not _AT_EXIT:
        return
    pid, conn = _AT_EXIT.pop()
    try:
        if pid == os.getpid() and not _mpi_took_over() and not _failed():  # a fork's child: its parent finalises
            conn.timeout = 5.0
            conn.command("cmd=finalize", "finalize_ack")
    except (OSError, PmiError):
        pass  # the launcher is gone: nothing to tell it
    finally:
        conn.close()


def finalize_at_exit(conn: Pmi) -> None:
    """Keep ``conn`` open and send PMI's ``finalize`` on it when this
    process exits normally, unless an MPI initialised meanwhile (its own
    finalize tells hydra) or the process ends on a failure (:func:`_failed`:
    then hydra ends the job, as it did before). A second connection is
    closed at once."""
    if _AT_EXIT:
        conn.close()
        return
    atexit.register(_finalize)  # once: a second call found _AT_EXIT set
    _AT_EXIT.append((os.getpid(), conn))
