"""A rank's training state into a checkpoint and back: what a job needs to continue exactly
where it stopped.

`Checkpointer.save` (collective) gathers every rank's RNG state and partial epoch sums to rank
0, which writes them with the model, optimiser, LR schedule, grad scaler, epoch, global step, the
batch reached in the current epoch, the MLflow run id and the composed config
(train/engine/checkpoint_folder.py: one file; under FSDP every rank writes its shards,
train/engine/sharded.py). `restore` puts one back.

Under distributed.strategy=fsdp a single-file checkpoint's model and optimiser state are
consolidated first (every rank takes part: train/engine/fsdp.py) into the layout a DDP job
writes, so a checkpoint of either strategy continues under the other; and any checkpoint,
mid-epoch too, continues on any world size (`partial_totals`).
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from train.config.groups import TrainerConfig
from train.engine import fsdp, sharded
from train.engine.checkpoint_folder import Resumed, candidates, save

# Re-exported: an error a Slurm job sends back pickled may name it here.
from train.engine.checkpoint_match import CheckpointMismatch as CheckpointMismatch
from train.engine.state import TrainState
from train.report.metrics import Totals

log = logging.getLogger("train")


def rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"torch": torch.get_rng_state(),
                             "python": list(random.getstate()[1]),
                             "python_pos": random.getstate()[2]}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate((3, tuple(state["python"]), state["python_pos"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def whole_state(train: TrainState) -> tuple[dict[str, Any], dict[str, Any]]:
    """The model's and optimiser's state dicts in one layout for both strategies (torch.optim's:
    parameters by index). Under FSDP a collective that gives rank 0 the consolidated dicts (the
    other ranks empty ones), so DDP and FSDP checkpoints load into each other."""
    if fsdp.is_sharded(train.module):
        weights, optimiser = fsdp.full_state_dict(train.module, train.optimizer)
        return weights, optimiser or {}
    return train.module.state_dict(), train.optimizer.state_dict()


class Checkpointer:
    """When to checkpoint, and the checkpoint itself; the same object on every rank.

    `save` is collective: every rank's RNG state and partial sums go to rank 0, which alone
    writes the file - after `before_write` (MLflow's flush: what a crash can lose is then only
    what a resume from this checkpoint replays) and with `run_fields()` added (the MLflow run
    id, the config, the restart count), so that a restarted job continues the same run.
    """

    def __init__(self, folder: Path, cfg: TrainerConfig, rank: int, world_size: int,
                 before_write: Callable[[], None], run_fields: Callable[[], dict[str, Any]],
                 background: bool = False) -> None:
        self.folder, self.keep = folder, cfg.keep_checkpoints
        self.every_epochs = cfg.checkpoint_every
        interval_min = cfg.checkpoint_interval_min
        self.interval_s = None if interval_min is None else interval_min * 60
        self.rank, self.world_size = rank, world_size
        self.before_write, self.run_fields = before_write, run_fields
        self.last_save = time.monotonic()
        self.background = background
        """distributed.fsdp.async_checkpoint: sharded checkpoints written in the background."""
        self.unfinished: sharded.Unfinished | None = None

    def interval_due(self) -> bool:
        """checkpoint_interval_min has passed since the last checkpoint (on this rank's clock)."""
        return self.interval_s is not None and time.monotonic() - self.last_save >= self.interval_s

    def epoch_end_due(self, epochs_done: int) -> bool:
        return self.every_epochs > 0 and epochs_done % self.every_epochs == 0

    def save(self, train: TrainState, totals: Totals | None, batch_in_epoch: int) -> None:
        """Collective: call it on every rank at the same point. Under FSDP every rank writes its
        shards (engine/sharded.py) and rank 0 the rest; otherwise rank 0 writes one file."""
        from train.distributed import phase
        from train.distributed import process_group as distributed

        phase.enter("checkpoint")
        self.finish()  # the one being written in the background, if any: whole first
        shards = fsdp.is_sharded(train.module)
        weights, optimiser = ({}, {}) if shards else whole_state(train)
        mine = {"rng": rng_state(), "totals": totals.snapshot() if totals is not None else None}
        ranks = distributed.gather_to_main(mine)
        fields = None
        if ranks is not None:  # rank 0: the one writer of all but the shards
            self.before_write()
            fields = {"scheduler": train.scheduler.state_dict(),
                      "scaler": train.scaler.state_dict(), "epoch": train.epoch,
                      "step": train.step, "batch_in_epoch": batch_in_epoch,
                      "world_size": self.world_size, "ranks": ranks, **self.run_fields()}
            if train.ema is not None:  # trainer.ema: the average, in the shards or here
                fields["ema_in_shards"] = shards
                fields.update({} if shards else {"ema": train.ema.state_dict()})
        if shards:
            self.unfinished = sharded.begin(
                self.folder, train.step, train.module, train.optimizer, fields,
                candidates(self.folder)[1:] if fields is not None else None, self.background,
                ema=None if train.ema is None else train.ema.state_dict())
            path = self.unfinished.final
            if not self.background:
                self.finish()
        elif fields is not None:
            path = save(self.folder, {"model": weights, "optimizer": optimiser, **fields},
                        self.keep)
        if fields is not None:
            # Epochs are numbered from 1: `epoch` counts those done, so one taken mid-epoch
            # is inside the next.
            where = (f"epoch {train.epoch}" if batch_in_epoch == 0 else
                     f"inside epoch {train.epoch + 1}, batch {batch_in_epoch}")
            log.info("checkpoint %s (%s, step %d%s)", path, where, train.step,
                     ", written in the background" if self.unfinished is not None else "")
        distributed.barrier()  # nobody stops (or goes on) before the checkpoint is complete
        self.last_save = time.monotonic()

    def finish(self) -> None:
        """Collective: complete the sharded checkpoint still being written, if any (before
        the next, and before the job ends), then keep the newest `keep`."""
        if self.unfinished is None:
            return
        sharded.finish(self.unfinished)
        if self.unfinished.meta is not None:
            for old in candidates(self.folder)[self.keep:]:
                sharded.remove(old)
        self.unfinished = None


def partial_totals(state: dict[str, Any], rank: int, world_size: int) -> Any:
    """This rank's running sums of a mid-epoch checkpoint (None at an epoch's end). On another
    world size, rank 0 takes the sum of every writer's sums and the others start at zero:
    the epoch's metrics sum over ranks, so they stay exact. The data position needs no such
    fold: `batch_in_epoch` counts global micro-batches (data.batch_size / accumulation
    samples each, whatever the world size), and DistributedSampler hands out its epoch's
    order interleaved over the ranks, so the first batch_in_epoch x that many samples of the
    order are the trained ones at any world size (train/data/batches.py ShardOrder)."""
    if not state["batch_in_epoch"]:
        return None
    ranks = state["ranks"]
    if len(ranks) == world_size:
        return ranks[rank]["totals"]
    if rank != 0:
        return None
    written = [r["totals"] for r in ranks if r.get("totals") is not None]
    if not written or not isinstance(written[0], dict):
        return written[0] if len(written) == 1 else None
    return {name: torch.stack([torch.as_tensor(t[name]) for t in written]).sum(0).tolist()
            for name in written[0]}


def restore(train: TrainState, resumed: Resumed, rank: int, world_size: int) -> None:
    """Put a loaded checkpoint back into this rank's training state."""
    s = resumed.state
    average = train.ema.state_dict() if train.ema is not None and s.get("ema_in_shards") \
        else None
    if sharded.is_checkpoint_dir(resumed.path):  # resharded for this world size and strategy
        sharded.load(resumed.path, train.module, train.optimizer, average)
    elif fsdp.is_sharded(train.module):  # the same layout whichever strategy wrote it
        fsdp.load_full(train.module, train.optimizer, s["model"], s["optimizer"])
    else:
        train.module.load_state_dict(s["model"])
        train.optimizer.load_state_dict(s["optimizer"])
    if train.ema is not None and "ema" in s:  # a single file's: whole tensors
        train.ema.load_state_dict(s["ema"])
    elif train.ema is not None and average is None:  # written without trainer.ema
        train.ema.reset()
    train.scheduler.load_state_dict(s["scheduler"])
    train.scaler.load_state_dict(s["scaler"])
    train.epoch, train.step, train.batch_in_epoch = s["epoch"], s["step"], s["batch_in_epoch"]
    mine = s["ranks"][rank] if rank < len(s["ranks"]) else None
    if mine is not None:
        set_rng_state(mine["rng"])
    train.partial_totals = partial_totals(s, rank, world_size)
    log.info("resumed from %s: epoch %d, step %d", resumed.path, train.epoch, train.step)
