"""torch's ``torch.backends`` entry point: makes ``backend="streamcoll"``
known to ``torch.distributed.init_process_group`` in every process, also
those that never import streamcoll (Ray Train's workers, accelerate's).

torch loads this group at the end of ``import torch``
(``torch._import_device_backends``; off with
``TORCH_DEVICE_BACKEND_AUTOLOAD=0``) and turns any exception into a failed
``import torch`` for everyone in the environment. So this is a top-level
module outside the ``streamcoll`` package (loading an entry point imports
its package: streamcoll's ``__init__`` imports everything), it imports only
``torch.distributed`` (already imported by then), loads no native library,
registers the name with a creator that imports streamcoll at the first
``init_process_group("streamcoll")``, and never raises: a failure is logged
at debug level and the name is left unregistered (streamcoll registers it
itself when imported). What it cannot guard is its own absence: where the
install's metadata names it but it cannot be imported (an editable install
whose checkout moved or was deleted), ``import torch`` fails; the README
("A stale install") says how to get out.
"""
from __future__ import annotations

import logging
import warnings
from typing import Any

__all__ = ["register", "create_process_group"]

NAME = "streamcoll"


def create_process_group(store: Any, rank: int, world_size: int, timeout: Any = None) -> Any:
    """The lazy creator: imports streamcoll (and through it the binding) at
    the first ``init_process_group("streamcoll")``, then creates as
    :func:`streamcoll.integrations.process_group.create_process_group` does."""
    from streamcoll.integrations.process_group import create_process_group as create
    return create(store, rank, world_size, timeout)


def register() -> None:
    """Register ``"streamcoll"`` with torch.distributed unless it is known
    already. Never raises (see the module docstring)."""
    try:
        import torch.distributed as dist
        if not dist.is_available() or NAME.upper() in getattr(dist.Backend, "_plugins", {}):
            return
        with warnings.catch_warnings():  # no devices=: see streamcoll.integrations.process_group.register_backend
            warnings.simplefilter("ignore", UserWarning)
            dist.Backend.register_backend(NAME, create_process_group)
    except Exception as e:  # never fail `import torch` for the whole environment
        logging.getLogger("streamcoll.autoload").debug("streamcoll: torch.backends entry point: %s: %s",
                                                       type(e).__name__, e)
