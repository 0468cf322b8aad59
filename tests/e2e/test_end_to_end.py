"""Whole jobs through the real CLI, read back from the real MLflow store."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import torch
from mlflow import MlflowClient

from tests.conftest import history, profiled_ops, run_train, runs_in
from train.report.breakdown import PHASES

EPOCH_METRICS = ("train/loss", "train/accuracy", "train/samples", "train/samples_per_sec",
                 "train/tflops_per_sec", "val/loss", "val/accuracy", "val/samples", "lr",
                 "epoch_time_s")


def test_two_rank_run_is_one_complete_mlflow_run(store: dict[str, str], tmp_path: Path) -> None:
    out_dir = tmp_path / "job"
    epochs, every = 3, 5
    result = run_train("distributed.nproc_per_node=2", f"trainer.epochs={epochs}",
                       f"trainer.log_every_n_steps={every}", "tracking.run_name=e2e",
                       "trainer.peak_tflops=0.05", "trainer.profile.enabled=true",
                       "trainer.profile.wait=3", "trainer.profile.active=2",
                       f"hydra.run.dir={out_dir}", env=store)
    assert result.returncode == 0, result.stderr
    uri = store["MLFLOW_TRACKING_URI"]
    [run] = runs_in(uri)
    assert run.info.status == "FINISHED"
    assert run.info.run_name == "e2e"

    params = run.data.params
    assert params["optim.lr"] == "0.05" and params["model.name"] == "cnn"
    assert params["distributed.nproc_per_node"] == "2"
    assert (params["data.num_train"], params["data.num_val"]) == ("1438", "359")
    tags = run.data.tags
    assert tags["world_size"] == "2" and tags["backend"] == "gloo"
    assert tags["torch_version"] == torch.__version__  # the ranks' torch: this interpreter's
    assert "distributed.nproc_per_node=2" in tags["command"]
    assert tags["hostnames"] and tags["git_commit"]

    for key in EPOCH_METRICS:
        steps = [step for step, _ in history(uri, run.info.run_id, key)]
        assert steps == list(range(1, epochs + 1)), key
    # Exact counts: every validation sample once; training covers the (evenly split) train set.
    assert {v for _, v in history(uri, run.info.run_id, "val/samples")} == {359.0}
    assert {v for _, v in history(uri, run.info.run_id, "train/samples")} == {1438.0}
    steps_per_epoch = math.ceil(1438 / 2 / 32)
    step_losses = history(uri, run.info.run_id, "train/step_loss")
    assert [s for s, _ in step_losses] == list(range(every, epochs * steps_per_epoch + 1, every))
    assert history(uri, run.info.run_id, "train/step_time_max_s")
    # Model FLOPs: the small CNN on 8x8 digits, forward and backward, over both ranks' peak.
    tflops = history(uri, run.info.run_id, "train/tflops_per_sec")
    mfu = history(uri, run.info.run_id, "train/mfu")
    assert [s for s, _ in mfu] == list(range(1, epochs + 1))
    for (_, rate), (_, share) in zip(tflops, mfu, strict=True):
        assert rate > 0 and share == pytest.approx(rate / (2 * 0.05))
    val_acc = history(uri, run.info.run_id, "val/accuracy")
    assert val_acc[-1][1] > 0.9
    # trainer.profile: steps 5 and 6 (3 waited, 1 warm-up) on each rank, forward and backward.
    assert tags["profile.steps"] == "5-6"
    traces = profiled_ops(uri, run.info.run_id, tmp_path / "artifacts")
    assert sorted(traces) == [0, 1]
    for names in traces.values():
        assert {"ProfilerStep#4", "ProfilerStep#5", "aten::conv2d"} <= names
        assert not {"ProfilerStep#3", "ProfilerStep#6"} & names  # warm-up and after: not kept
        assert any(n.startswith("autograd::engine::evaluate_function: ConvolutionBackward")
                   for n in names)
    for rank in (0, 1):  # each rank's top operators, as text
        summary = (out_dir / "profile" / f"rank-{rank}.txt").read_text()
        assert summary.startswith(f"rank {rank}, optimiser step(s) 5-6, by self_cpu_time_total\n")
        assert "Self CPU" in summary and "aten::convolution_backward" in summary
    assert sorted(a.path for a in MlflowClient(uri).list_artifacts(run.info.run_id, "profile")) \
        == [f"profile/rank-{r}.{kind}" for r in (0, 1) for kind in ("json.gz", "txt")]
    # Where the step time went, at each logging step; shares of rank 0's step summing to 1.
    shares = [dict(history(uri, run.info.run_id, f"time/{p}_share")) for p in PHASES]
    assert all(sum(s[step] for s in shares) == pytest.approx(1.0) for step, _ in step_losses)
    assert tags["bottleneck"] in ("input", "compute", "communication")
    artifacts = {a.path for a in MlflowClient(uri).list_artifacts(run.info.run_id)}
    assert "step_time.svg" in artifacts
    figure = (out_dir / "step_time.svg").read_text()
    assert figure.count(">rank 0 data: ") == figure.count(">rank 1 data: ") == 1

    client = MlflowClient(tracking_uri=uri)
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
    expected = {"config.yaml", "weights", "confusion_matrix.svg", "per_class_accuracy.json"}
    assert expected <= artifacts
    assert [a.path for a in client.list_artifacts(run.info.run_id, "weights")] == [
        "weights/model.pt"]
    table = json.loads(Path(client.download_artifacts(
        run.info.run_id, "per_class_accuracy.json", str(tmp_path))).read_text())
    assert sum(row[1] for row in table["data"]) == 359  # per-class samples add up
    [dataset] = client.get_run(run.info.run_id).inputs.dataset_inputs
    assert dataset.dataset.name == "digits-train" and dataset.dataset.digest
    assert json.loads(dataset.dataset.profile)["targets_shape"] == [1438]
    # The logged model loads back and predicts batches of any size.
    import mlflow.pytorch

    mlflow.set_tracking_uri(uri)
    model = mlflow.pytorch.load_model(f"runs:/{run.info.run_id}/model")
    for batch in (1, 5):
        assert model(torch.randn(batch, 1, 8, 8)).shape == (batch, 10)

    # The job's directory and its run point at each other.
    assert json.loads((out_dir / "mlflow_run.json").read_text())["run_id"] == run.info.run_id
    assert tags["output_dir"] == str(out_dir)
    summary = json.loads((out_dir / "summary.json").read_text())
    assert summary["metrics"]["val/accuracy"] == pytest.approx(val_acc[-1][1])
    assert len(summary["peak_rss_mb"]) == 2
    assert f"MLflow run {run.info.run_id} FINISHED" in result.stderr
    log = (out_dir / "train.log").read_text()  # the job's log beside its outputs
    assert f"[rank 0][INFO] epoch {epochs}/{epochs}" in log and run.info.run_id in log


def test_three_ranks_count_what_they_process(store: dict[str, str], tmp_path: Path) -> None:
    """1438 training samples over 3 ranks: the sampler pads to 1440, validation stays exact."""
    result = run_train("distributed.nproc_per_node=3", "data.batch_size=63", "trainer.epochs=1",
                       f"hydra.run.dir={tmp_path}/job", env=store)
    assert result.returncode == 0, result.stderr
    uri = store["MLFLOW_TRACKING_URI"]
    [run] = runs_in(uri)
    assert run.data.tags["world_size"] == "3"
    assert history(uri, run.info.run_id, "val/samples") == [(1, 359.0)]
    assert history(uri, run.info.run_id, "train/samples") == [(1, 1440.0)]


def test_torchrun_launch_works_unchanged(store: dict[str, str], tmp_path: Path) -> None:
    result = run_train("--nproc_per_node=2", "-m", "train", "trainer.epochs=1",
                       f"hydra.run.dir={tmp_path}/job", env=store,
                       module=("-m", "torch.distributed.run"))
    assert result.returncode == 0, result.stderr
    [run] = runs_in(store["MLFLOW_TRACKING_URI"])
    assert run.info.status == "FINISHED"
    assert run.data.tags["world_size"] == "2" and run.data.tags["launcher"] == "torchrun"
    assert history(store["MLFLOW_TRACKING_URI"], run.info.run_id, "val/samples") == [(1, 359.0)]


def test_system_metrics_of_every_node(store: dict[str, str], tmp_path: Path) -> None:
    result = run_train("distributed.nproc_per_node=2", "trainer.epochs=2", "model=mlp",
                       "tracking.system_metrics=true", f"hydra.run.dir={tmp_path}/job", env=store)
    assert result.returncode == 0, result.stderr
    uri = store["MLFLOW_TRACKING_URI"]
    [run] = runs_in(uri)
    host = run.data.tags["hostnames"]  # one node here: one series per metric
    system = {k for k in run.data.metrics if k.startswith("system/")}
    assert system == {f"system/{host}/{k}" for k in (
        "cpu_utilization_percentage", "system_memory_usage_megabytes",
        "system_memory_usage_percentage")}
    for key in system:
        assert [s for s, _ in history(uri, run.info.run_id, key)] == [1, 2]
    memory = history(uri, run.info.run_id, f"system/{host}/system_memory_usage_megabytes")
    assert memory[0][1] > 0


def test_tracking_disabled_leaves_mlflow_alone(store: dict[str, str], tmp_path: Path) -> None:
    result = run_train("tracking.enabled=false", "trainer.epochs=1", "model=mlp",
                       f"hydra.run.dir={tmp_path}/job", env=store)
    assert result.returncode == 0, result.stderr
    assert runs_in(store["MLFLOW_TRACKING_URI"]) == []
    summary = json.loads((tmp_path / "job" / "summary.json").read_text())
    assert summary["run_id"] is None and summary["metrics"]["val/samples"] == 359


LOG_LINE = re.compile(r"\[\d\d:\d\d:\d\d\]\[(rank \d|train)\]\[(INFO|WARNING|ERROR)\] \S")
"""Ours, one rank or many: `[20:06:31][rank 0][INFO] ...` (the launching process: `[train]`)."""


@pytest.mark.parametrize("ranks", [1, 2])
def test_one_log_format_for_one_rank_and_many(store: dict[str, str], tmp_path: Path,
                                              ranks: int) -> None:
    out_dir = tmp_path / "job"
    result = run_train(f"distributed.nproc_per_node={ranks}", "trainer.epochs=1",
                       "tracking.log_model=false", f"hydra.run.dir={out_dir}", env=store)
    assert result.returncode == 0, result.stderr
    log = (out_dir / "train.log").read_text()
    for text in (result.stderr, log):
        ours = [line for line in text.splitlines() if line.startswith("[")]
        assert ours and all(LOG_LINE.match(line) for line in ours), ours
        assert "[rank 0][INFO] epoch 1/1 " in text
    [run] = runs_in(store["MLFLOW_TRACKING_URI"])
    assert run.data.tags["launcher"] == "local"  # what started it: no torchrun here
