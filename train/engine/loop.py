"""The training loop of one rank: epochs of DDP steps, exact validation, reduced metrics.

The loop is the same on every rank. It syncs with the host only at the end of an epoch and on
every `trainer.log_every_n_steps`-th step; the metrics it reduces are the same on every rank, and
what is recorded of them is the training log's business (train/report/trainlog.py).
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from train.config.groups import TrainConfig, TrainerConfig
from train.data.build import Batches, DataBundle
from train.distributed import process_group as distributed
from train.distributed.stopping import StopSignals
from train.engine.checkpoint import Checkpointer
from train.engine.monitor import Monitor
from train.engine.state import TrainState
from train.models import build as models
from train.report import metrics, system_stats
from train.report.trainlog import TrainingLog


class NonFiniteLossError(FloatingPointError):
    """Training diverged."""


class ModelOutputError(ValueError):
    """The model's output is not (batch, num_classes)."""


class FailureDrill(RuntimeError):
    """The failure asked for with trainer.fail_on_rank."""


def fail_drill(trainer: TrainerConfig, step: int, rank: int) -> None:
    """trainer.fail_on_rank: raise on that rank at step trainer.fail_at_step (0: start-up)."""
    if step == trainer.fail_at_step and rank == trainer.fail_on_rank:
        raise FailureDrill(f"trainer.fail_on_rank={rank}: failing on purpose at step {step}")


@dataclass
class Duties:
    """What a rank must look after besides training: record, checkpoint, heed stop signals."""

    logger: TrainingLog
    checkpointer: Checkpointer
    stop: StopSignals
    rank: int
    local_rank: int
    monitor: Monitor


class Criterion:
    """trainer.loss on the model's class scores, and the top-k that goes with them.

    The first batch's scores are checked to be (batch, num_classes): a user's model that gets
    this wrong then fails with the shapes, not with an obscure error inside the loss.
    `num_classes=None`: neither that check nor top-k nor a confusion matrix.
    """

    def __init__(self, loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                 num_classes: int | None, model: str) -> None:
        self.loss_fn, self.num_classes, self.model = loss_fn, num_classes, model
        self.top_k = metrics.TOP_K if (num_classes or 0) > metrics.TOP_K else None
        self._checked = False

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor,
                 inputs: torch.Tensor) -> torch.Tensor:
        if not self._checked and self.num_classes is not None:  # host-side shapes: no sync
            if problem := models.output_mismatch(self.model, self.num_classes,
                                                 tuple(inputs.shape), tuple(logits.shape)):
                raise ModelOutputError(problem)
            self._checked = True
        return self.loss_fn(logits, labels)

    def totals(self, device: torch.device, confusion: bool = False) -> metrics.Totals:
        return metrics.Totals(device, self.num_classes if confusion else None, self.top_k)


def build_criterion(cfg: TrainConfig, num_classes: int, device: torch.device) -> Criterion:
    return Criterion(models.build_loss(cfg.trainer.loss, device), num_classes,
                     models.describe(cfg.model))


def autocast(device: torch.device, precision: str) -> contextlib.AbstractContextManager:
    if precision == "fp32":
        return contextlib.nullcontext()
    dtype = torch.bfloat16 if precision == "bf16-mixed" else torch.float16
    return torch.autocast(device_type=device.type, dtype=dtype)


def _check_finite(value: float, rank: int, step: int, where: str) -> None:
    if not math.isfinite(value):
        raise NonFiniteLossError(f"{where} is {value} on rank {rank} at step {step}: training "
                                 "diverged (lower optim.lr, set optim.grad_clip, or use fp32).")


# fp16's loss scale only falls when a step's gradients overflow; this low, every step for ~40
# in a row overflowed: the loss or the weights are no longer finite numbers in fp16, a
# divergence that skipping steps cannot cure.
MIN_LOSS_SCALE = 2.0**-24


def _report_scaler(state: TrainState, duties: Duties) -> None:
    """fp16: the steps skipped so far and the loss scale (host syncs: logging steps and epoch
    ends only); a scale that collapsed stops the job as a divergence, with rank and step."""
    if not state.scaler.is_enabled():
        return
    scale = state.scaler.get_scale()
    duties.logger.grad_scaler(state.step, state.scaler.skipped_steps, scale)
    if scale < MIN_LOSS_SCALE:
        raise NonFiniteLossError(
            f"fp16 gradients overflowed at every step up to step {state.step} on rank "
            f"{duties.rank} (loss scale {scale:.3g}): training diverged (lower optim.lr, set "
            "optim.grad_clip, or use bf16-mixed or fp32).")


def _micro_step(cfg: TrainConfig, state: TrainState, images: torch.Tensor,
                labels: torch.Tensor, device: torch.device, criterion: Criterion,
                weight: float, sync: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward and backward of one micro-batch, its loss weighted by its share of the optimiser
    step's samples (1/trainer.accumulate_grad_batches when all are full), so that the summed
    gradient is the mean over the step's samples. `sync=False`: under DDP's no_sync the
    gradient only accumulates on this rank; the step's last micro-batch all-reduces the sum."""
    with contextlib.nullcontext() if sync else state.model.no_sync():
        with autocast(device, cfg.trainer.precision):
            logits = state.model(images)
            loss = criterion(logits, labels, images)
        state.scaler.scale(loss if weight == 1 else loss * weight).backward()
    return logits, loss


def _optimiser_step(cfg: TrainConfig, state: TrainState) -> None:
    """Once per optimiser step, after its micro-batches: unscale (fp16) and clip the summed
    gradient, step, and advance the LR schedule and `state.step`."""
    if cfg.optim.grad_clip is not None:
        state.scaler.unscale_(state.optimizer)
        nn.utils.clip_grad_norm_(state.model.parameters(), cfg.optim.grad_clip)
    state.scaler.step(state.optimizer)
    state.scaler.update()
    state.scheduler.step()
    state.step += 1


def _log_step(state: TrainState, duties: Duties, totals: metrics.Totals, step_loss: torch.Tensor,
              step_time_s: float, batches_done: int, batches: int) -> None:
    """A logging step, the only one that waits for the device: the step loss, fp16's scaler,
    and a checkpoint (then a stop) if any rank asks for one."""
    sync = metrics.sync_step(step_loss, step_time_s, duties.stop.received is not None,
                             duties.checkpointer.interval_due())
    _check_finite(sync.mean_loss, duties.rank, state.step, "train/step_loss (mean over ranks)")
    duties.logger.step(state.step, sync)
    _report_scaler(state, duties)
    if (sync.stop_requested or sync.checkpoint_due) and batches_done < batches:
        duties.checkpointer.save(state, totals, batches_done)  # the epoch end does anyway
        if sync.stop_requested:
            raise duties.stop.preempted()


def train_epoch(cfg: TrainConfig, state: TrainState, batches: Batches, device: torch.device,
                duties: Duties, criterion: Criterion) -> metrics.Totals:
    """One epoch of optimiser steps, each over trainer.accumulate_grad_batches micro-batches
    (the epoch's last over what is left: its gradient is still the mean over its samples)."""
    state.model.train()
    totals = criterion.totals(device)
    skip, state.batch_in_epoch = state.batch_in_epoch, 0
    if state.partial_totals is not None:
        totals.restore(state.partial_totals)
        state.partial_totals = None
    # The same order as before a restart, from the first batch not yet trained: the batches
    # before it are not read (nor decoded, for streamed data). Checkpoints are taken between
    # optimiser steps only, so `skip` starts a group of micro-batches.
    batches.set_epoch(state.epoch, start_batch=skip)
    every, k = cfg.trainer.log_every_n_steps, cfg.trainer.accumulate_grad_batches
    count = len(batches)
    window_start, window_steps = time.perf_counter(), 0
    step_loss = torch.zeros((), device=device)
    for index, (images, labels) in enumerate(duties.logger.progress(batches, state.epoch),
                                             start=skip):
        first, end = index - index % k, min(index - index % k + k, count)
        if index == first:
            state.optimizer.zero_grad(set_to_none=True)
        weight = labels.shape[0] / batches.samples_in(first, end)  # shapes: no sync
        logits, loss = _micro_step(cfg, state, images, labels, device, criterion, weight,
                                   sync=index + 1 == end)
        totals.add(logits, labels, loss)
        share = loss.detach() if weight == 1 else loss.detach() * weight
        step_loss = share if index == first else step_loss + share
        if index + 1 < end:
            continue
        _optimiser_step(cfg, state)
        window_steps += 1
        if state.step == 1:
            duties.logger.first_step()
        fail_drill(cfg.trainer, state.step, duties.rank)
        if state.step % every == 0:
            _log_step(state, duties, totals, step_loss,
                      (time.perf_counter() - window_start) / window_steps, end, count)
            window_start, window_steps = time.perf_counter(), 0
        if state.step == cfg.trainer.max_steps:  # the training ends with this step
            break
    return totals


@torch.no_grad()
def evaluate(model: nn.Module, batches: Batches, device: torch.device, precision: str,
             criterion: Criterion | None = None, confusion: bool = False) -> metrics.Totals:
    """This rank's shard of the validation set, on the bare module (no DDP collectives): the
    loss on fp32 scores, accuracy, top-5 (more than 5 classes) and, with `confusion`, the
    confusion matrix. No criterion: cross-entropy and accuracy only."""
    model.eval()
    criterion = criterion or Criterion(nn.CrossEntropyLoss(), None, "the model")
    totals = criterion.totals(device, confusion)
    for images, labels in batches:
        with autocast(device, precision):
            logits = model(images)
        logits = logits.float()
        totals.add(logits, labels, criterion(logits, labels, images))
    return totals


def fit(cfg: TrainConfig, state: TrainState, data: DataBundle, device: torch.device,
        duties: Duties) -> metrics.Reduced | None:
    """Train from `state` to trainer.epochs (or trainer.max_steps), or until early stopping;
    returns the last validation (with its confusion matrix), or None when this start had no
    epoch left."""
    epochs, limit, val = cfg.trainer.epochs, cfg.trainer.max_steps, None
    criterion = build_criterion(cfg, data.num_classes, device)
    while state.epoch < epochs and (limit is None or state.step < limit):
        started = time.perf_counter()
        train_totals = train_epoch(cfg, state, data.train, device, duties, criterion)
        _check_finite(train_totals.as_host()[0], duties.rank, state.step,
                      "the epoch's training loss")
        if state.step % cfg.trainer.log_every_n_steps:  # else logged at that step already
            _report_scaler(state, duties)
        train_time = time.perf_counter() - started
        train = metrics.reduce(train_totals)
        last = state.epoch + 1 == epochs or state.step == limit
        val = None
        if last or (state.epoch + 1) % cfg.trainer.eval_every == 0:
            # With early stopping any evaluation may be the last: each keeps its confusion.
            confusion = last or duties.monitor.patience is not None
            val = metrics.reduce(evaluate(state.module, data.val, device, cfg.trainer.precision,
                                          criterion, confusion=confusion))
            duties.monitor.observe(state.epoch, state.step, val)
        nodes = None
        if cfg.tracking.system_metrics:  # one more small gather per epoch
            nodes = distributed.gather_to_all(system_stats.node_sample(duties.local_rank, device))
        duties.logger.epoch(state.epoch, train=train, val=val, train_time_s=train_time,
                            epoch_time_s=time.perf_counter() - started,
                            lrs=state.learning_rates(cfg.optim.lr), nodes=nodes)
        state.epoch += 1
        stop = distributed.any_rank(duties.stop.received is not None)
        early = not last and duties.monitor.stop_agreed()
        if stop or early or duties.checkpointer.epoch_end_due(state.epoch):
            duties.checkpointer.save(state, None, 0)
        if early:
            break
        if stop and not last:
            raise duties.stop.preempted()
    return val


def test(model: nn.Module, batches: Batches, device: torch.device, precision: str,
         criterion: Criterion) -> metrics.Reduced:
    """The final model, once, on every rank's strided shard of the test split (each sample on
    exactly one rank, none twice): loss, accuracy, top-5 and the confusion matrix."""
    return metrics.reduce(evaluate(model, batches, device, precision, criterion, confusion=True))
