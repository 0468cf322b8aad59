"""What a task is: how a batch's model output and target become a loss and metric sums.

A task computes, for one batch, the loss as a SUM over its items (samples, pixels, tokens) and
the named sums its metrics are made of. The service does the rest, the same for every task:
batches moved to the device whatever their structure, autocast, train and eval modes, gradient
accumulation, the gradient scaled by the optimiser step's global item count (across ranks and
micro-batches), the sums added over ranks, and the result handed back to the task to finish on
every rank (`finalize`: e.g. IoU from a confusion matrix). Exact at any world size: sums and
counts, never means of means.

Rules for a task of your own (task=custom task._target_=mypkg.MyTask):
- return SUMS: a mean over the batch weights batches wrongly (HF Trainer's old bug);
- no collectives and nothing that depends on the rank in `step`: every rank runs it alike;
- hold no trainable parameters (they would escape DDP): put them in the model;
- declare `metrics` up front, so that trainer.monitor and trainer.objective are checked
  before any rank starts.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

Sums = dict[str, torch.Tensor | float | int]
Layout = dict[str, tuple[tuple[int, ...], torch.dtype]]
Outputs = tuple[list[Path], dict[str, dict[str, list]]]
"""A task's pictures (files) and tables (artifact name -> columns)."""


class Task:
    """The interface, with the defaults a simple task keeps: the mean loss per item."""

    name: str = "task"
    metrics: tuple[str, ...] = ("loss",)
    """Every metric name `finalize` returns (logged as train/<name>, val/<name>, test/<name>)."""
    class_targets: bool = False
    """Targets are class indices (one per sample, or per token): the data names its classes."""
    fixed_items: bool = True
    """Every sample holds the same number of items (the gradient's divisor then follows from
    the batch shapes alone); False (ignored pixels, padded tokens) makes the service count the
    optimiser step's items over the ranks first: one small all-reduce per step."""
    items_name: str | None = None
    """What an item is, where its count is worth logging: "tokens" logs `<split>/tokens` and
    `train/tokens_per_sec` (train/report/trainlog.py)."""
    tokenizer: str | None = None
    """The data's tokenizer (data=tokens: meta.json's), set by the job, for tasks that write
    text (train/data/tokenize.py `tokenizer`)."""
    seq_len: int | None = None
    """The data's window length (data=tokens), set by the job."""

    def setup(self, loss: Callable[..., torch.Tensor], num_classes: int,
              class_names: list[str]) -> None:
        """Once per job, when the data is known: `loss` is trainer.loss returning a SUM."""
        self.loss_fn, self.num_classes, self.class_names = loss, num_classes, class_names

    def layout(self, detailed: bool) -> Layout:
        """The sums this task keeps beyond loss, items and samples; `detailed`: the final
        evaluations, where a task may keep more (a confusion matrix)."""
        return {}

    def step(self, output: Any, target: Any, detailed: bool = False) -> tuple[torch.Tensor, Sums]:
        """The batch's loss SUM (with its graph, in training) and the sums to add: `loss`
        (detached), `items` and `samples` at least."""
        loss = self.loss_fn(output, target)
        n = target.shape[0]
        return loss, {"loss": loss.detach().double(), "items": n * _per_sample(target),
                      "samples": n}

    def finalize(self, sums: Mapping[str, Any]) -> dict[str, float]:
        """The metrics from the sums added over every rank (plain numbers and lists)."""
        return {"loss": sums["loss"] / max(1, sums["items"])}

    def output_problem(self, output: Any, target: Any, inputs: Any) -> str | None:
        """Why the model's output cannot be scored against this target, or None: checked on
        the first batch (and at pre-flight where the shapes are known)."""
        return None

    def target_problem(self, target: Any) -> str | None:
        """Why one sample's target (sample 0, at pre-flight) is not what this task reads."""
        return None

    def outputs_per_sample(self, target_shape: tuple[int, ...], num_classes: int) -> int:
        """How many outputs the model gives per sample (filled into a model's num_classes):
        one per class where the data names classes, else one per target value."""
        return num_classes or int(torch.Size(target_shape).numel())

    def output_card(self, target_shape: tuple[int, ...], input_shape: tuple[int, ...]
                    ) -> dict[str, Any]:
        """What the logged model returns, for its card and signature (train/report/modelcard.py)."""
        return {"dtype": "float32",
                "shape": [-1, self.outputs_per_sample(target_shape, self.num_classes)],
                "meaning": f"the model's output as task {self.name} scores it"}

    def keep_examples(self, inputs: Any, output: Any, target: Any) -> None:
        """Final validation, rank 0's batches: a task may keep a few for its picture."""

    def write_outputs(self, reduced: Any, folder: Path, prefix: str) -> Outputs:
        """What its users look at after the final validation (`prefix` "") and the test
        (`prefix` "test_"): pictures written into `folder` (logged at the run's artifact root)
        and tables by artifact name."""
        return [], {}

    def final_outputs(self, model: nn.Module, folder: Path, device: torch.device) -> Outputs:
        """What the trained model makes, once at the end, on the rank that writes (a language
        model's sampled continuations): files written into `folder`, and tables."""
        return [], {}


def _per_sample(target: Any) -> int:
    return int(target[0].numel()) if isinstance(target, torch.Tensor) and target.ndim > 1 else 1


def model_output(output: Any) -> torch.Tensor:
    """The scores of a model's output: torchvision's segmentation models return a dict with
    them under "out" (and "aux"); other models a tensor."""
    if isinstance(output, Mapping) and "out" in output:
        return output["out"]
    return output


def summed(loss: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """trainer.loss as a SUM over items: a torch loss module is switched to reduction="sum" (the
    job's own instance), a function that takes `reduction` is called with "sum"; a loss without
    `reduction` is taken to return the mean over the target's elements and multiplied by their
    count."""
    if isinstance(loss, torch.nn.Module) and "reduction" in vars(loss):
        loss.reduction = "sum"
        return loss
    accepts = _accepts_reduction(loss)
    if accepts:
        return lambda output, target: loss(output, target, reduction="sum")

    def times_items(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return loss(output, target) * target.numel()
    return times_items


def _accepts_reduction(fn: Callable[..., Any]) -> bool:
    try:
        return "reduction" in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
