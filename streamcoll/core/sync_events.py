"""Completion events of synchronous CUDA collectives, for the watchdog.

A synchronous (``async_op=False``) GPU collective returns to the host as
soon as NCCL has enqueued it; its flight entry then says nothing about
whether the kernel ever finished. A kernel stuck on a dead peer with no
asynchronous error (``ncclCommGetAsyncError`` stays clean while it waits) was
invisible to the watchdog, and the process hung in the next
``cudaStreamSynchronize`` with no report. PyTorch's ProcessGroupNCCL records
events around every op; streamcoll records one completion event after every
``STREAMCOLL_SYNC_EVENTS``-th synchronous CUDA collective (default 1: every
one; 0: none) on the stream it ran on, and the watchdog declares the entry
stuck once the event has not fired within the communicator's timeout.

Cost: one ``cudaStreamIsCapturing`` and one ``cudaEventRecord`` through cffi
(:mod:`streamcoll._ffi.cudart`), inline in the generated launcher (no Python
frame), and no allocation: the events are created once per flight-ring slot
and reused with the slot. A
stream that is capturing a CUDA graph gets no event (the launch is a graph
node, not work to watch). Any failure here only costs the op its event: the
collective itself never fails because of it.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Any, Dict, List, Optional

import torch

from .env_vars import read_int

__all__ = ["SyncEvents", "every", "for_communicator"]

log = logging.getLogger("streamcoll")


def every() -> int:
    """``STREAMCOLL_SYNC_EVENTS``: record an event after every N-th
    synchronous CUDA collective (default 1; 0 disables)."""
    return read_int("STREAMCOLL_SYNC_EVENTS", 1, minimum=0)


def for_communicator(comm: Any) -> Optional["SyncEvents"]:
    """The completion events of a CUDA communicator's synchronous calls, or
    None: not CUDA, disabled with ``STREAMCOLL_SYNC_EVENTS=0``, or no CUDA
    runtime to record them with (a warning says so: the watchdog then
    cannot see a sync call hang)."""
    if comm._device.type != "cuda":
        return None
    if every() == 0:
        return None
    try:
        return SyncEvents(comm._flight.capacity, comm._rt.index)
    except Exception as e:
        log.warning("streamcoll: communicator %r records no completion events for synchronous calls (%s); the "
                    "watchdog cannot see such calls hang without an asynchronous error", comm.name, e)
        return None


class SlotEvent:
    """A raw ``cudaEvent_t`` owned by one flight-ring slot; ``query()`` as
    torch's Event (True once fired), raising CudaError on a CUDA error."""

    __slots__ = ("handle", "_owner", "seen")

    def __init__(self, handle: Any, owner: "SyncEvents") -> None:
        self.handle = handle
        self._owner = owner
        # The sequence number the watchdog last saw complete with this event:
        # an entry still holding that number is not queried again (a new
        # occupant of the slot has a new number).
        self.seen = 0

    def query(self) -> bool:
        o = self._owner
        with o.lock:  # not while close() destroys the events
            if o.closed:
                return True  # destroyed with its communicator: nothing left to watch
            rc = o.lib.cudaEventQuery(self.handle)
        if rc == 0:
            return True
        o.clear_last_error(rc)  # the runtime keeps it as this thread's last error, which torch's next launch check reads
        if rc == o.not_ready:
            return False
        raise o.binding.error("cudaEventQuery", rc)


class SyncEvents:
    """The completion events of one CUDA communicator's synchronous calls.

    The launch path records them inline (:meth:`source`, placed in the
    generated synchronous launchers of :mod:`streamcoll.core.launch`), so the
    CUDA fast path still enters one Python frame: only C calls (cffi) run
    per op, and Python methods only on the rare paths (the first call on a
    stream, a slot's first event, a failure).
    """

    def __init__(self, ring_size: int, device_index: int, n: Optional[int] = None) -> None:
        from .._ffi.cudart import CUDART, EVENT_DISABLE_TIMING

        self.every = every() if n is None else n
        self.binding = CUDART
        self.lib = CUDART.lib()
        self.ffi = CUDART.ffi
        self.device_index = device_index
        self.not_ready = CUDART.const("cudaErrorNotReady")
        self._flags = EVENT_DISABLE_TIMING
        self.mask = ring_size - 1
        self.slots: List[Optional[SlotEvent]] = [None] * ring_size
        self.streams: Dict[int, Any] = {}
        self.status = self.ffi.new("enum cudaStreamCaptureStatus *")
        self._new = self.ffi.new("cudaEvent_t *")
        self._dev = self.ffi.new("int *")
        self._prev = self.ffi.new("int *")
        self.closed = False
        self.lock = threading.Lock()
        self.failures = 0
        self.created = 0
        self.count = [0]  # synchronous calls so far (sampling counts these, not sequence numbers)

    # -- what the launch path runs --------------------------------------------
    def source(self) -> str:
        """Statements (indented 0) that put the completion event of call
        ``seq`` on its entry ``e``; ``hs`` is the int ``cudaStream_t`` it ran
        on. Names they use: :meth:`namespace`."""
        body = (
            "e.t_enq = _now()  # before the event: a reader never pairs the new event with an old time\n"
            "cs = _sev_streams.get(hs)\n"
            "if cs is None:\n"
            "    cs = _sev.stream(hs)\n"
            "if (rc2 := _sev_capturing(cs, _sev_status)) == 0 and _sev_status[0] == 0:\n"
            "    ev = _sev_slots[seq & _sev_mask]\n"
            "    if ev is None:\n"
            "        ev = _sev.slot(seq)\n"
            # the legacy stream (hs 0) is the *current device's*: record there only on the
            # communicator's device (a thread that never set one is on device 0)
            "    if ev is not None and (rc2 := (_sev_record(ev.handle, cs) if hs or (_sev_getdev(_sev_dev) == 0 and "
            "_sev_dev[0] == _sev_index) else _sev.record_on_device(ev, cs))) == 0:\n"
            "        e.event = ev\n"
            "    else:\n"
            "        e.event = _sev.failed('cudaEventRecord', rc2 if ev is not None else 0)\n"
            "else:\n"
            "    e.event = _sev.failed('cudaStreamIsCapturing', rc2)  # rc2 0: capturing, a graph node\n"
        )
        if self.every == 1:
            return body
        # every N-th synchronous call (async calls take sequence numbers too:
        # sampling by those could skip every sync call of a steady pattern)
        return ("_sev_count[0] = k = _sev_count[0] + 1\nif k % _sev_every:\n    e.event = None\nelse:\n"
                + "".join("    " + ln + "\n" for ln in body.splitlines()))

    def namespace(self) -> Dict[str, Any]:
        lib = self.lib
        return {"_sev": self, "_sev_streams": self.streams, "_sev_slots": self.slots, "_sev_mask": self.mask,
                "_sev_status": self.status, "_sev_every": self.every, "_sev_count": self.count,
                "_sev_capturing": lib.cudaStreamIsCapturing, "_sev_record": lib.cudaEventRecord,
                "_sev_getdev": lib.cudaGetDevice, "_sev_dev": self._dev, "_sev_index": self.device_index}

    def recorder(self):  # type: ignore[no-untyped-def]
        """``record(e, seq, hs)``: :meth:`source` as a function (the same
        code the launchers inline; for tests and tools)."""
        ns = dict(self.namespace(), _now=time.monotonic_ns)
        src = "def record(e, seq, hs):\n" + "".join("    " + ln + "\n" for ln in self.source().splitlines())
        exec(compile(src, "<streamcoll sync events>", "exec"), ns)
        return ns["record"]

    # -- the rare paths ---------------------------------------------------------
    def stream(self, hs: int) -> Any:
        cs = self.streams[hs] = self.ffi.cast("cudaStream_t", hs)
        return cs

    def slot(self, seq: int) -> Optional[SlotEvent]:
        """The event of ``seq``'s ring slot, created on first use (None if it cannot be)."""
        if self.closed:
            return None  # destroyed or aborted: no new events
        try:
            ev = self._create()
        except Exception as e:
            self._warn(e)
            return None
        self.slots[seq & self.mask] = ev
        return ev

    def _create(self) -> SlotEvent:
        # An event belongs to the current device's context: create it on the communicator's.
        with torch.cuda.device(self.device_index):
            rc = self.lib.cudaEventCreateWithFlags(self._new, self._flags)
        if rc:
            raise self.binding.error("cudaEventCreateWithFlags", rc)
        self.created += 1
        return SlotEvent(self._new[0], self)

    def record_on_device(self, ev: SlotEvent, cs: Any) -> int:
        """Record ``ev`` on the legacy stream ``cs`` of the communicator's
        device while the calling thread's current device is another one (or
        unknown): switch, record, switch back. Returns the CUDA result."""
        lib = self.lib
        rc = lib.cudaGetDevice(self._prev)
        if rc:
            return int(rc)
        prev = self._prev[0]
        rc = lib.cudaSetDevice(self.device_index)
        if rc:
            return int(rc)
        try:
            return int(lib.cudaEventRecord(ev.handle, cs))
        finally:
            lib.cudaSetDevice(prev)

    def clear_last_error(self, rc: int) -> None:
        """Clear ``rc`` from the calling thread's CUDA last error, where it
        is the last error: streamcoll and torch share one ``libcudart``, and
        torch's next kernel-launch check (``cudaGetLastError``) would raise a
        result of streamcoll's call as its own (torch clears it after its own
        event queries, ``c10/cuda/CUDAEvent.h``). Another error there (not
        ours) is left for its owner."""
        lib = self.lib
        if lib.cudaPeekAtLastError() == rc:
            lib.cudaGetLastError()

    def failed(self, function: str, rc: int) -> None:
        """The call gets no event: capturing (``rc`` 0), or ``function`` failed."""
        if rc:
            self.clear_last_error(rc)
            self._warn(self.binding.error(function, rc))
        return None

    def _warn(self, e: BaseException) -> None:
        self.failures += 1
        if self.failures == 1:
            log.warning("streamcoll: no completion event for a synchronous CUDA collective (%s); the watchdog "
                        "cannot see such calls hang without an asynchronous error", e)

    def close(self) -> None:
        """Destroy the events (pending ones are released by CUDA when they fire)."""
        with self.lock:  # a watchdog query in flight finishes first
            if self.closed:
                return
            self.closed = True
            for i, ev in enumerate(self.slots):
                self.slots[i] = None  # the list is shared with the launchers' namespaces
                if ev is not None:
                    try:
                        self.lib.cudaEventDestroy(ev.handle)
                    except Exception:
                        pass

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass
