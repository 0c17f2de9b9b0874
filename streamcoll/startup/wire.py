"""Records to and from the plain JSON that crosses the store: a rank's facts
and the layout (:mod:`streamcoll.startup.topology`) travel field by field
from their dataclasses' declarations, so a field added to a record travels
without changes to the exchange; integer runs (CPU and rank lists) as range
text."""
from __future__ import annotations

import dataclasses
import functools
import typing
from typing import Any, Dict, List, Sequence, Tuple

__all__ = ["run_text", "parse_runs", "to_plain", "from_plain"]


def run_text(values: Sequence[int]) -> str:
    """Ranks or CPUs as text, ``(0, 1, 2, 3, 8)`` -> ``"0..3,8"``, order kept (ascending runs)."""
    out: List[str] = []
    i = 0
    while i < len(values):
        j = i
        while j + 1 < len(values) and values[j + 1] == values[j] + 1:
            j += 1
        out.append(str(values[i]) if i == j else f"{values[i]}..{values[j]}")
        i = j + 1
    return ",".join(out)


def parse_runs(text: str) -> Tuple[int, ...]:
    """The inverse of :func:`run_text`."""
    out: List[int] = []
    for part in text.split(",") if text else ():
        a, sep, b = part.partition("..")
        out.extend(range(int(a), int(b) + 1) if sep else (int(a),))
    return tuple(out)


@functools.lru_cache(maxsize=None)
def _hints(cls: type) -> Dict[str, Any]:
    return typing.get_type_hints(cls)


def _is_int_run(hint: Any) -> bool:
    return typing.get_origin(hint) is tuple and typing.get_args(hint) == (int, Ellipsis)


def to_plain(value: Any, hint: Any = None) -> Any:
    """``value`` as JSON-able data, field by field from the dataclasses'
    declarations: nested dataclasses become dicts, ``Tuple[int, ...]``
    fields range text (CPU lists and rank lists are mostly runs), other
    tuples lists. The inverse is :func:`from_plain`."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        hints = _hints(type(value))
        return {f.name: to_plain(getattr(value, f.name), hints.get(f.name)) for f in dataclasses.fields(value)}
    if hint is not None and _is_int_run(hint) and isinstance(value, (tuple, list)):
        return run_text([int(v) for v in value])
    if isinstance(value, (tuple, list)):
        args = typing.get_args(hint) if hint is not None else ()
        if len(args) == 2 and args[1] is Ellipsis:
            return [to_plain(v, args[0]) for v in value]
        if typing.get_origin(hint) is list and args:
            return [to_plain(v, args[0]) for v in value]
        if args and len(args) == len(value):
            return [to_plain(v, a) for v, a in zip(value, args)]
        return [to_plain(v) for v in value]
    if isinstance(value, dict):
        args = typing.get_args(hint) if hint is not None else ()
        return {str(k): to_plain(v, args[1] if len(args) == 2 else None) for k, v in value.items()}
    return value


def from_plain(hint: Any, data: Any) -> Any:
    """Rebuild a value of type ``hint`` from :func:`to_plain`'s output.
    Fields a peer did not send take their defaults; fields this version does
    not know are ignored. The decoder of each type is built once from its
    declarations (every rank decodes the whole layout)."""
    dec = _decoder(hint)
    return data if dec is None else dec(data)


@functools.lru_cache(maxsize=None)
def _decoder(hint: Any) -> Any:
    """A function rebuilding ``hint`` from plain data, or None where the
    plain data is the value (str, int, bool, float, None, Any)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is typing.Union:
        inner = [a for a in args if a is not type(None)]
        one = _decoder(inner[0]) if len(inner) == 1 else None
        if one is None:
            return None
        return lambda data: None if data is None else one(data)
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        hints = _hints(hint)
        names = [f.name for f in dataclasses.fields(hint) if f.init]
        convert = {n: d for n in names if (d := _decoder(hints.get(n, Any))) is not None}
        cls = hint

        def dataclass_(data: Any) -> Any:
            kw = {n: data[n] for n in names if n in data}
            for n, d in convert.items():
                if n in kw:
                    kw[n] = d(kw[n])
            return cls(**kw)
        return dataclass_
    if origin is tuple:
        if args == (int, Ellipsis):
            return lambda data: parse_runs(data) if isinstance(data, str) else tuple(int(v) for v in data)
        if len(args) == 2 and args[1] is Ellipsis:
            each = _decoder(args[0])
            return tuple if each is None else (lambda data: tuple(map(each, data)))
        if args:
            decs = [_decoder(a) or (lambda v: v) for a in args]
            return lambda data: tuple(d(v) for d, v in zip(decs, data))
        return tuple
    if origin is list:
        each = _decoder(args[0]) if args else None
        return list if each is None else (lambda data: list(map(each, data)))
    if origin is dict:
        val = _decoder(args[1]) if len(args) == 2 else None
        return dict if val is None else (lambda data: {k: val(v) for k, v in data.items()})
    return None
