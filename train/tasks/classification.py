"""task=classification (the default): one class index per sample, one score per class.

Sums: the loss, correct predictions, with more than TOP_K classes the samples whose class is
among the TOP_K highest scores, and in the final evaluations the confusion matrix (rows: true
class, columns: predicted). Its picture is the confusion matrix with per-class accuracy.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from train.config.task import TOP_K
from train.report.figures import per_class_accuracy, render_confusion
from train.tasks.base import Layout, Outputs, Sums, Task, model_output


class Classification(Task):
    name = "classification"
    metrics = ("loss", "accuracy", "accuracy_top5")
    class_targets = True

    def setup(self, loss: Any, num_classes: int, class_names: list[str]) -> None:
        super().setup(loss, num_classes, class_names)
        self.top_k = TOP_K if num_classes > TOP_K else None

    def layout(self, detailed: bool) -> Layout:
        sums: Layout = {"correct": ((), torch.int64)}
        if self.top_k is not None:
            sums["correct_top5"] = ((), torch.int64)
        if detailed:
            sums["confusion"] = ((self.num_classes, self.num_classes), torch.int64)
        return sums

    def step(self, output: Any, target: Any, detailed: bool = False) -> tuple[torch.Tensor, Sums]:
        logits, labels = model_output(output), target.long()
        loss = self.loss_fn(logits, labels)
        n = labels.shape[0]
        with torch.no_grad():
            predicted = logits.argmax(dim=1)
            sums: Sums = {"loss": loss.detach(), "items": n, "samples": n,
                          "correct": (predicted == labels).sum()}
            if self.top_k is not None:  # one small kernel on the device, no sync
                best = logits.topk(self.top_k, dim=1).indices
                sums["correct_top5"] = (best == labels.unsqueeze(1)).any(dim=1).sum()
            if detailed:
                c = self.num_classes
                sums["confusion"] = torch.bincount(labels * c + predicted,
                                                   minlength=c * c).view(c, c)
        return loss, sums

    def finalize(self, sums: Mapping[str, Any]) -> dict[str, float]:
        samples = max(1, sums["samples"])
        values = {"loss": sums["loss"] / samples, "accuracy": sums["correct"] / samples}
        if "correct_top5" in sums:
            values["accuracy_top5"] = sums["correct_top5"] / samples
        return values

    def output_problem(self, output: Any, target: Any, inputs: Any) -> str | None:
        scores = model_output(output)
        batch = target.shape[0] if isinstance(target, torch.Tensor) else len(target)
        if isinstance(scores, torch.Tensor) and tuple(scores.shape) == (batch, self.num_classes):
            return None
        shape = tuple(scores.shape) if isinstance(scores, torch.Tensor) else type(scores).__name__
        given = tuple(inputs.shape) if isinstance(inputs, torch.Tensor) else f"a batch of {batch}"
        return (f"returns shape {shape} for inputs of shape {given}; task=classification needs "
                f"(batch, num_classes) = {(batch, self.num_classes)}: one score per class "
                "(take num_classes in the constructor to have it filled from the data).")

    def target_problem(self, target: Any) -> str | None:
        value = target.item() if hasattr(target, "item") and _size(target) == 1 else target
        if isinstance(value, bool) or not isinstance(value, int):
            return (f"sample 0's label is {value!r}, not an integer class index "
                    "(task=regression trains on float targets).")
        return None

    def output_card(self, target_shape: tuple[int, ...], input_shape: tuple[int, ...]
                    ) -> dict[str, Any]:
        return {"dtype": "float32", "shape": [-1, self.num_classes],
                "meaning": "one score (logit) per class; argmax = index into class_names"}

    def write_outputs(self, reduced: Any, folder: Path, prefix: str) -> Outputs:
        """<prefix>confusion_matrix.svg and the per-class accuracy table."""
        confusion = reduced.confusion
        if confusion is None:
            return [], {}
        svg = render_confusion(confusion, self.class_names,
                               folder / f"{prefix}confusion_matrix.svg")
        return [svg], {f"{prefix}per_class_accuracy.json":
                       per_class_accuracy(confusion, self.class_names)}


def _size(value: Any) -> int:
    try:
        return int(value.numel()) if isinstance(value, torch.Tensor) else int(value.size)
    except (AttributeError, TypeError):
        return 1
