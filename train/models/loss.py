"""trainer.loss: any loss class or function by `_target_`, built with its arguments, and the
pre-flight's check that it gives one value for a batch of logits and labels. Every problem is
one line (usercode.UserCodeError)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from train.config import usercode

LOSS_KEY = "trainer.loss._target_"


def build_loss(loss: dict, device: torch.device | None = None) -> Callable:
    """trainer.loss, instantiated: a loss class with its arguments (a function needs
    `+trainer.loss._partial_=true`). Raises usercode.UserCodeError with a one-line message."""
    node = dict(loss)
    path = node.pop("_target_", None)
    if not isinstance(path, str):
        raise usercode.UserCodeError(f"{LOSS_KEY} must be set, e.g. torch.nn.CrossEntropyLoss.")
    target = usercode.locate(path, LOSS_KEY)
    if not callable(target):
        raise usercode.UserCodeError(f"{LOSS_KEY}={path!r} is {usercode.describe(target)}, "
                                     "not a loss class or function.")
    if not isinstance(target, type) and not node.get("_partial_"):
        raise usercode.UserCodeError(f"{LOSS_KEY}={path!r} is a function: add "
                                     "+trainer.loss._partial_=true to call it as "
                                     f"{path}(logits, labels, ...).")
    loss_fn = usercode.build(path, LOSS_KEY, node)
    if not callable(loss_fn):
        raise usercode.UserCodeError(f"{LOSS_KEY}={path!r} gave {usercode.describe(loss_fn)}, "
                                     "which cannot be called as loss(logits, labels).")
    if isinstance(loss_fn, nn.Module) and device is not None:
        loss_fn = loss_fn.to(device)  # buffers such as class weights
    return loss_fn


def check_loss(loss: dict, num_classes: int | None) -> None:
    """Pre-flight: trainer.loss builds, and (with the number of classes) gives one value for a
    batch of logits and labels."""
    loss_fn = build_loss(loss)
    if num_classes is None:
        return
    logits, labels = torch.zeros(2, num_classes), torch.zeros(2, dtype=torch.long)
    path = loss["_target_"]
    try:
        value = loss_fn(logits, labels)
    except Exception as e:  # noqa: BLE001 - the user's loss: one line
        raise usercode.UserCodeError(
            f"{LOSS_KEY}={path!r} fails as loss(logits, labels) on logits {tuple(logits.shape)} "
            f"and labels {tuple(labels.shape)}: {usercode.one_line(e)}") from None
    if not isinstance(value, torch.Tensor) or value.numel() != 1:
        shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
        raise usercode.UserCodeError(
            f"{LOSS_KEY}={path!r} gives {shape} for a batch, not one value: training needs the "
            "batch's mean (e.g. reduction='mean').")
