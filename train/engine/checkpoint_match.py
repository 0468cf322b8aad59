"""Whether a job may continue a checkpoint: the config keys its tensors depend on must match,
and a mid-epoch position must count batches of the same size. Refused before any run is
touched (train/engine/prepare.py, and the pre-flight for a local job's own checkpoint).

Light: no torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from train.errors import TrainError


@dataclass
class Resumed:
    """A loaded checkpoint, as every rank needs it (train/engine/checkpoint_folder.py loads
    it; here because this module checks it and imports nothing of the engine)."""

    state: dict[str, Any]
    path: Path


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
    if problem := _other_shards(state, config):
        differences.append(problem)
    return "; ".join(differences) or None


def _other_shards(state: dict[str, Any], config: dict[str, Any]) -> str | None:
    """data=arrow: the shards the checkpoint trained on are not those of data.root now (their
    digest, from the manifest's checksums): its place in the epoch would point elsewhere."""
    data = config.get("data") if isinstance(config.get("data"), dict) else {}
    if not state.get("data_digest") or data.get("name") != "arrow":
        return None
    from train.data import arrow

    try:
        now = arrow.digest(arrow.find(data["root"]))
    except arrow.ArrowDataError as e:
        return str(e)
    if now == state["data_digest"]:
        return None
    return (f"it was written on data=arrow shards of digest {state['data_digest']} and "
            f"data.root={data['root']} now holds {now} (another or a changed data set)")


def check_compatible(resumed: Resumed, config: dict[str, Any], world_size: int) -> None:
    if problem := mismatch(resumed.state, config, world_size):
        raise CheckpointMismatch(
            f"Refusing to resume from {resumed.path}: this job cannot continue it ({problem}). "
            "Use the configuration that wrote it, another output directory "
            "(hydra.run.dir=...), or trainer.resume=never to start afresh.")
