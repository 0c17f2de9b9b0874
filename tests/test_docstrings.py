"""Every public name has a docstring (issue 15): the names in
``streamcoll.__all__`` and the public methods and properties of its classes."""
from __future__ import annotations

import inspect

import streamcoll


def test_public_names_have_docstrings():
    missing = []
    for n in streamcoll.__all__:
        o = getattr(streamcoll, n)
        if not (o.__doc__ or "").strip():
            missing.append(n)
        if inspect.isclass(o) and o.__module__.startswith("streamcoll"):
            for k, v in vars(o).items():
                if k.startswith("_"):
                    continue
                f = v.fget if isinstance(v, property) else v
                if (callable(f) or isinstance(v, property)) and not (getattr(f, "__doc__", None) or "").strip():
                    missing.append(f"{n}.{k}")
    assert missing == [], missing
