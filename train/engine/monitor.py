"""The monitored validation metric: the best value so far, and when to stop early.

One `Monitor` per rank, fed the reduced validation metrics (the same numbers on every rank),
so every rank reaches the same verdict; `stop_agreed` still confirms it with one collective so
that no rank can leave the loop alone. Its state (best value and epoch, evaluations without
improvement) goes into every checkpoint: a resumed job - a Slurm requeue included - keeps the
best-so-far and the patience it had used up.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from train.config.groups import TrainerConfig
from train.distributed import process_group as distributed
from train.report.metrics import Reduced

log = logging.getLogger("train")


def direction(name: str, mode: str) -> str:
    """trainer.monitor_mode resolved: auto = min for a loss, else max."""
    if mode != "auto":
        return mode
    return "min" if "loss" in name else "max"


def value_of(name: str, val: Reduced) -> float:
    value = val.values.get(name.removeprefix("val/")) if name.startswith("val/") else None
    if value is None:  # top-5 with 5 classes or fewer: pre-flight cannot always know
        raise ValueError(f"trainer.monitor={name} is not logged by this job (top-5 needs more "
                         f"than 5 classes); choose one of {[f'val/{k}' for k in val.values]}.")
    return float(value)


@dataclass
class Best:
    """What best.pt records besides the weights."""

    epoch: int
    """0-based epoch whose evaluation was the best."""
    step: int
    monitor: str
    mode: str
    value: float


OnBest = Callable[[Best], None]
"""What happens at a new best evaluation (train/engine/outputs.py: rank 0 writes best.pt)."""


class Monitor:
    """trainer.monitor over the evaluations: best value, its epoch, and patience used up.

    `on_best(best)` is called when an evaluation improves on the best so far
    (train/engine/outputs.py
    gives rank 0 one that writes best.pt and logs it; the other ranks none)."""

    def __init__(self, cfg: TrainerConfig,
                 on_best: OnBest | None = None) -> None:
        self.name, self.mode = cfg.monitor, direction(cfg.monitor, cfg.monitor_mode)
        self.patience = cfg.early_stopping_patience
        self.on_best = on_best
        self.best: float | None = None
        self.best_epoch: int | None = None
        self.bad_evaluations = 0
        self.stop_reason: str | None = None

    def _improves(self, value: float) -> bool:
        if self.best is None:
            return True
        return value > self.best if self.mode == "max" else value < self.best

    def observe(self, epoch: int, step: int, val: Reduced) -> bool:
        """One evaluation (after `epoch`, 0-based); True if it is the best so far."""
        value = value_of(self.name, val)
        if not self._improves(value):
            self.bad_evaluations += 1
            return False
        self.best, self.best_epoch, self.bad_evaluations = value, epoch, 0
        if self.on_best is not None:
            self.on_best(Best(epoch, step, self.name, self.mode, value))
        return True

    def stop_agreed(self) -> bool:
        """Collective (every rank, after every epoch): early stopping's verdict, the same on
        all ranks. Without patience: False, and no collective."""
        if self.patience is None:
            return False
        mine = self.bad_evaluations >= self.patience
        if not distributed.any_rank(mine):
            return False
        self.stop_reason = (f"early stopping: {self.name} did not improve for "
                            f"{self.bad_evaluations} evaluations (best {self.best:.4g} at epoch "
                            f"{(self.best_epoch or 0) + 1})")
        return True

    def state_dict(self) -> dict[str, Any]:
        return {"monitor": self.name, "mode": self.mode, "best": self.best,
                "best_epoch": self.best_epoch, "bad_evaluations": self.bad_evaluations}

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        """A checkpoint's monitor state; ignored when it watched another metric or way (the
        best of another metric is no best of this one) or the checkpoint had none."""
        if not state or state.get("monitor") != self.name or state.get("mode") != self.mode:
            return
        self.best, self.best_epoch = state.get("best"), state.get("best_epoch")
        self.bad_evaluations = int(state.get("bad_evaluations") or 0)
        if self.best is not None:
            log.info("monitor %s: best so far %.4g at epoch %d, %d evaluation(s) without "
                     "improvement", self.name, self.best, (self.best_epoch or 0) + 1,
                     self.bad_evaluations)
