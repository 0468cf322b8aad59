"""Optimiser and per-step learning-rate schedule."""

from __future__ import annotations

import math

import torch
from torch import nn

from train.config.groups import OptimConfig
from train.models import finetune


def build_optimizer(cfg: OptimConfig, model: nn.Module) -> torch.optim.Optimizer:
    """Over the trainable parameters (model.freeze's are left out), in optim.param_groups'
    groups (train/models/finetune.py) where there are any."""
    groups = finetune.param_groups(model, cfg.param_groups, cfg.lr, cfg.weight_decay)
    params = [p for g in groups for p in g["params"]]
    # On GPUs, the fused kernels: one launch for all parameters, and with fp16 the GradScaler
    # hands them its inf check instead of reading it back to the host every step.
    fused = (bool(params) and all(p.is_cuda for p in params)) or None
    if cfg.name == "adamw":
        return torch.optim.AdamW(groups, lr=cfg.lr, betas=tuple(cfg.betas),  # type: ignore[arg-type]
                                 weight_decay=cfg.weight_decay, fused=fused)
    return torch.optim.SGD(groups, lr=cfg.lr, momentum=cfg.momentum,
                           nesterov=cfg.nesterov and cfg.momentum > 0,
                           weight_decay=cfg.weight_decay, fused=fused)


def lr_factor(step: int, total_steps: int, warmup_steps: int, schedule: str,
              min_ratio: float) -> float:
    """Multiplier of the peak lr at optimiser step `step` (0-based)."""
    if warmup_steps > 0 and step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant":
        return 1.0
    progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


def build_scheduler(cfg: OptimConfig, optimizer: torch.optim.Optimizer, steps_per_epoch: int,
                    epochs: int, max_steps: int | None = None) -> torch.optim.lr_scheduler.LambdaLR:
    total = min(steps_per_epoch * epochs, max_steps or steps_per_epoch * epochs)
    warmup = round(cfg.warmup_epochs * steps_per_epoch)
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_factor(step, total, warmup, cfg.schedule, cfg.min_lr_ratio))
