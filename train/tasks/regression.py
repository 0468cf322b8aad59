"""task=regression: float targets of any shape, the model's output reshaped to the target's.

Sums (float64, over every target element): the loss, and `moments`: the squared and absolute
errors, the targets and their squares, so that mse, mae and r2 (1 - SSE / SST over all elements
pooled) are exact at any world size. Its picture plots predicted against true values of
validation samples.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from train.report.figures import render_scatter
from train.tasks.base import Layout, Outputs, Sums, Task, model_output

MAX_POINTS_PER_SHOWN = 200
MOMENTS = ("sq_err", "abs_err", "sum_y", "sum_y2")
"""What the `moments` sum holds, in order: one vector, summed in one kernel per step."""


class Regression(Task):
    name = "regression"
    metrics = ("loss", "mse", "mae", "r2")

    def __init__(self, samples_shown: int = 4) -> None:
        self.max_points = MAX_POINTS_PER_SHOWN * samples_shown
        self.points: list[tuple[float, float]] = []

    def layout(self, detailed: bool) -> Layout:
        return {"moments": ((len(MOMENTS),), torch.float64)}

    def _prediction(self, output: Any, target: torch.Tensor) -> torch.Tensor:
        return model_output(output).reshape(target.shape)

    def step(self, output: Any, target: Any, detailed: bool = False) -> tuple[torch.Tensor, Sums]:
        prediction = self._prediction(output, target)
        target = target.to(prediction.dtype)
        loss = self.loss_fn(prediction, target)
        with torch.no_grad():  # summed in float64, fewest kernels: a small model's step is short
            error = prediction.detach().float() - target.float()  # .float(): no-ops in fp32
            target = target.float()
            moments = torch.stack((error.square(), error.abs(), target, target.square()))
            sums: Sums = {"loss": loss.detach(), "items": target.numel(),
                          "samples": target.shape[0],
                          "moments": moments.flatten(1).sum(dim=1, dtype=torch.float64)}
        return loss, sums

    def finalize(self, sums: Mapping[str, Any]) -> dict[str, float]:
        n = max(1, sums["items"])
        sq_err, abs_err, sum_y, sum_y2 = sums["moments"]
        total = sum_y2 - sum_y ** 2 / n  # sum of squares about the mean
        return {"loss": sums["loss"] / n, "mse": sq_err / n, "mae": abs_err / n,
                "r2": 1.0 - sq_err / total if total > 0 else 0.0}

    def output_problem(self, output: Any, target: Any, inputs: Any) -> str | None:
        scores = model_output(output)
        if not isinstance(scores, torch.Tensor) or not isinstance(target, torch.Tensor):
            return (f"returns {type(scores).__name__}; task=regression needs a tensor with one "
                    "value per target element.")
        if scores.shape[0] == target.shape[0] and scores.numel() == target.numel():
            return None
        return (f"returns shape {tuple(scores.shape)} for targets of shape "
                f"{tuple(target.shape)}; task=regression needs the same number of values per "
                "sample as the target has (take num_classes in the constructor: it is filled "
                "with the target's size per sample).")

    def target_problem(self, target: Any) -> str | None:
        try:
            value = torch.as_tensor(target)
        except (TypeError, ValueError, RuntimeError):
            return f"sample 0's target is {type(target).__name__}, not a number or a tensor."
        if not (value.is_floating_point() or value.dtype in (torch.int32, torch.int64)):
            return f"sample 0's target has dtype {value.dtype}, not numbers to regress on."
        return None

    def outputs_per_sample(self, target_shape: tuple[int, ...], num_classes: int) -> int:
        return int(torch.Size(target_shape).numel())

    def output_card(self, target_shape: tuple[int, ...], input_shape: tuple[int, ...]
                    ) -> dict[str, Any]:
        return {"dtype": "float32", "shape": [-1, int(torch.Size(target_shape).numel())],
                "meaning": f"the predicted target, flattened (one sample's target: "
                           f"{list(target_shape) or 'a number'})"}

    def keep_examples(self, inputs: Any, output: Any, target: Any) -> None:
        room = self.max_points - len(self.points)
        if room <= 0:
            return
        predicted = self._prediction(output, target).detach().flatten()[:room].tolist()
        self.points.extend(zip(target.flatten()[:room].tolist(), predicted, strict=True))

    def write_outputs(self, reduced: Any, folder: Path, prefix: str) -> Outputs:
        if not self.points:
            return [], {}
        path = render_scatter(self.points, folder / f"{prefix}predicted_vs_true.svg",
                              f"r2 = {reduced.values['r2']:.4f}")
        self.points = []
        return [path], {}
