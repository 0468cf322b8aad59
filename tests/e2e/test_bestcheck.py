"""Best checkpoint, early stopping and the test split, through the real CLI, read back from the
real MLflow store: best.pt holds the best epoch's weights; a run that cannot improve stops early
on 2 gloo ranks (FINISHED, stop_reason) and evaluates its test split exactly once; a resumed job
keeps the best-so-far and the patience used up; bad settings refused before anything starts."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch
from mlflow import MlflowClient

from tests.conftest import REPO, assert_refused, history, run_train, runs_in

USERPKG = {"PYTHONPATH": str(REPO / "tests")}
DIGITS = ("data=digits", "distributed.device=cpu", "tracking.log_model=false", "model.width=8")


def _one_run(uri: str):
    [run] = runs_in(uri)
    return run


def test_best_pt_holds_the_best_epochs_weights_and_becomes_the_final_model(
        store: dict[str, str], tmp_path: Path) -> None:
    out = tmp_path / "job"
    result = run_train(*DIGITS, "trainer.epochs=3", "trainer.save_best=true",
                       "trainer.test_on=best", "trainer.keep_checkpoints=10",
                       f"hydra.run.dir={out}", env=store)
    assert result.returncode == 0, result.stderr
    uri = store["MLFLOW_TRACKING_URI"]
    run = _one_run(uri)
    assert run.info.status == "FINISHED"
    accuracy = history(uri, run.info.run_id, "val/accuracy")
    best_value = max(v for _, v in accuracy)
    best_step = min(s for s, v in accuracy if v == best_value)
    best = torch.load(out / "checkpoints" / "best.pt", weights_only=True)
    assert (best["epoch"], best["monitor"], best["mode"]) == (best_step, "val/accuracy", "max")
    assert best["value"] == pytest.approx(best_value)
    assert run.data.tags["best_epoch"] == str(best_step)
    assert run.data.tags["final_weights"] == "best"
    assert run.data.metrics["best/val/accuracy"] == pytest.approx(best_value)
    # The epoch-end checkpoint of the best epoch holds the same weights; model.pt is them.
    [at_best] = [p for p in (out / "checkpoints").glob("step-*.pt")
                 if torch.load(p, weights_only=True)["epoch"] == best_step]
    weights = torch.load(at_best, weights_only=True)["model"]
    final = torch.load(out / "model.pt", weights_only=True)
    for name, tensor in weights.items():
        assert torch.equal(best["model"][name], tensor), name
        assert torch.equal(final[name], tensor), name
    assert "no test split" in result.stderr  # digits has none


def test_early_stopping_on_two_ranks_and_an_exact_test_split(store: dict[str, str],
                                                             tmp_path: Path) -> None:
    out = tmp_path / "job"
    command = ("data=custom", "data.train._target_=userpkg.data.Lines", "+data.train.length=96",
               "data.val._target_=userpkg.data.Lines", "+data.val.length=30",
               "+data.val.seed=1", "data.test._target_=userpkg.data.Lines",
               "+data.test.length=101", "+data.test.seed=2", "model.width=8",
               "tracking.log_model=false", "distributed.nproc_per_node=2",
               "distributed.device=cpu", "data.batch_size=16", "trainer.epochs=8",
               "optim.lr=1e-12", "trainer.early_stopping_patience=2", "trainer.save_best=true",
               f"hydra.run.dir={out}")
    result = run_train(*command, env={**store, **USERPKG})
    assert result.returncode == 0, result.stderr
    uri = store["MLFLOW_TRACKING_URI"]
    run = _one_run(uri)
    assert run.info.status == "FINISHED"
    # lr ~ 0: the first evaluation is the best, two more without improvement, then the stop.
    assert [s for s, _ in history(uri, run.info.run_id, "val/accuracy")] == [1, 2, 3]
    reason = run.data.tags["stop_reason"]
    assert reason.startswith("early stopping: val/accuracy did not improve for 2 evaluations")
    assert result.stderr.count("early stopping:") == 1
    assert run.data.tags["final_weights"] == "last"
    assert run.data.metrics["test/samples"] == 101  # each test sample once over 2 ranks
    assert run.data.params["data.num_test"] == "101"
    artifacts = {a.path for a in MlflowClient(tracking_uri=uri).list_artifacts(run.info.run_id)}
    assert {"test_confusion_matrix.svg", "test_per_class_accuracy.json"} <= artifacts

    # An independent evaluation of model.pt on the test set gives the logged test/accuracy.
    import sys

    sys.path.insert(0, str(REPO / "tests"))
    from userpkg.data import Lines

    from train.config.groups import ModelConfig
    from train.models import build as models

    model = models.build(ModelConfig(width=8), models.InputSpec.of((1, 16, 16), 3)).eval()
    model.load_state_dict(torch.load(out / "model.pt", weights_only=True))
    test = Lines(length=101, seed=2)
    images = torch.stack([test[i][0] for i in range(101)])
    labels = torch.tensor([test[i][1] for i in range(101)])
    with torch.no_grad():
        correct = (model(images).argmax(1) == labels).sum().item()
    assert run.data.metrics["test/accuracy"] == pytest.approx(correct / 101)

    # The same command again: finished, nothing trained or logged again.
    again = run_train(*command, env={**store, **USERPKG})
    assert again.returncode == 0, again.stderr
    assert "finished already" in again.stderr
    assert len(runs_in(uri)) == 1
    assert json.loads((out / "summary.json").read_text())["stop_reason"] == reason


def test_a_resumed_job_keeps_the_best_so_far_and_the_patience_used(store: dict[str, str],
                                                                   tmp_path: Path) -> None:
    out = tmp_path / "job"
    common = (*DIGITS, "optim.lr=1e-12", "trainer.early_stopping_patience=3",
              f"hydra.run.dir={out}")
    first = run_train(*common, "trainer.epochs=2", env=store)
    assert first.returncode == 0, first.stderr
    state = torch.load(sorted((out / "checkpoints").glob("step-*.pt"))[-1], weights_only=True)
    assert state["monitor"]["best_epoch"] == 0 and state["monitor"]["bad_evaluations"] == 1
    # Two more allowed epochs: with patience 3 the counter reaches 3 at the 4th epoch and
    # the job stops before its 6th, had it started counting afresh it would run all 6.
    restarted_at = time.time()
    second = run_train(*common, "trainer.epochs=6", env=store)
    assert second.returncode == 0, second.stderr
    # This start's first step is its own (also where the MLflow sender is let go at once).
    assert json.loads((out / "summary.json").read_text())["first_step_at"] > restarted_at
    uri = store["MLFLOW_TRACKING_URI"]
    run = _one_run(uri)
    assert [s for s, _ in history(uri, run.info.run_id, "val/accuracy")] == [1, 2, 3, 4]
    assert "epoch 1)" in run.data.tags["stop_reason"]  # best 1-based epoch 1 kept


@pytest.mark.parametrize(("overrides", "line"), [
    (("trainer.monitor=val/acc",),
     "trainer.monitor='val/acc' is not a metric task=classification logs"),
    (("trainer.test_on=best",), "trainer.test_on=best needs trainer.save_best=true"),
])
def test_bad_settings_are_refused_before_anything_starts(store: dict[str, str], tmp_path: Path,
                                                         overrides: tuple[str, ...],
                                                         line: str) -> None:
    result = run_train(*DIGITS, *overrides, f"hydra.run.dir={tmp_path}/job", env=store)
    assert result.returncode == 2
    assert line in result.stderr
    assert len([x for x in result.stderr.strip().splitlines() if "Refusing" in x]) == 1
    assert runs_in(store["MLFLOW_TRACKING_URI"]) == []


TOP5 = "trainer.monitor=val/accuracy_top5"
TOO_FEW = "trainer.monitor=val/accuracy_top5 needs more than 5 classes; this data has {}"


def test_a_top5_monitor_on_five_classes_or_fewer_is_refused_before_anything_starts(
        store: dict[str, str], tmp_path: Path) -> None:
    from tests.images import write_image_folder

    synthetic = run_train("data=synthetic", "data.num_classes=5", "data.num_samples=64", TOP5,
                          f"hydra.run.dir={tmp_path}/synthetic", env=store)
    assert_refused(synthetic, TOO_FEW.format(5), store)
    folder = write_image_folder(tmp_path / "set", 3, 2, 1, size=8)
    images = run_train("data=imagefolder", f"data.root={folder}", TOP5,
                       f"hydra.run.dir={tmp_path}/images", env=store)
    assert_refused(images, TOO_FEW.format(3), store)
    # The user's Dataset names its 3 classes (`classes`): pre-flight, which builds it once,
    # knows them too.
    named = run_train("data=custom", "data.train._target_=userpkg.data.Lines",
                      "+data.train.length=24", TOP5, f"hydra.run.dir={tmp_path}/named",
                      env={**store, **USERPKG})
    assert_refused(named, TOO_FEW.format(3), store)


def test_a_top5_monitor_on_a_custom_data_set_of_three_unnamed_classes_fails_before_training(
        store: dict[str, str], tmp_path: Path) -> None:
    """A custom Dataset that does not name its classes: they are counted from its labels once
    the ranks built it, and the job ends there, FAILED with the reason, before its first step."""
    result = run_train("data=custom", "data.train._target_=userpkg.data.UnnamedLines",
                       "+data.train.length=24", "data.val._target_=userpkg.data.UnnamedLines",
                       "+data.val.length=8", "model.width=8", "tracking.log_model=false",
                       TOP5, f"hydra.run.dir={tmp_path}/job", env={**store, **USERPKG})
    assert result.returncode != 0
    assert TOO_FEW.format(3) in result.stderr
    run = _one_run(store["MLFLOW_TRACKING_URI"])
    assert run.info.status == "FAILED"
    assert TOO_FEW.format(3) in run.data.tags["error"]
    assert "train/loss" not in run.data.metrics
