"""A rank's training state: the DDP-wrapped model, optimiser, LR schedule, grad scaler and where
training stands. Built the same way on every rank; checkpoints save and restore it."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from train import models, optim
from train.config import TrainConfig


@dataclass
class TrainState:
    model: nn.Module
    """What the loop calls: DDP around the model (and torch.compile around that if asked)."""
    module: nn.Module
    """The bare model: what checkpoints, the saved weights and evaluation use."""
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    scaler: torch.amp.GradScaler
    epoch: int = 0
    step: int = 0
    batch_in_epoch: int = 0
    """Batches of `epoch` already trained (resuming mid-epoch)."""
    partial_totals: list[float] | None = None
    """This rank's sums over those batches."""


def build(cfg: TrainConfig, spec: models.InputSpec, steps_per_epoch: int,
          device: torch.device) -> TrainState:
    """The model on `device` in DDP, with its optimiser, schedule and scaler. Seed the RNG
    first: every rank must start from the same weights."""
    if device.type == "cuda":  # fixed input shapes: let cuDNN pick the fastest kernels once
        torch.backends.cudnn.benchmark = True
    module: nn.Module = models.build(cfg.model, spec)
    if cfg.distributed.sync_batchnorm:
        module = torch.nn.SyncBatchNorm.convert_sync_batchnorm(module)
    module = module.to(device)
    if cfg.trainer.channels_last:
        module = module.to(memory_format=torch.channels_last)
    ddp: nn.Module = DDP(module, device_ids=[device.index] if device.type == "cuda" else None,
                         find_unused_parameters=cfg.distributed.find_unused_parameters,
                         gradient_as_bucket_view=cfg.distributed.gradient_as_bucket_view,
                         static_graph=cfg.distributed.static_graph,
                         bucket_cap_mb=cfg.distributed.bucket_cap_mb)
    if cfg.trainer.compile:
        ddp = torch.compile(ddp)  # type: ignore[assignment]
    optimizer = optim.build_optimizer(cfg.optim, module)
    scheduler = optim.build_scheduler(cfg.optim, optimizer, steps_per_epoch, cfg.trainer.epochs)
    scaler = torch.amp.GradScaler(device.type, enabled=cfg.trainer.precision == "fp16-mixed")
    return TrainState(ddp, module, optimizer, scheduler, scaler)
