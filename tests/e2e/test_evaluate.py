"""`python -m train eval <run_id>` through the real CLI on real gloo ranks, read back from the
real MLflow store: a finished run's weights evaluated at other world sizes give its own test
metrics, recorded in the same run (still FINISHED) as eval/<name>/<metric>; another data set
and the best weights are further named entries; an FSDP run's sharded checkpoint evaluates at
any world size and strategy; bad input is refused in one line before any rank starts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from mlflow import MlflowClient

from tests.conftest import REPO, history, run_train, runs_in

USERPKG = {"PYTHONPATH": str(REPO / "tests")}
LINES = ("data=custom", "data.train._target_=userpkg.data.Lines", "+data.train.length=96",
         "data.val._target_=userpkg.data.Lines", "+data.val.length=30", "+data.val.seed=1",
         "data.test._target_=userpkg.data.Lines", "+data.test.length=101", "+data.test.seed=2",
         "model.width=8", "tracking.log_model=false", "distributed.device=cpu",
         "data.batch_size=16", "trainer.epochs=2")


def _train(store: dict[str, str], out: Path, *extra: str):
    result = run_train(*LINES, "distributed.nproc_per_node=2", *extra, f"hydra.run.dir={out}",
                       env={**store, **USERPKG})
    assert result.returncode == 0, result.stderr
    [run] = runs_in(store["MLFLOW_TRACKING_URI"])
    assert run.info.status == "FINISHED"
    return run


def _eval(store: dict[str, str], run_id: str, out: Path, *overrides: str):
    return run_train("eval", run_id, *overrides, f"hydra.run.dir={out}",
                     env={**store, **USERPKG})


def _evaluated(uri: str, run_id: str, name: str) -> dict[str, float]:
    run = MlflowClient(tracking_uri=uri).get_run(run_id)
    prefix = f"eval/{name}/"
    return {k[len(prefix):]: v for k, v in run.data.metrics.items() if k.startswith(prefix)}


def test_a_finished_run_evaluated_at_other_world_sizes_gives_its_test_metrics_in_the_same_run(
        store: dict[str, str], tmp_path: Path) -> None:
    uri = store["MLFLOW_TRACKING_URI"]
    trained = _train(store, tmp_path / "job", "trainer.save_best=true")
    run_id, test = trained.info.run_id, trained.data.metrics
    assert test["test/samples"] == 101

    one = _eval(store, run_id, tmp_path / "eval1", "distributed.nproc_per_node=1")
    assert one.returncode == 0, one.stderr
    three = _eval(store, run_id, tmp_path / "eval3", "distributed.nproc_per_node=3")
    assert three.returncode == 0, three.stderr
    after = MlflowClient(tracking_uri=uri).get_run(run_id)
    assert after.info.status == "FINISHED"  # evaluating leaves the run's status as it is
    assert len(runs_in(uri)) == 1  # and makes no run of its own
    got = _evaluated(uri, run_id, "custom_test")
    assert got["samples"] == 101  # every test sample once, at world size 3 as at 1
    for metric in ("loss", "accuracy"):
        assert got[metric] == pytest.approx(test[f"test/{metric}"], abs=1e-6), metric
        # Both evaluations are in the history, at the weights' epoch (the last: 2).
        steps_values = history(uri, run_id, f"eval/custom_test/{metric}")
        assert [s for s, _ in steps_values] == [2, 2]
        assert steps_values[0][1] == pytest.approx(steps_values[1][1], abs=1e-6)
    tags = after.data.tags
    assert tags["eval/custom_test/data"] == "data=custom split=test samples=101"
    assert tags["eval/custom_test/weights"] == f"last: {tmp_path / 'job' / 'model.pt'}"
    record = json.loads((tmp_path / "eval3" / "eval-custom_test.json").read_text())
    assert (record["world_size"], record["samples"], record["epoch"]) == (3, 101, 2)
    artifacts = {a.path for a in MlflowClient(tracking_uri=uri).list_artifacts(run_id, "eval")}
    assert artifacts == {"eval/eval-custom_test.json"}

    # Another data set of the same shape, and the best weights: two more named entries.
    other = _eval(store, run_id, tmp_path / "other", "eval.name=shifted", "data.test.seed=7",
                  "data.test.length=45", "distributed.nproc_per_node=3")
    assert other.returncode == 0, other.stderr
    best = _eval(store, run_id, tmp_path / "best", "eval.weights=best", "eval.name=at_best",
                 "eval.split=val")
    assert best.returncode == 0, best.stderr
    assert _evaluated(uri, run_id, "shifted")["samples"] == 45
    at_best = _evaluated(uri, run_id, "at_best")
    assert at_best["samples"] == 30
    best_epoch = int(MlflowClient(tracking_uri=uri).get_run(run_id).data.tags["best_epoch"])
    [(step, accuracy)] = history(uri, run_id, "eval/at_best/accuracy")
    assert step == best_epoch
    assert accuracy == pytest.approx(history(uri, run_id, "val/accuracy")[best_epoch - 1][1],
                                     abs=1e-6)  # the best epoch's own validation

    # Data of another shape is refused before any rank starts; nothing is logged.
    wrong = _eval(store, run_id, tmp_path / "wrong", "data=digits", "eval.split=val")
    line = _refusal(wrong)
    assert "gives inputs 1x8x8 and 10 outputs" in line and "1x16x16 and 3" in line, line
    assert not (tmp_path / "wrong" / "ranks").exists()
    assert not _evaluated(uri, run_id, "digits_val")
    refused = _eval(store, run_id, tmp_path / "bad", "eval.weights=/nowhere/step-1.pt")
    assert "no such file or directory" in _refusal(refused)  # (the others: tests/unit)
    assert not (tmp_path / "bad").exists()


def test_an_fsdp_runs_sharded_checkpoint_evaluates_at_any_world_size_and_strategy(
        store: dict[str, str], tmp_path: Path) -> None:
    uri = store["MLFLOW_TRACKING_URI"]
    trained = _train(store, tmp_path / "job", "distributed.strategy=fsdp")
    run_id, test = trained.info.run_id, trained.data.metrics
    [last] = sorted((tmp_path / "job" / "checkpoints").glob("step-*.dcp"))[-1:]
    for name, overrides in (("fsdp3", ["distributed.nproc_per_node=3"]),
                            ("ddp1", ["distributed.nproc_per_node=1",
                                      "distributed.strategy=ddp"])):
        result = _eval(store, run_id, tmp_path / name, f"eval.weights={last}",
                       f"eval.name={name}", *overrides)
        assert result.returncode == 0, result.stderr
        got = _evaluated(uri, run_id, name)
        # The run's own test (its ranks share rank 0's BatchNorm statistics, as under DDP).
        assert got["accuracy"] == pytest.approx(test["test/accuracy"], abs=1e-6), name
        assert got["loss"] == pytest.approx(test["test/loss"], abs=1e-6), name
        assert got["samples"] == 101


def test_a_run_whose_output_directory_is_out_of_sight_is_evaluated_from_its_store(
        store: dict[str, str], tmp_path: Path) -> None:
    """The run trained on another machine's disk (here: its output directory moved away): eval
    and predict take its final weights from the store (`weights/model.pt`), at another world
    size, and give its own test metrics; weights the store does not keep are refused in one
    line that says which it does."""
    import shutil

    import pyarrow.parquet as pq

    uri = store["MLFLOW_TRACKING_URI"]
    trained = _train(store, tmp_path / "job")
    run_id, test = trained.info.run_id, trained.data.metrics
    shutil.move(tmp_path / "job", tmp_path / "elsewhere")

    result = _eval(store, run_id, tmp_path / "eval", "distributed.nproc_per_node=3")
    assert result.returncode == 0, result.stderr
    in_store = f"runs:/{run_id}/weights/model.pt"
    assert f"evaluating run {run_id}: {in_store}" in result.stderr
    got = _evaluated(uri, run_id, "custom_test")
    assert got["samples"] == 101
    for metric in ("loss", "accuracy"):
        assert got[metric] == pytest.approx(test[f"test/{metric}"], abs=1e-6), metric
        assert [s for s, _ in history(uri, run_id, f"eval/custom_test/{metric}")] == [2]
    tags = MlflowClient(tracking_uri=uri).get_run(run_id).data.tags
    assert tags["eval/custom_test/weights"] == f"last: {in_store}"
    size = (tmp_path / "elsewhere" / "model.pt").stat().st_size
    assert f"{in_store} downloaded from the store to {tmp_path}/eval/from-store/model.pt " \
        f"({size / 1e6:.1f} MB" in (tmp_path / "eval" / "train.log").read_text()
    assert not (tmp_path / "eval" / "from-store").exists()  # the copy is gone once loaded

    # The store's file named as MLflow names it, by predict at one rank: every test sample.
    out = tmp_path / "predictions.parquet"
    predicted = run_train("predict", run_id, f"predict.weights={in_store}", f"predict.out={out}",
                          "distributed.nproc_per_node=1", f"hydra.run.dir={tmp_path}/predict",
                          env={**store, **USERPKG})
    assert predicted.returncode == 0, predicted.stderr
    assert pq.read_table(out).column("index").to_pylist() == list(range(101))

    # The store keeps the final weights only: the best ones, a file it does not hold, or
    # another run's file are refused before anything starts, saying what it holds.
    best = _refusal(_eval(store, run_id, tmp_path / "best", "eval.weights=best"))
    assert f"output directory {tmp_path / 'job'} is not on this machine" in best, best
    assert "keeps no checkpoints; the tracking store keeps its final weights, the last: " \
        "eval.weights=last" in best, best
    nothing = _refusal(_eval(store, run_id, tmp_path / "none",
                             f"eval.weights=runs:/{run_id}/weights/other.pt"))
    assert "holds no file weights/other.pt" in nothing and in_store in nothing, nothing
    other = _refusal(_eval(store, run_id, tmp_path / "other",
                           f"eval.weights=runs:/{'0' * 32}/weights/model.pt"))
    assert f"is run {'0' * 32}'s file, not run {run_id}'s" in other, other
    assert not [p.name for p in tmp_path.iterdir() if p.name in ("best", "none", "other")]


def _run_without_end(uri: str, params: dict[str, str]) -> str:
    """A run as a job that is still training leaves it: RUNNING, its config recorded."""
    client = MlflowClient(tracking_uri=uri)
    experiment = client.create_experiment("train")
    run = client.create_run(experiment)
    client.log_text(run.info.run_id, "data:\n  name: digits\n", "config.yaml")
    for key, value in params.items():
        client.log_param(run.info.run_id, key, value)
    return run.info.run_id


def _refusal(result) -> str:
    """The one `error:` line of a refused command (exit 2, no traceback)."""
    assert result.returncode == 2, result.stdout + result.stderr
    assert "Traceback" not in result.stderr
    [line] = [x for x in result.stderr.splitlines() if x.startswith("error:")]
    return line


def test_a_run_still_training_or_missing_or_without_a_model_is_refused_in_one_line(
        store: dict[str, str], tmp_path: Path) -> None:
    uri = store["MLFLOW_TRACKING_URI"]
    client = MlflowClient(tracking_uri=uri)
    run_id = _run_without_end(uri, {"data.input_shape": "1x8x8", "model.outputs": "10"})
    out = f"hydra.run.dir={tmp_path / 'out'}"
    assert f"run {run_id} is still RUNNING" in _refusal(run_train("eval", run_id, out, env=store))
    client.set_terminated(run_id, "KILLED")
    assert f"run {run_id} ended KILLED" in _refusal(run_train("eval", run_id, out, env=store))
    client.set_terminated(run_id, "FINISHED")  # but no final weights: not a training run
    assert "has no trained model" in _refusal(run_train("eval", run_id, out, env=store))
    missing = run_train("eval", "0123456789abcdef0123456789abcdef", out, env=store)
    assert "no run 0123456789abcdef0123456789abcdef" in _refusal(missing)
    assert "is not a run id" in _refusal(run_train("eval", "not/a-run", out, env=store))
    assert not (tmp_path / "out").exists()  # nothing made
    assert client.get_run(run_id).data.metrics == {}


def test_predictions_at_world_size_3_are_one_file_in_order_equal_to_the_loaded_model(
        store: dict[str, str], tmp_path: Path) -> None:
    """23 test samples over 3 ranks (8, 8, 7): one Parquet file, 23 rows in the data set's
    order, each the output of train.load.load_model's model on one process."""
    import sys

    import pyarrow.parquet as pq
    import torch

    uri = store["MLFLOW_TRACKING_URI"]
    trained = run_train(*LINES, "distributed.nproc_per_node=1", f"hydra.run.dir={tmp_path}/job",
                        env={**store, **USERPKG})
    assert trained.returncode == 0, trained.stderr
    [run] = runs_in(uri)
    out = tmp_path / "predictions" / "lines.parquet"
    command = ("predict", run.info.run_id, "data.test.length=23", f"predict.out={out}",
               "distributed.nproc_per_node=3")
    result = run_train(*command, f"hydra.run.dir={tmp_path}/predict", env={**store, **USERPKG})
    assert result.returncode == 0, result.stderr
    table = pq.read_table(out)
    assert table.column("index").to_pylist() == list(range(23))
    assert set(table.column_names) == {"index", "prediction", "class", "probabilities",
                                       "target"}
    about = json.loads(out.with_name("lines.parquet.json").read_text())
    assert (about["run_id"], about["rows"], about["split"]) == (run.info.run_id, 23, "test")
    assert json.loads(table.schema.metadata[b"train.run_id"]) == run.info.run_id
    assert not (tmp_path / "predict" / "predict-parts").exists()  # the parts are gone

    sys.path.insert(0, str(REPO / "tests"))
    from userpkg.data import Lines

    from train.load import load_model

    test = Lines(length=23, seed=2)
    images = torch.stack([test[i][0] for i in range(23)])
    with torch.no_grad():
        expected = load_model(run.info.run_id, uri)(images).softmax(-1)
    got = torch.tensor(table.column("probabilities").to_pylist())
    assert torch.allclose(got, expected, atol=1e-6)
    assert table.column("prediction").to_pylist() == expected.argmax(-1).tolist()
    assert table.column("target").to_pylist() == [test[i][1] for i in range(23)]
    assert table.column("class").to_pylist() == [Lines.classes[i]
                                                 for i in expected.argmax(-1).tolist()]

    # The file exists: refused before anything starts, unless predict.overwrite=true.
    again = run_train(*command, f"hydra.run.dir={tmp_path}/again", env={**store, **USERPKG})
    assert "exists: give another path, or predict.overwrite=true" in _refusal(again)
    assert not (tmp_path / "again").exists()
    replaced = run_train(*command, "predict.overwrite=true", "predict.split=val",
                         f"hydra.run.dir={tmp_path}/again", env={**store, **USERPKG})
    assert replaced.returncode == 0, replaced.stderr
    assert pq.read_table(out).column("index").to_pylist() == list(range(30))  # val: 30
    assert sorted(p.name for p in out.parent.iterdir()) == ["lines.parquet", "lines.parquet.json"]
