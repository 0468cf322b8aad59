"""Your own model and loss through the real CLI: `--cfg job`, refusals before any rank starts,
and whole jobs - locally (killed and resumed), under torchrun - read back from the real MLflow
store; the logged model loads where the user's package is importable, and only there."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from tests.conftest import USER_PATH, history, kill_job_after_checkpoints, run_train, runs_in
from tests.unit.test_custom_model import BAD_INPUTS, CUSTOM, NET


@pytest.mark.parametrize("flags", [(), ("-m",)], ids=["run", "sweep"])
def test_cli_refuses_a_custom_model_without_target(flags: tuple[str, ...],
                                                   store: dict[str, str]) -> None:
    out = run_train(*flags, "model=custom", "trainer.epochs=1", env=store, timeout=60)
    assert out.returncode == 2, out.stderr
    assert "error: model._target_ must be set" in out.stderr and "Traceback" not in out.stderr
    assert runs_in(store["MLFLOW_TRACKING_URI"]) == []


def test_cfg_job_shows_the_custom_model_and_the_loss() -> None:
    out = run_train("--cfg", "job", *CUSTOM, "+trainer.loss.label_smoothing=0.1", timeout=60)
    assert out.returncode == 0, out.stderr
    printed = yaml.safe_load(out.stdout)
    assert printed["model"] == {"_target_": NET, "depth": 3}
    assert printed["trainer"]["loss"] == {"_target_": "torch.nn.CrossEntropyLoss",
                                          "label_smoothing": 0.1}


@pytest.mark.parametrize(("overrides", "expected"), [BAD_INPUTS[0], BAD_INPUTS[2], BAD_INPUTS[5]])
def test_cli_refuses_bad_input_before_any_rank_starts(store: dict[str, str],
                                                      overrides: tuple[str, ...],
                                                      expected: list[str]) -> None:
    out = run_train(*overrides, "distributed.nproc_per_node=2", "trainer.epochs=1",
                    env={**store, "PYTHONPATH": USER_PATH}, timeout=120)
    assert out.returncode == 2, out.stderr
    assert all(part in out.stderr for part in expected), out.stderr
    assert "Traceback" not in out.stderr and "[rank" not in out.stderr
    assert runs_in(store["MLFLOW_TRACKING_URI"]) == []


def assert_custom_run(uri: str, run, epochs: int, world_size: int) -> None:
    assert run.info.status == "FINISHED"
    assert run.data.tags["world_size"] == str(world_size)
    params = run.data.params
    assert params["model._target_"] == NET and params["model.depth"] == "3"
    assert params["trainer.loss._target_"] == "torch.nn.CrossEntropyLoss"
    for key in ("train/loss", "val/accuracy", "val/accuracy_top5", "train/accuracy_top5"):
        assert [s for s, _ in history(uri, run.info.run_id, key)] == list(range(1, epochs + 1)), key
    assert {v for _, v in history(uri, run.info.run_id, "val/samples")} == {359.0}
    for (_, top1), (_, top5) in zip(history(uri, run.info.run_id, "val/accuracy"),
                                    history(uri, run.info.run_id, "val/accuracy_top5"),
                                    strict=True):
        assert 0 <= top1 <= top5 <= 1


def test_user_model_trains_resumes_and_loads_back(store: dict[str, str], tmp_path: Path,
                                                  user_path: None) -> None:
    """Two local ranks: killed after two checkpoints, run again, one run with every epoch once;
    the logged model loads where the user's package is importable, and only there."""
    env = {**store, "PYTHONPATH": USER_PATH}
    out_dir = tmp_path / "job"
    kill_job_after_checkpoints(out_dir, env, 2, "distributed.nproc_per_node=2", *CUSTOM,
                               "trainer.epochs=4")
    result = run_train("distributed.nproc_per_node=2", *CUSTOM, "trainer.epochs=4",
                       f"hydra.run.dir={out_dir}", env=env)
    assert result.returncode == 0, result.stderr
    assert "resumed from" in result.stderr and "continuing MLflow run" in result.stderr
    uri = store["MLFLOW_TRACKING_URI"]
    [run] = runs_in(uri)
    assert run.data.tags["restarts"] == "1"
    assert_custom_run(uri, run, epochs=4, world_size=2)

    import mlflow.pytorch

    mlflow.set_tracking_uri(uri)
    model = mlflow.pytorch.load_model(f"runs:/{run.info.run_id}/model")
    assert type(model).__module__ == "userpkg.models"
    assert model(torch.randn(3, 1, 8, 8)).shape == (3, 10)
    without = subprocess.run(
        [sys.executable, "-c", "import mlflow.pytorch, sys; "
         f"mlflow.set_tracking_uri({uri!r}); mlflow.pytorch.load_model(sys.argv[1])",
         f"runs:/{run.info.run_id}/model"], cwd=tmp_path, capture_output=True, text=True,
        timeout=120)
    assert without.returncode != 0 and "No module named 'userpkg'" in without.stderr


def test_user_model_under_torchrun(store: dict[str, str], tmp_path: Path) -> None:
    result = run_train("--nproc_per_node=2", "-m", "train", *CUSTOM, "trainer.epochs=1",
                       f"hydra.run.dir={tmp_path}/job", env={**store, "PYTHONPATH": USER_PATH},
                       module=("-m", "torch.distributed.run"))
    assert result.returncode == 0, result.stderr
    uri = store["MLFLOW_TRACKING_URI"]
    [run] = runs_in(uri)
    assert run.data.tags["launcher"] == "torchrun"
    assert_custom_run(uri, run, epochs=1, world_size=2)


def test_label_smoothing_changes_the_training_loss(store: dict[str, str],
                                                   tmp_path: Path) -> None:
    """The same seed, data and model: only the loss differs."""
    uri = store["MLFLOW_TRACKING_URI"]
    losses = {}
    for name, extra in (("plain", ()), ("smooth", ("+trainer.loss.label_smoothing=0.1",))):
        result = run_train("trainer.epochs=1", "model=mlp", "tracking.log_model=false",
                           f"tracking.run_name={name}", f"hydra.run.dir={tmp_path}/{name}",
                           *extra, env=store)
        assert result.returncode == 0, result.stderr
    for run in runs_in(uri):
        losses[run.info.run_name] = (history(uri, run.info.run_id, "train/loss")[0][1],
                                     history(uri, run.info.run_id, "val/loss")[0][1])
        if run.info.run_name == "smooth":
            assert run.data.params["trainer.loss.label_smoothing"] == "0.1"
    assert losses["smooth"][0] != pytest.approx(losses["plain"][0], rel=1e-3)
    assert losses["smooth"][1] != pytest.approx(losses["plain"][1], rel=1e-3)
