"""Model registry, and the user's own models (`model=custom`). Every builder takes the model
config and what the data is: one sample's shape and the number of classes."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from train.config import usercode
from train.config.groups import CustomModelConfig, ModelConfig
from train.models.loss import LOSS_KEY as LOSS_KEY  # re-exported: callers use models.*
from train.models.loss import build_loss as build_loss
from train.models.loss import check_loss as check_loss


@dataclass(frozen=True)
class InputSpec:
    channels: int
    image_size: int
    num_classes: int
    input_shape: tuple[int, ...] = ()
    """One sample's shape; () = (channels, image_size, image_size)."""
    vocab_size: int | None = None
    """Token data: the vocabulary; the sample is a window of input_shape[0] token ids."""
    text: tuple[int, int] | None = None
    """Texts as padded token ids (data=arrow with data.tokenizer): the tokenizer's vocabulary
    and padding id; the task is the data's (a class per text)."""
    class_names: tuple[str, ...] = ()
    """The classes' names where the data has them (one per class): a constructor that takes
    `class_names` gets them (model=hf: its config's id2label)."""

    @classmethod
    def of(cls, input_shape: tuple[int, ...], num_classes: int,
           vocab_size: int | None = None, text: tuple[int, int] | None = None,
           class_names: tuple[str, ...] = ()) -> InputSpec:
        """From one sample's shape: channels first, the last dimension as the image size."""
        shape = tuple(input_shape)
        names = tuple(class_names) if len(class_names) == num_classes else ()
        return cls(shape[0], shape[-1], num_classes, shape, vocab_size, text, names)

    @property
    def token_ids(self) -> bool:
        """Samples are token ids (int64), not pixels or features."""
        return self.vocab_size is not None or self.text is not None

    @property
    def sample_shape(self) -> tuple[int, ...]:
        return self.input_shape or (self.channels, self.image_size, self.image_size)

    def constructor_values(self) -> dict[str, Any]:
        """What a custom model's constructor may take from the data (by these names)."""
        if self.vocab_size is not None:  # token windows: a language model's sizes
            return {"vocab_size": self.vocab_size, "seq_len": self.input_shape[0]}
        names = {"class_names": list(self.class_names)} if self.class_names else {}
        if self.text is not None:  # padded texts: a classifier's, and its tokenizer's
            return {"num_classes": self.num_classes, "vocab_size": self.text[0],
                    "pad_token_id": self.text[1], "seq_len": self.input_shape[0], **names}
        return {"num_classes": self.num_classes, "in_channels": self.channels,
                "channels": self.channels, "image_size": self.image_size, **names}


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
    width_in = math.prod(spec.sample_shape)  # an image's pixels, or a table row's numbers
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
    # Built for the data's classes with random weights; model.weights (train/models/pretrained.py)
    # loads pretrained ones over it from the local cache, the classifier head left new.
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


def build(cfg: ModelConfig | CustomModelConfig, spec: InputSpec) -> nn.Module:
    if isinstance(cfg, CustomModelConfig):
        return _custom(cfg, spec)
    if cfg.source == "torchvision":
        return _torchvision(cfg, spec)
    return MODELS[cfg.name](cfg, spec)


def build_on_meta(cfg: ModelConfig | CustomModelConfig, spec: InputSpec) -> nn.Module:
    """The model for its parameter names and shapes only: on the meta device (no memory, no
    initialisation) where it can be built there, else on the CPU."""
    try:
        with torch.device("meta"):
            return build(cfg, spec)
    except Exception:  # noqa: BLE001 - what the meta device lacks (the user's code): for real
        return build(cfg, spec)


KEY = "model._target_"


def _custom(cfg: CustomModelConfig, spec: InputSpec) -> nn.Module:
    """The user's model: its class (or factory) from `model._target_`, called with its model.*
    keys and, where it takes them and they are not set, the data's num_classes, in_channels /
    channels and image_size. Raises usercode.UserCodeError with a one-line message."""
    target = custom_target(cfg)
    known = spec.constructor_values()
    usercode.check_filled(target, cfg.target, KEY, cfg.kwargs, known)
    filled = usercode.fill_arguments(target, cfg.kwargs, known)
    model = usercode.build(cfg.target, KEY, {**cfg.kwargs, **filled})
    if not isinstance(model, nn.Module):
        raise usercode.UserCodeError(f"{KEY}={cfg.target!r} returned {usercode.describe(model)}, "
                                     "not a torch.nn.Module.")
    return model


def custom_target(cfg: CustomModelConfig) -> Callable:
    """The class (or factory) `model._target_` names: importable, and a model class."""
    target = usercode.locate(cfg.target, KEY)
    if isinstance(target, type) and not issubclass(target, nn.Module):
        raise usercode.UserCodeError(
            f"{KEY}={cfg.target!r} is {usercode.describe(target)}, not a torch.nn.Module; "
            "name your model class (or a function that returns one).")
    if not callable(target):
        raise usercode.UserCodeError(f"{KEY}={cfg.target!r} is {usercode.describe(target)}, "
                                     "not a model class.")
    return target


def describe(cfg: ModelConfig | CustomModelConfig) -> str:
    """The model as the user chose it, for messages."""
    if isinstance(cfg, CustomModelConfig):
        return f"model=custom {KEY}={cfg.target}"
    return f"model.name={cfg.name}" + (" (torchvision)" if cfg.source == "torchvision" else "")


def logits_of(output: Any) -> Any:
    """A transformers ModelOutput's logits (what a model=custom of a transformers class
    returns; the task computes its own loss from them); any other output as it is."""
    if isinstance(output, torch.Tensor):
        return output
    logits = getattr(output, "logits", None)
    return output if logits is None else logits


def output_mismatch(model: str, num_classes: int, input_shape: tuple[int, ...],
                    output_shape: tuple[int, ...]) -> str | None:
    """The message for a model whose output is not (batch, num_classes), else None."""
    expected = (input_shape[0], num_classes)
    if tuple(output_shape) == expected:
        return None
    return (f"{model} returns shape {tuple(output_shape)} for inputs of shape "
            f"{tuple(input_shape)}; training needs (batch, num_classes) = {expected}: one score "
            "per class (take num_classes in the constructor to have it filled from the data).")


def check_output(cfg: ModelConfig | CustomModelConfig, spec: InputSpec) -> None:
    """Build the model and run it on zeros of the data's shape, without spending memory where
    possible: on the meta device first (no weights allocated, nothing computed), else for real
    on the CPU with one sample. Raises usercode.UserCodeError: cannot be built, does not run on
    such inputs, or its output is not (batch, num_classes)."""
    shape = (2, *spec.sample_shape)  # 2: BatchNorm in training mode wants more than one value
    try:
        with torch.device("meta"):
            output = logits_of(build(cfg, spec)(torch.zeros(shape)))
    except Exception:  # noqa: BLE001 - maybe what the meta device lacks: try for real, and
        # report what fails there (an import error fails there the same way)
        shape = (1, *spec.sample_shape)
        model = build(cfg, spec).eval()
        try:
            with torch.no_grad():
                output = logits_of(model(torch.zeros(shape)))
        except Exception as e:  # noqa: BLE001 - the user's forward: report it, one line
            raise usercode.UserCodeError(
                f"{describe(cfg)} fails on inputs of the data's shape {shape}: "
                f"{usercode.one_line(e)}") from None
    if not isinstance(output, torch.Tensor):
        raise usercode.UserCodeError(f"{describe(cfg)} returns {usercode.describe(output)}, "
                                     "not a tensor of class scores.")
    if message := output_mismatch(describe(cfg), spec.num_classes, shape, tuple(output.shape)):
        raise usercode.UserCodeError(message)
