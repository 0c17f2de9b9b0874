"""Training loops the integration tests run on a backend and on gloo alike
(the same seeds, so their results compare exactly)."""
from __future__ import annotations

from typing import Any, List

import torch


def fsdp2_train(mesh: Any, rank: int, steps: int) -> List[torch.Tensor]:
    """FSDP2 (``fully_shard`` per Linear, then the model) over ``mesh``: a
    small MLP from seed 0, SGD for ``steps`` steps on per-rank batches; the
    full parameters after them."""
    from torch.distributed.fsdp import fully_shard
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    for m in model:
        if isinstance(m, torch.nn.Linear):
            fully_shard(m, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(100 + rank)
    for _ in range(steps):
        x = torch.randn(4, 8, generator=g)
        loss = model(x).pow(2).sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
    return [p.full_tensor().detach().clone() for p in model.parameters()]
