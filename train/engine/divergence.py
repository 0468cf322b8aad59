"""A diverged training stops the job with its rank and step: a loss that is no longer a finite
number, or fp16's loss scale collapsed (every step's gradients overflowed). Checked where the
loop reads the loss on the host anyway (logging steps, epoch ends): no sync of its own.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from train.engine.state import TrainState
    from train.report.trainlog import TrainingLog


class NonFiniteLossError(FloatingPointError):
    """Training diverged."""


def check_finite(value: float, rank: int, step: int, where: str) -> None:
    if not math.isfinite(value):
        raise NonFiniteLossError(f"{where} is {value} on rank {rank} at step {step}: training "
                                 "diverged (lower optim.lr, set optim.grad_clip, or use fp32).")


# fp16's loss scale only falls when a step's gradients overflow; this low, every step for ~40
# in a row overflowed: the loss or the weights are no longer finite numbers in fp16, a
# divergence that skipping steps cannot cure.
MIN_LOSS_SCALE = 2.0**-24


def report_scaler(state: TrainState, logger: TrainingLog, rank: int) -> None:
    """fp16: the steps skipped so far and the loss scale (host syncs: logging steps and epoch
    ends only); a scale that collapsed stops the job as a divergence, with rank and step."""
    if not state.scaler.is_enabled():
        return
    scale = state.scaler.get_scale()
    logger.grad_scaler(state.step, state.scaler.skipped_steps, scale)
    if scale < MIN_LOSS_SCALE:
        raise NonFiniteLossError(
            f"fp16 gradients overflowed at every step up to step {state.step} on rank "
            f"{rank} (loss scale {scale:.3g}): training diverged (lower optim.lr, set "
            "optim.grad_clip, or use bf16-mixed or fp32).")
