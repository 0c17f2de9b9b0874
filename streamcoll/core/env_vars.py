"""Every environment variable streamcoll reads or sets, in one table.

``python -m streamcoll info`` prints the current value of each, and the
docs/backends-and-defaults.md's table is rendered from it (:func:`markdown`; a test keeps the two
equal), so a variable documented in one place is documented in all. The
*values* of the defaults streamcoll applies, and why, are in
:mod:`streamcoll.startup.env_defaults`; this table says which variables they are.
"""
from __future__ import annotations

import os
from typing import List, NamedTuple, Optional, Tuple, overload

__all__ = ["EnvVar", "TABLE", "names", "markdown", "read_int", "read_choice"]


class EnvVar(NamedTuple):
    """One variable: its name, its default (as streamcoll sees it), and what
    it does. ``kind``: ``streamcoll`` (read by streamcoll), ``applied`` (a
    native library's variable that streamcoll sets when unset, around the
    native calls only: :mod:`streamcoll.startup.env_defaults`), or ``read`` (a launcher's or
    library's variable streamcoll reads). Whether a variable must be equal
    on every rank: :data:`streamcoll.startup.env_defaults.AGREEMENT` (the native ones),
    :data:`streamcoll.startup.env_defaults.OWN` (streamcoll's); each of streamcoll's says
    which in its ``doc`` ("equal on every rank (checked)" or "may differ
    between ranks", tests/core/test_env_vars.py)."""

    name: str
    kind: str
    default: str
    doc: str


TABLE: Tuple[EnvVar, ...] = (
    EnvVar("STREAMCOLL_TIMEOUT", "streamcoll", "600",
           "default timeout of communicators, in seconds (positive); may differ between ranks (when this rank "
           "gives up)"),
    EnvVar("STREAMCOLL_WATCHDOG", "streamcoll", "exit",
           "`exit`: end a process whose call outlives the timeout (code 86); `fail`: mark the "
           "communicator failed only; `off`: no watchdog; may differ between ranks (what this rank does then)"),
    EnvVar("STREAMCOLL_HANG_REPORT_S", "streamcoll", "2",
           "seconds a rank whose collective timed out waits for the other ranks' answers to its hang report "
           "(who has not entered the collective, and where: docs/failures.md); `0`: no hang reports (no alarm, "
           "no polling, no extra store connection); may differ between ranks (a rank with `0` neither asks nor "
           "answers: the others name it as not answering)"),
    EnvVar("STREAMCOLL_FLIGHT_DIR", "streamcoll", "$XDG_RUNTIME_DIR/streamcoll-flight or <tmp>/streamcoll-flight-<uid>",
           "where flight-record dumps go (files of mode 0600). The default directory is this user's, made "
           "0700; one that is a link, not a directory or another user's is refused with a warning, and the "
           "dump goes to a new private directory named in it; may differ between ranks"),
    EnvVar("STREAMCOLL_FLIGHT_SIZE", "streamcoll", "1024",
           "entries kept per communicator by the flight recorder; may differ between ranks"),
    EnvVar("STREAMCOLL_DEBUG_CHECKS", "streamcoll", "0",
           "`1`: every rank checks, before each collective, that all ranks call the same one "
           "(also turned on by `TORCH_DISTRIBUTED_DEBUG=DETAIL`); equal on every rank (checked: the checks are "
           "store keys every rank writes and waits for)"),
    EnvVar("STREAMCOLL_SIGNATURE_CHECKS", "streamcoll", "256",
           "distinct call signatures (collective, element counts, dtypes, reduction, root) each communicator "
           "of 2 or more ranks checks across ranks the first time it sees one; `0`: none; equal on every rank "
           "(checked: a rank without them, or with another bound, leaves its peers waiting for its keys)"),
    EnvVar("STREAMCOLL_RECORD_STREAM", "streamcoll", "0",
           "`1`: async tensors are kept with `Tensor.record_stream` instead of held by the Work; may differ "
           "between ranks"),
    EnvVar("STREAMCOLL_NCCL_NONBLOCKING", "streamcoll", "0",
           "`1`: NCCL communicators are created non-blocking and polled (init can time out); may differ between "
           "ranks (how this rank waits; the calls are the same)"),
    EnvVar("STREAMCOLL_DEVICE", "streamcoll", "",
           "`xpu`: default device of a oneCCL communicator is the XPU (else the CPU); may differ between ranks as "
           "far as streamcoll checks (this rank's default device, not compared, as `device=` is not)"),
    EnvVar("STREAMCOLL_NO_ENV_DEFAULTS", "streamcoll", "0",
           "`1`: apply none of the CCL_/FI_/NCCL_ defaults below; may differ between ranks where the values it "
           "leaves agree (those are checked)"),
    EnvVar("STREAMCOLL_ONECCL_LIBRARY", "streamcoll", "",
           "path to `libccl.so.2` or its folder (first in the search order); may differ between ranks"),
    EnvVar("STREAMCOLL_NCCL_LIBRARY", "streamcoll", "",
           "path to `libnccl.so.2` or its folder (first in the search order); may differ between ranks"),
    EnvVar("STREAMCOLL_CUDART_LIBRARY", "streamcoll", "",
           "path to `libcudart.so.<N>` or its folder (first in the search order; CUDA only: helper threads' "
           "capture mode, sync completion events); may differ between ranks"),
    EnvVar("STREAMCOLL_SYNC_EVENTS", "streamcoll", "1",
           "CUDA: record a completion event after every N-th synchronous collective, so the watchdog sees "
           "one hang (`0`: none); may differ between ranks"),
    EnvVar("STREAMCOLL_HOME", "streamcoll", "~/.cache/streamcoll",
           "where the runtime `scripts/setup.sh` assembles lives; may differ between ranks"),
    EnvVar("CCL_LOG_LEVEL", "applied", "error", "oneCCL prints errors only"),
    EnvVar("CCL_LOCAL_RANK", "applied", "the rank's place on its host", "oneCCL's local rank"),
    EnvVar("CCL_LOCAL_SIZE", "applied", "the ranks on its host", "oneCCL's local size"),
    EnvVar("CCL_WORKER_OFFLOAD", "applied", "0 (1 when some machine's ranks cannot have a core each)",
           "run collectives on the calling thread; equal on every rank (checked)"),
    EnvVar("CCL_YIELD", "applied", "sched_yield (when offloading; several hosts: sleep)",
           "oversubscribed: waiting ranks yield their core; equal on every rank (checked)"),
    EnvVar("CCL_ATL_SHM", "applied", "1 (several hosts: where a host has several ranks)",
           "shared-memory transport inside hosts; equal on every rank (checked)"),
    EnvVar("FI_PROVIDER", "applied", "shm (one host)", "libfabric's provider; equal on every rank (checked)"),
    EnvVar("CCL_KVS_IFACE", "applied", "lo / the routed interface",
           "oneCCL's key-value store: loopback on one host, else the interface that reaches MASTER_ADDR"),
    EnvVar("CCL_MNIC_NAME", "applied", "the routed interface", "several hosts: oneCCL's network interface"),
    EnvVar("CCL_MNIC", "read", "", "oneCCL's NIC selection (set by the user: streamcoll sets no CCL_MNIC_NAME)"),
    EnvVar("CCL_MNIC_COUNT", "read", "", "oneCCL's number of NICs (user setting)"),
    EnvVar("CCL_ALLREDUCE", "applied", "recursive_doubling:0-16384;nreduce:16385-max (or nreduce)",
           "all-reduce algorithm by message size; equal on every rank (checked)"),
    EnvVar("NCCL_SOCKET_IFNAME", "applied", "lo / =the routed interface",
           "NCCL's sockets: loopback on one host, else exactly the interface that reaches MASTER_ADDR"),
    EnvVar("STREAMCOLL_INLINE_ASYNC_BYTES", "streamcoll", "65536",
           "CPU: an `async_op=True` call whose largest buffer has at most this many bytes is queued without "
           "waking the comm thread and returns a pending Work; `wait()` within 1 ms runs it on the calling thread, "
           "a query, `wait(timeout)` or its 1 ms deadline starts it on the comm thread (`streamcoll/core/work.py`); "
           "larger ones go to the comm thread at once and overlap. `0`: every call wakes the comm thread "
           "(measured: `benchmarks/inline_async.py`); may differ between ranks (when this rank starts a call, "
           "not which)"),
    EnvVar("STREAMCOLL_EAGER_INIT", "streamcoll", "auto",
           "`init_process_group(\"streamcoll\")` makes the world's cpu communicator at once where oneCCL loads "
           "and no CUDA GPU is visible, before any sub-group's (oneCCL's shared memory serves later communicators "
           "only among a process's first one's members); `1` always, `0` at the first cpu collective; may differ "
           "between ranks where every rank's first cpu collective is the world's (the settings oneCCL then runs "
           "with are checked); a lazy rank whose first is a sub-group's with an eager peer waits for it until "
           "the timeout: set it alike (not checked: the ranks are then in different rendezvous)"),
    EnvVar("STREAMCOLL_WIDEN_BF16", "streamcoll", "1",
           "`0`: bf16 reductions on oneCCL's CPU path in bf16 (default: through float32, correctly rounded); "
           "equal on every rank (checked: it changes the C calls, at two ranks an all-gather or an all-reduce)"),
    EnvVar("CCL_BF16", "read", "", "oneCCL's bf16 implementation (avx512 variants crash on AVX2-only CPUs)"),
    EnvVar("CCL_ROOT", "read", "", "an installed oneAPI oneCCL (library search)"),
    EnvVar("CCL_ATL_TRANSPORT", "read", "ofi",
           "oneCCL's transport: `mpi` only under that MPI's own mpiexec with its libmpi loadable (else refused before the init, naming why); equal on every rank (checked)"),
    EnvVar("NCCL_DEBUG", "read", "", "NCCL's own logging"),
    EnvVar("NCCL_HOME", "read", "", "NCCL installation (library and header search)"),
    EnvVar("CUDA_HOME", "read", "", "CUDA installation (library search)"),
    EnvVar("RANK", "read", "0", "this process's rank (torchrun)"),
    EnvVar("WORLD_SIZE", "read", "1", "number of ranks (torchrun); `world_size=` must agree"),
    EnvVar("LOCAL_RANK", "read", "RANK", "rank on this host; picks `cuda:LOCAL_RANK`"),
    EnvVar("LOCAL_WORLD_SIZE", "read", "WORLD_SIZE", "ranks on this host"),
    EnvVar("TORCH_DISTRIBUTED_DEBUG", "read", "",
           "`DETAIL`: streamcoll's per-call debug checks, as `STREAMCOLL_DEBUG_CHECKS=1`; equal on every rank "
           "(checked, with it)"),
    EnvVar("TORCH_NCCL_ASYNC_ERROR_HANDLING", "read", "",
           "where `STREAMCOLL_WATCHDOG` is unset: `1`/`3` exit, `0`/`2` fail"),
    EnvVar("TORCH_FR_BUFFER_SIZE", "read", "",
           "where `STREAMCOLL_FLIGHT_SIZE` is unset: entries per communicator; > 0 also writes torch-format dumps"),
    EnvVar("TORCH_FR_DUMP_TEMP_FILE", "read", "/tmp/nccl_trace_rank_",
           "set: flight dumps are also written as torch's pickles `<prefix><rank>` (for `fr_trace`)"),
    EnvVar("TORCH_NCCL_DUMP_ON_TIMEOUT", "read", "",
           "`1`: flight dumps are also written in torch's format (at `TORCH_FR_DUMP_TEMP_FILE`'s prefix)"),
    EnvVar("GROUP_RANK", "read", "", "torchrun's node index (several hosts)"),
    EnvVar("MASTER_ADDR", "read", "", "address of the rendezvous store (rank 0)"),
    EnvVar("MASTER_PORT", "read", "", "port of the rendezvous store"),
    EnvVar("LD_LIBRARY_PATH", "read", "", "the loader's search path (library search)"),
)


def names() -> List[str]:
    """Every variable's name, in table order."""
    return [v.name for v in TABLE]


def markdown() -> str:
    """The table as docs/backends-and-defaults.md shows it."""
    lines = ["| variable | kind | default | what it does |", "| --- | --- | --- | --- |"]
    for v in TABLE:
        default = f"`{v.default}`" if v.default else ""
        lines.append(f"| `{v.name}` | {v.kind} | {default} | {v.doc} |")
    return "\n".join(lines) + "\n"


@overload
def read_int(name: str, default: int, minimum: Optional[int] = None) -> int: ...
@overload
def read_int(name: str, default: None = None, minimum: Optional[int] = None) -> Optional[int]: ...


def read_int(name: str, default: Optional[int] = None, minimum: Optional[int] = None) -> Optional[int]:
    """Integer variable ``name`` (``default`` when unset or empty). Anything
    else, or a value below ``minimum``, is a ValueError naming the variable
    and what was expected."""
    v = os.environ.get(name, "").strip()
    if v == "":
        return default
    want = "an integer" if minimum is None else f"an integer >= {minimum}"
    try:
        n = int(v)
    except ValueError:
        raise ValueError(f"{name}: expected {want}, got {v!r}") from None
    if minimum is not None and n < minimum:
        raise ValueError(f"{name}: expected {want}, got {n}")
    return n


def read_choice(name: str, choices: Tuple[str, ...], default: str) -> str:
    """Variable ``name``, one of ``choices`` (``default`` when unset or
    empty); anything else is a ValueError naming the variable and them."""
    v = os.environ.get(name, "").strip().lower()
    if v == "":
        return default
    if v not in choices:
        raise ValueError(f"{name}: expected one of {', '.join(map(repr, choices))}, got {v!r}")
    return v
