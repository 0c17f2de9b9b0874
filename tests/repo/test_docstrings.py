"""Every public name has a docstring (issue 15): the names in
``streamcoll.__all__`` and the public methods and properties of its classes,
those of their streamcoll bases included (Communicator's concerns live in
bases of their own: streamcoll.core.p2p, streamcoll.core.async_launch, ...)."""
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
            seen = set()
            for cls in inspect.getmro(o):
                if not cls.__module__.startswith("streamcoll"):
                    continue
                for k, v in vars(cls).items():
                    if k.startswith("_") or k in seen:
                        continue
                    seen.add(k)  # the one a subclass defines is the one in use
                    f = v.fget if isinstance(v, property) else v
                    if (callable(f) or isinstance(v, property)) and not (getattr(f, "__doc__", None) or "").strip():
                        missing.append(f"{n}.{k}")
    assert missing == [], missing
