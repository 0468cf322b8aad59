"""A rank's training state: the DDP-wrapped model, optimiser, LR schedule, grad scaler and where
training stands. Built the same way on every rank; checkpoints save and restore it."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from train.config.groups import TrainConfig
from train.distributed import devices
from train.engine import fsdp, fsdp_init, optim, recompute
from train.engine.ema import Ema
from train.engine.monitor import direction
from train.errors import ConfigError
from train.models import build as models
from train.models import finetune, pretrained

log = logging.getLogger("train")


class GradScaler(torch.amp.GradScaler):
    """fp16's loss scaler that also counts the optimiser steps it skipped.

    A step whose scaled gradients overflowed (inf/NaN) is not applied and the scale backs off
    (halves); that is the only time the scale falls, so a fall is a skipped step. The count is a
    tensor on the device, so counting costs no host sync; it is read at logging steps and epoch
    ends (train/engine/loop.py), and kept in checkpoints with the rest of the scaler's state.
    """

    def __init__(self, device: torch.device, enabled: bool) -> None:
        super().__init__(device.type, enabled=enabled)
        self._skipped = torch.zeros((), dtype=torch.int64, device=device)

    def update(self, new_scale: float | torch.Tensor | None = None) -> None:
        if not self.is_enabled() or self._scale is None:
            super().update(new_scale)
            return
        before = self._scale.clone()
        super().update(new_scale)
        if new_scale is None:
            self._skipped += (self._scale < before).squeeze().long()

    @property
    def skipped_steps(self) -> int:
        """Steps skipped so far in this job (restarts included); a host sync."""
        return int(self._skipped.item())

    def state_dict(self) -> dict:
        state = super().state_dict()
        return {**state, "skipped_steps": self.skipped_steps} if state else state

    def load_state_dict(self, state_dict: dict) -> None:
        state_dict = dict(state_dict)
        self._skipped.fill_(int(state_dict.pop("skipped_steps", 0)))
        super().load_state_dict(state_dict)


@dataclass
class TrainState:
    model: nn.Module
    """What the loop calls: DDP around the model where the job has more than one rank (and
    torch.compile around that if asked); under FSDP the sharded model itself."""
    module: nn.Module
    """The bare model: what checkpoints, the saved weights and evaluation use; under FSDP the
    same sharded model as `model` (train/engine/fsdp.py: whole state dicts are collectives)."""
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    """The built-in schedule (a LambdaLR) or optim.scheduler's class."""
    scaler: GradScaler
    epoch: int = 0
    step: int = 0
    batch_in_epoch: int = 0
    """Batches of `epoch` already trained (resuming mid-epoch)."""
    partial_totals: list[float] | None = None
    """This rank's sums over those batches."""
    scheduler_interval: str = "step"
    """When `scheduler` steps: after each optimiser step (train/engine/loop.py's
    _optimiser_step), or once at each epoch's end (optim.step_at_epoch_end)."""
    filler: torch.Tensor | None = None
    """FSDP: one zero sample of the input's shape, for the forwards a rank runs without data so
    that every rank runs as many (train/engine/loop.py `evaluate`); None under DDP."""
    grad_norm: torch.Tensor | None = None
    """optim.grad_clip: the last step's total gradient norm before clipping, left on the
    device (a DTensor under FSDP) until a logging step reads it (train/engine/loop.py)."""
    initialised_on: str | None = None
    """FSDP: where the model was built before sharding (cpu: whole, as DDP builds it; meta:
    each rank's shards initialised apart); the run's tag fsdp.init_on. None under DDP."""
    ema: Ema | None = None
    """trainer.ema: the average of the weights (train/engine/ema.py); None when off."""
    peak_lrs: list[float] | None = None
    """Each optimiser group's lr as built (optim.lr x its lr_scale), before any schedule: what
    the `lr` metric is read against. None = the scheduler's base_lrs (the built-in schedule's
    are these)."""

    def learning_rates(self, base_lr: float) -> dict[str, float]:
        """`lr`: optim.lr (`base_lr`) as scheduled now, and `lr/<prefix>`: each
        optim.param_groups group's. `lr` is read off the first group, scaled back by its
        lr_scale (the first is a named group's when every parameter is in one): the same for
        every group where the schedule scales them alike (the built-in one, StepLR, ...).
        Any scheduler: get_last_lr() is LRScheduler's (ReduceLROnPlateau's too, torch 2.2+)."""
        now = self.scheduler.get_last_lr()
        peaks = self.peak_lrs or self.scheduler.base_lrs
        rates = {"lr": base_lr * now[0] / peaks[0]}
        for group, lr in zip(self.optimizer.param_groups, now, strict=True):
            if group.get("prefix"):
                rates[f"lr/{group['prefix']}"] = lr
        return rates


def build(cfg: TrainConfig, spec: models.InputSpec, steps_per_epoch: int,
          device: torch.device, resuming: bool = False) -> TrainState:
    """The model on `device` in DDP (one rank: bare), with its optimiser, schedule and scaler.
    Seed the RNG first: every rank must start from the same weights. model.weights are loaded
    unless `resuming` (the checkpoint's weights win); model.freeze's parameters are frozen
    before DDP and the optimiser see them."""
    if cfg.distributed.strategy == "fsdp":
        return _build_sharded(cfg, spec, steps_per_epoch, device)
    module = models.build(cfg.model, spec)
    if resuming and cfg.model.weights:
        log.info("model.weights=%s not loaded: the checkpoint's weights are resumed",
                 cfg.model.weights)
    elif cfg.model.weights:
        pretrained.load(module, cfg.model, spec.num_classes)
    finetune.freeze(module, cfg.model.freeze)
    recompute.apply(module, cfg.model.activation_checkpointing,
                    list(cfg.distributed.fsdp.shard_modules))
    module = devices.sync_batchnorm(module, cfg.distributed.sync_batchnorm)
    module = module.to(device)
    if cfg.trainer.channels_last:
        module = module.to(memory_format=torch.channels_last)
    model = module if one_rank() else DDP(
        module, device_ids=devices.ddp_device_ids(device),
        find_unused_parameters=cfg.distributed.find_unused_parameters,
        gradient_as_bucket_view=cfg.distributed.gradient_as_bucket_view,
        static_graph=cfg.distributed.static_graph, bucket_cap_mb=cfg.distributed.bucket_cap_mb)
    if cfg.trainer.compile and recompute.applied(module):
        recompute.compile_blocks(module)  # per block: the recompute runs the same graph
    elif cfg.trainer.compile:
        model = torch.compile(model)  # type: ignore[assignment]
    return _with_optimiser(cfg, model, module, steps_per_epoch, device)


def one_rank() -> bool:
    """A job of one rank has no gradients to average: it trains the bare model, as Lightning's
    single-device strategy does. DDP's wrapper would only cost - its reducer copies every
    gradient into buckets at each step, and its constructor imports torch._dynamo (a second
    or two of every one-rank job's start)."""
    import torch.distributed as dist

    return not dist.is_initialized() or dist.get_world_size() == 1


def _build_sharded(cfg: TrainConfig, spec: models.InputSpec, steps_per_epoch: int,
                   device: torch.device) -> TrainState:
    """distributed.strategy=fsdp: the model sharded (train/engine/fsdp.py). Built whole on
    every rank (init_on=cpu, and auto where it fits in host memory: the same initial weights as
    DDP from the same seed; model.weights loaded), or on the meta device, each rank's shards
    then allocated and initialised (meta). FSDP moves each block to the device as it shards
    it, so a model built whole in host memory is never whole on the GPU. The optimiser is built
    on the sharded parameters, so its state is sharded too."""
    place = fsdp_init.init_place(cfg, spec, device)
    if place == "meta":
        with torch.device("meta"):
            module = models.build(cfg.model, spec)
        refusal = (fsdp_init.meta_refusal(cfg, module)
                   if cfg.distributed.fsdp.init_on == "meta"
                   else fsdp_init.meta_refusal_of_auto(cfg, module))
        if refusal:
            raise ConfigError(refusal)
    else:
        module = models.build(cfg.model, spec)
        if cfg.model.weights:
            pretrained.load(module, cfg.model, spec.num_classes)
    recompute.apply(module, cfg.model.activation_checkpointing,  # before fully_shard's hooks
                    list(cfg.distributed.fsdp.shard_modules))
    module = fsdp.shard(module, cfg, device)
    if place == "meta":
        fsdp_init.materialise(module, device, cfg.distributed.fsdp.cpu_offload)
    if cfg.trainer.compile:
        log.info("trainer.compile under FSDP2: %s compiled", fsdp.compile_sharded(module, cfg))
    state = _with_optimiser(cfg, module, module, steps_per_epoch, device)
    state.initialised_on = place
    kind = torch.long if spec.token_ids else torch.float32
    state.filler = torch.zeros(1, *spec.sample_shape, dtype=kind, device=device)
    return state


def _with_optimiser(cfg: TrainConfig, model: nn.Module, module: nn.Module,
                    steps_per_epoch: int, device: torch.device) -> TrainState:
    optimizer = optim.build_optimizer(cfg.optim, module)
    peaks = [float(group["lr"]) for group in optimizer.param_groups]
    scheduler = optim.build_scheduler(cfg.optim, optimizer, steps_per_epoch, cfg.trainer.epochs,
                                      cfg.trainer.max_steps,
                                      direction(cfg.trainer.monitor, cfg.trainer.monitor_mode))
    scaler = GradScaler(device, enabled=cfg.trainer.precision == "fp16-mixed")
    ema = Ema(cfg.trainer.ema, module) if cfg.trainer.ema.enabled else None
    return TrainState(model, module, optimizer, scheduler, scaler,
                      scheduler_interval=optim.interval(cfg.optim), peak_lrs=peaks, ema=ema)
