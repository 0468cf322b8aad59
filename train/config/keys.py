"""The config's keys as the dataclasses declare them, with each field's docstring: the
"did you mean" of a misspelt override, and `python -m train --help <group>`.

Field docstrings (the string under a field) are not kept at runtime, so they are read from the
modules' source with `ast`. Light: the standard library and train/config only.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import inspect
import json
import re
import typing
from functools import cache
from typing import Any

from train.config.cluster import ClusterConfig
from train.config.groups import ModelConfig, TrainConfig

GROUP_TYPES: dict[str, type] = {"model": ModelConfig, "cluster": ClusterConfig}
"""Groups whose field in TrainConfig is untyped or optional: the dataclass that types them."""


def _group_type(name: str) -> type | None:
    if name in GROUP_TYPES:
        return GROUP_TYPES[name]
    hint = typing.get_type_hints(TrainConfig)[name]
    return hint if dataclasses.is_dataclass(hint) else None


def groups() -> list[str]:
    return [f.name for f in dataclasses.fields(TrainConfig)]


@cache
def field_docs(cls: type) -> dict[str, str]:
    """Each field's docstring, from the class's source."""
    tree = ast.parse(inspect.getsource(cls))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs: dict[str, str] = {}
    for field, doc in zip(body, body[1:], strict=False):
        if isinstance(field, ast.AnnAssign) and isinstance(field.target, ast.Name) and \
                isinstance(doc, ast.Expr) and isinstance(doc.value, ast.Constant):
            docs[field.target.id] = inspect.cleandoc(str(doc.value.value))
    return docs


def fields(group: str) -> list[tuple[str, Any, str]]:
    """(key, default, docstring) of each field of a group."""
    cls = _group_type(group)
    if cls is None:
        return []
    docs = field_docs(cls)
    return [(f"{group}.{f.name}", default_of(f), docs.get(f.name, ""))
            for f in dataclasses.fields(cls)]


def default_of(f: dataclasses.Field) -> Any:
    """A field's default ("???": none, the value must be given)."""
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        return f.default_factory()  # type: ignore[misc]
    return "???"


@cache
def schema_keys() -> tuple[str, ...]:
    return tuple(key for group in groups() for key, _, _ in fields(group))


def did_you_mean(key: str) -> str | None:
    """The schema key meant by a misspelt one: a near name in the same group
    (`trainer.epoch` -> `trainer.epochs`), else the same name in another (`trainer.lr` ->
    `optim.lr`). Names are compared without their group, which would make every key near."""
    group, _, name = key.rpartition(".")
    siblings = {k.rpartition(".")[2]: k for k in schema_keys() if k.rpartition(".")[0] == group}
    if close := difflib.get_close_matches(name, siblings, n=1, cutoff=0.75):
        return siblings[close[0]]
    elsewhere = [k for k in schema_keys() if k.rpartition(".")[2] == name]
    return elsewhere[0] if len(elsewhere) == 1 else None


def _as_typed(value: Any) -> str:
    """A default as it is written on the command line (null, true, [0.9, 0.999])."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, list | dict):
        return json.dumps(value)
    return str(value)


def group_help(group: str) -> str:
    """`python -m train --help <group>`: the group's keys, defaults and docs."""
    if group not in groups():
        raise KeyError(group)
    lines = [f"== {group} (override as {group}.<key>=<value>) ==",
             "The defaults of the schema; an option of the group may set others "
             "(`python -m train --cfg job` shows the composed values)."]
    for key, default, doc in fields(group):
        lines.append(f"\n{key}={_as_typed(default)}")
        lines.extend(f"    {line}" for line in doc.splitlines())
    if not fields(group):
        lines.append("(no fixed keys: its option's own, see conf/" + group + "/)")
    return "\n".join(lines)


def override_hint(message: str) -> str | None:
    """What to type instead, for Hydra's "Could not override 'KEY'" (a key the config lacks):
    `+KEY=VALUE` where the node takes keys of the user's own (a custom model's constructor
    arguments, a Dataset's), else the schema key closest to KEY."""
    if tilde := re.search(r"LexerNoViableAltException: ([\w.+]+)=~", message):
        # The shell expands ~ only at a word's start: Hydra's grammar then refuses it.
        return (f"~ is not expanded after '=': write {tilde.group(1)}=$HOME/..., or an "
                "absolute path.")
    found = re.search(r"Could not override '([^']+)'", message) or \
        re.search(r"^([\w.]+): Key '[^']+' not in '\w+'", message)
    if found is None:
        return None
    key = found.group(1)
    append = re.search(r"To append to your config use (\+\S+)", message)
    if append and "is not in struct" in message:  # an untyped node: the user's own keys
        return f"a key of your own needs a +: {append.group(1)}."
    close = did_you_mean(key)
    return f"did you mean {close}?" if close else None
