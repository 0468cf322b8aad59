"""The training loop of one rank: epochs of DDP steps, exact validation, reduced metrics.

The loop is the same on every rank. It syncs with the host only at the end of an epoch and on
every `trainer.log_every_n_steps`-th step; what rank 0 does with the numbers is up to the
reporter it is handed.
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass

import torch
from torch import nn

from train import distributed, metrics, system_stats
from train.checkpoint import Checkpointer, Preempted
from train.config import TrainConfig
from train.data import Batches, DataBundle
from train.report import NullReporter


class NonFiniteLossError(FloatingPointError):
    """Training diverged."""


class FailureDrill(RuntimeError):
    """The failure asked for with trainer.fail_on_rank."""


@dataclass
class TrainState:
    model: nn.Module
    """The DDP-wrapped model."""
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    scaler: torch.amp.GradScaler
    epoch: int = 0
    step: int = 0
    batch_in_epoch: int = 0
    """Batches of `epoch` already trained (resuming mid-epoch)."""
    partial_totals: list[float] | None = None
    """This rank's sums over those batches."""


def autocast(device: torch.device, precision: str) -> contextlib.AbstractContextManager:
    if precision == "fp32":
        return contextlib.nullcontext()
    dtype = torch.bfloat16 if precision == "bf16-mixed" else torch.float16
    return torch.autocast(device_type=device.type, dtype=dtype)


def _check_finite(value: float, rank: int, step: int, where: str) -> None:
    if not math.isfinite(value):
        raise NonFiniteLossError(f"{where} is {value} on rank {rank} at step {step}: training "
                                 "diverged (lower optim.lr, set optim.grad_clip, or use fp32).")


def train_epoch(cfg: TrainConfig, state: TrainState, batches: Batches, device: torch.device,
                reporter: NullReporter, rank: int, checkpointer: Checkpointer) -> metrics.Totals:
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
    for index, (images, labels) in enumerate(reporter.progress(batches, state.epoch,
                                                              len(batches))):
        if index < skip:  # trained before the checkpoint this job resumed from
            continue
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
        totals.add(logits, labels, loss)
        state.step += 1
        window_steps += 1
        if state.step == 1:
            reporter.first_step_done()
        if state.step == cfg.trainer.fail_at_step and rank == cfg.trainer.fail_on_rank:
            raise FailureDrill(f"trainer.fail_on_rank={rank}: failing on purpose at step "
                               f"{state.step}")
        if state.step % every == 0:  # the only steps that wait for the device
            now = time.perf_counter()
            mean_loss, slowest, fastest, request = metrics.step_stats_to_all(
                loss, (now - window_start) / window_steps, checkpointer.request())
            _check_finite(mean_loss, rank, state.step, "train/step_loss (mean over ranks)")
            reporter.step({"train/step_loss": mean_loss, "train/step_time_max_s": slowest,
                           "train/step_time_min_s": fastest}, state.step)
            if request > 0 and index + 1 < len(batches):  # the epoch end checkpoints anyway
                checkpointer.save(state, totals, index + 1, reporter)
                if request >= 2:
                    raise Preempted(checkpointer.stop_signal or "a stop request on another rank")
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
        reporter: NullReporter, rank: int, local_rank: int, checkpointer: Checkpointer) -> None:
    bare = state.model.module if hasattr(state.model, "module") else state.model
    epochs = cfg.trainer.epochs
    while state.epoch < epochs:
        started = time.perf_counter()
        train_totals = train_epoch(cfg, state, data.train, device, reporter, rank, checkpointer)
        loss_sum = train_totals.as_host()[0]
        _check_finite(loss_sum, rank, state.step, "the epoch's training loss")
        train_time = time.perf_counter() - started
        train = metrics.reduce_to_main(train_totals)
        last = state.epoch + 1 == epochs
        val = None
        if last or (state.epoch + 1) % cfg.trainer.eval_every == 0:
            val = metrics.reduce_to_main(evaluate(bare, data.val, device, cfg.trainer.precision,
                                                  data.num_classes if last else None))
        nodes = None
        if cfg.tracking.system_metrics:  # one more small gather per epoch
            nodes = distributed.gather_to_main(system_stats.node_sample(local_rank, device))
        reporter.epoch(state.epoch, train=train, val=val, train_time_s=train_time,
                       epoch_time_s=time.perf_counter() - started,
                       lr=state.scheduler.get_last_lr()[0], nodes=nodes)
        state.epoch += 1
        stop = distributed.any_rank(checkpointer.stop_signal is not None)
        if stop or checkpointer.epoch_end_due(state.epoch):
            checkpointer.save(state, None, 0, reporter)
        if stop and state.epoch < epochs:
            raise Preempted(checkpointer.stop_signal or "a stop request on another rank")
