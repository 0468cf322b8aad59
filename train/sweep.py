"""Hydra sweeps as one MLflow parent run with a child run per job.

A Hydra callback, so it runs in the process that launches the sweep (the login node for Slurm
arrays, this process for local sweeps), before the first job starts and after the last ends.
It hands the experiment and parent run ids to the jobs through the environment, which local
jobs share and Slurm jobs inherit from sbatch.
"""

from __future__ import annotations

import atexit
import logging
import os
from typing import Any

from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from train import config as config_lib

log = logging.getLogger("train.sweep")

EXPERIMENT_ENV = "TRAIN_EXPERIMENT_ID"
PARENT_ENV = "TRAIN_PARENT_RUN_ID"


def is_sweep(config: DictConfig) -> bool:
    """More than one job: a sweep override (a=1,2) or a sweeper that proposes trials itself."""
    if "BasicSweeper" not in str(config.hydra.sweeper.get("_target_", "BasicSweeper")):
        return True
    overrides = OverridesParser.create().parse_overrides(list(config.hydra.overrides.task))
    return any(o.is_sweep_override() for o in overrides)


class ParentRunCallback(Callback):
    def __init__(self) -> None:
        self.parent_run_id: str | None = None
        self.settings: tuple[Any, str, str] | None = None

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        app = {k: v for k, v in config.items() if k != "hydra"}
        typed = config_lib.to_typed(OmegaConf.to_container(OmegaConf.create(app), resolve=True))
        if not typed.tracking.enabled or not is_sweep(config):
            return
        from train import tracking

        experiment_id = tracking.prepare(typed.tracking)
        tags = {"sweep": "true", "sweep.dir": str(config.hydra.sweep.dir),
                "sweep.overrides": " ".join(config.hydra.overrides.task)}
        self.parent_run_id = tracking.start_parent_run(typed.tracking, experiment_id, tags)
        os.environ[EXPERIMENT_ENV] = experiment_id
        os.environ[PARENT_ENV] = self.parent_run_id
        self.settings = (typed.tracking, typed.trainer.objective,
                         typed.trainer.objective_direction)
        # Also when a job failure ends the sweep with an exception (no on_multirun_end then).
        atexit.register(self.finish)
        log.info("sweep parent run %s in experiment %s", self.parent_run_id, experiment_id)

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        self.finish()

    def finish(self) -> None:
        if self.parent_run_id is None or self.settings is None:
            return
        from train import tracking

        parent, self.parent_run_id = self.parent_run_id, None
        summary = tracking.end_parent_run(*self.settings[:1], parent, *self.settings[1:])
        print(f"Sweep parent run {parent}: {summary['children']} job(s), {summary['failed']} "
              f"failed; best {self.settings[1]} = {summary.get('best_value')} "
              f"(run {summary.get('best_run_id')})", flush=True)
        os.environ.pop(PARENT_ENV, None)
