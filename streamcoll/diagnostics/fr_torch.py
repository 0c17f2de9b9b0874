"""Flight-recorder dumps in torch's format, for
``python -m torch.distributed.flight_recorder.fr_trace DIR``.

torch's reader (torch 2.13, ``flight_recorder/components/loader.py`` and
``types.py``) reads pickles named ``<prefix><rank>`` holding ``version``
(``"major.minor"``), ``pg_config`` (group name -> ``name``, ``desc``,
``ranks`` as a string) and ``entries``, each with ``record_id``,
``pg_id``, ``process_group`` (name, desc), ``collective_seq_id``,
``p2p_seq_id``, ``op_id``, ``profiling_name`` (``<library>:<op>``, the
library one of its list: ``nccl`` here for NCCL, ``xccl`` for oneCCL), sizes
and dtypes in and out, ``state`` (``scheduled``/``started``/``completed``),
times in ns, ``timeout_ms``, ``is_p2p``, ``frames``.

Written next to streamcoll's JSON dump (:func:`streamcoll.core.recorder.dump`,
which the watchdog calls on a hang) when one of torch's variables asks for
it: ``TORCH_FR_DUMP_TEMP_FILE`` (the prefix; torch's default
``/tmp/nccl_trace_rank_``), ``TORCH_NCCL_DUMP_ON_TIMEOUT=1`` or
``TORCH_FR_BUFFER_SIZE`` > 0. One file per process (every live
communicator's entries, as torch writes every group's), the rank being
``RANK`` (the global rank) where set, else the communicator's.

``frames`` (torch: the stack where the collective was issued) is empty,
except for a call in flight when a hang report dumped the record
(:mod:`streamcoll.diagnostics.hang_report`): the stack of the thread inside
it, innermost first. The other threads' stacks have no field in torch's
format: they are in the JSON dump only.

What does not map: point-to-point entries carry no peer in streamcoll's
recorder, and torch's reader needs ``send a->b``; they are left out (the
collectives' order is what fr_trace aligns).
"""
from __future__ import annotations

import logging
import os
import pickle
import re
from typing import Any, Dict, List, Optional

from ..core import hooks as _hooks
from ..core.communicator import LIVE
from ..core.recorder import open_dump_dir, snapshot, write_private

__all__ = ["VERSION", "wanted", "prefix", "to_torch", "dump_torch"]

VERSION = "2.10"
DEFAULT_PREFIX = "/tmp/nccl_trace_rank_"

# streamcoll's op names -> the names torch's reader knows (types.COLLECTIVES)
_NAMES = {"all_gather_into_tensor": "_all_gather_base", "reduce_scatter_tensor": "_reduce_scatter_base",
          "split": "all_gather", "coalesced": "coalesced"}
_STATES = {"enqueued": "scheduled", "launched": "started", "running": "started", "completed": "completed",
           "failed": "completed"}


def wanted() -> bool:
    """Whether torch's flight-recorder variables ask for its dumps."""
    if os.environ.get("TORCH_FR_DUMP_TEMP_FILE", "").strip():
        return True
    if os.environ.get("TORCH_NCCL_DUMP_ON_TIMEOUT", "").strip().lower() in ("1", "true", "yes", "on"):
        return True
    try:
        return int(os.environ.get("TORCH_FR_BUFFER_SIZE", "0") or "0") > 0
    except ValueError:
        return False


def prefix() -> str:
    return os.environ.get("TORCH_FR_DUMP_TEMP_FILE", "").strip() or DEFAULT_PREFIX


def _dtype(s: Any) -> str:
    from ..core.profiling import dtype_name
    import torch
    d = getattr(torch, str(s).replace("torch.", ""), None)
    return dtype_name(d) if isinstance(d, torch.dtype) else str(s)


def _ns(wall: Any) -> int:
    return int(float(wall) * 1e9) if isinstance(wall, (int, float)) and wall else 0


def to_torch(snaps: List[dict], rank: int) -> dict:
    """torch's dump of a process from streamcoll snapshots (:func:`streamcoll.core.recorder.snapshot`)."""
    entries: List[dict] = []
    pg_config: Dict[str, dict] = {}
    for pg_id, s in enumerate(snaps):
        name = s["communicator"]
        desc = f"streamcoll:{s['backend']}"
        pg_config[name] = {"name": name, "desc": desc, "ranks": str(list(range(int(s["size"]))))}
        lib = "nccl" if s["backend"] == "nccl" else "xccl"
        # the stack of the thread inside a call in flight, where a hang report took it (hang_report)
        frames = (s.get("hang") or {}).get("call_frames") or {}
        for e in s["entries"]:
            if e.get("collective_seq") is None:
                continue  # point to point: no peer recorded (module docstring)
            op = _NAMES.get(e["op"], e["op"])
            shapes = [list(x) for x in (e.get("shapes") or []) if x is not None]
            dtypes = [_dtype(x) for x in (e.get("dtypes") or [])]
            state = _STATES.get(e.get("state"), "scheduled")
            entries.append({
                "record_id": len(entries), "pg_id": pg_id, "process_group": (name, desc),
                "collective_seq_id": int(e["collective_seq"]), "p2p_seq_id": 0, "op_id": int(e["seq"]),
                "profiling_name": f"{lib}:{op}", "time_created_ns": _ns(e.get("enqueued") or e.get("started")),
                "input_sizes": shapes, "input_dtypes": dtypes, "output_sizes": shapes, "output_dtypes": dtypes,
                "state": state, "time_discovered_started_ns": _ns(e.get("started")) or None,
                "time_discovered_completed_ns": _ns(e.get("ended")) or None, "retired": state == "completed",
                "timeout_ms": int(float(s.get("timeout_s") or 0) * 1000), "is_p2p": False,
                "frames": list(frames.get(str(e["seq"])) or []) if state != "completed" else [],
            })
    return {"version": VERSION, "pg_config": pg_config, "pg_status": {}, "entries": entries, "rank": rank}


def dump_torch(comms: List[Any], reason: str = "", path: Optional[str] = None) -> str:
    """Write torch's dump of ``comms`` (this process's communicators) to
    ``path`` (default ``<prefix><rank>``); returns the file written."""
    if not comms:
        raise ValueError("comms: no communicator to dump")
    r = os.environ.get("RANK", "")
    rank = int(r) if r.isdigit() else int(comms[0]._rank)
    target = path or f"{prefix()}{rank}"
    dfd, d = open_dump_dir(os.path.dirname(os.path.abspath(target)))
    try:
        write_private(dfd, os.path.basename(target),
                      pickle.dumps(to_torch([snapshot(c, reason) for c in comms], rank)))
    finally:
        os.close(dfd)
    return os.path.join(d, os.path.basename(target))


def _after_dump(comm: Any, reason: str) -> None:
    """After streamcoll's JSON dump of ``comm`` (:func:`streamcoll.core.recorder.dump`,
    through :data:`streamcoll.core.hooks.on_dump`): torch's too, of every live
    communicator, where torch's variables ask for it. Never raises: the JSON
    dump is written; a warning says why torch's is not."""
    if not wanted():
        return
    try:
        dump_torch([comm] + [c for c in list(LIVE) if c is not comm], reason)
    except Exception as e:  # noqa: BLE001
        logging.getLogger("streamcoll.flight").warning("torch-format flight dump not written: %s", e)


# ------------------------------------------------------- reading torch's dumps
_BACK = {v: k for k, v in _NAMES.items() if k not in ("split", "coalesced")}
_BACK.update({"allreduce": "all_reduce", "_allgather_base": "all_gather_into_tensor",
              "allgather_into_tensor_coalesced": "all_gather_into_tensor"})
_STATES_BACK = {"scheduled": "enqueued", "started": "running", "completed": "completed"}


class _Plain(pickle.Unpickler):
    """Only plain containers: a dump is data, and unpickling runs code otherwise."""

    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"not a flight-recorder dump (it names {module}.{name})")


def load(path: str) -> Optional[dict]:
    """torch's dump at ``path`` (a dict with ``entries``, ``version``,
    ``pg_config``), or None if it is not one."""
    try:
        with open(path, "rb") as f:
            d = _Plain(f).load()
    except Exception:
        return None
    if not isinstance(d, dict) or not {"entries", "version", "pg_config"} <= set(d):
        return None
    return d


def from_torch(d: dict, path: str) -> List[dict]:
    """streamcoll snapshots (one per process group) of torch's dump ``d``
    read from ``path`` (its rank: the name's trailing digits, as fr_trace
    reads it). Groups are named by their entries' ``process_group`` name; a
    ``pg_config`` keyed ``""`` (gloo's CPU dumps on torch 2.13, on which
    fr_trace raises ``KeyError``) is matched by that name or, with one
    group, taken for it."""
    import re
    m = re.search(r"(\d+)$", os.path.basename(path))
    raw = d.get("rank")
    grank = int(raw) if raw is not None else (int(m.group(1)) if m else -1)
    cfg = d.get("pg_config") or {}
    by_name: Dict[str, dict] = {}
    for k, v in cfg.items():
        by_name[str(v.get("name", k)) if isinstance(v, dict) else str(k)] = v if isinstance(v, dict) else {}
    out: Dict[str, dict] = {}
    for e in d["entries"]:
        pg = e.get("process_group") or ("", "")
        name = str(pg[0])
        c = by_name.get(name) or (next(iter(by_name.values())) if len(by_name) == 1 else {})
        try:
            ranks = [int(x) for x in re.findall(r"-?\d+", str(c.get("ranks", "[]")))]  # "[0, 1]": text, never code
        except Exception:
            ranks = []
        s = out.get(name)
        if s is None:
            rank = ranks.index(grank) if grank in ranks else grank
            s = out[name] = {"format": "streamcoll-flight", "communicator": f"{name}:{pg[1]}" if pg[1] else name,
                             "backend": "torch", "rank": rank, "size": len(ranks) or 1, "issued": 0,
                             "p2p_issued": 0, "entries": [], "_file": path, "_torch": True}
        lib, _, op = str(e.get("profiling_name", ":")).partition(":")
        op = op.split(" ")[0]
        p2p = bool(e.get("is_p2p")) or op in ("send", "recv")
        seq = int(e.get("collective_seq_id") or 0)
        s["entries"].append({
            "seq": seq, "collective_seq": None if p2p else seq, "op": _BACK.get(op, op),
            "shapes": e.get("input_sizes"), "dtypes": e.get("input_dtypes") or [],
            "strategy": f"{lib} (torch)", "state": _STATES_BACK.get(e.get("state"), "enqueued"),
        })
        if not p2p:
            s["issued"] = max(s["issued"], seq)
    return list(out.values())


_hooks.on_dump.append(_after_dump)  # attached to the core at import (streamcoll.core.hooks)
