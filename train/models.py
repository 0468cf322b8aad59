"""Model registry. Every builder takes the model config and the data's shape."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from train.config import ModelConfig


@dataclass(frozen=True)
class InputSpec:
    channels: int
    image_size: int
    num_classes: int


def _cnn(cfg: ModelConfig, spec: InputSpec) -> nn.Module:
    w = cfg.width
    return nn.Sequential(
        nn.Conv2d(spec.channels, w, 3, padding=1), nn.BatchNorm2d(w), nn.ReLU(inplace=True),
        nn.Conv2d(w, 2 * w, 3, padding=1), nn.BatchNorm2d(2 * w), nn.ReLU(inplace=True),
        nn.MaxPool2d(2) if spec.image_size >= 4 else nn.Identity(),
        nn.Conv2d(2 * w, 4 * w, 3, padding=1), nn.BatchNorm2d(4 * w), nn.ReLU(inplace=True),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Dropout(cfg.dropout),
        nn.Linear(4 * w, spec.num_classes))


def _mlp(cfg: ModelConfig, spec: InputSpec) -> nn.Module:
    layers: list[nn.Module] = [nn.Flatten()]
    width_in = spec.channels * spec.image_size ** 2
    for _ in range(cfg.depth):
        layers += [nn.Linear(width_in, cfg.width), nn.ReLU(inplace=True)]
        width_in = cfg.width
    layers += [nn.Dropout(cfg.dropout), nn.Linear(width_in, spec.num_classes)]
    return nn.Sequential(*layers)


class _BasicBlock(nn.Module):
    def __init__(self, c_in: int, c_out: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or c_in != c_out:
            self.shortcut = nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride, bias=False),
                                          nn.BatchNorm2d(c_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(out)) + self.shortcut(x))


def _resnet18(cfg: ModelConfig, spec: InputSpec) -> nn.Module:
    """ResNet-18 for small images (CIFAR-style): 3x3 stem, stride 1, no max-pool."""
    blocks: list[nn.Module] = []
    c_in = 64
    for c_out, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
        blocks += [_BasicBlock(c_in, c_out, stride), _BasicBlock(c_out, c_out, 1)]
        c_in = c_out
    return nn.Sequential(
        nn.Conv2d(spec.channels, 64, 3, 1, 1, bias=False), nn.BatchNorm2d(64),
        nn.ReLU(inplace=True), *blocks,
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Dropout(cfg.dropout),
        nn.Linear(512, spec.num_classes))


def torchvision_builders() -> list[str]:
    """The classification builders of torchvision.models (not detection, video, ...)."""
    import torchvision.models as tvm  # costs seconds: only when asked for

    return sorted(tvm.list_models(module=tvm))


def _torchvision(cfg: ModelConfig, spec: InputSpec) -> nn.Module:
    import torchvision.models as tvm

    if cfg.name not in torchvision_builders():
        raise ValueError(f"model=torchvision model.name={cfg.name!r} is not a torchvision "
                         f"classification model; choose one of {torchvision_builders()}.")
    # Random weights: pretrained ones would be a download, and compute nodes are often offline.
    model = tvm.get_model(cfg.name, weights=None, num_classes=spec.num_classes)
    if spec.channels != 3:
        _adapt_first_conv(model, spec.channels)
    return model


def _adapt_first_conv(model: nn.Module, channels: int) -> None:
    """Swap the first Conv2d for one taking `channels` inputs (e.g. grey-scale MNIST)."""
    for module in model.modules():
        for name, child in module.named_children():
            if isinstance(child, nn.Conv2d):
                setattr(module, name, nn.Conv2d(
                    channels, child.out_channels, child.kernel_size, child.stride, child.padding,
                    child.dilation, child.groups, child.bias is not None))
                return


MODELS: dict[str, Callable[[ModelConfig, InputSpec], nn.Module]] = {
    "cnn": _cnn,
    "mlp": _mlp,
    "resnet18": _resnet18,
}


def build(cfg: ModelConfig, spec: InputSpec) -> nn.Module:
    if cfg.source == "torchvision":
        return _torchvision(cfg, spec)
    return MODELS[cfg.name](cfg, spec)
