"""An Optuna sweep's study: its settings checked, its storage, its search space.

Everything here that can refuse does so before the study, the parent run or any job exists
(hydra_plugins/train_launcher/optuna_sweeper.py calls `check` first): an unknown pruner, a
pruner on a multi-objective study (Optuna's `Trial.report` cannot prune those), a storage path
that cannot be written, a parameter that is no search space.

The study lives in a journal file in the sweep directory unless `storage` says otherwise: it
needs no server, works on a shared filesystem, and is what `python -m train sweep status|resume`
read (train/sweep.py). `sweep.json` next to it records the command that started the sweep.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from train.engine import trial as trial_lib
from train.errors import ConfigError
from train.tracking.sweep import SWEEP_FILE

JOURNAL = "optuna.journal"
FINISHED = ("COMPLETE", "PRUNED", "FAIL")
PARENT_ATTR = "parent_run_id"


@dataclass
class StudySettings:
    """hydra.sweeper's keys, checked."""

    study_name: str
    storage: str
    directions: list[str]
    objectives: list[str]
    n_trials: int
    n_jobs: int
    sampler: Any
    pruner: dict[str, Any] | None
    params: dict[str, str] = field(default_factory=dict)
    heartbeat_s: float = 30.0

    @property
    def study(self) -> str:
        """trainer.study for the jobs."""
        return f"{self.storage}{trial_lib.SEPARATOR}{self.study_name}"


def pruner_spec(pruner: Any) -> dict[str, Any] | None:
    """hydra.sweeper.pruner as {name: ..., **kwargs}: a name (`median`) or a mapping with
    `name`; null or `none` for no pruning."""
    if pruner is None:
        return None
    spec = {"name": pruner} if isinstance(pruner, str) else dict(pruner)
    if spec.get("name") in (None, "none"):
        return None
    return spec


def storage_url(storage: str | None, sweep_dir: str) -> str:
    """The study's storage: a journal file in the sweep directory by default."""
    if storage and "://" in storage:
        return storage
    if storage:  # a path: absolute, as the jobs may run elsewhere
        return str(Path(storage.removeprefix("journal:")).resolve())
    return str(Path(sweep_dir).resolve() / JOURNAL)


def check(s: StudySettings) -> None:
    """Refusals before anything exists (ConfigError, one line each)."""
    if s.n_trials < 1 or s.n_jobs < 1:
        raise ConfigError("hydra.sweeper.n_trials and n_jobs must be at least 1.")
    bad = [d for d in s.directions if d not in ("minimize", "maximize")]
    if bad:
        raise ConfigError(f"hydra.sweeper.direction must be minimize or maximize, not {bad[0]}.")
    if len(s.directions) != len(s.objectives):
        raise ConfigError(f"hydra.sweeper.objectives has {len(s.objectives)} metric(s) for "
                          f"{len(s.directions)} direction(s).")
    if s.pruner is not None:
        if len(s.directions) > 1:
            raise ConfigError("hydra.sweeper.pruner cannot prune a multi-objective study "
                              "(Optuna's trials report one value): set pruner=null or one "
                              "direction.")
        try:
            trial_lib.build_pruner(s.pruner)
        except (ValueError, TypeError) as e:
            raise ConfigError(f"hydra.sweeper.pruner: {e}") from None
    check_storage(s.storage)


def check_storage(url: str) -> None:
    """A journal file must be creatable (or writable) where it is asked for."""
    if "://" in url:
        return
    path = Path(url.removeprefix("journal:"))
    folder = path.parent
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    target = path if path.exists() else folder
    if not target.is_dir() and not path.exists() or not os.access(target, os.W_OK):
        raise ConfigError(f"hydra.sweeper.storage: {path} cannot be written ({target} is not "
                          f"writable): choose a path on a writable shared filesystem.")


def distributions(params: dict[str, str]) -> dict[str, Any]:
    """Hydra's sweep syntax (choice, range, interval, tag(log, ...)) as Optuna distributions."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.core.override_parser.types import ChoiceSweep, IntervalSweep, RangeSweep
    from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution

    parser = OverridesParser.create()
    out: dict[str, Any] = {}
    for key, text in params.items():
        value = parser.parse_override(f"{key}={text}").value()
        if isinstance(value, ChoiceSweep):
            out[key] = CategoricalDistribution(list(value.list))
        elif isinstance(value, RangeSweep):
            start, step = int(value.start), int(value.step or 1)
            last = start + step * ((int(value.stop) - 1 - start) // step)  # stop excluded
            out[key] = IntDistribution(start, last, step=step)
        elif isinstance(value, IntervalSweep):
            log = "log" in value.tags
            if isinstance(value.start, int) and isinstance(value.end, int):
                out[key] = IntDistribution(value.start, value.end, log=log)
            else:
                out[key] = FloatDistribution(float(value.start), float(value.end), log=log)
        else:
            raise ConfigError(f"hydra.sweeper.params.{key}={text} is no search space: use "
                              f"choice(...), range(...) or interval(...).")
    return out


def open_study(s: StudySettings) -> Any:
    """Created, or loaded when it exists (a resumed sweep)."""
    import optuna

    if "://" not in s.storage:  # the sweep directory is made here, before any job
        Path(s.storage.removeprefix("journal:")).parent.mkdir(parents=True, exist_ok=True)
    study = optuna.create_study(study_name=s.study_name, storage=trial_lib.storage_of(s.storage),
                                sampler=s.sampler, pruner=trial_lib.build_pruner(s.pruner),
                                directions=s.directions, load_if_exists=True)
    if study.trials:
        # A resumed sweep: a seeded sampler would start its sequence again and propose the
        # parameters of the trials that ran already.
        study.sampler.reseed_rng()
    study.set_user_attr(trial_lib.PRUNER_ATTR, s.pruner)
    study.set_user_attr(trial_lib.HEARTBEAT_S_ATTR, s.heartbeat_s)
    return study


def write_sweep_file(sweep_dir: str, s: StudySettings) -> None:
    """What status and resume need: the storage, the study, and the command to run again."""
    Path(sweep_dir).mkdir(parents=True, exist_ok=True)
    record = {"storage": s.storage, "study_name": s.study_name, "n_trials": s.n_trials,
              "cwd": os.getcwd(), "argv": [sys.executable, "-m", "train", *sys.argv[1:]]}
    path = Path(sweep_dir) / SWEEP_FILE
    if path.exists():  # a resumed sweep keeps the command that started it
        record["argv"] = json.loads(path.read_text())["argv"]
    path.write_text(json.dumps(record, indent=2))


def results(study: Any) -> dict[str, Any]:
    """optimization_results.yaml, as hydra-optuna-sweeper wrote it."""
    states = [t.state.name for t in study.trials]
    counts = {k: states.count(k) for k in ("COMPLETE", "PRUNED", "FAIL")}
    if len(study.directions) > 1:
        return {"name": "optuna", "solutions": [
            {"params": t.params, "values": t.values} for t in study.best_trials], **counts}
    try:
        best = study.best_trial
    except ValueError:  # no trial completed
        return {"name": "optuna", "best_params": None, "best_value": None, **counts}
    return {"name": "optuna", "best_params": best.params, "best_value": best.value,
            "best_trial": best.number, **counts}
