"""trainer.ema's keys: an exponential moving average of the weights (train/engine/ema.py), with
a docstring per field like train/config/groups.py's (whose TrainerConfig holds it)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class EmaConfig:
    enabled: bool = False
    """Keep an exponential moving average of the weights (and of BatchNorm's statistics)
    beside the trained ones. Validation, the test split, best.pt, model.pt and the logged model
    are then the average's; the trained weights are kept as model_raw.pt. Checkpoints hold
    both, so a resumed job continues the average exactly, at any world size and strategy
    (FSDP: each rank averages its own shards)."""
    decay: float = 0.999
    """Weight of the average at each update: average = decay x average + (1 - decay) x
    weights (torch.optim.swa_utils' EMA rule). In (0, 1); about 1 / (1 - decay) updates are
    remembered."""
    start_step: int = 0
    """Until this optimiser step the average is a copy of the weights; it averages after."""
    every: int = 1
    """Update the average every N optimiser steps (each update applies `decay` once)."""

    def problem(self) -> str | None:
        """What is wrong with these values, in one sentence; None if nothing."""
        if not self.enabled:
            return None
        if not 0.0 < self.decay < 1.0:
            return (f"trainer.ema.decay={self.decay}: the average's decay must be between 0 and "
                    "1, both excluded (e.g. 0.999).")
        if self.every < 1 or self.start_step < 0:
            return (f"trainer.ema.every={self.every} and trainer.ema.start_step="
                    f"{self.start_step}: every must be 1 or more, start_step 0 or more.")
        return None
