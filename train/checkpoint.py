"""Checkpoints: what a job needs to continue exactly where it stopped, written safely.

One file per checkpoint, written by rank 0 after gathering every rank's RNG state and partial
epoch sums: model, optimiser, LR schedule, grad scaler, epoch, global step, the batch reached in
the current epoch, the MLflow run id and the composed config. Written atomically (temporary
file, fsync, rename, fsync of the directory); the newest `keep` are kept. Read back with
`torch.load(weights_only=True)`, which never unpickles arbitrary objects; a file that does not
load (truncated, corrupt) is reported and the previous one is used.
"""

from __future__ import annotations

import logging
import os
import random
import re
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger("train")

NAME = re.compile(r"step-(\d+)\.pt$")


@dataclass
class Resumed:
    """A loaded checkpoint, as every rank needs it."""

    state: dict[str, Any]
    path: Path


def directory(output_dir: Path) -> Path:
    return output_dir / "checkpoints"


def candidates(folder: Path) -> list[Path]:
    """Checkpoint files, newest (highest step) first."""
    found = [(int(m.group(1)), p) for p in folder.glob("step-*.pt") if (m := NAME.search(p.name))]
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
    """Write `state` atomically as step-<global step>.pt and drop all but the newest `keep`."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"step-{state['step']:09d}.pt"
    tmp = path.with_suffix(".tmp")
    with open(tmp, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)  # the rename itself survives a crash
    finally:
        os.close(fd)
    for old in candidates(folder)[keep:]:
        old.unlink(missing_ok=True)
    return path


def load_newest(paths: list[Path]) -> Resumed | None:
    """The newest checkpoint that loads; unreadable ones are reported and skipped."""
    for path in paths:
        try:
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
    paths = candidates(path) if path.is_dir() else [path]
    found = load_newest(paths)
    if found is None:
        raise FileNotFoundError(f"trainer.resume={resume}: no loadable checkpoint there.")
    return found


class Preempted(Exception):
    """The job was asked to stop (time limit, preemption, requeue); a checkpoint was saved."""

    def __init__(self, signal_name: str) -> None:
        super().__init__(f"stopped by {signal_name} after saving a checkpoint")
        self.signal_name = signal_name


class Checkpointer:
    """Decides when to checkpoint and writes checkpoints; the same object on every rank.

    Signals (USR2 before a Slurm time limit, TERM on preemption or `scontrol requeue`) only set
    a flag: the ranks agree on it at the next logging step or epoch end, where they already
    exchange numbers, save one checkpoint together, and stop.
    """

    STOP_SIGNALS = ("SIGUSR2", "SIGTERM")

    def __init__(self, folder: Path, every_epochs: int, interval_min: float | None,
                 keep: int, rank: int, world_size: int) -> None:
        self.folder, self.every_epochs, self.keep = folder, every_epochs, keep
        self.interval_s = None if interval_min is None else interval_min * 60
        self.rank, self.world_size = rank, world_size
        self.last_save = time.monotonic()
        self.stop_signal: str | None = None

    def install_signal_handlers(self) -> dict[int, Any]:
        """Catch the stop signals; returns the handlers they replace (to put back)."""
        def request_stop(signum: int, _frame: Any) -> None:
            self.stop_signal = signal.Signals(signum).name
            log.warning("received %s: checkpointing at the next step boundary", self.stop_signal)

        previous = {}
        for name in self.STOP_SIGNALS:
            number = getattr(signal, name)
            previous[number] = signal.signal(number, request_stop)
        return previous

    def request(self) -> float:
        """This rank's wish at a step boundary: 0 nothing, 1 an interval checkpoint, 2 stop."""
        if self.stop_signal is not None:
            return 2.0
        due = self.interval_s is not None and time.monotonic() - self.last_save >= self.interval_s
        return 1.0 if due else 0.0

    def epoch_end_due(self, epoch: int) -> bool:
        return self.every_epochs > 0 and epoch % self.every_epochs == 0

    def save(self, train: Any, totals: Any, batch_in_epoch: int, reporter: Any) -> None:
        """Collective: every rank's RNG and partial sums go to rank 0, which writes the file."""
        from train import distributed

        mine = {"rng": rng_state(), "totals": totals.snapshot() if totals is not None else None}
        ranks = distributed.gather_to_main(mine)
        bare = getattr(train.model, "module", train.model)
        reporter.write_checkpoint(self, lambda: {
            "model": bare.state_dict(), "optimizer": train.optimizer.state_dict(),
            "scheduler": train.scheduler.state_dict(), "scaler": train.scaler.state_dict(),
            "epoch": train.epoch, "step": train.step, "batch_in_epoch": batch_in_epoch,
            "world_size": self.world_size, "ranks": ranks})
        distributed.barrier()  # nobody stops (or goes on) before the file is complete
        self.last_save = time.monotonic()

    def write(self, state: dict[str, Any]) -> Path:
        return save(self.folder, state, self.keep)


def restore(train: Any, resumed: Resumed, rank: int, world_size: int) -> None:
    """Put a loaded checkpoint back into this rank's training state."""
    s = resumed.state
    if s["world_size"] != world_size and s["batch_in_epoch"]:
        raise ValueError(f"{resumed.path} was written mid-epoch by {s['world_size']} ranks; "
                         f"resume it with the same world size (not {world_size}).")
    getattr(train.model, "module", train.model).load_state_dict(s["model"])
    train.optimizer.load_state_dict(s["optimizer"])
    train.scheduler.load_state_dict(s["scheduler"])
    train.scaler.load_state_dict(s["scaler"])
    train.epoch, train.step, train.batch_in_epoch = s["epoch"], s["step"], s["batch_in_epoch"]
    mine = s["ranks"][rank] if rank < len(s["ranks"]) else None
    if mine is not None:
        set_rng_state(mine["rng"])
        train.partial_totals = mine["totals"] if s["batch_in_epoch"] else None
    log.info("resumed from %s: epoch %d, step %d", resumed.path, train.epoch, train.step)
