"""Hydra sweeps as one MLflow parent run with a child run per job.

`ParentRunCallback` is a Hydra callback: it runs in the process that launches the sweep (the
login node for Slurm arrays, this process for local sweeps). It creates the parent run lazily,
when the first job has passed its checks and is about to start (`parent_run_for_jobs`, called
by the local launcher and the Slurm launcher), so that a sweep refused before anything ran
leaves no empty run behind; after the last job it summarises the children on the parent and
ends it. The ids go to the jobs in their configs (and the environment, for Hydra's own
interpolations).
"""

from __future__ import annotations

import atexit
import logging
import os
import time
from typing import Any

from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from train import config as config_lib
from train.config import TrackingConfig
from train.outbox import Batch
from train.store import resolve_uri

log = logging.getLogger("train.sweep")

EXPERIMENT_ENV = "TRAIN_EXPERIMENT_ID"
PARENT_ENV = "TRAIN_PARENT_RUN_ID"
UNWAITED_ENV = "TRAIN_SWEEP_UNWAITED_JOBS"
"""Set by the Slurm launcher with cluster.wait=false: how many jobs it submitted and left."""
JOBS_TAG = "sweep.jobs"

_active: ParentRunCallback | None = None
"""The sweep this process is launching, if any (set by the callback in the launching process
only: inside a Slurm job there is none)."""


def parent_run_for_jobs() -> tuple[str, str] | None:
    """(experiment id, parent run id) for jobs about to start, if they belong to a sweep."""
    return _active.start_parent() if _active is not None else None


def is_sweep(config: DictConfig) -> bool:
    """More than one job: a sweep override (a=1,2) or a sweeper that proposes trials itself."""
    if "BasicSweeper" not in str(config.hydra.sweeper.get("_target_", "BasicSweeper")):
        return True
    overrides = OverridesParser.create().parse_overrides(list(config.hydra.overrides.task))
    return any(o.is_sweep_override() for o in overrides)


def start_parent_run(cfg: TrackingConfig, experiment_id: str, tags: dict[str, str]) -> str:
    from train.tracking import Sender

    sender = Sender(resolve_uri(cfg))
    run = sender.client.create_run(experiment_id, tags=tags, run_name=cfg.run_name)
    return str(run.info.run_id)


def end_parent_run(cfg: TrackingConfig, parent_run_id: str, objective: str,
                   direction: str, only_if_done: bool = False) -> dict[str, Any] | None:
    """Summarise the children on the parent (best objective, failures) and end it.

    `only_if_done`: for a job of a sweep submitted without waiting (`cluster.wait=false`), which
    ends the parent only if it is the last of the `sweep.jobs` jobs to end; None otherwise.
    """
    from train.tracking import Sender

    sender = Sender(resolve_uri(cfg), parent_run_id)
    parent = sender.client.get_run(parent_run_id)
    expected = parent.data.tags.get(JOBS_TAG)
    if only_if_done and expected is None:  # a waited sweep: its submitter ends the parent
        return None
    children = sender.client.search_runs(
        [parent.info.experiment_id], f"tags.`mlflow.parentRunId` = '{parent_run_id}'",
        max_results=10000)
    if only_if_done and (len(children) < int(expected) or any(
            c.info.status in ("RUNNING", "SCHEDULED") for c in children)):
        return None
    failed = [c for c in children if c.info.status != "FINISHED"]
    scored = [c for c in children if objective in c.data.metrics]
    summary: dict[str, Any] = {"children": len(children), "failed": len(failed)}
    now = int(time.time() * 1000)
    rows = Batch(metrics=[("sweep/children", len(children), now, 0),
                          ("sweep/failed_children", len(failed), now, 0)])
    if scored:
        pick = max if direction == "maximize" else min
        best = pick(scored, key=lambda c: c.data.metrics[objective])
        summary.update(best_run_id=best.info.run_id, best_value=best.data.metrics[objective])
        rows.metrics.append((f"best/{objective}", best.data.metrics[objective], now, 0))
        rows.tags.append(("best_run_id", best.info.run_id))
    sender.rows(rows)
    sender.client.set_terminated(parent_run_id,
                                 "FAILED" if failed or not children else "FINISHED")
    return summary


def tag_unwaited_jobs(cfg: TrackingConfig, parent_run_id: str, jobs: int) -> None:
    """The submitter will not see the jobs end: the parent learns how many there are, so that
    the last job to end can end it."""
    from train.tracking import Sender

    Sender(resolve_uri(cfg), parent_run_id).rows(Batch(tags=[(JOBS_TAG, str(jobs))]))


class ParentRunCallback(Callback):
    def __init__(self) -> None:
        self.parent_run_id: str | None = None
        self.experiment_id = ""
        self.settings: tuple[Any, str, str] | None = None
        self.overrides = ""
        self.sweep_dir = ""

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        global _active
        app = {k: v for k, v in config.items() if k != "hydra"}
        typed = config_lib.to_typed(OmegaConf.to_container(OmegaConf.create(app), resolve=True))
        if not typed.tracking.enabled or not is_sweep(config):
            return
        self.settings = (typed.tracking, typed.trainer.objective,
                         typed.trainer.objective_direction)
        self.overrides = " ".join(config.hydra.overrides.task)
        self.sweep_dir = str(config.hydra.sweep.dir)
        _active = self
        # Also when a job failure ends the sweep with an exception (no on_multirun_end then).
        atexit.register(self.finish)

    def start_parent(self) -> tuple[str, str]:
        """The experiment and parent run ids, the run created at the first call."""
        assert self.settings is not None
        if self.parent_run_id is None:
            from train import tracking

            self.experiment_id = tracking.prepare(self.settings[0])
            tags = {"sweep": "true", "sweep.dir": self.sweep_dir,
                    "sweep.overrides": self.overrides}
            self.parent_run_id = start_parent_run(self.settings[0], self.experiment_id, tags)
            os.environ[EXPERIMENT_ENV] = self.experiment_id
            os.environ[PARENT_ENV] = self.parent_run_id
            log.info("sweep parent run %s in experiment %s", self.parent_run_id,
                     self.experiment_id)
        return self.experiment_id, self.parent_run_id

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        self.finish()

    def finish(self) -> None:
        global _active
        if _active is self:
            _active = None
        if self.parent_run_id is None or self.settings is None:
            return
        parent, self.parent_run_id = self.parent_run_id, None
        os.environ.pop(PARENT_ENV, None)
        os.environ.pop(EXPERIMENT_ENV, None)
        unwaited = os.environ.pop(UNWAITED_ENV, None)
        if unwaited is not None:
            tag_unwaited_jobs(self.settings[0], parent, int(unwaited))
        summary = end_parent_run(*self.settings[:1], parent, *self.settings[1:],
                                 only_if_done=unwaited is not None)
        if summary is None:
            print(f"Sweep parent run {parent} stays RUNNING: the last of its {unwaited} jobs to "
                  "end will summarise and end it.", flush=True)
            return
        print(f"Sweep parent run {parent}: {summary['children']} job(s), {summary['failed']} "
              f"failed; best {self.settings[1]} = {summary.get('best_value')} "
              f"(run {summary.get('best_run_id')})", flush=True)
