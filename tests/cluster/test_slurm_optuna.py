"""The Optuna sweeper on the local Slurm cluster: each trial its own Slurm job, 2 slots, and a
slow trial that does not hold the other slot."""

from __future__ import annotations

from pathlib import Path

import optuna
import pytest

from tests.cluster.conftest import slurm_job
from tests.e2e.test_sweeps import parent_and_children


@pytest.mark.timeout(1200)
def test_a_slow_trial_does_not_hold_the_other_slot(cluster: None, store: dict[str, str],
                                                   tmp_path: Path) -> None:
    # RandomSampler(seed=1) asks trainer.epochs 1, 30, 1: trial 2 must be asked as soon as the
    # first of trials 0 and 1 ends, while the other still runs (a batch of 2 would wait for
    # both; which ends first also depends on the queue of a shared cluster).
    result = slurm_job(tmp_path, "-m", "+hparams_search=optuna_digits",
                       "hydra.sweeper.n_trials=3", "model=mlp", "tracking.log_model=false",
                       "hydra.sweeper.sampler._target_=optuna.samplers.RandomSampler",
                       "hydra.sweeper.sampler.seed=1", "trainer.epochs=choice(1,30)",
                       env=store, timeout=1100)
    assert result.returncode == 0, result.stdout + result.stderr
    storage = optuna.storages.JournalStorage(optuna.storages.journal.JournalFileBackend(
        str(tmp_path / "sweep" / "optuna.journal")))
    trials = optuna.load_study(study_name="digits", storage=storage).trials
    assert [t.params["trainer.epochs"] for t in trials] == [1, 30, 1]
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
