"""Any optimiser and LR scheduler by `_target_` through the real CLI: the pre-flight's refusals
(exit 2, one line, no run) and a killed job with a StepLR schedule resumed into the same run, the
schedule continued. Built, stepped and checked in process: tests/unit/test_optim_target.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import (
    USER_PATH,
    assert_refused,
    history,
    kill_job_after_checkpoints,
    run_train,
    runs_in,
)


@pytest.mark.parametrize(("overrides", "expected"), [
    (("optim._target_=torch.optim.Adadeltaa",),
     "optim._target_='torch.optim.Adadeltaa': 'torch.optim' "),
    (("optim._target_=userpkg.optim.NoSuchOptimiser",),
     "optim._target_='userpkg.optim.NoSuchOptimiser': 'userpkg.optim' "),
    (("optim._target_=torch.nn.Linear",),
     "optim._target_='torch.nn.Linear' is the class torch.nn.modules.linear.Linear (bases: "
     "Module), not a torch.optim.Optimizer"),
    (("optim._target_=torch.optim.Adadelta",
      "optim.scheduler._target_=torch.optim.lr_scheduler.OneCycleLR"),
     "optim.scheduler._target_='torch.optim.lr_scheduler.OneCycleLR': calling "
     "torch.optim.lr_scheduler.OneCycleLR(<the optimiser>, "),
    (("optim.scheduler._target_=torch.optim.lr_scheduler.StepLR",
      "+optim.scheduler.step_sise=2"), "got an unexpected keyword argument 'step_sise'"),
])
def test_cli_refuses_an_optimiser_or_scheduler_before_any_rank_starts(
        store: dict[str, str], overrides: tuple[str, ...], expected: str) -> None:
    env = {**store, "PYTHONPATH": USER_PATH}
    assert_refused(run_train(*overrides, "trainer.epochs=1", env=env, timeout=120), expected,
                   store)


REGRESSION = ("task=regression", "data=custom", "data.train._target_=userpkg.tasks.Diabetes",
              "model=custom", "model._target_=userpkg.tasks.Regressor", "data.num_workers=0")
"""scikit-learn's diabetes data and a small MLP of the user's (tests/userpkg/tasks.py)."""


@pytest.mark.parametrize("task", [(), REGRESSION], ids=["classification", "regression"])
def test_a_killed_job_with_steplr_resumes_into_the_same_run_continuing_the_schedule(
        store: dict[str, str], tmp_path: Path, task: tuple[str, ...]) -> None:
    """Two ranks, Adadelta with StepLR (halved every 2 epochs, stepped per epoch), SIGKILLed
    once two epoch-end checkpoints exist: the same command continues the same MLflow run, and
    `lr` is StepLR's for each of the 6 epochs, none logged twice; the same for a regression
    job, whose val/mse then has one value per epoch too."""
    out_dir = tmp_path / "job"
    job = ("distributed.nproc_per_node=2", "trainer.epochs=6",
           "optim._target_=torch.optim.Adadelta", "optim.lr=1.0",
           "optim.scheduler._target_=torch.optim.lr_scheduler.StepLR",
           "+optim.scheduler.step_size=2", "+optim.scheduler.gamma=0.5", *task)
    store = {**store, "PYTHONPATH": USER_PATH}
    kill_job_after_checkpoints(out_dir, store, 2, *job)
    uri = store["MLFLOW_TRACKING_URI"]
    [killed] = runs_in(uri)
    assert killed.info.status == "RUNNING"

    result = run_train(*job, f"hydra.run.dir={out_dir}", env=store)
    assert result.returncode == 0, result.stderr
    assert "resumed from" in result.stderr and "continuing MLflow run" in result.stderr
    assert "optim.scheduler: torch.optim.lr_scheduler.StepLR(step_size=2, gamma=0.5), stepped " \
           "per epoch" in result.stderr
    [run] = runs_in(uri)
    assert run.info.run_id == killed.info.run_id
    assert run.info.status == "FINISHED" and run.data.tags["restarts"] == "1"
    lrs = history(uri, run.info.run_id, "lr")
    assert [step for step, _ in lrs] == list(range(1, 7))
    assert [value for _, value in lrs] == pytest.approx([1.0, 1.0, 0.5, 0.5, 0.25, 0.25])
    if task:
        assert [step for step, _ in history(uri, run.info.run_id, "val/mse")] == list(range(1, 7))
        assert "val/accuracy" not in run.data.metrics
