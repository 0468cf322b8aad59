"""Fine-tuning a model's parameters by module name: `model.freeze` (not trained at all) and
`optim.param_groups` (trained with their own lr multiplier and weight decay).

A prefix names a module (`layer4`, `features.0`) or one parameter (`fc.weight`): it matches a
parameter whose dotted name equals it or starts with it and a dot, so `layer1` is not
`layer10`. A prefix that matches nothing is refused (pre-flight, in one line naming the model's
top-level modules): a misspelt prefix would otherwise train everything silently.

The prefixes as written are checked without a model in train/config/prefixes.py.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from train.config.prefixes import matches, prefix_of
from train.errors import TrainError

if TYPE_CHECKING:
    from torch import nn

class FinetuneError(TrainError, ValueError):
    """A prefix that matches nothing (or only frozen parameters); one line for the user."""


def _unmatched(names: Iterable[str], prefix: str, model: nn.Module, what: str) -> None:
    if not any(matches(n, prefix) for n in names):
        top = [name for name, _ in model.named_children()]
        kind = "trainable parameter" if "group" in what else "parameter"
        raise FinetuneError(f"{what}: {prefix!r} matches no {kind} of the model; its top-level "
                            f"modules are {top} (a prefix is a dotted module name, e.g. layer4 "
                            "or features.0).")


def freeze(model: nn.Module, prefixes: Sequence[str]) -> None:
    """requires_grad=False for the parameters under `prefixes` (before DDP wraps the model:
    DDP then neither syncs nor waits for them)."""
    names = [n for n, _ in model.named_parameters()]
    for prefix in prefixes:
        _unmatched(names, prefix, model, f"model.freeze={list(prefixes)}")
    for name, param in model.named_parameters():
        if any(matches(name, p) for p in prefixes):
            param.requires_grad_(False)


def check(model: nn.Module, prefixes: Sequence[str], groups: Sequence[Mapping[str, Any]]
          ) -> None:
    """Pre-flight, on a model built on the meta device: every prefix matches."""
    names = [n for n, _ in model.named_parameters()]
    for prefix in prefixes:
        _unmatched(names, prefix, model, f"model.freeze={list(prefixes)}")
    trainable = [n for n in names if not any(matches(n, p) for p in prefixes)]
    for i, group in enumerate(groups):
        _unmatched(trainable, prefix_of(group), model, f"optim.param_groups[{i}]")


def param_groups(model: nn.Module, groups: Sequence[Mapping[str, Any]], lr: float,
                 weight_decay: float) -> list[dict[str, Any]]:
    """The optimiser's groups: first the rest (optim.lr, optim.weight_decay; the lr logged as
    `lr`), then one per optim.param_groups entry. Frozen parameters are in none."""
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    rest: dict[str, Any] = {"params": [], "lr": lr, "weight_decay": weight_decay}
    chosen = [{"params": [], "prefix": prefix_of(g), "lr": lr * float(g.get("lr_scale", 1.0)),
               "weight_decay": float(g.get("weight_decay", weight_decay))} for g in groups]
    for i, group in enumerate(groups):
        _unmatched([n for n, _ in trainable], prefix_of(group), model,
                   f"optim.param_groups[{i}]")
    for name, param in trainable:
        home = next((c for c in chosen if matches(name, c["prefix"])), rest)
        home["params"].append(param)
    return [rest, *chosen] if rest["params"] or not chosen else chosen


def counts(model: nn.Module) -> dict[str, int]:
    """Parameter counts (elements) trained and frozen, for the run's params."""
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad)
    return {"model.params_trainable": trained, "model.params_frozen": frozen}
