"""What a finished run's model does after training: `python -m train eval <run_id>` evaluates
its weights on any data set (`eval.*`), `python -m train predict <run_id>` writes its outputs
(`predict.*`). Dataclasses with a docstring per field, like train/config/groups.py's (whose
TrainConfig holds them). A job whose `eval.run_id` is set evaluates or predicts instead of
training (train/engine/evaluate.py, predict.py); the commands (train/launch/evaluate.py,
predict.py) set it, with the fields below they mark as theirs, after checking the run and
finding its weights.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

WEIGHTS_WORDS = ("best", "last")
SPLITS = ("test", "val")
NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
"""An evaluation's name is part of metric keys (eval/<name>/<metric>): MLflow's key characters."""


@dataclass
class EvalConfig:
    weights: str = "last"
    """Which weights of the run: last (its final weights; with trainer.test_on=best the newest
    checkpoint), best (checkpoints/best.pt: trainer.save_best), the path of a checkpoint
    (step-<N>.pt, a sharded step-<N>.dcp directory, best.pt or model.pt), or a file in the
    store (runs:/<run_id>/weights/model.pt). Where the run's output directory does not hold its
    final weights (another machine's disk), last or best takes the store's copy of them."""
    split: str = "test"
    """The data set's split evaluated: test, or val (the validation split)."""
    name: str | None = None
    """The evaluation's name in the run: its metrics are eval/<name>/<metric>. Default: the data
    set and split, e.g. digits_test."""
    run_id: str | None = None
    """The run evaluated (set by the command: a job with it set evaluates instead of training)."""
    checkpoint: str | None = None
    """The weights' file or directory, or runs:/<run_id>/<path> in the store, as the command
    resolved eval.weights (set by it)."""
    trained_shape: str | None = None
    """The run's input shape, e.g. 1x8x8 (set by the command: data of another shape is
    refused)."""
    trained_outputs: int | None = None
    """The run's number of outputs, e.g. 10 classes (set by the command)."""
    purpose: str = "eval"
    """What the job does with the run's model: eval or predict (set by the command)."""

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


@dataclass
class PredictConfig:
    out: str | None = None
    """Where the predictions go: a Parquet file (one row per sample, in the data set's order),
    or for a language model's prompts a JSON-lines file; default: predictions.parquet (or
    .jsonl) in the job's output directory. Segmentation masks go beside it as PNGs."""
    overwrite: bool = False
    """Replace an existing predict.out; otherwise one is refused before anything starts."""
    weights: str = "last"
    """Which weights of the run, as eval.weights: last, best, a checkpoint's path, or
    runs:/<run_id>/<path> of the store."""
    split: str = "test"
    """The data set's split predicted: test or val."""
    prompts: list[str] = field(default_factory=list)
    """A language model's prompts: each one's continuation is written instead of the split's
    outputs."""
    max_new_tokens: int = 64
    """How many tokens each prompt's continuation has."""
    temperature: float = 0.0
    """0: the most likely token each time (the same text on every run); above 0: sampled."""

    def problem(self) -> str | None:
        """What is wrong with these settings, in one line; None if nothing."""
        if self.split not in SPLITS:
            return f"predict.split={self.split} must be one of {', '.join(SPLITS)}."
        if self.max_new_tokens < 1 or self.temperature < 0:
            return ("predict.max_new_tokens must be 1 or more and predict.temperature 0 or more "
                    f"(got {self.max_new_tokens} and {self.temperature}).")
        return None
