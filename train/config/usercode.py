"""The user's own code named in the config (`model._target_`, `trainer.loss._target_`): found by
its dotted path with an error that says which module is missing and where Python looked, its
constructor's arguments filled from what the service knows, and built with Hydra's instantiate.

No torch import here: pre-flight uses it before anything heavy is loaded.
"""

from __future__ import annotations

import importlib
import inspect
import os
import sys
from collections.abc import Mapping
from typing import Any

from train.errors import TrainError


class UserCodeError(TrainError, ValueError):
    """A `_target_` that cannot be imported or built; the message is one line for the user."""


def one_line(error: BaseException) -> str:
    """`Type: first line of the message`: what an error from the user's code says, on one line."""
    text = str(error).strip()
    return f"{type(error).__name__}: {text.splitlines()[0]}" if text else type(error).__name__


def where_python_looks() -> str:
    """PYTHONPATH and sys.path, for an error about a module that is not found."""
    entries = [p or "." for p in sys.path]
    return (f"PYTHONPATH={os.environ.get('PYTHONPATH', '')!r}, sys.path={entries}. Put the "
            "directory that holds your package on PYTHONPATH (export it before submitting to "
            "Slurm), or pip install the package into this venv.")


def _import_longest_module(parts: list[str], key: str, path: str) -> tuple[Any, int]:
    """The deepest importable module of `parts` and how many parts it took."""
    for taken in range(len(parts), 0, -1):
        name = ".".join(parts[:taken])
        try:
            return importlib.import_module(name), taken
        except ModuleNotFoundError as e:
            missing = e.name or ""
            if name == missing or name.startswith(missing + "."):
                continue  # this prefix is no module: the rest may be attributes of a shorter one
            raise UserCodeError(  # the user's module imports something that is not there
                f"{key}={path!r}: importing module {name!r} failed, as the module {missing!r} "
                f"it imports is not found. {where_python_looks()}") from None
        except Exception as e:  # noqa: BLE001 - the user's module raised while importing
            raise UserCodeError(f"{key}={path!r}: importing module {name!r} raised "
                                f"{one_line(e)}") from None
    raise UserCodeError(f"{key}={path!r}: no module named {parts[0]!r} is found. "
                        f"{where_python_looks()}")


def locate(path: str, key: str) -> Any:
    """The object at dotted `path` (package.module.Class); `key` names the config key."""
    parts = path.split(".")
    if len(parts) < 2 or not all(p.isidentifier() for p in parts):
        raise UserCodeError(f"{key}={path!r} is not a dotted path to a class or function, "
                            "e.g. mypkg.models.Net.")
    obj, taken = _import_longest_module(parts, key, path)
    for depth in range(taken, len(parts)):
        if not hasattr(obj, parts[depth]):
            where = getattr(obj, "__file__", None) or ".".join(parts[:depth])
            raise UserCodeError(f"{key}={path!r}: {'.'.join(parts[:depth])!r} ({where}) has no "
                                f"{parts[depth]!r}; check the spelling.")
        obj = getattr(obj, parts[depth])
    return obj


def describe(obj: Any) -> str:
    """What an object is, for an error: its kind and its qualified name."""
    if inspect.isclass(obj):
        bases = ", ".join(b.__name__ for b in obj.__mro__[1:-1]) or "object"
        return f"the class {obj.__module__}.{obj.__qualname__} (bases: {bases})"
    if callable(obj):
        return f"the function {getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', obj)}"
    return f"a {type(obj).__name__} ({obj!r:.60})"


def accepted_arguments(target: Any) -> set[str]:
    """The argument names `target` (a class or function) takes by keyword; empty where its
    signature cannot be read (a C extension)."""
    try:
        signature = inspect.signature(target)
    except (TypeError, ValueError):
        return set()
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return {name for name, p in signature.parameters.items() if p.kind in kinds}


def fill_arguments(target: Any, given: Mapping[str, Any],
                   known: Mapping[str, Any]) -> dict[str, Any]:
    """`known` values (num_classes, channels, ...) for the arguments `target` takes and the
    user did not set: what the service knows of the data, handed to the user's constructor."""
    takes = accepted_arguments(target)
    return {name: value for name, value in known.items() if name in takes and name not in given}


def required_arguments(target: Any) -> list[str]:
    """The arguments `target` cannot be called without (no default), in order; empty where its
    signature cannot be read."""
    try:
        signature = inspect.signature(target)
    except (TypeError, ValueError):
        return []
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return [name for name, p in signature.parameters.items()
            if p.kind in kinds and p.default is inspect.Parameter.empty]


def check_filled(target: Any, path: str, key: str, given: Mapping[str, Any],
                 known: Mapping[str, Any]) -> None:
    """Refuse, before calling it, a constructor that needs an argument nobody gives: neither the
    config (`+model.<name>=...`) nor the data (only the names in `known` are filled)."""
    missing = [a for a in required_arguments(target) if a not in given and a not in known]
    if missing:
        names, group = ", ".join(missing), key.removesuffix("._target_")
        raise UserCodeError(
            f"{key}={path!r}: its constructor needs {names}, which nothing sets. The data fills "
            f"only {', '.join(known)} (where the constructor takes them by those names); set "
            f"the rest yourself: {' '.join(f'+{group}.{a}=<value>' for a in missing)}.")


def build(path: str, key: str, kwargs: Mapping[str, Any]) -> Any:
    """hydra.utils.instantiate of {_target_: path, **kwargs} (nested `_target_`s too), with
    plain dicts and lists as arguments; a failing call is one line naming the call."""
    from hydra.errors import InstantiationException
    from hydra.utils import instantiate

    try:
        return instantiate({"_target_": path, **kwargs}, _convert_="all")
    except InstantiationException as e:
        cause = e.__cause__ or e
        shown = ", ".join(f"{k}={v!r}" for k, v in kwargs.items())
        raise UserCodeError(f"{key}={path!r}: calling {path}({shown}) failed: "
                            f"{one_line(cause)}") from None
