"""The training loop of one rank: epochs of DDP steps, exact validation, reduced metrics.

The loop is the same on every rank. It syncs with the host only at the end of an epoch and on
every `trainer.log_every_n_steps`-th step; the metrics it reduces are the same on every rank, and
what is recorded of them is the run logger's business (train/runlog.py).
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from train import distributed, metrics, models, system_stats
from train.checkpoint import Checkpointer
from train.config import TrainConfig
from train.data import Batches, DataBundle
from train.monitor import Monitor
from train.runlog import RunLogger
from train.state import TrainState
from train.stopping import StopSignals


class NonFiniteLossError(FloatingPointError):
    """Training diverged."""


class ModelOutputError(ValueError):
    """The model's output is not (batch, num_classes)."""


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


def _optimiser_step(cfg: TrainConfig, state: TrainState, images: torch.Tensor,
                    labels: torch.Tensor, device: torch.device,
                    criterion: Criterion) -> tuple[torch.Tensor, torch.Tensor]:
    with autocast(device, cfg.trainer.precision):
        logits = state.model(images)
        loss = criterion(logits, labels, images)
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
                duties: Duties, criterion: Criterion) -> metrics.Totals:
    state.model.train()
    totals = criterion.totals(device)
    skip, state.batch_in_epoch = state.batch_in_epoch, 0
    if state.partial_totals is not None:
        totals.restore(state.partial_totals)
        state.partial_totals = None
    # The same order as before a restart, from the first batch not yet trained: the batches
    # before it are not read (nor decoded, for streamed data).
    batches.set_epoch(state.epoch, start_batch=skip)
    every = cfg.trainer.log_every_n_steps
    window_start, window_steps = time.perf_counter(), 0
    for index, (images, labels) in enumerate(duties.logger.progress(batches, state.epoch),
                                             start=skip):
        logits, loss = _optimiser_step(cfg, state, images, labels, device, criterion)
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
            _report_scaler(state, duties)
            wanted = sync.stop_requested or sync.checkpoint_due
            if wanted and index + 1 < len(batches):  # the epoch end checkpoints anyway
                duties.checkpointer.save(state, totals, index + 1)
                if sync.stop_requested:
                    raise duties.stop.preempted()
            window_start, window_steps = time.perf_counter(), 0
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
    """Train from `state` to trainer.epochs, or until early stopping; returns the last
    validation (with its confusion matrix), or None when this start had no epoch left."""
    epochs, val = cfg.trainer.epochs, None
    criterion = build_criterion(cfg, data.num_classes, device)
    while state.epoch < epochs:
        started = time.perf_counter()
        train_totals = train_epoch(cfg, state, data.train, device, duties, criterion)
        _check_finite(train_totals.as_host()[0], duties.rank, state.step,
                      "the epoch's training loss")
        if state.step % cfg.trainer.log_every_n_steps:  # else logged at that step already
            _report_scaler(state, duties)
        train_time = time.perf_counter() - started
        train = metrics.reduce(train_totals)
        last = state.epoch + 1 == epochs
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
                            lr=state.scheduler.get_last_lr()[0], nodes=nodes)
        state.epoch += 1
        stop = distributed.any_rank(duties.stop.received is not None)
        early = state.epoch < epochs and duties.monitor.stop_agreed()
        if stop or early or duties.checkpointer.epoch_end_due(state.epoch):
            duties.checkpointer.save(state, None, 0)
        if early:
            break
        if stop and state.epoch < epochs:
            raise duties.stop.preempted()
    return val


def test(model: nn.Module, batches: Batches, device: torch.device, precision: str,
         criterion: Criterion) -> metrics.Reduced:
    """The final model, once, on every rank's strided shard of the test split (each sample on
    exactly one rank, none twice): loss, accuracy, top-5 and the confusion matrix."""
    return metrics.reduce(evaluate(model, batches, device, precision, criterion, confusion=True))
