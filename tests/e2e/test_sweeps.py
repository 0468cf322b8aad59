"""Hydra multirun sweeps through the real CLI: one parent MLflow run, one child run per job;
refused and failing jobs; an Optuna search optimising the returned objective."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.conftest import LAUNCHER_VARS, REPO, history, run_train, runs_in, wait_until


def parent_and_children(uri: str) -> tuple:
    runs = runs_in(uri)
    parents = [r for r in runs if r.data.tags.get("sweep") == "true"]
    assert len(parents) == 1, [r.data.tags for r in runs]
    parent = parents[0]
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id]
    assert len(children) == len(runs) - 1  # every other run of the experiment is a child
    return parent, children


def test_local_sweep_groups_jobs_under_a_parent_run(store: dict[str, str],
                                                    tmp_path: Path) -> None:
    sweep_dir = tmp_path / "sweep"
    result = run_train("-m", "optim.lr=0.1,0.02", "model=cnn,mlp", "trainer.epochs=1",
                       "tracking.log_model=false",
                       f"hydra.sweep.dir={sweep_dir}", env=store, timeout=600)
    assert result.returncode == 0, result.stderr
    uri = store["MLFLOW_TRACKING_URI"]
    parent, children = parent_and_children(uri)
    assert parent.info.status == "FINISHED"
    assert "optim.lr=0.1,0.02" in parent.data.tags["sweep.overrides"]
    assert len(children) == 4
    combos = {(c.data.params["optim.lr"], c.data.params["model.name"]) for c in children}
    assert combos == {(lr, m) for lr in ("0.1", "0.02") for m in ("cnn", "mlp")}
    for child in children:
        assert child.info.status == "FINISHED"
        assert history(uri, child.info.run_id, "val/samples") == [(1, 359.0)]
        # Named after what it trained, and its job's number: the children tell apart.
        assert child.info.run_name == "-".join(
            [child.data.params["model.name"], "digits", Path(child.data.tags["output_dir"]).name])
        # The ids the launcher appended are not part of what the user typed.
        assert "_id=" not in child.data.tags["command"]
        assert "tracking.log_model=" in child.data.tags["command"]
        # Job directory and run point at each other.
        job_dir = Path(child.data.tags["output_dir"])
        assert job_dir.parent == sweep_dir
        assert json.loads((job_dir / "mlflow_run.json").read_text())["run_id"] == \
            child.info.run_id
    best = max(children, key=lambda c: c.data.metrics["val/accuracy"])
    assert parent.data.tags["best_run_id"] == best.info.run_id
    assert parent.data.metrics["best/val/accuracy"] == best.data.metrics["val/accuracy"]
    assert parent.data.metrics["sweep/children"] == 4
    assert parent.data.metrics["sweep/failed_children"] == 0
    # The closing line rounds the best value as every other line does.
    best_value = parent.data.metrics["best/val/accuracy"]
    assert f"best val/accuracy = {best_value:.4g} (run {best.info.run_id})" in result.stdout
    # And where its jobs are, which a sweep that went well printed nowhere.
    assert f"Its jobs: python -m train sweep status {sweep_dir}\n" in result.stdout



def test_sweeps_started_together_from_one_directory_each_get_their_own(
        store: dict[str, str], tmp_path: Path) -> None:
    """Two `python -m train -m ...` started at once: Hydra's multirun/<date>/<time> would be
    one directory for both (one multirun.yaml, one sweep.json, jobs 0 and 1 twice). Each:
    its own directory, jobs and parent run."""
    env = {k: v for k, v in os.environ.items()
           if k not in LAUNCHER_VARS and not k.startswith("SLURM_")}
    sweeps = {"model=cnn": "0.1,0.2", "model=mlp": "0.3,0.4"}
    started = [subprocess.Popen([sys.executable, "-m", "train", "-m", model, f"optim.lr={lrs}",
                                 "trainer.epochs=1", "trainer.max_steps=2",
                                 "tracking.log_model=false"], cwd=tmp_path, env={**env, **store},
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
               for model, lrs in sweeps.items()]
    for sweep in started:
        assert sweep.wait(timeout=300) == 0, sweep.stderr.read() if sweep.stderr else ""
    dirs = sorted((tmp_path / "multirun").glob("*/*"))
    recorded = {yaml.safe_load((d / "multirun.yaml").read_text())["hydra"]["overrides"]["task"][0]
                for d in dirs}
    assert recorded == set(sweeps) and all(sorted(p.name for p in d.iterdir()) == [
        "0", "1", "multirun.yaml", "sweep.json"] for d in dirs)
    runs = runs_in(store["MLFLOW_TRACKING_URI"])
    parents = {r.info.run_id: r for r in runs if r.data.tags.get("sweep") == "true"}
    assert len(parents) == 2 and {p.info.status for p in parents.values()} == {"FINISHED"}
    children = [r for r in runs if r.info.run_id not in parents]
    assert sorted((c.data.params["model.name"], c.data.params["optim.lr"]) for c in children) == \
        [("cnn", "0.1"), ("cnn", "0.2"), ("mlp", "0.3"), ("mlp", "0.4")]
    for child in children:  # each under its own sweep's parent, in its own sweep's directory
        parent = parents[child.data.tags["mlflow.parentRunId"]]
        assert Path(child.data.tags["output_dir"]).parent.name == \
            Path(parent.data.tags["sweep.dir"]).name


def test_a_sweep_whose_jobs_are_all_refused_leaves_no_run(store: dict[str, str],
                                                         tmp_path: Path) -> None:
    result = run_train("-m", "optim.lr=-0.1,-0.2", f"hydra.sweep.dir={tmp_path}/sweep",
                       env=store, timeout=300)
    assert result.returncode == 2, result.stderr  # refused before any job: exit 2, as a run
    assert "optim.lr must be positive" in result.stderr
    assert runs_in(store["MLFLOW_TRACKING_URI"]) == []  # not even an empty parent run


def test_a_failing_job_does_not_stop_the_sweep(store: dict[str, str], tmp_path: Path) -> None:
    # Job 0 fails at start-up, before its run exists; job 1 at step 1; job 2 finishes.
    result = run_train("-m", "optim.lr=0.1,0.05,0.01", "trainer.epochs=1",
                       "tracking.log_model=false", f"hydra.sweep.dir={tmp_path}/sweep",
                       env={**store, "TRAIN_FAIL_DRILL": "0/0:0,1/0:1"}, timeout=600)
    assert result.returncode == 1  # the sweep reports its failure...
    # ...in one line per failed job, by number and overrides; no Hydra report, no traceback.
    said = result.stderr[result.stderr.index("\njob #0 "):].strip().splitlines()
    assert said[0].startswith("job #0 (optim.lr=0.1 ") and "failing on purpose" in said[0]
    assert said[1:3] == ["  kept: nothing: no checkpoint yet",
                         f"  start again: python -m train optim.lr=0.1 trainer.epochs=1 "
                         f"tracking.log_model=False hydra.run.dir={tmp_path}/sweep/0"], said
    [job1] = [line for line in said if line.startswith("job #1 ")]
    assert job1.startswith("job #1 (optim.lr=0.05 ") and "FailureDrill" in job1
    assert "Traceback" not in result.stderr and "Error executing job" not in result.stderr
    assert said[-1].endswith(f": python -m train sweep resume {tmp_path}/sweep"), said
    parent, children = parent_and_children(store["MLFLOW_TRACKING_URI"])
    statuses = sorted(c.info.status for c in children)
    assert statuses == ["FAILED", "FINISHED"]  # ...after running every job
    failed = next(c for c in children if c.info.status == "FAILED")
    assert "FailureDrill" in failed.data.tags["error"]
    # The job that never had a run is on the parent, and counts among the failed.
    [no_run] = [v for k, v in parent.data.tags.items() if k.startswith("sweep.no_run.")]
    assert f"{tmp_path}/sweep/0: " in no_run and "failing on purpose at step 0" in no_run
    assert parent.info.status == "FAILED"
    assert parent.data.metrics["sweep/failed_children"] == 2

    # The sweep continued in its directory: the failed jobs run again, the finished one not.
    sweep_dir = tmp_path / "sweep"
    status = run_train("sweep", "status", str(sweep_dir))
    assert status.returncode == 0, status.stderr
    wrong = run_train("sweep", "status", str(sweep_dir / "0"))  # a job's, not the sweep's
    assert wrong.returncode == 2 and wrong.stderr.strip() == (
        f"error: {sweep_dir / '0' / 'sweep.json'} does not exist: not the directory of a sweep "
        "of this project that started its jobs with tracking on (hydra.sweep.dir)")
    assert [line.split()[:2] for line in status.stdout.splitlines()[1:4]] == [
        ["0", "FAILED"], ["1", "FAILED"], ["2", "FINISHED"]], status.stdout
    finished = next(c for c in children if c.info.status == "FINISHED")
    resumed = run_train("sweep", "resume", str(sweep_dir), env=store,
                        timeout=600)
    assert resumed.returncode == 0, resumed.stderr
    assert "1 of the sweep's 3 jobs finished already in their directories, not started again: " \
           "#2" in resumed.stdout
    assert resumed.stderr.count("training on 1 rank(s)") == 2  # jobs 0 and 1 alone
    parent_again, children = parent_and_children(store["MLFLOW_TRACKING_URI"])
    assert parent_again.info.run_id == parent.info.run_id  # the same parent, one run per job
    assert parent_again.info.status == "FINISHED"
    assert parent_again.data.metrics["sweep/failed_children"] == 0
    assert parent_again.data.metrics["sweep/children"] == 3
    assert not [k for k in parent_again.data.tags if k.startswith("sweep.no_run.")]
    by_id = {c.info.run_id: c for c in children}
    assert by_id[failed.info.run_id].info.status == "FINISHED"  # job 1 went on in its run
    uri = store["MLFLOW_TRACKING_URI"]
    assert history(uri, finished.info.run_id, "val/samples") == [(1, 359.0)]  # not retrained


def test_optuna_sweep_optimises_the_returned_objective(store: dict[str, str],
                                                       tmp_path: Path) -> None:
    sweep_dir = tmp_path / "sweep"
    result = run_train("-m", "+hparams_search=optuna_digits", "hydra.sweeper.n_trials=3",
                       "trainer.epochs=1", "tracking.log_model=false",
                       f"hydra.sweep.dir={sweep_dir}", env=store,
                       timeout=600)
    assert result.returncode == 0, result.stderr
    parent, children = parent_and_children(store["MLFLOW_TRACKING_URI"])
    assert len(children) == 3
    # Optuna saw each job's return value: its best is the best child's final val/accuracy.
    optuna = yaml.safe_load((sweep_dir / "optimization_results.yaml").read_text())
    best = max(c.data.metrics["val/accuracy"] for c in children)
    assert optuna["best_value"] == pytest.approx(best)
    assert parent.data.metrics["best/val/accuracy"] == pytest.approx(best)
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=store["MLFLOW_TRACKING_URI"])
    lrs = {client.get_run(c.info.run_id).data.params["optim.lr"] for c in children}
    assert len(lrs) == 3  # three different trials


@pytest.mark.parametrize("how", ["ctrl-c", "kill"])
def test_a_stopped_sweep_starts_no_further_job(store: dict[str, str], tmp_path: Path,
                                               how: str) -> None:
    """Ctrl-C (INT to the terminal's process group) or `kill` (TERM to the launcher) while the
    first of three jobs trains: that job stops after its checkpoint, its run KILLED, as a single
    job would; the other two never start training, and the parent run is FAILED."""
    sweep_dir, log = tmp_path / "sweep", tmp_path / "stderr"
    env = {k: v for k, v in os.environ.items()
           if k not in LAUNCHER_VARS and not k.startswith("SLURM_")}
    with open(log, "w") as stderr:
        proc = subprocess.Popen(
            [sys.executable, "-m", "train", "-m", "optim.lr=0.1,0.05,0.02", "trainer.epochs=200",
             "tracking.log_model=false", f"hydra.sweep.dir={sweep_dir}"], cwd=REPO,
            env={**env, **store}, stdout=subprocess.DEVNULL, stderr=stderr,
            start_new_session=True)
    first = sweep_dir / "0"
    try:
        wait_until(lambda: list((first / "checkpoints").glob("step-*.pt")), 240,
                   "the first job's first checkpoint", job=proc)
        if how == "ctrl-c":
            os.killpg(proc.pid, signal.SIGINT)
        else:
            proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:  # this test's own sweep, should it have outlived it
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    name = "SIGINT" if how == "ctrl-c" else "SIGTERM"
    stderr_text = log.read_text()
    # As a shell reports a process ended by that signal; one line for the stopped job and one
    # for those not started, no Hydra report, no traceback.
    assert proc.returncode == 128 + getattr(signal, name), stderr_text
    said = stderr_text.strip().splitlines()
    assert said[-3] == (f"job #0 (optim.lr=0.1 trainer.epochs=200 tracking.log_model=False): "
                        f"stopped by {name} after saving a checkpoint in {first}/checkpoints; "
                        f"the same command with hydra.run.dir={first} resumes it"), stderr_text
    assert said[-2] == f"jobs #1, #2 not started: the sweep was stopped by {name}"
    assert said[-1].endswith(f"(the finished ones stay): python -m train sweep resume {sweep_dir}")
    status = run_train("sweep", "status", str(sweep_dir)).stdout.splitlines()
    assert [(line[:5].strip(), line[7:19].strip()) for line in status[1:4]] == [
        ("0", "not finished"), ("1", "not started"), ("2", "not started")], status
    assert status[4] == "not finished: 1  not started: 2", status
    assert "Traceback" not in stderr_text and "Error executing job" not in stderr_text
    assert stderr_text.count("training on 1 rank(s)") == 1  # the other jobs never trained
    for later in ("1", "2"):  # Hydra made their directories; nothing ran in them
        assert not (sweep_dir / later / "checkpoints").exists()
        assert not (sweep_dir / later / "mlflow_run.json").exists()
    parent, [child] = parent_and_children(store["MLFLOW_TRACKING_URI"])
    assert child.info.status == "KILLED" and child.data.tags["stopped_by"] == name
    assert child.data.tags["output_dir"] == str(first)
    assert list((first / "checkpoints").glob("step-*.pt"))
    assert parent.info.status == "FAILED"
