"""Module-name prefixes as the config writes them: what `model.freeze` and
`optim.param_groups` may say, checked without a model (and without torch). A prefix names a
module (`layer4`, `features.0`) or one parameter (`fc.weight`): it matches a parameter whose
dotted name equals it or starts with it and a dot, so `layer1` is not `layer10`.
train/models/finetune.py matches the same prefixes against a built model.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

GROUP_KEYS = ("prefix", "lr_scale", "weight_decay")
"""What one entry of optim.param_groups may set."""


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
