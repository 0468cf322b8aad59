"""A model's copy on another device, made without a second copy on its own device.

`copy.deepcopy(model).to(device)` first copies every parameter and buffer where it is: on a GPU
the whole model again, for a moment, at the end of the first epoch (the FLOPs count's shapes)
or of the job (the logged model's host copy) - an out-of-memory error for a model that had
trained within its GPU's memory. Here each tensor is made directly on the target device.
"""

from __future__ import annotations

import copy
import itertools
from typing import Any

import torch
from torch import nn


def copy_on(model: nn.Module, device: str | torch.device) -> nn.Module:
    """A deep copy of `model` whose parameters and buffers live on `device`: their values
    copied there, or their shapes alone on the meta device. Tied parameters stay tied; the
    model itself is untouched."""
    device = torch.device(device)
    made: dict[int, Any] = {}
    for tensor in itertools.chain(model.parameters(), model.buffers()):
        if id(tensor) in made:
            continue
        moved = (torch.empty_like(tensor, device=device) if device.type == "meta"
                 else tensor.detach().to(device, copy=True))
        if isinstance(tensor, nn.Parameter):
            moved = nn.Parameter(moved, requires_grad=tensor.requires_grad)
        made[id(tensor)] = moved
    return copy.deepcopy(model, made)
