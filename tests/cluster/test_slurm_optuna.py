"""The Optuna sweeper on the local Slurm cluster: each trial its own Slurm job, 2 slots, a slow
trial that does not hold the other slot, and a trial whose job Slurm requeues."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import optuna
import pytest

from tests.cluster.conftest import queued_jobs, slurm_job, wait_for_job
from tests.conftest import LAUNCHER_VARS, REPO, history, wait_until
from tests.e2e.test_sweeps import parent_and_children


@pytest.mark.timeout(1200)
def test_a_slow_trial_does_not_hold_the_other_slot(cluster: None, store: dict[str, str],
                                                   tmp_path: Path) -> None:
    # RandomSampler(seed=1) asks trainer.epochs 1, 100, 1: trial 2 must be asked as soon as the
    # first of trials 0 and 1 ends, while the other still runs (a batch of 2 would wait for
    # both; which ends first also depends on the queue of a shared cluster).
    result = slurm_job(tmp_path, "-m", "+hparams_search=optuna_digits",
                       "hydra.sweeper.n_trials=3", "model=mlp", "tracking.log_model=false",
                       "hydra.sweeper.sampler._target_=optuna.samplers.RandomSampler",
                       "hydra.sweeper.sampler.seed=1", "trainer.epochs=choice(1,100)",
                       env=store, timeout=1100)
    assert result.returncode == 0, result.stdout + result.stderr
    trials = _study(tmp_path / "sweep").trials
    assert [t.params["trainer.epochs"] for t in trials] == [1, 100, 1]
    assert [t.state.name for t in trials] == ["COMPLETE"] * 3
    parent, children = parent_and_children(store["MLFLOW_TRACKING_URI"])
    runs = {int(c.data.params["trainer.trial"]): c for c in children}
    assert len({c.data.tags["slurm.job_id"] for c in children}) == 3  # a Slurm job each
    # The study's own times: a trial's start is when the driver asked it, just before its
    # job was submitted.
    first_end, last_end = sorted([trials[0].datetime_complete, trials[1].datetime_complete])
    assert first_end <= trials[2].datetime_start < last_end
    assert runs[2].info.status == "FINISHED"
    assert parent.info.status == "FINISHED"


@pytest.mark.timeout(900)
def test_a_requeued_trial_is_one_trial_that_reports_each_epoch_once(
        cluster: None, store: dict[str, str], tmp_path: Path) -> None:
    # One trial of 8 epochs (cnn: a few seconds each), requeued by Slurm once it has reported
    # epoch 2: the job runs again under the same id, resumes from its stop checkpoint, and the
    # trial must stay one trial whose every epoch was reported once.
    sweep_dir = tmp_path / "sweep"
    env = {k: v for k, v in os.environ.items()
           if k not in LAUNCHER_VARS and not k.startswith("SLURM_")}
    driver = subprocess.Popen(
        [sys.executable, "-m", "train", "-m", "+cluster=slurm", "cluster.partition=debug",
         "cluster.time_min=10", f"hydra.sweep.dir={sweep_dir}", "+hparams_search=optuna_digits",
         "hydra.sweeper.n_trials=1", "trainer.epochs=8", "tracking.log_model=false"],
        cwd=REPO, env={**env, **store}, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True)
    journal = sweep_dir / "optuna.journal"
    try:
        wait_until(lambda: len(reported_steps(journal)) >= 2, 300, "epoch 2 reported",
                   every=0.5, job=driver)
        [job_id] = queued_jobs().split()
        subprocess.run(["scontrol", "requeue", job_id], check=True)
        stdout, stderr = driver.communicate(timeout=600)
    finally:
        if driver.poll() is None:  # failing: leave no job behind (the tests hold the cluster)
            driver.kill()
            subprocess.run(["scancel", *queued_jobs().split()], check=False)
    assert driver.returncode == 0, stdout + stderr
    [trial] = _study(sweep_dir).trials
    assert trial.state.name == "COMPLETE"
    # The journal holds every write the study ever got: one report per epoch, none twice.
    steps = reported_steps(journal)
    assert sorted(steps) == list(range(1, 9)), steps
    parent, [child] = parent_and_children(store["MLFLOW_TRACKING_URI"])
    assert child.data.tags["slurm.job_id"] == job_id
    assert child.data.tags["restarts"] == "1" and child.data.tags["stopped_by"] == "SIGTERM"
    uri = store["MLFLOW_TRACKING_URI"]
    accuracy = history(uri, child.info.run_id, "val/accuracy")
    assert [s for s, _ in accuracy] == list(range(1, 9))  # every epoch once in the run too
    assert trial.intermediate_values == pytest.approx(dict(accuracy))  # and what it reported
    assert trial.value == pytest.approx(accuracy[-1][1])
    assert parent.info.status == "FINISHED" and parent.data.metrics["sweep/children"] == 1


def reported_steps(journal: Path) -> list[int]:
    """The step of every intermediate value written to a journal file, in order."""
    from optuna.storages.journal._storage import JournalOperation

    if not journal.exists():
        return []
    ops = []
    for line in journal.read_text().splitlines():
        try:
            ops.append(json.loads(line))
        except ValueError:  # the line being written as we read
            break
    return [op["step"] for op in ops
            if op["op_code"] == JournalOperation.SET_TRIAL_INTERMEDIATE_VALUE]


def _study(sweep_dir: Path) -> optuna.Study:
    storage = optuna.storages.JournalStorage(optuna.storages.journal.JournalFileBackend(
        str(sweep_dir / "optuna.journal")))
    return optuna.load_study(study_name="digits", storage=storage)


@pytest.mark.timeout(900)
def test_the_driver_runs_as_a_slurm_job_of_its_own(cluster: None, store: dict[str, str],
                                                   tmp_path: Path) -> None:
    # docs/sweeps.md's line: the driver as a small job (one CPU, no GPU), its trials Slurm jobs
    # of their own; nothing of the sweep is left on the login node.
    sweep_dir = tmp_path / "sweep"
    command = (f"{sys.executable} -m train -m +hparams_search=optuna_digits +cluster=slurm "
               f"cluster.partition=debug cluster.time_min=10 hydra.sweep.dir={sweep_dir} "
               "hydra.sweeper.n_trials=2 trainer.epochs=1 model=mlp tracking.log_model=false")
    env = {k: v for k, v in os.environ.items()
           if k not in LAUNCHER_VARS and not k.startswith("SLURM_")}
    submitted = subprocess.run(
        ["sbatch", "--parsable", "--partition=debug", "--cpus-per-task=1", "--time=20",
         f"--output={tmp_path}/driver.out", "--wrap", command],
        cwd=REPO, env={**env, **store}, capture_output=True, text=True, check=True)
    driver_job = submitted.stdout.strip().split(";")[0]
    try:
        state = wait_for_job(driver_job, 600)
    finally:
        subprocess.run(["scancel", *queued_jobs().split()], check=False)
    out = (tmp_path / "driver.out").read_text()
    assert state == "COMPLETED", out
    assert "(2 complete, 0 pruned, 0 failed)" in out
    assert [t.state.name for t in _study(sweep_dir).trials] == ["COMPLETE"] * 2
    parent, children = parent_and_children(store["MLFLOW_TRACKING_URI"])
    trial_jobs = {c.data.tags["slurm.job_id"] for c in children}
    assert len(trial_jobs) == 2 and driver_job not in trial_jobs  # each trial its own job
    assert parent.info.status == "FINISHED" and parent.data.metrics["sweep/children"] == 2
