"""task=token_classification: a class per token (named entities, parts of speech), as
`transformers`' token classifiers score them - (batch, tokens, classes) logits for a (batch,
tokens) label sequence whose positions labelled task.ignore_index (-100: padding, and the
second and later pieces of a word, as data=arrow aligns a column of words to its tokenizer)
count nowhere.

The sums are segmentation's (train/tasks/segmentation.py: the loss over the positions that
count, and a confusion matrix of them, exact at any world size); from the matrix: token
accuracy and the macro-averaged F1 over the classes that occur or are predicted. Its table:
each class's precision, recall, F1 and tokens.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from train.tasks.base import Outputs, Sums, model_output
from train.tasks.segmentation import Segmentation


class TokenClassification(Segmentation):
    name = "token_classification"
    metrics = ("loss", "accuracy", "macro_f1")
    class_targets = True

    def __init__(self, ignore_index: int = -100) -> None:
        super().__init__(ignore_index, samples_shown=0)

    def step(self, output: Any, target: Any, detailed: bool = False) -> tuple[torch.Tensor, Sums]:
        # (batch, tokens, classes) -> (batch, classes, tokens): the loss's and the sums' layout
        return super().step(model_output(output).transpose(1, 2), target, detailed)

    def finalize(self, sums: Mapping[str, Any]) -> dict[str, float]:
        confusion = torch.tensor(sums["confusion"], dtype=torch.float64)
        tokens = confusion.sum()
        f1 = _per_class(confusion)["f1"]
        present = ~torch.isnan(f1)
        return {"loss": sums["loss"] / max(1, sums["items"]),
                "accuracy": float(confusion.diagonal().sum() / tokens) if tokens else 0.0,
                "macro_f1": float(f1[present].mean()) if present.any() else 0.0}

    def output_problem(self, output: Any, target: Any, inputs: Any) -> str | None:
        scores = model_output(output)
        expected = (*target.shape, self.num_classes) if isinstance(target, torch.Tensor) else None
        if isinstance(scores, torch.Tensor) and tuple(scores.shape) == expected:
            return None
        shape = tuple(scores.shape) if isinstance(scores, torch.Tensor) else type(scores).__name__
        return (f"returns {shape} for labels of shape {tuple(getattr(target, 'shape', ()))}; "
                f"task=token_classification needs (batch, tokens, num_classes) = {expected}: "
                "one score per class and token (model.auto_class=token_classification).")

    def target_problem(self, target: Any) -> str | None:
        labels = torch.as_tensor(target)
        if labels.ndim != 1 or labels.is_floating_point():
            return (f"sample 0's target has shape {tuple(labels.shape)} and dtype {labels.dtype};"
                    " task=token_classification reads a sequence of integer class indices, one "
                    "per token.")
        return None

    def output_card(self, target_shape: tuple[int, ...], input_shape: tuple[int, ...]
                    ) -> dict[str, Any]:
        return {"dtype": "float32", "shape": [-1, *target_shape, self.num_classes],
                "meaning": "one score (logit) per token and class; argmax over the last "
                           "dimension = each token's class"}

    def keep_examples(self, inputs: Any, output: Any, target: Any) -> None:
        return None  # no pictures of token ids

    def write_outputs(self, reduced: Any, folder: Path, prefix: str) -> Outputs:
        confusion = torch.tensor(reduced.sums["confusion"], dtype=torch.float64)
        names = self.class_names or [str(i) for i in range(self.num_classes)]
        table = {"class": names, **{k: [None if v != v else round(float(v), 6) for v in values]
                                    for k, values in _per_class(confusion).items()},
                 "tokens": [int(row) for row in confusion.sum(dim=1).tolist()]}
        return [], {f"{prefix}per_class_f1.json": table}


def _per_class(confusion: torch.Tensor) -> dict[str, torch.Tensor]:
    """Each class's precision, recall and F1 from the confusion (rows: true class); NaN where
    a class neither occurs nor is predicted."""
    tp = confusion.diagonal()
    predicted, true = confusion.sum(dim=0), confusion.sum(dim=1)
    precision = torch.where(predicted > 0, tp / predicted.clamp_min(1), torch.zeros_like(tp))
    recall = torch.where(true > 0, tp / true.clamp_min(1), torch.zeros_like(tp))
    f1 = torch.where(precision + recall > 0, 2 * precision * recall /
                     (precision + recall).clamp_min(1e-12), torch.zeros_like(tp))
    absent = (predicted == 0) & (true == 0)
    nan = torch.full_like(tp, float("nan"))
    return {"precision": torch.where(absent, nan, precision),
            "recall": torch.where(absent, nan, recall), "f1": torch.where(absent, nan, f1)}
