"""Checkpoints: what a job needs to continue exactly where it stopped, written safely.

One file per checkpoint, written by rank 0 (through train/engine/safewrite.py: a full disk costs no
earlier checkpoint and leaves no partial file) after gathering every rank's RNG state and partial
epoch sums: model, optimiser, LR schedule, grad scaler, epoch, global step, the batch reached in
the current epoch, the MLflow run id and the composed config. Written atomically (temporary
file, fsync, rename, fsync of the directory); the newest `keep` are kept. Read back with
`torch.load(weights_only=True)`, which never unpickles arbitrary objects; a file that does not
load (truncated, corrupt) is reported and the previous one is used.

Under distributed.strategy=fsdp the model and optimiser state are consolidated first (every
rank takes part: train/engine/fsdp.py) into the layout a DDP job writes, so a checkpoint of
either strategy continues under the other; and any checkpoint, mid-epoch too, continues on
any world size (`partial_totals`).
"""

from __future__ import annotations

import logging
import random
import re
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from train.config.groups import TrainerConfig
from train.engine import fsdp, safewrite, sharded
from train.engine.state import TrainState
from train.errors import TrainError
from train.report.metrics import Totals

log = logging.getLogger("train")

NAME = re.compile(r"step-(\d+)\.(pt|dcp)$")
"""A checkpoint: a file (step-<N>.pt) or a sharded directory (step-<N>.dcp: engine/sharded.py)."""


@dataclass
class Resumed:
    """A loaded checkpoint, as every rank needs it."""

    state: dict[str, Any]
    path: Path


def directory(output_dir: Path) -> Path:
    return output_dir / "checkpoints"


def is_own(resumed: Resumed, output_dir: Path) -> bool:
    """Whether a checkpoint is this output directory's own (not trainer.resume=<elsewhere>)."""
    return resumed.path.resolve().parent == directory(output_dir).resolve()


def candidates(folder: Path) -> list[Path]:
    """Checkpoints (files and sharded directories), newest (highest step) first."""
    found = [(int(m.group(1)), p) for p in folder.glob("step-*") if (m := NAME.search(p.name))]
    return [p for _, p in sorted(found, reverse=True)]


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


def save(folder: Path, state: dict[str, Any], keep: int) -> Path:
    """Write `state` atomically as step-<global step>.pt and drop all but the newest `keep`.

    Serialised in memory first, so its size is known before the disk is touched: if the
    filesystem cannot hold it, older checkpoints but the newest go first; if it still does not
    fit, DiskFull - no partial file, the newest checkpoint kept."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"step-{state['step']:09d}.pt"
    payload = safewrite.serialised(state)
    for stale in folder.glob("step-*.tmp"):  # left by a crash mid-write: space nobody uses
        stale.unlink(missing_ok=True)
    safewrite.make_room(folder, len(payload), _files(candidates(folder)[1:]),
                        f"checkpoint {path}")
    safewrite.write_atomically(path, payload)
    for old in candidates(folder)[keep:]:
        sharded.remove(old)
    return path


def _files(paths: list[Path]) -> list[Path]:
    """What making room may delete: single files (a sharded directory is kept)."""
    return [p for p in paths if p.is_file()]


BEST = "best.pt"
"""trainer.save_best's file in the checkpoints folder; `candidates` (step-*.pt) never prunes it."""


def save_best(folder: Path, weights: dict[str, Any], record: dict[str, Any]) -> Path:
    """The best evaluation's weights (and `record`: epoch, step, monitor, mode, value), written
    atomically over the previous best."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / BEST
    payload = safewrite.serialised({"model": weights, **record})
    safewrite.make_room(folder, len(payload), _files(candidates(folder)[1:]),
                        f"best weights {path}")
    safewrite.write_atomically(path, payload)
    return path


def load_best(folder: Path) -> dict[str, Any]:
    return torch.load(folder / BEST, map_location="cpu", weights_only=True)


def save_weights(weights: dict[str, Any], path: Path, checkpoints: Path) -> Path:
    """The final weights at `path` (written atomically); where the output directory's
    filesystem cannot hold them - even once older checkpoints but the newest are gone - in the
    temporary directory ($TMPDIR) instead, so that a finished training is not thrown away.
    Returns where they are."""
    payload = safewrite.serialised(weights)
    try:
        safewrite.make_room(path.parent, len(payload), _files(candidates(checkpoints)[1:]),
                            f"weights {path}")
        safewrite.write_atomically(path, payload)
        return path
    except safewrite.DiskFull as full:
        import tempfile

        elsewhere = Path(tempfile.mkdtemp(prefix="train-weights-")) / path.name
        safewrite.write_atomically(elsewhere, payload)
        log.error("%s. The final weights were saved to %s instead: move them next to the "
                  "job's outputs once there is room.", full, elsewhere)
        return elsewhere


def check_room_for_one(folder: Path, train: TrainState) -> None:
    """Before training: the output directory's filesystem holds at least one checkpoint (the
    weights and, per parameter, the optimiser's buffers), or DiskFull now rather than after
    the first epoch's work."""
    weights = (sum(p.numel() * p.element_size() for p in train.module.parameters())
               if fsdp.is_sharded(train.module)  # shards: their global shapes are the size
               else len(safewrite.serialised(train.module.state_dict())))
    buffers = 2 if isinstance(train.optimizer, torch.optim.Adam | torch.optim.AdamW) else 1
    folder.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(folder).free
    needed = weights * (1 + buffers) + safewrite.ROOM_MARGIN
    if free < needed:
        raise safewrite.DiskFull(f"No space left on device: {folder} has {free} bytes free and one "
                       f"checkpoint needs about {needed}. Free some space, or put the outputs "
                       "on a larger filesystem (hydra.run.dir=...).")


def whole_state(train: TrainState) -> tuple[dict[str, Any], dict[str, Any]]:
    """The model's and optimiser's state dicts in one layout for both strategies (torch.optim's:
    parameters by index). Under FSDP a collective that gives rank 0 the consolidated dicts (the
    other ranks empty ones), so DDP and FSDP checkpoints load into each other."""
    if fsdp.is_sharded(train.module):
        weights, optimiser = fsdp.full_state_dict(train.module, train.optimizer)
        return weights, optimiser or {}
    return train.module.state_dict(), train.optimizer.state_dict()


def load_newest(paths: list[Path]) -> Resumed | None:
    """The newest checkpoint that loads; unreadable ones are reported and skipped."""
    for path in paths:
        try:
            if sharded.is_checkpoint_dir(path):
                return Resumed(sharded.load_meta(path), path)
            state = torch.load(path, map_location="cpu", weights_only=True)
            if not isinstance(state, dict) or "model" not in state:
                raise ValueError("not a checkpoint of this tool")
            return Resumed(state, path)
        except Exception as e:  # noqa: BLE001 - truncated zip, bad pickle, wrong content
            log.warning("checkpoint %s cannot be loaded (%s: %s); trying the previous one",
                        path, type(e).__name__, e)
    return None


class CheckpointMismatch(TrainError, ValueError):
    """A checkpoint this job cannot continue from (another model, data shape, optimiser, or a
    mid-epoch position on another world size); refused before any run is touched."""


SHAPING = {"model": None, "data": ("name",), "optim": ("name", "_target_", "param_groups")}
"""Config keys a checkpoint's tensors depend on (None: the whole section but MODEL_FREE);
model.freeze and optim.param_groups shape the optimiser's groups, optim._target_ its state
(and optim.scheduler._target_ the schedule's, `_shaping`). A checkpoint older than a key has
None for it, as a config without it has."""
MODEL_FREE = ("dropout", "weights_strict")
"""Model keys that do not change the state dict's tensors."""
DATA_SHAPE = ("channels", "image_size", "num_classes")
"""Data keys that shape the model where a data set takes them (synthetic, imagefolder)."""


def _shaping(config: dict[str, Any]) -> dict[str, Any]:
    picked: dict[str, Any] = {}
    for section, keys in SHAPING.items():
        values = config.get(section) or {}
        if not isinstance(values, dict):
            continue
        chosen = [k for k in values if k not in MODEL_FREE] if keys is None else list(keys)
        if section == "data" and values.get("name") in ("synthetic", "imagefolder"):
            chosen += [k for k in DATA_SHAPE if k in values]
        picked.update({f"{section}.{k}": values.get(k) for k in chosen})
    optim = config.get("optim")
    scheduler = optim.get("scheduler") if isinstance(optim, dict) else None
    picked["optim.scheduler._target_"] = (
        scheduler.get("_target_") if isinstance(scheduler, dict) else None)
    # The task shapes the model's outputs; a checkpoint from before tasks is a classifier's.
    task = config.get("task") if isinstance(config.get("task"), dict) else {}
    picked["task.name"] = task.get("name") or "classification"
    picked["task._target_"] = task.get("_target_")
    return picked


def _accumulation(config: Any) -> Any:
    trainer = config.get("trainer") if isinstance(config, dict) else None
    return trainer.get("accumulate_grad_batches", 1) if isinstance(trainer, dict) else 1


def _batch_size(config: Any) -> Any:
    data = config.get("data") if isinstance(config, dict) else None
    return data.get("batch_size") if isinstance(data, dict) else None


def mismatch(state: dict[str, Any], config: dict[str, Any], world_size: int) -> str | None:
    """Why this job (its composed `config`, on `world_size` ranks) cannot continue from a
    checkpoint's `state`; None if it can. A checkpoint taken at an epoch's end continues on any
    world size (every rank starts the next epoch afresh; the other ranks' RNG streams are
    seeded anew); one taken mid-epoch holds each rank's place in its shard and partial sums,
    which are folded for another world size (`restore`): any world size continues either."""
    import yaml

    try:
        stored = yaml.safe_load(state.get("config") or "") or {}
    except yaml.YAMLError:
        stored = {}
    theirs, ours = _shaping(stored if isinstance(stored, dict) else {}), _shaping(config)
    differences = [f"{key}={theirs[key]!r} there, {ours.get(key)!r} here"
                   for key in theirs if key in ours and theirs[key] != ours[key]]
    theirs_k, ours_k = _accumulation(stored), _accumulation(config)
    if state.get("batch_in_epoch") and theirs_k != ours_k:
        differences.append(
            f"it was written mid-epoch with trainer.accumulate_grad_batches={theirs_k} and this "
            f"job has {ours_k} (its place in the epoch counts micro-batches of that size)")
    theirs_b, ours_b = _batch_size(stored), _batch_size(config)
    if state.get("batch_in_epoch") and theirs_b != ours_b:
        differences.append(
            f"it was written mid-epoch with data.batch_size={theirs_b} and this job has "
            f"{ours_b} (its place in the epoch counts global batches of that size)")
    return "; ".join(differences) or None


def check_compatible(resumed: Resumed, config: dict[str, Any], world_size: int) -> None:
    if problem := mismatch(resumed.state, config, world_size):
        raise CheckpointMismatch(
            f"Refusing to resume from {resumed.path}: this job cannot continue it ({problem}). "
            "Use the configuration that wrote it, another output directory "
            "(hydra.run.dir=...), or trainer.resume=never to start afresh.")


def find(resume: str, output_dir: Path) -> Resumed | None:
    """`trainer.resume`: auto (this job's newest, if any), never, or a checkpoint path."""
    if resume == "never":
        return None
    if resume == "auto":
        return load_newest(candidates(directory(output_dir)))
    path = Path(resume)
    paths = candidates(path) if path.is_dir() and not sharded.is_checkpoint_dir(path) else [path]
    found = load_newest(paths)
    if found is None:
        raise CheckpointMismatch(f"trainer.resume={resume}: no loadable checkpoint there "
                                 "(step-<N>.pt files or step-<N>.dcp directories, or one).")
    return found


class Checkpointer:
    """When to checkpoint, and the checkpoint itself; the same object on every rank.

    `save` is collective: every rank's RNG state and partial sums go to rank 0, which alone
    writes the file - after `before_write` (MLflow's flush: what a crash can lose is then only
    what a resume from this checkpoint replays) and with `run_fields()` added (the MLflow run
    id, the config, the restart count), so that a restarted job continues the same run.
    """

    def __init__(self, folder: Path, cfg: TrainerConfig, rank: int, world_size: int,
                 before_write: Callable[[], None], run_fields: Callable[[], dict[str, Any]]
                 ) -> None:
        self.folder, self.keep = folder, cfg.keep_checkpoints
        self.every_epochs = cfg.checkpoint_every
        interval_min = cfg.checkpoint_interval_min
        self.interval_s = None if interval_min is None else interval_min * 60
        self.rank, self.world_size = rank, world_size
        self.before_write, self.run_fields = before_write, run_fields
        self.last_save = time.monotonic()

    def interval_due(self) -> bool:
        """checkpoint_interval_min has passed since the last checkpoint (on this rank's clock)."""
        return self.interval_s is not None and time.monotonic() - self.last_save >= self.interval_s

    def epoch_end_due(self, epochs_done: int) -> bool:
        return self.every_epochs > 0 and epochs_done % self.every_epochs == 0

    def save(self, train: TrainState, totals: Totals | None, batch_in_epoch: int) -> None:
        """Collective: call it on every rank at the same point. Under FSDP every rank writes its
        shards (engine/sharded.py) and rank 0 the rest; otherwise rank 0 writes one file."""
        from train.distributed import process_group as distributed
        from train.distributed import watch

        watch.enter("checkpoint")
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
        if shards:
            path = sharded.save(self.folder, train.step, train.module, train.optimizer, fields)
            if fields is not None:
                for old in candidates(self.folder)[self.keep:]:
                    sharded.remove(old)
        elif fields is not None:
            path = save(self.folder, {"model": weights, "optimizer": optimiser, **fields},
                        self.keep)
        if fields is not None:
            log.info("checkpoint %s (epoch %d, step %d)", path, train.epoch, train.step)
        distributed.barrier()  # nobody stops (or goes on) before the checkpoint is complete
        self.last_save = time.monotonic()


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
    if sharded.is_checkpoint_dir(resumed.path):  # resharded for this world size and strategy
        sharded.load(resumed.path, train.module, train.optimizer)
    elif fsdp.is_sharded(train.module):  # the same layout whichever strategy wrote it
        fsdp.load_full(train.module, train.optimizer, s["model"], s["optimizer"])
    else:
        train.module.load_state_dict(s["model"])
        train.optimizer.load_state_dict(s["optimizer"])
    train.scheduler.load_state_dict(s["scheduler"])
    train.scaler.load_state_dict(s["scaler"])
    train.epoch, train.step, train.batch_in_epoch = s["epoch"], s["step"], s["batch_in_epoch"]
    mine = s["ranks"][rank] if rank < len(s["ranks"]) else None
    if mine is not None:
        set_rng_state(mine["rng"])
    train.partial_totals = partial_totals(s, rank, world_size)
    log.info("resumed from %s: epoch %d, step %d", resumed.path, train.epoch, train.step)
