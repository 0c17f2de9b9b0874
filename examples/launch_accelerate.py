"""accelerate on the CPU with streamcoll (README, "Launching").

accelerate 1.15 on the CPU chooses gloo (or mpi) itself and refuses
``InitProcessGroupKwargs(backend="streamcoll")`` ("Your assigned backend
streamcoll is not available, please use gloo"). What works: create the
default process group yourself, with ``init_process_group("streamcoll")``,
before the ``Accelerator``; accelerate then adopts it (it initialises no
group of its own when one exists), and its ``reduce``/``gather`` and the
DDP wrapper ``prepare`` makes run on streamcoll. Started by
``accelerate launch`` (torchrun underneath) or torchrun.

``--backend gloo`` runs the same on gloo; rank 0 prints a JSON line
(tests/startup/test_launchers.py compares the two).
"""
import argparse
import json

import torch
import torch.distributed as dist
from accelerate import Accelerator

parser = argparse.ArgumentParser()
parser.add_argument("--backend", default="streamcoll", choices=["streamcoll", "gloo"])
backend = parser.parse_args().backend
dist.init_process_group(backend)                 # before the Accelerator: accelerate keeps this group
accelerator = Accelerator(cpu=True)
torch.manual_seed(0)
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
model, opt = accelerator.prepare(model, opt)
g = torch.Generator().manual_seed(accelerator.process_index)
for _ in range(3):
    x = torch.randn(8, 4, generator=g)
    opt.zero_grad()
    accelerator.backward(((model(x) - x.sum(1, keepdim=True)) ** 2).mean())
    opt.step()
total = accelerator.reduce(torch.tensor([float(accelerator.process_index + 1)]), reduction="sum")
gathered = accelerator.gather(torch.tensor([accelerator.process_index]))
if accelerator.is_main_process:
    print(json.dumps({"backend": dist.get_backend(), "world": accelerator.num_processes, "sum": total.item(),
                      "gathered": gathered.tolist(), "state_backend": str(accelerator.state.backend),
                      "groups": sorted({dist.get_backend(g) for g in dist.distributed_c10d._world.pg_map}),
                      "params": [p.detach().flatten().tolist() for p in accelerator.unwrap_model(model).parameters()]}),
          flush=True)
accelerator.end_training()                       # destroys the process group
