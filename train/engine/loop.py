"""The training loop of one rank: epochs of DDP steps and reduced metrics (validation and test:
train/engine/evaluation.py), the same for every task (train/tasks/: a batch's loss and sums).

The loop is the same on every rank. It syncs with the host only at the end of an epoch and on
every `trainer.log_every_n_steps`-th step; the metrics it reduces are the same on every rank, and
what is recorded of them is the training log's business (train/report/trainlog.py).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from train.config.groups import TrainConfig
from train.data.build import SHARDED, Batches, DataBundle
from train.distributed import phase
from train.distributed import process_group as distributed
from train.distributed.stopping import StopSignals
from train.engine import divergence, drill, ema, fsdp, optim
from train.engine.checkpoint import Checkpointer
from train.engine.evaluation import autocast, check_output, evaluate
from train.engine.monitor import Monitor
from train.engine.profiling import StepProfiler
from train.engine.state import TrainState
from train.engine.stragglers import Stragglers
from train.engine.trial import TrialReporter
from train.models.build import logits_of
from train.report import breakdown, metrics, system_stats
from train.report.trainlog import TrainingLog
from train.tasks.base import Sums, Task


@dataclass
class Duties:
    """What a rank must look after besides training: record, checkpoint, heed stop signals."""

    logger: TrainingLog
    checkpointer: Checkpointer
    stop: StopSignals
    rank: int
    local_rank: int
    monitor: Monitor
    fail_at: int | None = None
    """The step of this rank's failure drill (train/engine/drill.py); None = none."""
    stragglers: Stragglers | None = None
    trial: TrialReporter | None = None
    """An Optuna sweep's trial (train/engine/trial.py): reports and the pruner's verdict."""
    breakdown: breakdown.Breakdown = field(default_factory=breakdown.Breakdown)
    """Where the step time goes, over every logging interval of this start."""
    profiler: StepProfiler | None = None
    """trainer.profile's (train/engine/profiling.py); None = not profiled."""


def _micro_step(cfg: TrainConfig, state: TrainState, inputs: Any, target: Any,
                device: torch.device, task: Task, step_samples: int,
                sync: bool) -> tuple[torch.Tensor, Sums]:
    """Forward and backward of one micro-batch. The task's loss is a SUM over the batch's
    items. For a task of fixed items it is weighted by 1 / the optimiser step's items on this
    rank (its `step_samples` times the items per sample: shapes, no sync; every rank holds as
    many samples, DistributedSampler pads), so the summed gradient is the mean over the step's
    items; where items vary (ignored pixels, padding) the sum stays, and `_optimiser_step`
    divides by the step's item count over all ranks. `sync=False`: under DDP's no_sync the
    gradient only accumulates on this rank; the step's last micro-batch all-reduces the sum."""
    with fsdp.gradient_sync(state.model, sync):
        with autocast(device, cfg.trainer.precision):
            output = logits_of(state.model(inputs))
            loss, sums = task.step(output, target)
        if task.fixed_items:
            per_sample = int(sums["items"]) / max(1, int(sums["samples"]))
            loss = loss / (step_samples * per_sample)
        phase.enter("backward")
        state.scaler.scale(loss).backward()
    return output, sums


def _optimiser_step(cfg: TrainConfig, state: TrainState, items: torch.Tensor | None,
                    device: torch.device) -> None:
    """Once per optimiser step, after its micro-batches: divide the summed gradient by the
    step's item count over all ranks where the task's items vary (`items`: this rank's; one
    small all-reduce, no host sync), unscale (fp16) and clip it, step, and advance
    `state.step` and the LR schedule where it steps per optimiser step (the built-in one;
    optim.scheduler_interval=step)."""
    phase.enter("optimizer")
    if items is not None:
        # On the job's device, not the parameters' (in host memory with cpu_offload): nccl
        # reduces only GPU tensors.
        everywhere = torch.as_tensor(items, dtype=torch.float64, device=device).clone()
        phase.enter("collective")
        torch.distributed.all_reduce(everywhere)
        phase.enter("optimizer")
        # DDP averaged the ranks' summed gradients: times the world size, over every item.
        scale = (torch.distributed.get_world_size() / everywhere.clamp_min(1)).float()
        # FSDP: this rank's shards (offloaded: on the host). One foreach kernel per device and
        # dtype, not one per parameter (a GPT's ~100 launches a step on a GPU).
        grads: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
        for param in state.module.parameters():
            if param.grad is not None:
                grad = fsdp.local(param.grad)
                grads.setdefault((grad.device, grad.dtype), []).append(grad)
        for (where, _), group in grads.items():
            torch._foreach_mul_(group, scale.to(where))
    if cfg.optim.grad_clip is not None:
        state.scaler.unscale_(state.optimizer)
        state.grad_norm = nn.utils.clip_grad_norm_(state.model.parameters(), cfg.optim.grad_clip)
    state.scaler.step(state.optimizer)
    state.scaler.update()
    if state.scheduler_interval == "step":
        state.scheduler.step()
    state.step += 1
    if state.ema is not None:
        state.ema.update(state.step)
    phase.enter("optimizer", state.step)


def _log_step(state: TrainState, duties: Duties, totals: metrics.Totals, step_loss: torch.Tensor,
              step_time_s: float, steps: int, batches_done: int, batches: int) -> None:
    """A logging step, the only one that waits for the device: the step loss, where the
    interval's `steps` steps spent their time (train/report/breakdown.py), fp16's scaler, and a
    checkpoint (then a stop) if any rank asks for one."""
    phase.enter("collective")  # the interval's last phase ends here: it counts in take_spent
    phases = breakdown.phase_seconds(phase.take_spent())
    sync = metrics.sync_step(step_loss, step_time_s, duties.stop.received is not None,
                             duties.checkpointer.interval_due(), phases)
    if duties.stragglers is not None:  # every rank judges alike; rank 0 speaks
        duties.stragglers.judge([duties.stragglers.own_work(row) for row in sync.shared],
                                state.step)
    phase.note_data_share(breakdown.share(phases, "data"))  # `train status` shows it
    divergence.check_finite(sync.mean_loss, duties.rank, state.step,
                            "train/step_loss (mean over ranks)")
    # The clipped step's norm, read only here (a host sync; under FSDP a collective, every
    # rank logs at the same steps).
    grad_norm = None if state.grad_norm is None else float(fsdp.whole(state.grad_norm))
    duties.logger.step(state.step, sync, grad_norm,
                       duties.breakdown.interval(sync.shared, steps) | {"time/step": step_time_s})
    divergence.report_scaler(state, duties.logger, duties.rank)
    if (sync.stop_requested or sync.checkpoint_due) and batches_done < batches:
        duties.checkpointer.save(state, totals, batches_done)  # the epoch end does anyway
        if sync.stop_requested:
            raise duties.stop.preempted()


def train_epoch(cfg: TrainConfig, state: TrainState, batches: Batches, device: torch.device,
                duties: Duties, task: Task) -> metrics.Totals:
    """One epoch of optimiser steps, each over trainer.accumulate_grad_batches micro-batches
    (the epoch's last over what is left: its gradient is still the mean over its items)."""
    state.model.train()
    totals = metrics.Totals(device, task.layout(detailed=False))
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
    phase.enter("data")  # ends what came before (validation, a checkpoint, the set-up) ...
    phase.forget_spent()  # ... which the breakdown's first interval must not hold
    if duties.profiler is not None:
        duties.profiler.epoch_begins()
    window_start, window_steps = time.perf_counter(), 0
    step_losses: list[torch.Tensor] = []
    step_items: Any = 0
    logs = False
    for index, (inputs, target) in enumerate(phase.reading(duties.logger.progress(batches,
                                                                            state.epoch)),
                                             start=skip):
        first, end = index - index % k, min(index - index % k + k, count)
        if index == first:
            state.optimizer.zero_grad(set_to_none=True)
            step_items, logs = 0, (state.step + 1) % every == 0
            step_losses = []
        output, sums = _micro_step(cfg, state, inputs, target, device, task,
                                   batches.samples_in(first, end), sync=index + 1 == end)
        if index == skip:
            check_output(task, output, target, inputs)
        totals.add(sums)
        step_items = step_items + sums["items"]
        if logs:  # the step loss is added up only where it is logged: no kernel elsewhere
            step_losses.append(sums["loss"])
        if index + 1 < end:
            continue
        _optimiser_step(cfg, state, None if task.fixed_items else step_items, device)
        window_steps += 1
        if duties.profiler is not None:
            duties.profiler.step()
        if duties.logger.first_step_at is None:  # this start's first step (also a resumed one)
            phase.enter("tracking")  # rank 0 starts its MLflow sender: not the optimiser's
            duties.logger.first_step()
        drill.check(duties.fail_at, state.step, duties.rank)
        if logs:  # (state.step is now the step `logs` was decided for)
            # The next window starts now, as the breakdown's next interval: the logging step's
            # own time counts in both.
            step_time, steps = (time.perf_counter() - window_start) / window_steps, window_steps
            window_start, window_steps = time.perf_counter(), 0
            _log_step(state, duties, totals, sum(step_losses[1:], step_losses[0]) / step_items,
                      step_time, steps, end, count)
        if state.step == cfg.trainer.max_steps:  # the training ends with this step
            break
    return totals


def fit(cfg: TrainConfig, state: TrainState, data: DataBundle, device: torch.device,
        duties: Duties, task: Task) -> metrics.Reduced | None:
    """Train from `state` to trainer.epochs (or trainer.max_steps), or until early stopping;
    returns the last validation (with what the task keeps for the final one), or None when
    this start had no epoch left."""
    if duties.profiler is None:
        return _fit(cfg, state, data, device, duties, task)
    duties.profiler.start(state.step)
    try:
        return _fit(cfg, state, data, device, duties, task)
    finally:
        duties.profiler.stop()


def _fit(cfg: TrainConfig, state: TrainState, data: DataBundle, device: torch.device,
         duties: Duties, task: Task) -> metrics.Reduced | None:
    epochs, limit, val = cfg.trainer.epochs, cfg.trainer.max_steps, None
    while state.epoch < epochs and (limit is None or state.step < limit):
        started, cpu_started = time.perf_counter(), time.process_time()
        train_totals = train_epoch(cfg, state, data.train, device, duties, task)
        divergence.check_finite(train_totals.as_host()["loss"], duties.rank, state.step,
                      "the epoch's training loss")
        if state.step % cfg.trainer.log_every_n_steps:  # else logged at that step already
            divergence.report_scaler(state, duties.logger, duties.rank)
        train_time = time.perf_counter() - started
        # This process's CPU time (all its threads): what the rank's work cost, whatever else
        # ran on the machine (bench/ compares it with a plain loop's).
        train_cpu = time.process_time() - cpu_started
        train = metrics.reduce(train_totals, task.finalize, task.items_name)
        last = state.epoch + 1 == epochs or state.step == limit
        val, val_started = None, time.perf_counter()
        if last or (state.epoch + 1) % cfg.trainer.eval_every == 0:
            # With early stopping any evaluation may be the last: each keeps the details.
            detailed = last or duties.monitor.patience is not None
            with ema.applied(state.ema):  # trainer.ema: the average is validated and kept
                val = metrics.reduce(evaluate(state.module, data.val, device,
                                              cfg.trainer.precision, task, detailed,
                                              examples=last and duties.rank == 0,
                                              filler=state.filler),
                                     task.finalize, task.items_name)
                duties.monitor.observe(state.epoch, state.step, val)  # best.pt's weights
        val_time = time.perf_counter() - val_started
        # Collective at each evaluation, like early stopping: no rank leaves the loop alone.
        pruned = (val is not None and duties.trial is not None
                  and duties.trial.should_stop(state.epoch + 1, train, val, last))
        nodes = None
        if cfg.tracking.system_metrics:  # one more small gather per epoch
            nodes = distributed.gather_to_all(system_stats.node_sample(duties.local_rank, device))
        profiled = (0, 0.0) if duties.profiler is None else duties.profiler.take_excluded()
        duties.logger.epoch(state.epoch, train=train, val=val, train_time_s=train_time,
                            epoch_time_s=time.perf_counter() - started, train_cpu_s=train_cpu,
                            val_time_s=val_time,
                            lrs=state.learning_rates(cfg.optim.lr), nodes=nodes,
                            profiled=(profiled[0] * cfg.data.batch_size, profiled[1]))
        optim.step_at_epoch_end(state.scheduler, state.scheduler_interval, val,
                                cfg.trainer.monitor)  # before the epoch's checkpoint
        state.epoch += 1
        stop = distributed.any_rank(duties.stop.received is not None)
        early = pruned or (not last and duties.monitor.stop_agreed())
        if stop or early or duties.checkpointer.epoch_end_due(state.epoch):
            duties.checkpointer.save(state, None, 0)
        if early:
            break
        if stop and not last:
            raise duties.stop.preempted()
    workers = data.train.loader.num_workers if data.train.loader is not None else 0
    ranks_here = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if (verdict := duties.breakdown.verdict(workers, ranks_here, cfg.trainer.precision,
                                            cfg.trainer.compile, cfg.data.name in SHARDED,
                                            cfg.distributed.strategy)) is not None:
        duties.logger.bottleneck(verdict)
    return val
