"""`hydra/sweeper=train_optuna`: the project's own Optuna sweeper (optuna >= 4), replacing
hydra-optuna-sweeper, with pruning, no blocking batches and a study that outlives its driver.

The same keys as hydra-optuna-sweeper (`params`, `n_trials`, `n_jobs`, `direction`, `sampler`,
`study_name`, `storage`), plus `pruner`, `objectives` (default: trainer.objective) and
`heartbeat_s`. What happens, in order (docs/sweeps.md):
1. every refusal (train/launch/study.py `check`, the pre-flight of the sweep's fixed config):
   one line, exit 2, nothing created;
2. the study (a journal file in the sweep dir by default), sweep.json, the parent run;
3. train/launch/trials.py `run_trials`: up to n_jobs trials in flight, each pre-flighted and
   handed the ids and `trainer.trial` / `trainer.study` (train/engine/trial.py reports);
4. optimization_results.yaml; the parent run ends through Hydra's multirun end (the callback).
"""
# No `from __future__ import annotations`: Hydra's plugin scan executes this module outside
# sys.modules, where dataclasses cannot resolve string annotations.

from dataclasses import dataclass, field
from typing import Any

from hydra.core.config_store import ConfigStore
from hydra.plugins.sweeper import Sweeper


@dataclass
class TrainOptunaSweeperConf:
    _target_: str = "hydra_plugins.train_launcher.optuna_sweeper.TrainOptunaSweeper"
    direction: Any = "maximize"
    objectives: Any = None
    study_name: str | None = None
    storage: str | None = None
    n_trials: int = 20
    n_jobs: int = 2
    sampler: Any = field(default_factory=lambda: {"_target_": "optuna.samplers.TPESampler",
                                                  "seed": None})
    pruner: Any = None
    params: dict[str, str] | None = None
    heartbeat_s: float = 30.0


ConfigStore.instance().store(group="hydra/sweeper", name="train_optuna",
                             node=TrainOptunaSweeperConf, provider="train")


class TrainOptunaSweeper(Sweeper):
    def __init__(self, **conf: Any) -> None:
        self.conf = conf
        self.hydra_context: Any = None
        self.config: Any = None
        self.task_function: Any = None

    def setup(self, *, hydra_context: Any, task_function: Any, config: Any) -> None:
        # Trials run as their own processes (train/launch/trials.py), not through Hydra's
        # launcher, which runs a batch and waits for all of it.
        self.hydra_context, self.config = hydra_context, config
        self.task_function = task_function

    def _one_trial(self, arguments: list[str]) -> None:
        """This process is one trial's (`+cluster=slurm` makes every command a multirun): its
        one job through the configured launcher, as Hydra's basic sweeper would."""
        from hydra.core.plugins import Plugins

        launcher = Plugins.instance().instantiate_launcher(
            hydra_context=self.hydra_context, task_function=self.task_function,
            config=self.config)
        [result] = launcher.launch([arguments], initial_job_idx=0)
        _ = result.return_value  # raises the job's error: the trial's process exits non-zero

    def sweep(self, arguments: list[str]) -> None:
        from hydra_plugins.train_launcher import checked_jobs, optuna_run
        from train.errors import TrainError
        from train.launch import study as study_lib

        if any(a.startswith("trainer.trial=") for a in arguments):
            return self._one_trial(arguments)
        fixed, params = optuna_run.split_arguments(arguments, self.conf.get("params") or {})
        sweep_dir = str(self.config.hydra.sweep.dir)
        try:
            settings = optuna_run.settings(self.conf, self.config, params, sweep_dir)
            study_lib.check(settings)
            study_lib.distributions(settings.params)
        except TrainError as e:
            checked_jobs.refuse(e)
        on_slurm = "slurm" in str(self.config.hydra.launcher.get("_target_", ""))
        if on_slurm and not self.config.hydra.launcher.get("wait", True):
            checked_jobs.refuse("cluster.wait=false cannot serve TrainOptunaSweeper: it needs "
                                "each trial's result before it proposes the next. Drop "
                                "cluster.wait=false (the search then follows its jobs).")
        base = checked_jobs.job_configs(self, [fixed])
        optuna_run.check_objective(settings, base[0])
        experiment_id = checked_jobs.preflight_jobs(base, on_slurm=on_slurm)
        optuna_run.run(self, settings, fixed, experiment_id, sweep_dir, on_slurm)
