"""The checkpoints folder: its files and directories, found, loaded and written safely.

A checkpoint is one file `step-<N>.pt` written by rank 0 (this module's `save`), or under
distributed.strategy=fsdp a directory `step-<N>.dcp` that every rank writes its shard of
(train/engine/sharded.py). A file is written atomically through train/engine/safewrite.py
(temporary file, fsync, rename, fsync of the directory: a full disk costs no earlier
checkpoint and leaves no partial file), and the newest `keep` are kept. Read back with
`torch.load(weights_only=True)`, which never unpickles arbitrary objects; one that does not
load (truncated, corrupt, not whole) is reported and the previous one is used. Also here: the
best evaluation's weights (best.pt), the final weights, and the room a checkpoint needs.

What goes into a checkpoint and back into a rank's training state is
train/engine/checkpoint.py's; whether a job may continue one, train/engine/checkpoint_match.py's.
"""

from __future__ import annotations

import logging
import re
import shutil
from pathlib import Path
from typing import Any

import torch

from train.engine import fsdp, safewrite, sharded
from train.engine.checkpoint_match import CheckpointMismatch, Resumed
from train.engine.state import TrainState

log = logging.getLogger("train")

NAME = re.compile(r"step-(\d+)\.(pt|dcp)$")
"""A checkpoint: a file (step-<N>.pt) or a sharded directory (step-<N>.dcp: engine/sharded.py)."""


def directory(output_dir: Path) -> Path:
    return output_dir / "checkpoints"


def is_own(resumed: Resumed, output_dir: Path) -> bool:
    """Whether a checkpoint is this output directory's own (not trainer.resume=<elsewhere>)."""
    return resumed.path.resolve().parent == directory(output_dir).resolve()


def candidates(folder: Path) -> list[Path]:
    """Checkpoints (files and sharded directories), newest (highest step) first."""
    found = [(int(m.group(1)), p) for p in folder.glob("step-*") if (m := NAME.search(p.name))]
    return [p for _, p in sorted(found, reverse=True)]


def save(folder: Path, state: dict[str, Any], keep: int) -> Path:
    """Write `state` atomically as step-<global step>.pt and drop all but the newest `keep`.

    Serialised in memory first, so its size is known before the disk is touched: if the
    filesystem cannot hold it, older checkpoints but the newest go first; if it still does not
    fit, DiskFull - no partial file, the newest checkpoint kept."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"step-{state['step']:09d}.pt"
    payload = safewrite.serialised(state)
    sharded.clear_leftovers(folder)
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
    Returns where they are. Their tensors are written from host memory: a file saved from
    the GPU's would not load on a machine without CUDA (a laptop) without a map_location."""
    payload = safewrite.serialised({name: value.detach().cpu() if torch.is_tensor(value)
                                    else value for name, value in weights.items()})
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
    weights and, per parameter, the optimiser's buffers; trainer.ema's average), or DiskFull
    now rather than after the first epoch's work."""
    weights = (sum(p.numel() * p.element_size() for p in train.module.parameters())
               if fsdp.is_sharded(train.module)  # shards: their global shapes are the size
               else len(safewrite.serialised(train.module.state_dict())))
    buffers = 2 if isinstance(train.optimizer, torch.optim.Adam | torch.optim.AdamW) else 1
    buffers += train.ema is not None
    folder.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(folder).free
    needed = weights * (1 + buffers) + safewrite.ROOM_MARGIN
    if free < needed:
        raise safewrite.DiskFull(f"No space left on device: {folder} has {free} bytes free and one "
                       f"checkpoint needs about {needed}. Free some space, or put the outputs "
                       "on a larger filesystem (hydra.run.dir=...).")


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
