"""The optimiser and its learning-rate schedule: the presets (optim=sgd|adamw, the built-in
cosine / constant schedule with warm-up, stepped per optimiser step), or any class by
`_target_`, as Hydra users write them.

- `optim._target_=torch.optim.Adadelta` (or the user's own Optimizer): called, as Hydra's
  `_partial_: true` does, as target(<parameter groups>, lr=optim.lr,
  weight_decay=optim.weight_decay, **optim.args), lr and weight_decay where it takes them. The
  groups are optim.param_groups' (each with its lr x lr_scale and weight decay; model.freeze's
  parameters in none), whatever the class.
- `optim.scheduler._target_=torch.optim.lr_scheduler.StepLR` (+ its arguments): called as
  target(optimizer, **args), stepped per epoch (default) or per optimiser step
  (`optim.scheduler_interval`); ReduceLROnPlateau per epoch only, with trainer.monitor's value
  after each validation (`step_at_epoch_end`, called by train/engine/loop.py).

Every failure to import or build either is a UserCodeError of one line; pre-flight (`check`)
builds both once on the model on the meta device, so that it comes before any rank starts.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from typing import Any

import torch
from torch import nn
from torch.optim.lr_scheduler import LambdaLR, LRScheduler, ReduceLROnPlateau

from train.config import usercode
from train.config.groups import OptimConfig, TrainConfig
from train.config.usercode import UserCodeError
from train.engine.monitor import direction, value_of
from train.models import build as models
from train.models import finetune
from train.report.metrics import Reduced

log = logging.getLogger("train")

OPTIMIZER_KEY = "optim._target_"
SCHEDULER_KEY = "optim.scheduler._target_"
LENGTH_KEYS = ("total_steps", "epochs", "steps_per_epoch")
"""A scheduler's own length arguments (OneCycleLR's): with any one set, total_steps is not
filled."""


def build_optimizer(cfg: OptimConfig, model: nn.Module) -> torch.optim.Optimizer:
    """Over the trainable parameters (model.freeze's are left out), in optim.param_groups'
    groups (train/models/finetune.py) where there are any."""
    groups = finetune.param_groups(model, cfg.param_groups, cfg.lr, cfg.weight_decay)
    if cfg._target_ is not None:
        return _user_optimizer(cfg, cfg._target_, groups)
    params = [p for g in groups for p in g["params"]]
    fused = fused_kernels(cfg.name, params, bool(params) and all(p.is_cuda for p in params))
    if cfg.name == "adamw":
        return torch.optim.AdamW(groups, lr=cfg.lr, betas=tuple(cfg.betas),  # type: ignore[arg-type]
                                 weight_decay=cfg.weight_decay, fused=fused)
    return torch.optim.SGD(groups, lr=cfg.lr, momentum=cfg.momentum,
                           nesterov=cfg.nesterov and cfg.momentum > 0,
                           weight_decay=cfg.weight_decay, fused=fused)


def fused_kernels(name: str, params: list[torch.Tensor], on_gpu: bool) -> bool | None:
    """The presets' `fused` argument. On GPUs, the fused kernels: one launch for all
    parameters, and with fp16 the GradScaler hands them its inf check instead of reading it
    back to the host every step. Not SGD's over FSDP's DTensor shards: torch has no sharding
    rule for `_fused_sgd_` (NotImplementedError at the first step), while fused AdamW has
    one; SGD takes its foreach kernels there. None: torch's default."""
    from torch.distributed.tensor import DTensor

    if not on_gpu or (name == "sgd" and any(isinstance(p, DTensor) for p in params)):
        return None
    return True


def _user_optimizer(cfg: OptimConfig, path: str, groups: list[dict[str, Any]]
                    ) -> torch.optim.Optimizer:
    target = usercode.locate(path, OPTIMIZER_KEY)
    if isinstance(target, type) and not issubclass(target, torch.optim.Optimizer):
        raise UserCodeError(f"{OPTIMIZER_KEY}={path!r} is {usercode.describe(target)}, not a "
                            "torch.optim.Optimizer: name an optimiser class (e.g. "
                            "torch.optim.Adadelta) or a function that returns one.")
    takes = usercode.accepted_arguments(target)
    given = {k: v for k, v in (("lr", cfg.lr), ("weight_decay", cfg.weight_decay)) if k in takes}
    optimizer = _call(path, OPTIMIZER_KEY, cfg.args, (groups, "the model's parameter groups"),
                      given)
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise UserCodeError(f"{OPTIMIZER_KEY}={path!r} returned {usercode.describe(optimizer)}, "
                            "not a torch.optim.Optimizer.")
    return optimizer


def _call(path: str, key: str, args: dict[str, Any], first: tuple[Any, str],
          filled: dict[str, Any]) -> Any:
    """target(first, **filled, **args), through Hydra's instantiate with `_partial_` (a nested
    `_target_` among the args is built too); a failure is one line naming the call. `first`:
    the positional argument and how the line names it."""
    partial = usercode.build(path, key, {**args, "_partial_": True})
    try:
        return partial(first[0], **filled)
    except Exception as e:  # noqa: BLE001 - the class's own refusal, in one line
        shown = "".join(f", {k}={v!r}" for k, v in {**filled, **args}.items())
        raise UserCodeError(f"{key}={path!r}: calling {path}(<{first[1]}>{shown}) failed: "
                            f"{usercode.one_line(e)}") from None


def lr_factor(step: int, total_steps: int, warmup_steps: int, schedule: str,
              min_ratio: float) -> float:
    """Multiplier of the peak lr at optimiser step `step` (0-based)."""
    if warmup_steps > 0 and step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant":
        return 1.0
    progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


def interval(cfg: OptimConfig) -> str:
    """When the scheduler steps: `step` for the built-in schedule, else optim.scheduler_interval."""
    return "step" if cfg.scheduler.get("_target_") is None else cfg.scheduler_interval


def build_scheduler(cfg: OptimConfig, optimizer: torch.optim.Optimizer, steps_per_epoch: int,
                    epochs: int, max_steps: int | None = None, monitor_mode: str = "min"
                    ) -> LRScheduler:
    """optim.scheduler's class, or the built-in schedule over the job's optimiser steps (to
    trainer.max_steps where that comes first). `monitor_mode`: trainer.monitor's direction,
    ReduceLROnPlateau's mode unless optim.scheduler sets it."""
    total = min(steps_per_epoch * epochs, max_steps or steps_per_epoch * epochs)
    if (path := cfg.scheduler.get("_target_")) is not None:
        if cfg.scheduler_interval == "epoch":  # the epochs that run, to max_steps' epoch
            total = min(epochs, math.ceil(total / max(1, steps_per_epoch)))
        return _user_scheduler(cfg, path, optimizer, total, monitor_mode)
    warmup = round(cfg.warmup_epochs * steps_per_epoch)
    return LambdaLR(
        optimizer, lambda step: lr_factor(step, total, warmup, cfg.schedule, cfg.min_lr_ratio))


def _user_scheduler(cfg: OptimConfig, path: str, optimizer: torch.optim.Optimizer, total: int,
                    monitor_mode: str) -> LRScheduler:
    args = {k: v for k, v in cfg.scheduler.items() if k not in ("_target_", "_partial_")}
    target = usercode.locate(path, SCHEDULER_KEY)
    if isinstance(target, type) and not issubclass(target, LRScheduler | ReduceLROnPlateau):
        raise UserCodeError(f"{SCHEDULER_KEY}={path!r} is {usercode.describe(target)}, not a "
                            "torch.optim.lr_scheduler.LRScheduler: name a scheduler class (e.g. "
                            "torch.optim.lr_scheduler.StepLR) or a function that returns one.")
    known: dict[str, Any] = {"max_lr": [g["lr"] for g in optimizer.param_groups]}
    if not set(LENGTH_KEYS) & set(args):
        known["total_steps"] = total
    if isinstance(target, type) and issubclass(target, ReduceLROnPlateau):
        known["mode"] = monitor_mode
    filled = usercode.fill_arguments(target, args, known)
    scheduler = _call(path, SCHEDULER_KEY, args, (optimizer, "the optimiser"), filled)
    if not isinstance(scheduler, LRScheduler | ReduceLROnPlateau):
        raise UserCodeError(f"{SCHEDULER_KEY}={path!r} returned {usercode.describe(scheduler)}, "
                            "not a torch.optim.lr_scheduler.LRScheduler.")
    if takes_metric(scheduler) and cfg.scheduler_interval != "epoch":
        raise UserCodeError(f"{SCHEDULER_KEY}={path!r} reduces the lr when trainer.monitor stops "
                            "improving, so it steps after validation: set "
                            "optim.scheduler_interval=epoch.")
    shown = ", ".join(f"{k}={v!r}" for k, v in {**filled, **args}.items())
    log.info("optim.scheduler: %s(%s), stepped per %s", path, shown, cfg.scheduler_interval)
    return scheduler


def takes_metric(scheduler: LRScheduler) -> bool:
    """ReduceLROnPlateau (or a subclass): stepped with the monitored value."""
    return isinstance(scheduler, ReduceLROnPlateau)


def step_at_epoch_end(scheduler: LRScheduler, every: str, val: Reduced | None,
                      monitor: str) -> None:
    """A per-epoch scheduler's one step at an epoch's end: after the epoch's lr is logged and
    before its checkpoint (a mid-epoch checkpoint comes before it, so a resumed epoch steps it
    once). ReduceLROnPlateau: with trainer.monitor's value, where the epoch was validated
    (trainer.eval_every); its patience then counts validations."""
    if every != "epoch":
        return
    if not takes_metric(scheduler):
        scheduler.step()
    elif val is not None:
        scheduler.step(value_of(monitor, val))  # type: ignore[arg-type]


def check(cfg: TrainConfig, known: tuple[tuple[int, ...], int] | None) -> None:
    """Pre-flight: optim._target_ and optim.scheduler._target_ import and build, the
    optimiser on the model's parameter groups (model.freeze, optim.param_groups) built on the
    meta device where the data's shape is `known`, else on a one-layer stand-in (the groups
    are then checked when the job starts), and the scheduler on that optimiser."""
    optim = cfg.optim
    if known is not None:
        model = models.build_on_meta(cfg.model, models.InputSpec.of(*known))
        finetune.freeze(model, cfg.model.freeze)
    else:
        model = nn.Linear(1, 1, device="meta")
        optim = dataclasses.replace(optim, param_groups=[])
    optimizer = build_optimizer(optim, model)
    build_scheduler(optim, optimizer, 1, cfg.trainer.epochs, cfg.trainer.max_steps,
                    direction(cfg.trainer.monitor, cfg.trainer.monitor_mode))
