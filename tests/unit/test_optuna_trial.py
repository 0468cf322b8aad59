"""The Optuna sweep's parts in process, on real journal files: the search space from Hydra's
sweep syntax, the refusals before anything exists, and a trial's reports from inside its job
(a requeued job does not report an epoch twice; the pruner's verdict reaches the loop).

The collectives run over a real 1-rank gloo process group; 2 ranks are tests/e2e/test_optuna.py's.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from types import SimpleNamespace

import optuna
import pytest

from tests.conftest import typed
from train.engine import trial as trial_lib
from train.errors import ConfigError
from train.launch import study as study_lib


def settings(tmp_path: Path, **changes: object) -> study_lib.StudySettings:
    base = {"study_name": "s", "storage": str(tmp_path / "optuna.journal"),
            "directions": ["maximize"], "objectives": ["val/accuracy"], "n_trials": 4,
            "n_jobs": 2, "sampler": optuna.samplers.RandomSampler(seed=0),
            "pruner": {"name": "median", "n_startup_trials": 1}}
    return study_lib.StudySettings(**{**base, **changes})  # type: ignore[arg-type]


def test_hydras_sweep_syntax_becomes_optuna_distributions() -> None:
    space = study_lib.distributions({"optim.lr": "tag(log, interval(0.001, 0.1))",
                                     "model.width": "choice(16, 32)",
                                     "data.batch_size": "range(16, 65, 16)",
                                     "model.name": "cnn,mlp"})
    assert space["optim.lr"] == optuna.distributions.FloatDistribution(0.001, 0.1, log=True)
    assert space["model.width"] == optuna.distributions.CategoricalDistribution([16, 32])
    assert space["data.batch_size"] == optuna.distributions.IntDistribution(16, 64, step=16)
    assert space["model.name"] == optuna.distributions.CategoricalDistribution(["cnn", "mlp"])
    with pytest.raises(ConfigError, match="is no search space"):
        study_lib.distributions({"optim.lr": "0.1"})


@pytest.mark.parametrize(("changes", "expected"), [
    ({"pruner": {"name": "medain"}}, "unknown pruner 'medain'"),
    ({"pruner": {"name": "median", "n_startup": 1}}, "hydra.sweeper.pruner:"),
    ({"directions": ["maximize", "minimize"], "objectives": ["val/accuracy", "val/loss"]},
     "cannot prune a multi-objective study"),
    ({"directions": ["up"]}, "must be minimize or maximize"),
])
def test_bad_settings_are_refused_before_the_study_exists(tmp_path: Path, changes: dict,
                                                          expected: str) -> None:
    with pytest.raises(ConfigError, match=expected):
        study_lib.check(settings(tmp_path, **changes))
    assert not (tmp_path / "optuna.journal").exists()


def test_a_storage_path_that_cannot_be_written_is_refused(tmp_path: Path) -> None:
    (tmp_path / "a_file").write_text("")  # no folder can be made under it, even by root
    with pytest.raises(ConfigError, match="cannot be written"):
        study_lib.check(settings(tmp_path, storage=str(tmp_path / "a_file" / "optuna.journal")))
    if os.geteuid() != 0:  # root writes anywhere
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        with pytest.raises(ConfigError, match="cannot be written"):
            study_lib.check(settings(tmp_path, storage=str(locked / "deep" / "optuna.journal")))
        assert list(locked.iterdir()) == []


def _reporter(s: study_lib.StudySettings, number: int) -> trial_lib.TrialReporter:
    cfg = typed(f"trainer.trial={number}", f"trainer.study='{s.study}'")
    return trial_lib.TrialReporter(cfg, rank=0)


def _val(accuracy: float) -> SimpleNamespace:
    return SimpleNamespace(values={"accuracy": accuracy})


def test_a_requeued_job_does_not_report_an_epoch_twice(tmp_path: Path,
                                                       one_rank_group: None) -> None:
    s = settings(tmp_path)
    study = study_lib.open_study(s)
    trial = study.ask({"optim.lr": optuna.distributions.FloatDistribution(0.01, 0.1)})
    first = _reporter(s, trial.number)
    assert not first.should_stop(1, None, _val(0.5))
    first.close()
    again = _reporter(s, trial.number)  # the job started again from its checkpoint
    assert not again.should_stop(1, None, _val(0.9))
    assert not again.should_stop(2, None, _val(0.95))
    again.close()
    [stored] = optuna.load_study(study_name="s", storage=trial_lib.storage_of(s.storage)).trials
    assert stored.intermediate_values == {1: 0.5, 2: 0.95}  # the first report of epoch 1 holds
    assert stored.user_attrs[trial_lib.HEARTBEAT_ATTR] > 0


def test_the_pruners_verdict_stops_the_trial_and_is_told_to_the_study(
        tmp_path: Path, one_rank_group: None) -> None:
    s = settings(tmp_path)
    study = study_lib.open_study(s)
    space = {"optim.lr": optuna.distributions.FloatDistribution(0.01, 0.1)}
    good = study.ask(space)
    for step in (1, 2, 3):
        good.report(0.9, step)
    study.tell(good, 0.9)
    bad = study.ask(space)
    reporter = _reporter(s, bad.number)
    assert reporter.should_stop(1, None, _val(0.1))  # below the median of the one before
    assert reporter.pruned_at == 1
    reporter.tell({"val/accuracy": 0.1})
    stored = study.trials[bad.number]
    assert stored.state == optuna.trial.TrialState.PRUNED
    assert stored.user_attrs["pruned_at"] == 1


def test_the_last_evaluation_is_reported_but_never_pruned(tmp_path: Path,
                                                          one_rank_group: None) -> None:
    s = settings(tmp_path)
    study = study_lib.open_study(s)
    space = {"optim.lr": optuna.distributions.FloatDistribution(0.01, 0.1)}
    good = study.ask(space)
    for step in (1, 2):
        good.report(0.9, step)
    study.tell(good, 0.9)
    bad = study.ask(space)
    reporter = _reporter(s, bad.number)
    # Below the median at epoch 2 as at epoch 1, but epoch 2 is the last: the trial ends.
    assert not reporter.should_stop(2, None, _val(0.1), last=True)
    assert reporter.pruned_at is None
    reporter.tell({"val/accuracy": 0.1})
    stored = study.trials[bad.number]
    assert stored.state == optuna.trial.TrialState.COMPLETE
    assert stored.intermediate_values == {2: 0.1}


def test_a_trial_whose_heartbeat_stopped_is_failed_and_asked_again(tmp_path: Path) -> None:
    from train.launch.trials import fail_stale

    s = settings(tmp_path, pruner=None)
    study = study_lib.open_study(s)
    space = {"optim.lr": optuna.distributions.FloatDistribution(0.01, 0.1)}
    dead, alive, mine = study.ask(space), study.ask(space), study.ask(space)
    dead.set_user_attr(trial_lib.HEARTBEAT_ATTR, time.time() - 3 * s.heartbeat_s - 5)
    alive.set_user_attr(trial_lib.HEARTBEAT_ATTR, time.time())
    mine.set_user_attr(trial_lib.HEARTBEAT_ATTR, 0.0)  # this driver's own: its process tells
    assert fail_stale(study, study.trials, {mine.number}, s.heartbeat_s) == [dead.number]
    states = [t.state.name for t in study.trials]
    assert states == ["FAIL", "RUNNING", "RUNNING", "WAITING"]
    retry = study.ask(space)  # the next trial asked is the dead one's parameters
    assert retry.params == dead.params
    assert study.trials[retry.number].user_attrs["retry_of"] == dead.number
