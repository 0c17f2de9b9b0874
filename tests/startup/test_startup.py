"""Start-up details of issue 20 that need no second process: launcher
variables a rendezvous does not use are not parsed into its failure."""
from __future__ import annotations

import pytest

from conftest import needs_oneccl


@needs_oneccl
def test_non_integer_master_port_with_store_given(monkeypatch):
    """With ``store=`` given MASTER_PORT is not used; Kubernetes sets
    ``MASTER_PORT=tcp://10.96.0.5:29500`` for a Service named "master".
    The rendezvous waits for the missing rank with progress lines and ends
    with the RendezvousError naming it (before: the first progress line
    parsed MASTER_PORT and raised ValueError)."""
    import torch.distributed as dist
    import streamcoll
    from streamcoll._ffi.errors import RendezvousError
    monkeypatch.setenv("MASTER_PORT", "tcp://10.96.0.5:29500")
    with pytest.raises(RendezvousError) as ei:
        streamcoll.new_communicator(backend="oneccl", device="cpu", rank=0, world_size=2, store=dist.HashStore(),
                                    timeout=2.5)
    msg = str(ei.value)
    assert "rank 1 never joined within 2.5 s" in msg, msg


@needs_oneccl
def test_launcher_variables_the_call_does_not_need_are_not_parsed(monkeypatch):
    """rank, world_size, device and store given: a LOCAL_RANK or
    MASTER_PORT that is no integer does not stop the communicator."""
    import torch
    import torch.distributed as dist
    import streamcoll
    monkeypatch.setenv("LOCAL_RANK", "worker-0")
    monkeypatch.setenv("MASTER_PORT", "tcp://10.96.0.5:29500")
    c = streamcoll.new_communicator(backend="oneccl", device="cpu", rank=0, world_size=1, store=dist.HashStore())
    try:
        t = torch.ones(2)
        c.all_reduce(t)
        assert t.tolist() == [1.0, 1.0]
    finally:
        c.destroy()
