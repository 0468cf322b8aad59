"""Hydra sweeps as one MLflow parent run with a child run per job.

`ParentRunCallback` is a Hydra callback: it runs in the process that launches the sweep (the
login node for Slurm arrays, this process for local sweeps). The launchers
(hydra_plugins/train_launcher) find it among Hydra's callbacks and ask it for the parent run
once the sweep's jobs have passed their pre-flight (`parent_for_jobs`): the run is created at
that first call, so a sweep refused before anything ran leaves no empty run behind. The
launchers hand its id to every job as the override `tracking.parent_run_id=...`. After the last
job the callback summarises the children on the parent and ends it; a sweep whose Slurm jobs
were left unwaited (`cluster.wait=false`) is ended by its last job instead
(`end_parent_if_last`, called on rank 0 after the job's own run ended).
With tracking.register_best_of_sweep the end also registers the best finished job's model
(`register_best`); its jobs registered nothing themselves (train/report/runlog.py).

Every MLflow request goes through train/tracking/parent_run.py (one request each).
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import sys
from pathlib import Path
from typing import Any

from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from train.config import schema
from train.config.groups import TrackingConfig

log = logging.getLogger("train.tracking.sweep")

JOBS_TAG = "sweep.jobs"
"""On the parent of a sweep left unwaited: how many jobs it has (the last to end ends it)."""
NO_RUN_TAG = "sweep.no_run."
"""On a sweep's parent, one per job that failed before its own run existed (the key ends in a
digest of the job's output directory, the value says which and why): it has ended, failed."""


SWEEP_FILE = "sweep.json"
"""In the sweep directory: the command that started the sweep (`python -m train sweep resume`
runs it again there) and its parent run, which a resumed sweep continues."""

PRUNED_TAG = "pruned_at"
"""On a job the sweep's pruner stopped (train/engine/trial.py): the epoch it stopped after."""


def is_sweep(config: DictConfig) -> bool:
    """More than one job: a sweep override (a=1,2) or a sweeper that proposes trials itself.
    One trial of the Optuna sweeper (trainer.trial set) is one job of its driver's sweep."""
    if config.get("trainer", {}).get("trial") is not None:
        return False
    if "BasicSweeper" not in str(config.hydra.sweeper.get("_target_", "BasicSweeper")):
        return True
    overrides = OverridesParser.create().parse_overrides(list(config.hydra.overrides.task))
    return any(o.is_sweep_override() for o in overrides)


def start_parent_run(cfg: TrackingConfig, experiment_id: str, tags: dict[str, str]) -> str:
    from train.tracking import parent_run, resolve_uri

    return parent_run.create_run(resolve_uri(cfg), experiment_id, cfg.run_name, tags)


def end_parent_run(cfg: TrackingConfig, parent_run_id: str, objective: str,
                   direction: str, only_if_done: bool = False) -> dict[str, Any] | None:
    """Summarise the children on the parent (best objective, failures) and end it.

    `only_if_done`: for a sweep submitted without waiting (`cluster.wait=false`), end the parent
    only if all of its `sweep.jobs` jobs have ended; None otherwise.
    """
    from train.tracking import parent_run, resolve_uri

    uri = resolve_uri(cfg)
    parent = parent_run.get_run(uri, parent_run_id)
    expected = parent.tags.get(JOBS_TAG)
    if only_if_done and expected is None:  # a waited sweep: its submitter ends the parent
        return None
    children = parent_run.child_runs(uri, parent.experiment_id, parent_run_id)
    without_run = [k for k in parent.tags if k.startswith(NO_RUN_TAG)]
    if only_if_done and (len(children) + len(without_run) < int(expected or 0) or any(
            c.status in ("RUNNING", "SCHEDULED") for c in children)):
        return None
    failed = len([c for c in children if c.status != "FINISHED"]) + len(without_run)
    # A pruned job (tag pruned_at, FINISHED) stopped before its end: never the sweep's best,
    # as Optuna's best trial is a completed one.
    pruned = [c for c in children if PRUNED_TAG in c.tags]
    scored = [c for c in children if objective in c.metrics and PRUNED_TAG not in c.tags]
    summary: dict[str, Any] = {"children": len(children), "failed": failed,
                               "pruned": len(pruned)}
    metrics = {"sweep/children": float(len(children)), "sweep/failed_children": float(failed),
               "sweep/pruned_children": float(len(pruned))}
    tags: dict[str, str] = {}
    if scored:
        pick = max if direction == "maximize" else min
        best = pick(scored, key=lambda c: c.metrics[objective])
        summary.update(best_run_id=best.run_id, best_value=best.metrics[objective])
        metrics[f"best/{objective}"] = best.metrics[objective]
        tags["best_run_id"] = best.run_id
    if cfg.register_model and cfg.register_best_of_sweep:
        tags.update(register_best(uri, cfg.register_model, children, objective, direction))
        summary["registered"] = tags.get("registered_model")
    parent_run.log_values(uri, parent_run_id, metrics=metrics, tags=tags)
    parent_run.end_run(uri, parent_run_id, "FAILED" if failed or not children else "FINISHED")
    return summary


def register_best(uri: str, name: str, children: list[Any], objective: str,
                  direction: str) -> dict[str, str]:
    """tracking.register_best_of_sweep: the finished job with the best objective becomes a new
    version of `name` (its jobs did not register themselves). Returns the parent's tags: the
    version (registered_model), or why none (registered_model_error). Never raises."""
    from train.tracking import parent_run

    scored = [c for c in children if c.status == "FINISHED" and objective in c.metrics]
    if not scored:
        log.error("Model registry: no finished job of the sweep has %s: nothing registered as %r",
                  objective, name)
        return {"registered_model_error": f"no finished job has {objective}"}
    pick = max if direction == "maximize" else min
    best = pick(scored, key=lambda c: c.metrics[objective])
    outcome = parent_run.register_model(uri, best.run_id, name)
    try:  # the job's own run says so too, as a job that registered itself would
        parent_run.log_values(uri, best.run_id, tags=outcome)
    except Exception as e:  # noqa: BLE001 - the parent holds the outcome anyway
        log.warning("could not tag run %s with its registration: %s", best.run_id, e)
    return {**outcome, "registered_run_id": best.run_id}


def end_parent_if_last(cfg: TrackingConfig, objective: str, direction: str,
                       without_run: tuple[str, str] | None = None) -> None:
    """Rank 0 of a sweep's job, after its own run ended (finished, failed, or stopped for
    good): if the sweep was left unwaited (`cluster.wait=false`) and this is its last job to
    end, summarise and end the parent. Otherwise (no sweep, a waited sweep, jobs still
    running) nothing. `without_run`: (output directory, error) of a job that failed before its
    run existed, kept on the parent (NO_RUN_TAG) so that it counts as ended. Never raises: the
    job's own run is complete whatever happens here."""
    if not cfg.enabled or not cfg.parent_run_id:
        return
    try:
        if without_run is not None:
            _count_without_run(cfg, cfg.parent_run_id, *without_run)
        summary = end_parent_run(cfg, cfg.parent_run_id, objective, direction, only_if_done=True)
    except Exception as e:  # noqa: BLE001 - say so, do not fail a job that did its work
        log.warning("could not summarise the sweep's parent run %s: %s", cfg.parent_run_id, e)
        return
    if summary is not None:
        log.info("last job of the sweep: ended parent run %s (%d jobs, %d failed)",
                 cfg.parent_run_id, summary["children"], summary["failed"])


def _count_without_run(cfg: TrackingConfig, parent_run_id: str, job_dir: str,
                       error: str) -> None:
    import hashlib

    from train.tracking import parent_run, resolve_uri

    key = NO_RUN_TAG + hashlib.sha256(job_dir.encode()).hexdigest()[:16]
    parent_run.log_values(resolve_uri(cfg), parent_run_id,
                          tags={key: f"{job_dir}: {error}"[:5000]})


def tag_unwaited_jobs(cfg: TrackingConfig, parent_run_id: str, jobs: int) -> None:
    """The submitter will not see the jobs end: the parent learns how many there are, so that
    the last job to end can end it."""
    from train.tracking import parent_run, resolve_uri

    parent_run.log_values(resolve_uri(cfg), parent_run_id, tags={JOBS_TAG: str(jobs)})


def read_sweep_file(sweep_dir: Path) -> dict[str, Any]:
    """<sweep dir>/sweep.json, or {} where there is none (or it is unreadable)."""
    try:
        record = json.loads((sweep_dir / SWEEP_FILE).read_text())
    except (OSError, ValueError):
        return {}
    return record if isinstance(record, dict) else {}


def find_callback(hydra_context: Any) -> ParentRunCallback | None:
    """The sweep callback among Hydra's callbacks (what a launcher asks for the parent)."""
    callbacks = getattr(getattr(hydra_context, "callbacks", None), "callbacks", [])
    return next((c for c in callbacks if isinstance(c, ParentRunCallback)), None)


class ParentRunCallback(Callback):
    def __init__(self) -> None:
        self.parent_run_id: str | None = None
        self.settings: tuple[TrackingConfig, str, str] | None = None
        """(tracking, objective, direction) of a sweep with tracking; None otherwise."""
        self.overrides = ""
        self.sweep_dir = ""
        self.unwaited_jobs = 0
        self.continued = False
        """Whether this is a sweep run again in its directory, under its recorded parent."""

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        app = {k: v for k, v in config.items() if k != "hydra"}
        typed = schema.to_typed(OmegaConf.to_container(OmegaConf.create(app), resolve=True))
        if not typed.tracking.enabled or not is_sweep(config):
            return
        self.settings = (typed.tracking, typed.trainer.objective,
                         typed.trainer.objective_direction)
        self.overrides = " ".join(config.hydra.overrides.task)
        self.sweep_dir = str(config.hydra.sweep.dir)
        # Also when a job failure ends the sweep with an exception (no on_multirun_end then).
        atexit.register(self.finish)

    def parent_for_jobs(self, experiment_id: str) -> str | None:
        """The parent run of jobs about to start, created at the first call; None when this
        multirun is no sweep (one job) or has tracking disabled."""
        if self.settings is None:
            return None
        if self.parent_run_id is None:
            self.parent_run_id = self._continued(experiment_id)
            self.continued = self.parent_run_id is not None
            if self.parent_run_id is None:
                tags = {"sweep": "true", "sweep.dir": self.sweep_dir,
                        "sweep.overrides": self.overrides}
                self.parent_run_id = start_parent_run(self.settings[0], experiment_id, tags)
                log.info("sweep parent run %s in experiment %s", self.parent_run_id,
                         experiment_id)
            self._record()
        return self.parent_run_id

    def _continued(self, experiment_id: str) -> str | None:
        """The parent of the same sweep run again in its directory (`python -m train sweep
        resume`): its finished jobs stay its children, its failed ones continue their runs
        under it. Another sweep's overrides in the same directory get a parent of their own."""
        from train.tracking import parent_run, resolve_uri

        assert self.settings is not None
        earlier = read_sweep_file(Path(self.sweep_dir))
        run_id = earlier.get("parent_run_id")
        if not run_id or earlier.get("sweep") != self._identity() or not \
                parent_run.reopen_run(resolve_uri(self.settings[0]), run_id, experiment_id,
                                      NO_RUN_TAG):
            return None
        log.info("sweep parent run %s continued: the sweep's finished jobs stay finished, "
                 "the others resume", run_id)
        return str(run_id)

    def _identity(self) -> str:
        """What makes the same sweep: its overrides, but for whether it is followed (`resume`
        follows an unwaited one)."""
        return " ".join(o for o in self.overrides.split(" ") if not o.startswith("cluster.wait="))

    def _record(self) -> None:
        """The command and the parent into sweep.json, once the jobs passed their pre-flight
        (a refused sweep leaves no directory). A resumed sweep keeps the command that started
        it; other overrides in the same directory are another sweep, recorded instead."""
        path = Path(self.sweep_dir) / SWEEP_FILE
        record = read_sweep_file(path.parent)
        if record.get("sweep") != self._identity() or "argv" not in record:
            record.update(argv=[sys.executable, "-m", "train", *sys.argv[1:]], cwd=os.getcwd())
        record.update(parent_run_id=self.parent_run_id, sweep=self._identity())
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(record, indent=2))

    def left_unwaited(self, jobs: int) -> None:
        """The Slurm launcher submitted `jobs` jobs and will not see them end."""
        self.unwaited_jobs += jobs

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        self.finish()

    def finish(self) -> None:
        if self.parent_run_id is None or self.settings is None:
            return
        parent, self.parent_run_id = self.parent_run_id, None
        tracking, objective, direction = self.settings
        if self.unwaited_jobs:
            tag_unwaited_jobs(tracking, parent, self.unwaited_jobs)
        summary = end_parent_run(tracking, parent, objective, direction,
                                 only_if_done=self.unwaited_jobs > 0)
        if summary is None:
            print(f"Sweep parent run {parent} stays RUNNING: the last of its "
                  f"{self.unwaited_jobs} jobs to end will summarise and end it.", flush=True)
            return
        best = summary.get("best_value")
        best = (f"best {objective} = {best:.4g} (run {summary.get('best_run_id')})"
                if isinstance(best, float | int) else f"no job logged {objective}")
        print(f"Sweep parent run {parent}: {summary['children']} job(s), {summary['failed']} "
              f"failed, {summary.get('pruned', 0)} pruned; {best}", flush=True)
        if summary.get("registered"):
            print(f"Sweep's best job registered as {summary['registered']}: "
                  f"mlflow.pytorch.load_model('models:/{summary['registered']}')", flush=True)
        print(f"Its jobs: python -m train sweep status {self.sweep_dir}", flush=True)
