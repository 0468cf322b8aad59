"""The resnet workload's third peer: a Lightning Trainer, as its documentation writes one.

    python -m bench.gpu_lightning PLAN.json

The same torchvision model, optimiser, synthetic data on the GPU (bench/gpu_peers.py's
`on_device_batches`) and bf16 autocast (`precision="bf16-mixed"`) as the plain loop, on one
device, without a logger, checkpoints or a progress bar, stopped after the meter's last step
(`max_steps`). `lightning` or the older `pytorch_lightning` package, whichever imports.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import gpu_peers  # noqa: E402
from bench.gpu_meter import Meter, Plan, current  # noqa: E402

try:
    import lightning.pytorch as pl
except ImportError:  # the package's older name
    import pytorch_lightning as pl


class Classifier(pl.LightningModule):
    def __init__(self, settings: dict[str, Any], device: torch.device) -> None:
        super().__init__()
        self.model, self._optimizer = gpu_peers.resnet_model(settings, device)
        self.loss = nn.CrossEntropyLoss()

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], index: int) -> torch.Tensor:
        x, y = batch
        loss = self.loss(self.model(x), y)
        meter = current()
        if meter is not None and meter.wants_loss():
            meter.note_loss(loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return self._optimizer


def train(plan: Plan) -> None:
    s, device = plan.settings, torch.device(plan.device)
    Meter.install(plan)
    torch.backends.cudnn.benchmark = True  # Trainer(benchmark=None) leaves it as it is
    torch.manual_seed(s["seed"])
    module = Classifier(s, device)
    trainer = pl.Trainer(accelerator="gpu" if device.type == "cuda" else "cpu", devices=1,
                         precision="bf16-mixed" if s["dtype"] == "bf16" else "32-true",
                         max_steps=plan.last, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False,
                         log_every_n_steps=plan.log_every, num_sanity_val_steps=0)
    trainer.fit(module, train_dataloaders=gpu_peers.on_device_batches(s, device))


if __name__ == "__main__":
    train(Plan.read(sys.argv[1]))
