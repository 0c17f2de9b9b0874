"""Lightning DDP on streamcoll (README, "Launching"): ``Trainer(accelerator=
"cpu", devices=2, strategy=DDPStrategy(process_group_backend="streamcoll"))``
with ``self.log(..., sync_dist=True)`` and ``self.all_gather``. Lightning
starts the second process by re-running this script; the backend name is
known there from streamcoll's ``torch.backends`` entry point (and from
``import streamcoll`` where the install has none).

``--backend gloo`` trains the same model on gloo; rank 0 prints the
parameters as a JSON line (tests/startup/test_launchers.py compares the two).
"""
import argparse
import json

import lightning as L
import torch
from lightning.pytorch.strategies import DDPStrategy
from torch.utils.data import DataLoader, TensorDataset


class Model(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layer = torch.nn.Linear(4, 1)
        self.gathered = 0

    def training_step(self, batch, index):
        x, y = batch
        loss = ((self.layer(x) - y) ** 2).mean()
        self.log("loss", loss, sync_dist=True)
        self.gathered += int(self.all_gather(loss.detach()).numel())
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


parser = argparse.ArgumentParser()
parser.add_argument("--backend", default="streamcoll", choices=["streamcoll", "gloo"])
backend = parser.parse_args().backend
x = torch.randn(64, 4, generator=torch.Generator().manual_seed(1))
data = DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=8)
model = Model()
trainer = L.Trainer(accelerator="cpu", devices=2, strategy=DDPStrategy(process_group_backend=backend), max_epochs=2,
                    logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
trainer.fit(model, data)
if trainer.global_rank == 0:
    print(json.dumps({"backend": backend, "world": trainer.world_size, "gathered": model.gathered,
                      "loss": float(trainer.callback_metrics["loss"]),
                      "params": [p.detach().flatten().tolist() for p in model.parameters()]}), flush=True)
