"""The `eval` settings: `python -m train eval <run_id> [overrides]` evaluates a finished run's
weights on any data set. A dataclass with a docstring per field, like train/config/groups.py's
(whose TrainConfig holds it). A job whose `eval.run_id` is set evaluates instead of training
(train/engine/evaluate.py); the command (train/launch/evaluate.py) sets it, with the fields below
it marks as its own, after checking the run and finding its weights.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

WEIGHTS_WORDS = ("best", "last")
SPLITS = ("test", "val")
NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
"""An evaluation's name is part of metric keys (eval/<name>/<metric>): MLflow's key characters."""


@dataclass
class EvalConfig:
    weights: str = "last"
    """Which weights of the run: last (its final weights; with trainer.test_on=best the newest
    checkpoint), best (checkpoints/best.pt: trainer.save_best), or the path of a checkpoint
    (step-<N>.pt, a sharded step-<N>.dcp directory, best.pt or model.pt)."""
    split: str = "test"
    """The data set's split evaluated: test, or val (the validation split)."""
    name: str | None = None
    """The evaluation's name in the run: its metrics are eval/<name>/<metric>. Default: the data
    set and split, e.g. digits_test."""
    run_id: str | None = None
    """The run evaluated (set by the command: a job with it set evaluates instead of training)."""
    checkpoint: str | None = None
    """The weights' file or directory, as the command resolved eval.weights (set by it)."""
    trained_shape: str | None = None
    """The run's input shape, e.g. 1x8x8 (set by the command: data of another shape is
    refused)."""
    trained_outputs: int | None = None
    """The run's number of outputs, e.g. 10 classes (set by the command)."""

    def problem(self) -> str | None:
        """What is wrong with the user's settings, in one line; None if nothing."""
        if (self.run_id is None) != (self.checkpoint is None):
            return ("eval.run_id and eval.checkpoint are set by `python -m train eval <run_id>`, "
                    "which checks the run first: evaluate with that command.")
        if self.split not in SPLITS:
            return f"eval.split={self.split} must be one of {', '.join(SPLITS)}."
        if self.name is not None and not NAME.match(self.name):
            return (f"eval.name={self.name!r} must be 1-64 letters, digits, '_', '-' or '.' "
                    "(it is part of the metrics' names).")
        return None

    def data_problem(self, data_name: str, shape: tuple[int, ...], outputs: int) -> str | None:
        """The one line refusing data of another shape or number of outputs than the run's
        model was trained on; None if it fits (or this job evaluates nothing)."""
        given = "x".join(map(str, shape))
        if self.run_id is None or (given == (self.trained_shape or given)
                                   and outputs == (self.trained_outputs or outputs)):
            return None
        return (f"data={data_name} gives inputs {given} and {outputs} outputs; run "
                f"{self.run_id} was trained on {self.trained_shape} and {self.trained_outputs}: "
                "evaluate it on data of the same shape and classes.")

    def default_name(self, data_name: str) -> str:
        return self.name or f"{data_name}_{self.split}"
