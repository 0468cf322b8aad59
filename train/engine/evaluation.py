"""Evaluation of one rank's shard: validation each epoch and the final test, exact at any world
size (every item once, nothing padded: train/data/), the same for every task; under FSDP every
rank runs as many forwards (its each is a collective)."""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import nn

from train.data.build import Batches
from train.distributed import phase
from train.engine import fsdp
from train.models.build import logits_of
from train.report import metrics
from train.tasks.base import Task


def autocast(device: torch.device, precision: str) -> contextlib.AbstractContextManager:
    """trainer.precision's autocast, for the forwards of training and of evaluation."""
    if precision == "fp32":
        return contextlib.nullcontext()
    dtype = torch.bfloat16 if precision == "bf16-mixed" else torch.float16
    return torch.autocast(device_type=device.type, dtype=dtype)


class ModelOutputError(ValueError):
    """The model's output does not fit the task (e.g. not (batch, num_classes))."""


def check_output(task: Task, output: Any, target: Any, inputs: Any) -> None:
    """The first batch's output fits the task (host-side shapes: no sync), or the model is
    named with the shapes instead of an obscure error inside the loss."""
    if problem := task.output_problem(output, target, inputs):
        raise ModelOutputError(f"the model {problem}")


@torch.no_grad()
def evaluate(model: nn.Module, batches: Batches, device: torch.device, precision: str,
             task: Task, detailed: bool = False, examples: bool = False,
             filler: torch.Tensor | None = None) -> metrics.Totals:
    """This rank's shard of the validation set, on the bare module (no DDP collectives), the
    task's sums on fp32 outputs; `detailed`: what the task keeps for the final evaluations (a
    confusion matrix); `examples`: the task keeps a few samples for its picture. `filler`
    (FSDP, whose every forward is a collective): the shards differ by up to a batch, so a rank
    with fewer batches runs forwards on it until it has run as many as the rank with the most;
    their outputs are dropped, so the sums stay exact."""
    model.eval()
    phase.enter("validation")
    totals = metrics.Totals(device, task.layout(detailed))
    # One model on every rank: rank 0's BatchNorm statistics, which its checkpoints and final
    # weights hold (each rank's own moved with its last training batch, under DDP as well).
    fsdp.share_rank0_buffers(model)
    if filler is not None:
        lockstep(model, len(batches), filler, device, precision)
    for index, (inputs, target) in enumerate(batches):
        with autocast(device, precision):
            output = model(inputs)
        output = _fp32(logits_of(output))
        if index == 0:
            check_output(task, output, target, inputs)
        totals.add(task.step(output, target, detailed)[1])
        if examples:
            task.keep_examples(inputs, output, target)
    return totals


def lockstep(model: nn.Module, batches: int, filler: torch.Tensor, device: torch.device,
              precision: str) -> None:
    """Every rank learns the most batches any rank holds (one small all-reduce) and runs the
    forwards it lacks first, on `filler`, outputs dropped: then all run as many forwards."""
    most = torch.tensor([batches], dtype=torch.int64, device=device)
    torch.distributed.all_reduce(most, op=torch.distributed.ReduceOp.MAX)
    for _ in range(int(most.item()) - batches):
        with autocast(device, precision):
            model(filler)


def _fp32(output: Any) -> Any:
    if isinstance(output, torch.Tensor):
        return output.float()
    if isinstance(output, dict):
        return {key: _fp32(value) for key, value in output.items()}
    return output


def test(model: nn.Module, batches: Batches, device: torch.device, precision: str,
         task: Task, filler: torch.Tensor | None = None) -> metrics.Reduced:
    """The final model, once, on every rank's strided shard of the test split (each sample on
    exactly one rank, none twice), with the task's details (a confusion matrix)."""
    return metrics.reduce(evaluate(model, batches, device, precision, task, detailed=True,
                                   filler=filler),
                          task.finalize, task.items_name)
