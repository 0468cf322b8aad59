"""The Optuna sweeper's steps after its checks (hydra_plugins/train_launcher/optuna_sweeper.py):
settings from hydra.sweeper, the study and parent run, each trial's overrides, the results.

Kept apart from the sweeper's module, which Hydra imports at every start: this one imports
optuna, lazily, only when a sweep runs.
"""

import sys
from pathlib import Path
from typing import Any

from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import OmegaConf


def split_arguments(arguments: list[str],
                    params: dict[str, Any]) -> tuple[list[str], dict[str, str]]:
    """Command-line overrides: fixed ones go to every job; sweep ones (choice, interval, a,b)
    join hydra.sweeper.params (and win over them)."""
    space = {str(k): str(v) for k, v in params.items()}
    fixed = []
    for override in OverridesParser.create().parse_overrides(arguments):
        if override.is_sweep_override():
            space[override.get_key_element()] = override.input_line.split("=", 1)[1]
        else:
            fixed.append(override.input_line)
    return fixed, space


def settings(conf: dict[str, Any], config: Any, params: dict[str, str], sweep_dir: str) -> Any:
    from train.launch import study as study_lib

    def plain(value: Any) -> Any:
        return OmegaConf.to_container(value, resolve=True) if OmegaConf.is_config(value) \
            else value

    directions = plain(conf.get("direction")) or config.trainer.objective_direction
    directions = [str(d) for d in (directions if isinstance(directions, list) else [directions])]
    objectives = plain(conf.get("objectives")) or [str(config.trainer.objective)]
    objectives = [str(o) for o in (objectives if isinstance(objectives, list) else [objectives])]
    storage = study_lib.storage_url(conf.get("storage"), sweep_dir)
    return study_lib.StudySettings(
        study_name=conf.get("study_name") or "train", storage=storage, directions=directions,
        objectives=objectives, n_trials=int(conf.get("n_trials", 20)),
        n_jobs=int(conf.get("n_jobs", 2)), sampler=_sampler(conf.get("sampler")),
        pruner=study_lib.pruner_spec(plain(conf.get("pruner"))), params=params,
        heartbeat_s=float(conf.get("heartbeat_s", 30.0)))


def _sampler(sampler: Any) -> Any:
    """Hydra instantiated it already with the sweeper (its `_target_`); a mapping otherwise."""
    from hydra.utils import instantiate

    if sampler is None or OmegaConf.is_config(sampler) or isinstance(sampler, dict):
        return instantiate(sampler) if sampler else None
    return sampler


def check_objective(s: Any, cfg: Any) -> None:
    """Pruning reports at each evaluation: only val/ and train/ metrics exist then."""
    from hydra_plugins.train_launcher.checked_jobs import refuse

    if s.pruner is not None and not s.objectives[0].startswith(("val/", "train/")):
        refuse(f"hydra.sweeper.pruner: the objective {s.objectives[0]} exists only after "
               f"training; pruning needs a val/ or train/ metric.")
    if s.objectives[0] != cfg.trainer.objective:
        refuse(f"hydra.sweeper.objectives starts with {s.objectives[0]}, but "
               f"trainer.objective={cfg.trainer.objective}: the jobs report the latter.")


def run(sweeper: Any, s: Any, fixed: list[str], experiment_id: str | None,
        sweep_dir: str, on_slurm: bool = False) -> None:
    """The study, the parent run, the trials, the results."""
    import yaml

    from hydra_plugins.train_launcher import checked_jobs
    from train.errors import TrainError
    from train.launch import study as study_lib
    from train.launch import trials
    from train.launch.preflight import preflight
    from train.tracking.sweep import find_callback

    study = study_lib.open_study(s)
    study_lib.write_sweep_file(sweep_dir, s)
    callback = find_callback(sweeper.hydra_context)
    earlier = study.user_attrs.get(study_lib.PARENT_ATTR)
    if callback is not None and earlier and experiment_id is not None:
        callback.parent_run_id = earlier  # a resumed sweep: the same parent run
    handed, parent = checked_jobs.with_ids(sweeper, [[]], experiment_id)
    if parent:
        study.set_user_attr(study_lib.PARENT_ATTR, parent)

    def prepare(number: int, params: dict[str, Any]) -> list[str]:
        overrides = [*fixed, *(f"{k}={_value(v)}" for k, v in params.items()), *handed[0],
                     f"trainer.trial={number}", f"trainer.study='{s.study}'",
                     # Run mode, or a one-job multirun with +cluster=slurm: the same directory.
                     f"hydra.sweep.dir={Path(sweep_dir) / str(number)}", "hydra.sweep.subdir=."]
        try:
            preflight(checked_jobs.job_configs(sweeper, [overrides]), on_slurm=on_slurm)
        except SystemExit:  # job_configs refused a composition: this trial only
            raise TrainError(f"trial {number}'s config does not compose") from None
        return overrides

    print(f"Optuna study {s.study_name!r} in {s.storage}: {s.n_trials} trials, {s.n_jobs} at "
          f"a time, pruner {s.pruner}", flush=True)
    trials.run_trials(study, s, sweep_dir, prepare, trials.local_start(sweep_dir))
    outcome = study_lib.results(study)
    (Path(sweep_dir) / "optimization_results.yaml").write_text(yaml.safe_dump(outcome))
    print(f"Best: {outcome.get('best_value')} {outcome.get('best_params')} "
          f"({outcome['COMPLETE']} complete, {outcome['PRUNED']} pruned, {outcome['FAIL']} "
          f"failed)", flush=True)
    if not outcome["COMPLETE"]:
        print("error: no trial completed", file=sys.stderr, flush=True)
        raise SystemExit(1)


def _value(value: Any) -> str:
    """A sampled value as a Hydra override value."""
    if isinstance(value, str) and not value.replace("_", "").replace("-", "").isalnum():
        return "'" + value.replace("'", "\\'") + "'"
    return repr(value) if isinstance(value, float) else str(value)
