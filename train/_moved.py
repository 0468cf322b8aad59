"""Module paths from before train/ was split into wings (2026-11-25), which pickles may name.

A pickle names a class by its module: an exception a Slurm job sent back through submitit
(`train.launch.JobStoppedError`, `train.stopping.Preempted`) while the login node already runs
the new code, or a model an older run logged pickled to MLflow (`train.models.SmallCNN`).
`install()` (called by train/__init__.py) makes `import train.stopping` give the module's new
home, and a wing that took an old module's name (train.config, train.data, train.distributed,
train.launch, train.models) answers that module's names through `old_name` in its __init__.
Checkpoints and unsent files name no class (tests/unit/test_moved_paths.py shows it).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

MOVED = {
    "config": "config.groups", "cluster_config": "config.cluster", "schema": "config.schema",
    "validation": "config.validation", "safe_text": "config.safe_text",
    "usercode": "config.usercode", "redact": "security.redact",
    "safe_pickle": "security.safe_pickle", "server_auth": "security.server_auth",
    "distenv": "distributed.env", "distributed": "distributed.process_group",
    "devices": "distributed.devices", "stopping": "distributed.stopping",
    "models": "models.build", "pretrained": "models.pretrained", "finetune": "models.finetune",
    "exportable": "models.exportable", "data": "data.build", "datasets": "data.datasets",
    "batches": "data.batches", "streaming": "data.streaming", "imagefolder": "data.imagefolder",
    "userdata": "data.userdata", "metrics": "report.metrics", "trainlog": "report.trainlog",
    "runlog": "report.runlog", "progress": "report.progress", "figures": "report.figures",
    "flops": "report.flops", "system_stats": "report.system_stats",
    "modelcard": "report.modelcard", "job": "engine.job", "loop": "engine.loop",
    "state": "engine.state", "checkpoint": "engine.checkpoint", "monitor": "engine.monitor",
    "optim": "engine.optim", "safewrite": "engine.safewrite", "launch": "launch.local",
    "joblock": "launch.joblock", "preflight": "launch.preflight", "slurm": "launch.submit",
    "slurm_follow": "launch.follow",
}
# `train.sweep` (now tracking/sweep.py) is no alias: `python -m train.sweep` is a root command
# again (train/sweep.py), whose module __getattr__ answers the old module's names.
"""Old module (under train.) -> where it lives now."""
_PACKAGE = Path(__file__).resolve().parent


def old_name(package: str, name: str) -> object:
    """A wing's `__getattr__`: `name` of the old module that had the wing's name. A submodule
    of the wing is not answered here (`from train.models import build` imports it)."""
    wing = package.removeprefix("train.")
    if name.startswith("__") or (_PACKAGE / wing / f"{name}.py").exists():
        raise AttributeError(f"module {package!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"train.{MOVED[wing]}"), name)


class _Alias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """`import train.<old module>` -> the module at its new path (the same module object)."""

    def find_spec(self, fullname: str, path: object = None,
                  target: object = None) -> importlib.machinery.ModuleSpec | None:
        head, _, old = fullname.partition(".")
        if head != "train" or old not in MOVED or (_PACKAGE / old).is_dir():
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        return importlib.import_module("train." + MOVED[spec.name.removeprefix("train.")])

    def exec_module(self, module: ModuleType) -> None:
        pass  # the module at its new path ran already


def install() -> None:
    if not any(isinstance(finder, _Alias) for finder in sys.meta_path):
        sys.meta_path.append(_Alias())
