"""The project's Optuna sweeper through the real CLI: pruned trials, slots that never wait for a
batch, a driver killed and resumed, DDP trials, and the refusals before anything starts.

Each trial is a real `python -m train` process; the study is a real journal file, read back
with Optuna; the runs are read back from a real MLflow store.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import optuna
import pytest
import yaml

from tests.conftest import LAUNCHER_VARS, REPO, run_train, runs_in, wait_until
from tests.e2e.test_sweeps import parent_and_children

FAST = ("+hparams_search=optuna_digits", "model=mlp", "tracking.log_model=false")
"""The search of conf/hparams_search/optuna_digits.yaml (lr, width) on a small MLP."""
PRUNED = (*FAST,
          "hydra.sweeper.sampler._target_=optuna.samplers.RandomSampler",
          "+hydra.sweeper.pruner.name=median", "+hydra.sweeper.pruner.n_startup_trials=2",
          "optim.lr=tag(log, interval(0.0001, 0.2))")


def study_of(sweep_dir: Path) -> optuna.Study:
    storage = optuna.storages.JournalStorage(
        optuna.storages.journal.JournalFileBackend(str(sweep_dir / "optuna.journal")))
    return optuna.load_study(study_name="digits", storage=storage)


@pytest.mark.timeout(1500)  # 5 trials of 2 epochs, 2 at a time
def test_a_pruned_sweep_keeps_both_slots_busy(store: dict[str, str], tmp_path: Path) -> None:
    sweep_dir = tmp_path / "sweep"
    result = run_train("-m", *PRUNED, "hydra.sweeper.n_trials=5", "trainer.epochs=2",
                       f"hydra.sweep.dir={sweep_dir}", env=store, timeout=1500)
    assert result.returncode == 0, result.stdout + result.stderr
    trials = study_of(sweep_dir).trials
    states = [t.state.name for t in trials]
    assert len(trials) == 5 and set(states) <= {"COMPLETE", "PRUNED"}, states
    assert "PRUNED" in states
    parent, children = parent_and_children(store["MLFLOW_TRACKING_URI"])
    assert len(children) == 5
    by_trial = {int(c.data.params["trainer.trial"]): c for c in children}
    assert sorted(by_trial) == [0, 1, 2, 3, 4]
    for t in trials:
        run = by_trial[t.number]
        assert run.info.status == "FINISHED"  # pruned or not
        if t.state.name == "PRUNED":
            assert run.data.tags["pruned_at"] == "1" == str(t.user_attrs["pruned_at"])
            assert "pruned" in run.data.tags["stop_reason"]
            assert sorted(t.intermediate_values) == [1]
        else:  # every evaluation reported, the last one too
            assert "pruned_at" not in run.data.tags
            assert sorted(t.intermediate_values) == [1, 2]
            assert t.intermediate_values[2] == pytest.approx(t.value)
    # The best is a completed trial, the same for Optuna, the parent run and the results file.
    best = study_of(sweep_dir).best_trial
    assert parent.data.tags["best_run_id"] == by_trial[best.number].info.run_id
    assert parent.data.metrics["best/val/accuracy"] == pytest.approx(best.value)
    assert parent.data.metrics["sweep/pruned_children"] == states.count("PRUNED")
    assert parent.data.metrics["sweep/failed_children"] == 0
    results = yaml.safe_load((sweep_dir / "optimization_results.yaml").read_text())
    assert results["best_value"] == pytest.approx(best.value)
    # No batches: some trial was asked (and started) after one trial had ended, while another
    # asked before it still ran. The study's times: a trial starts when the driver asks it.
    spans = [(t.datetime_start, t.datetime_complete) for t in trials]
    assert any(a_end <= c_start < b_end
               for c_start, _ in spans for _, a_end in spans for b_start, b_end in spans
               if b_start < c_start), spans
    status = run_train("status", str(sweep_dir), module=("-m", "train.sweep"), env=store)
    assert status.returncode == 0, status.stderr
    assert f"best so far: trial {best.number}" in status.stdout
    assert status.stdout.count("pruned_at=1") == states.count("PRUNED")


@pytest.mark.timeout(1500)
def test_a_killed_driver_resumes_without_repeating_a_trial(store: dict[str, str],
                                                           tmp_path: Path) -> None:
    sweep_dir = tmp_path / "sweep"
    env = {k: v for k, v in os.environ.items()
           if k not in LAUNCHER_VARS and not k.startswith("SLURM_")}
    env.update(store)
    driver = subprocess.Popen(
        # A heartbeat every 10 s, not 30: a trial the driver asked but never started is
        # failed by the resume after 3 missed beats (30 s, not 90 s of the test's time).
        [sys.executable, "-m", "train", "-m", *FAST, "hydra.sweeper.n_trials=3",
         "trainer.epochs=1", "hydra.sweeper.heartbeat_s=10",
         f"hydra.sweep.dir={sweep_dir}"], cwd=REPO, env=env,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_until(lambda: (sweep_dir / "optuna.journal").exists() and any(
            t.state.name == "COMPLETE" for t in study_of(sweep_dir).trials), 900,
            "a first completed trial", every=1.0, job=driver)
    finally:
        driver.send_signal(signal.SIGKILL)  # the driver alone: its running trials go on
        driver.wait(timeout=30)
    resumed = run_train("resume", str(sweep_dir), module=("-m", "train.sweep"), env=store,
                        timeout=1200)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    trials = study_of(sweep_dir).trials
    done = [t for t in trials if t.state.name == "COMPLETE"]
    # Killed between asking a trial and starting its job (the first trials may end together,
    # and the next is asked at once), the driver leaves a RUNNING trial with no job: the
    # resume fails it once its heartbeat is overdue and asks its parameters again, as one
    # retry (trials.fail_stale). Either way, three trials trained, each once.
    never_started = [t for t in trials if t.state.name != "COMPLETE"]
    assert len(done) == 3 and all(t.state.name == "FAIL" for t in never_started), \
        [t.state.name for t in trials]
    assert {t.user_attrs.get("retry_of") for t in done} - {None} == \
        {t.number for t in never_started}
    assert len({t.params["optim.lr"] for t in done}) == 3  # nothing proposed twice either
    parent, children = parent_and_children(store["MLFLOW_TRACKING_URI"])
    assert sorted(int(c.data.params["trainer.trial"]) for c in children) == \
        [t.number for t in done]
    assert parent.info.status == "FINISHED"
    assert parent.data.metrics["sweep/children"] == 3


@pytest.mark.timeout(900)
def test_every_rank_of_a_ddp_trial_trains_the_same_parameters(store: dict[str, str],
                                                              tmp_path: Path) -> None:
    sweep_dir = tmp_path / "sweep"
    result = run_train("-m", *FAST, "hydra.sweeper.n_trials=1", "distributed.nproc_per_node=2",
                       "trainer.epochs=1", f"hydra.sweep.dir={sweep_dir}", env=store,
                       timeout=900)
    assert result.returncode == 0, result.stdout + result.stderr
    [trial] = study_of(sweep_dir).trials
    log = (sweep_dir / "0" / "train.log").read_text()
    assert f"trial 0: the same parameters on all 2 rank(s): {trial.params}" in log
    _, [child] = parent_and_children(store["MLFLOW_TRACKING_URI"])
    assert float(child.data.params["optim.lr"]) == pytest.approx(trial.params["optim.lr"])
    assert int(child.data.params["model.width"]) == trial.params["model.width"]


@pytest.mark.parametrize(("overrides", "expected"), [
    (("hydra.sweeper.pruner=medain",), "unknown pruner 'medain'"),
    (("hydra.sweeper.pruner=median", "hydra.sweeper.direction=[maximize,minimize]",
      "hydra.sweeper.objectives=[val/accuracy,val/loss]"),
     "cannot prune a multi-objective study"),
    (("hydra.sweeper.storage=/proc/version/optuna.journal",), "cannot be written"),
])
def test_bad_sweeps_are_refused_before_anything_starts(store: dict[str, str], tmp_path: Path,
                                                       overrides: tuple[str, ...],
                                                       expected: str) -> None:
    sweep_dir = tmp_path / "sweep"
    result = run_train("-m", "+hparams_search=optuna_digits", *overrides,
                       f"hydra.sweep.dir={sweep_dir}", env=store, timeout=300)
    assert result.returncode == 2, result.stdout + result.stderr
    [line] = [x for x in result.stderr.splitlines() if x.startswith("error:")]
    assert expected in line, result.stderr
    assert "Traceback" not in result.stderr
    assert runs_in(store["MLFLOW_TRACKING_URI"]) == []
    assert not sweep_dir.exists()  # no study, no sweep.json, no job directory
