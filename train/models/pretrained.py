"""`model.weights`: the weights a job starts from instead of random ones (fine-tuning).

Two sources, both read with `torch.load(weights_only=True)` (tensors only, nothing unpickled):
- a local file: a state dict, this project's model.pt, or one of its checkpoints (its `model`
  entry); `module.` (DDP) and `_orig_mod.` (torch.compile) key prefixes are stripped;
- with model=torchvision, a torchvision weights name (DEFAULT, IMAGENET1K_V1,
  ResNet18_Weights.IMAGENET1K_V1), found in the local torch hub cache (`torch.hub.get_dir()`,
  which follows TORCH_HOME) and never downloaded: compute nodes are often offline.

The model is built for the data as always (its classifier has the data's class count) and the
file's tensors are matched to it by key and shape. Strict (model.weights_strict=true, the
default): every key must match, except, for torchvision weights, the classifier head (the
weights' 1000 ImageNet classes against the data's: left newly initialised) and the first
convolution on data of other than 3 channels (the pretrained filters summed over their RGB
inputs). Not strict: what matches is loaded and the rest reported. Pre-flight runs the same
match on a model built on the meta device (`check`), so a misfit is refused before any rank.
"""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlparse

import torch
from torch import nn

from train.config.groups import CustomModelConfig, ModelConfig
from train.errors import TrainError

log = logging.getLogger("train")
PREFIXES = ("module.", "_orig_mod.")
"""Key prefixes of a state dict saved from DDP or torch.compile's wrapper."""
WEIGHTS_NAME = re.compile(r"(\w+_Weights\.)?[A-Z][A-Z0-9_]*")
SHOWN = 3
"""Keys named in a refusal, per kind of problem."""
REPORTED = 50
"""Keys named in a non-strict load's report, per kind."""


class WeightsError(TrainError, ValueError):
    """Weights that cannot be found, read or fitted to the model; one line for the user."""


@dataclass(frozen=True)
class Source:
    """Where the weights come from: what the run records (`label`, a path or a weights name,
    never the contents) and the file to read."""

    label: str
    path: Path
    categories: int | None = None
    """torchvision weights: their class count (the head the data's may replace)."""


def resolve(cfg: ModelConfig | CustomModelConfig) -> Source | None:
    """model.weights as a file to read; None = random weights. Raises WeightsError."""
    if not cfg.weights:
        return None
    torchvision = isinstance(cfg, ModelConfig) and cfg.source == "torchvision"
    if _names_torchvision_weights(cfg):
        return _torchvision_source(cfg.name, cfg.weights)  # type: ignore[union-attr]
    path = Path(cfg.weights).expanduser()
    names = " (or, with model=torchvision, DEFAULT or a weights name)" if torchvision else ""
    if not path.exists():
        raise WeightsError(f"model.weights={cfg.weights}: no such file. Give a state dict file "
                           f"(a run's model.pt, a checkpoint step-<N>.pt){names}.")
    if path.is_dir():
        raise WeightsError(f"model.weights={cfg.weights} is a directory; name the file in it "
                           "(model.pt, or checkpoints/step-<N>.pt).")
    return Source(str(path.resolve()), path)


def download_command(full_name: str) -> str:
    return ("python -c \"import torchvision; torchvision.models.get_weight("
            f"'{full_name}').get_state_dict(progress=True)\"")


def _torchvision_weights(builder: str, name: str):  # noqa: ANN202 - a torchvision WeightsEnum
    """torchvision's weights `name` (DEFAULT, IMAGENET1K_V1, <Enum>.<member>) of `builder`."""
    import torchvision.models as tvm

    try:
        enum = tvm.get_model_weights(builder)
    except (ValueError, KeyError):
        raise WeightsError(f"model.weights={name}: torchvision has no pretrained weights for "
                           f"{builder}; give a state dict file.") from None
    members = list(enum.__members__)
    owner, _, member = name.rpartition(".")
    if (owner and owner != enum.__name__) or member not in members:
        raise WeightsError(f"model.weights={name} are not weights of {builder}; choose DEFAULT "
                           f"or one of {[f'{enum.__name__}.{m}' for m in members]}.")
    return enum[member]


def _torchvision_source(builder: str, name: str) -> Source:
    weights = _torchvision_weights(builder, name)
    full = f"{type(weights).__name__}.{weights.name}"
    file = Path(torch.hub.get_dir()) / "checkpoints" / os.path.basename(urlparse(weights.url).path)
    if not file.is_file():
        raise WeightsError(
            f"model.weights={name}: {full} is not in the local torch hub cache ({file} is "
            "missing), and jobs never download. Fetch it on a machine with internet access "
            f"(a login node), with the same TORCH_HOME: {download_command(full)}")
    return Source(f"torchvision:{full}", file, len(weights.meta["categories"]))


def label(cfg: ModelConfig | CustomModelConfig) -> str | None:
    """What the run records of model.weights (tag `weights_source`): the file's absolute path
    or torchvision:<Enum>.<member>; the file need not exist any more (a resumed job)."""
    if not cfg.weights:
        return None
    if _names_torchvision_weights(cfg):
        try:
            weights = _torchvision_weights(cfg.name, cfg.weights)  # type: ignore[union-attr]
            return f"torchvision:{type(weights).__name__}.{weights.name}"
        except WeightsError:
            return f"torchvision:{cfg.weights}"
    return str(Path(cfg.weights).expanduser().resolve())


def _names_torchvision_weights(cfg: ModelConfig | CustomModelConfig) -> bool:
    return (isinstance(cfg, ModelConfig) and cfg.source == "torchvision" and bool(cfg.weights)
            and WEIGHTS_NAME.fullmatch(str(cfg.weights)) is not None
            and not Path(str(cfg.weights)).exists())


def read(path: Path, label: str) -> dict[str, torch.Tensor]:
    """The file's state dict (a checkpoint's `model` entry), wrapper prefixes stripped;
    memory-mapped where the format allows (pre-flight only looks at the shapes)."""
    try:
        try:
            loaded = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError:  # the legacy (non-zip) format cannot be mapped
            loaded = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - pickled objects, truncated, not torch at all
        text = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise WeightsError(f"model.weights={label}: cannot be read as a state dict of tensors "
                           f"({type(e).__name__}: {text[:200]}). Give a file written with "
                           "torch.save(model.state_dict(), path).") from None
    if isinstance(loaded, dict) and isinstance(loaded.get("model"), dict):
        loaded = loaded["model"]  # a checkpoint of this project
    if not isinstance(loaded, dict) or not loaded or not all(
            isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in loaded.items()):
        raise WeightsError(f"model.weights={label} holds {type(loaded).__name__}, not a state "
                           "dict (parameter names to tensors). Give a file written with "
                           "torch.save(model.state_dict(), path).")
    return {_strip(key): value for key, value in loaded.items()}


def _strip(key: str) -> str:
    while key.startswith(PREFIXES):
        key = key.split(".", 1)[1]
    return key


@dataclass
class Match:
    """How a file's tensors fit a model's state dict, key by key."""

    loaded: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    mismatched: list[str] = field(default_factory=list)
    """'key: (file shape) in the file, (model shape) here'."""
    head: list[str] = field(default_factory=list)
    """torchvision: the classifier's tensors, sized for the data's classes (left new)."""
    adapted: list[str] = field(default_factory=list)
    """torchvision: the first convolution, summed over RGB for the data's channels."""

    def misfit(self, shown: int = SHOWN) -> str:
        """The problems a strict load refuses, naming `shown` keys of each kind; '' if none."""
        parts = []
        for what, keys in (("missing", self.missing), ("unexpected", self.unexpected),
                           ("of another shape", self.mismatched)):
            if keys:
                more = ", ..." if len(keys) > shown else ""
                parts.append(f"{len(keys)} {what} ({', '.join(keys[:shown])}{more})")
        return "; ".join(parts)


def match(model: dict[str, tuple[int, ...]], file: dict[str, tuple[int, ...]],
          categories: int | None, num_classes: int) -> Match:
    """Match the shapes of a model's state dict and a file's (pure: no tensors read)."""
    found = Match(unexpected=[k for k in file if k not in model])
    for key, shape in model.items():
        theirs = file.get(key)
        if theirs is None:
            found.missing.append(key)
        elif tuple(theirs) == tuple(shape):
            found.loaded.append(key)
        elif categories is not None and _is_head(shape, theirs, num_classes, categories):
            found.head.append(key)
        elif categories is not None and _is_first_conv(shape, theirs):
            found.adapted.append(key)
        else:
            found.mismatched.append(f"{key}: {tuple(theirs)} in the file, {tuple(shape)} here")
    return found


def _is_head(ours: tuple[int, ...], theirs: tuple[int, ...], classes: int,
             categories: int) -> bool:
    return (len(ours) == len(theirs) >= 1 and ours[0] == classes and theirs[0] == categories
            and tuple(ours[1:]) == tuple(theirs[1:]))


def _is_first_conv(ours: tuple[int, ...], theirs: tuple[int, ...]) -> bool:
    return (len(ours) == len(theirs) == 4 and theirs[1] == 3 and ours[0] == theirs[0]
            and tuple(ours[2:]) == tuple(theirs[2:]))


def shapes(state: dict[str, torch.Tensor]) -> dict[str, tuple[int, ...]]:
    return {k: tuple(v.shape) for k, v in state.items()}


def fit(model: nn.Module, source: Source, weights: dict[str, torch.Tensor], strict: bool,
        num_classes: int) -> Match:
    """Match, or refuse (strict) with one line naming a few keys of each kind."""
    found = match(shapes(model.state_dict()), shapes(weights), source.categories, num_classes)
    if strict and (problem := found.misfit()):
        raise WeightsError(
            f"model.weights={source.label} does not fit the model: {problem}. Weights of "
            "another model (or class count)? model.weights_strict=false loads what matches "
            "and reports the rest.")
    return found


def load(model: nn.Module, cfg: ModelConfig | CustomModelConfig, num_classes: int) -> None:
    """Put model.weights into `model` (every rank reads the file: DDP then starts every rank
    from the same weights), and say what was loaded and what was not."""
    source = resolve(cfg)
    if source is None:
        return
    weights = read(source.path, source.label)
    found = fit(model, source, weights, cfg.weights_strict, num_classes)
    take = {k: weights[k] for k in found.loaded}
    own = model.state_dict()
    for key in found.adapted:  # grey-scale (or other) inputs: RGB filters summed, spread
        channels = own[key].shape[1]
        take[key] = weights[key].sum(1, keepdim=True).repeat(1, channels, 1, 1) / channels
    model.load_state_dict(take, strict=False)
    log.info("model.weights: %d of %d tensors loaded from %s", len(take), len(own), source.label)
    if found.head:
        log.info("classifier head %s newly initialised: the weights have %d classes, the data "
                 "%d", found.head, source.categories, num_classes)
    if found.adapted:
        log.info("first convolution %s: the pretrained RGB filters summed for %d input "
                 "channel(s)", found.adapted, own[found.adapted[0]].shape[1])
    if problem := found.misfit(shown=REPORTED):
        log.warning("model.weights_strict=false: not loaded from %s: %s", source.label, problem)
