"""Fine-tuning a model's parameters by module name: `model.freeze` (not trained at all) and
`optim.param_groups` (trained with their own lr multiplier and weight decay).

A prefix names a module (`layer4`, `features.0`) or one parameter (`fc.weight`): it matches a
parameter whose dotted name equals it or starts with it and a dot, so `layer1` is not
`layer10`. A prefix that matches nothing is refused (pre-flight, in one line naming the model's
top-level modules): a misspelt prefix would otherwise train everything silently.

No torch import at module level: validation.py's config-only checks (`group_problems`) use it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch import nn

GROUP_KEYS = ("prefix", "lr_scale", "weight_decay")
"""What one entry of optim.param_groups may set."""


class FinetuneError(ValueError):
    """A prefix that matches nothing (or only frozen parameters); one line for the user."""


def matches(name: str, prefix: str) -> bool:
    """Whether parameter `name` lies under module (or is parameter) `prefix`."""
    return name == prefix or name.startswith(prefix + ".")


def overlap(a: str, b: str) -> bool:
    return matches(a, b) or matches(b, a)


def group_problems(groups: Sequence[Any], freeze: Sequence[str]) -> list[str]:
    """What is wrong with optim.param_groups and model.freeze as written (no model needed)."""
    problems: list[str] = []
    if any(not isinstance(p, str) or not p.strip() for p in freeze):
        problems.append(f"model.freeze={list(freeze)!r} must list module-name prefixes, "
                        "e.g. model.freeze=[layer1,layer2].")
    prefixes: list[str] = []
    example = "optim.param_groups=[{prefix:layer4,lr_scale:0.1}]"
    for i, group in enumerate(groups):
        where = f"optim.param_groups[{i}]"
        if not isinstance(group, Mapping) or not prefix_of(group):
            problems.append(f"{where}={group!r} needs a module-name prefix, e.g. {example}.")
            continue
        if unknown := sorted(set(group) - set(GROUP_KEYS)):
            problems.append(f"{where} has {unknown}; a group takes {list(GROUP_KEYS)}.")
        scale, decay = group.get("lr_scale", 1.0), group.get("weight_decay", 0.0)
        if not _number(scale) or scale <= 0:
            problems.append(f"{where}.lr_scale={scale!r} must be a positive number.")
        if not _number(decay) or decay < 0:
            problems.append(f"{where}.weight_decay={decay!r} must be 0 or more.")
        prefix = prefix_of(group)
        if clash := [p for p in prefixes if overlap(p, prefix)]:
            problems.append(f"{where}.prefix={prefix!r} overlaps the group of prefix "
                            f"{clash[0]!r}: a parameter can be in one group only.")
        prefixes.append(prefix)
    return problems


def prefix_of(group: Mapping[str, Any]) -> str:
    """A group's prefix as text ('' if it has none): `3` of a Sequential is a module name too,
    and the command line reads it as a number."""
    prefix = group.get("prefix")
    if isinstance(prefix, bool) or not isinstance(prefix, str | int):
        return ""
    return str(prefix).strip()


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


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
