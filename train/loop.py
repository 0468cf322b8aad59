"""The training loop of one rank: epochs of DDP steps, exact validation, reduced metrics.

The loop is the same on every rank. It syncs with the host only at the end of an epoch and on
every `trainer.log_every_n_steps`-th step; the metrics it reduces are the same on every rank, and
what is recorded of them is the run logger's business (train/runlog.py).
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass

import torch
from torch import nn

from train import distributed, metrics, system_stats
from train.checkpoint import Checkpointer
from train.config import TrainConfig
from train.data import Batches, DataBundle
from train.runlog import RunLogger
from train.state import TrainState
from train.stopping import StopSignals


class NonFiniteLossError(FloatingPointError):
    """Training diverged."""


class FailureDrill(RuntimeError):
    """The failure asked for with trainer.fail_on_rank."""


@dataclass
class Duties:
    """What a rank must look after besides training: record, checkpoint, heed stop signals."""

    logger: RunLogger
    checkpointer: Checkpointer
    stop: StopSignals
    rank: int
    local_rank: int


def autocast(device: torch.device, precision: str) -> contextlib.AbstractContextManager:
    if precision == "fp32":
        return contextlib.nullcontext()
    dtype = torch.bfloat16 if precision == "bf16-mixed" else torch.float16
    return torch.autocast(device_type=device.type, dtype=dtype)


def _check_finite(value: float, rank: int, step: int, where: str) -> None:
    if not math.isfinite(value):
        raise NonFiniteLossError(f"{where} is {value} on rank {rank} at step {step}: training "
                                 "diverged (lower optim.lr, set optim.grad_clip, or use fp32).")


def _optimiser_step(cfg: TrainConfig, state: TrainState, images: torch.Tensor,
                    labels: torch.Tensor, device: torch.device,
                    loss_fn: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    with autocast(device, cfg.trainer.precision):
        logits = state.model(images)
        loss = loss_fn(logits, labels)
    state.optimizer.zero_grad(set_to_none=True)
    state.scaler.scale(loss).backward()
    if cfg.optim.grad_clip is not None:
        state.scaler.unscale_(state.optimizer)
        nn.utils.clip_grad_norm_(state.model.parameters(), cfg.optim.grad_clip)
    state.scaler.step(state.optimizer)
    state.scaler.update()
    state.scheduler.step()
    state.step += 1
    return logits, loss


def train_epoch(cfg: TrainConfig, state: TrainState, batches: Batches, device: torch.device,
                duties: Duties) -> metrics.Totals:
    state.model.train()
    batches.set_epoch(state.epoch)  # the same order as before a restart
    totals = metrics.Totals(device)
    skip, state.batch_in_epoch = state.batch_in_epoch, 0
    if state.partial_totals is not None:
        totals.restore(state.partial_totals)
        state.partial_totals = None
    loss_fn = nn.CrossEntropyLoss()
    every = cfg.trainer.log_every_n_steps
    window_start, window_steps = time.perf_counter(), 0
    for index, (images, labels) in enumerate(duties.logger.progress(batches, state.epoch)):
        if index < skip:  # trained before the checkpoint this job resumed from
            continue
        logits, loss = _optimiser_step(cfg, state, images, labels, device, loss_fn)
        totals.add(logits, labels, loss)
        window_steps += 1
        if state.step == 1:
            duties.logger.first_step()
        if state.step == cfg.trainer.fail_at_step and duties.rank == cfg.trainer.fail_on_rank:
            raise FailureDrill(f"trainer.fail_on_rank={duties.rank}: failing on purpose at step "
                               f"{state.step}")
        if state.step % every == 0:  # the only steps that wait for the device
            sync = metrics.sync_step(loss, (time.perf_counter() - window_start) / window_steps,
                                     duties.stop.received is not None,
                                     duties.checkpointer.interval_due())
            _check_finite(sync.mean_loss, duties.rank, state.step,
                          "train/step_loss (mean over ranks)")
            duties.logger.step(state.step, sync)
            wanted = sync.stop_requested or sync.checkpoint_due
            if wanted and index + 1 < len(batches):  # the epoch end checkpoints anyway
                duties.checkpointer.save(state, totals, index + 1)
                if sync.stop_requested:
                    raise duties.stop.preempted()
            window_start, window_steps = time.perf_counter(), 0
    return totals


@torch.no_grad()
def evaluate(model: nn.Module, batches: Batches, device: torch.device, precision: str,
             num_classes: int | None = None) -> metrics.Totals:
    """This rank's shard of the validation set, on the bare module (no DDP collectives).

    With `num_classes`, the confusion matrix is counted too.
    """
    model.eval()
    totals = metrics.Totals(device, num_classes)
    loss_fn = nn.CrossEntropyLoss()
    for images, labels in batches:
        with autocast(device, precision):
            logits = model(images)
        totals.add(logits, labels, loss_fn(logits.float(), labels))
    return totals


def fit(cfg: TrainConfig, state: TrainState, data: DataBundle, device: torch.device,
        duties: Duties) -> metrics.Reduced | None:
    """Train from `state` to trainer.epochs; returns the last validation (with its confusion
    matrix), or None when this start had no epoch left to train."""
    epochs, val = cfg.trainer.epochs, None
    while state.epoch < epochs:
        started = time.perf_counter()
        train_totals = train_epoch(cfg, state, data.train, device, duties)
        _check_finite(train_totals.as_host()[0], duties.rank, state.step,
                      "the epoch's training loss")
        train_time = time.perf_counter() - started
        train = metrics.reduce(train_totals)
        last = state.epoch + 1 == epochs
        val = None
        if last or (state.epoch + 1) % cfg.trainer.eval_every == 0:
            val = metrics.reduce(evaluate(state.module, data.val, device, cfg.trainer.precision,
                                          data.num_classes if last else None))
        nodes = None
        if cfg.tracking.system_metrics:  # one more small gather per epoch
            nodes = distributed.gather_to_all(system_stats.node_sample(duties.local_rank, device))
        duties.logger.epoch(state.epoch, train=train, val=val, train_time_s=train_time,
                            epoch_time_s=time.perf_counter() - started,
                            lr=state.scheduler.get_last_lr()[0], nodes=nodes)
        state.epoch += 1
        stop = distributed.any_rank(duties.stop.received is not None)
        if stop or duties.checkpointer.epoch_end_due(state.epoch):
            duties.checkpointer.save(state, None, 0)
        if stop and state.epoch < epochs:
            raise duties.stop.preempted()
    return val
