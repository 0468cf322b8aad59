"""Rank 0's tracker in-process, against real MLflow stores: batching, outages, the unsent file,
and the model FLOP figures behind train/mfu."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from mlflow import MlflowClient

from tests.conftest import history, runs_in
from train import flops, models, outbox
from train.config import ModelConfig, TrackingConfig
from train.distenv import free_port
from train.tracker import RunTracker


def tracker(uri: str, out: Path, **overrides: object) -> RunTracker:
    out.mkdir(parents=True, exist_ok=True)
    cfg = TrackingConfig(uri=uri, experiment="unit", experiment_id=None, parent_run_id=None,
                         **overrides)  # type: ignore[arg-type]
    return RunTracker(cfg, out / "mlflow_run.json")


def test_rows_logged_together_travel_together_and_none_is_lost(tmp_path: Path) -> None:
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    t = tracker(uri, tmp_path / "job", batch_interval_s=0.5)
    t.start(tags={"world_size": 2}, run_name="batched")
    t.log_params({"optim.lr": "0.1"})
    t.begin_sending()
    for step in range(1, 1201):  # more than one request may carry (1000 metrics)
        t.log_metrics({"train/step_loss": 1.0 / step, "train/step_time_max_s": 0.01}, step)
    t.finish()
    [run] = runs_in(uri, "unit")
    assert run.info.status == "FINISHED" and run.info.run_name == "batched"
    assert run.data.params == {"optim.lr": "0.1"} and run.data.tags["world_size"] == "2"
    losses = history(uri, run.info.run_id, "train/step_loss")
    assert [s for s, _ in losses] == list(range(1, 1201))
    assert losses[9][1] == pytest.approx(0.1)
    recorded = json.loads((tmp_path / "job" / "mlflow_run.json").read_text())
    assert recorded["run_id"] == run.info.run_id


def test_a_store_never_reached_leaves_a_file_that_creates_the_run_later(tmp_path: Path) -> None:
    """The server is gone before the run could even be created: everything waits in the unsent
    file, and the upload - pointed at where the store is now - creates the run with it all."""
    dead = f"http://127.0.0.1:{free_port()}"
    job = tmp_path / "job"
    t = tracker(dead, job, flush_timeout_s=1.0)
    t.start(tags={"world_size": 1}, run_name="late")
    t.log_params({"optim.lr": "0.1"})
    t.log("text", text="optim:\n  lr: 0.1\n", artifact_file="config.yaml")
    for epoch in range(3):
        t.log_metrics({"train/loss": 3.0 - epoch, "val/samples": 359.0}, epoch)
    weights = job / "model.pt"
    torch.save({"w": torch.ones(2)}, weights)
    t.log("file", path=str(weights), artifact_path="weights")
    t.log("dataset", name="digits-train", images=torch.zeros(4, 1, 8, 8),
          labels=torch.zeros(4), rows=torch.arange(3))
    t.finish(error="rank 1 on node2: ValueError: boom")

    unsent = job / outbox.UNSENT_FILE
    header, rows, records = outbox.load(unsent)
    assert header == {"run_id": None, "tracking_uri": dead, "status": "FAILED"}
    assert [r.kind for r in records] == ["create", "text", "file", "end"]  # not the dataset
    assert len(rows.metrics) == 6 and rows.params == [("optim.lr", "0.1")]

    store = f"sqlite:///{tmp_path / 'mlflow.db'}"
    outbox.upload(unsent, tracking_uri=store)
    [run] = runs_in(store, "unit")
    assert run.info.run_name == "late" and run.info.status == "FAILED"
    assert run.data.tags["error"] == "rank 1 on node2: ValueError: boom"
    assert run.data.params == {"optim.lr": "0.1"}
    assert history(store, run.info.run_id, "train/loss") == [(0, 3.0), (1, 2.0), (2, 1.0)]
    client = MlflowClient(tracking_uri=store)
    assert {a.path for a in client.list_artifacts(run.info.run_id)} == {"config.yaml", "weights"}
    assert unsent.with_suffix(".uploaded").exists() and not unsent.exists()


def test_upload_adds_only_the_steps_the_run_lacks(tmp_path: Path) -> None:
    store = f"sqlite:///{tmp_path / 'mlflow.db'}"
    t = tracker(store, tmp_path / "job")
    t.start(tags={}, run_name="partial")
    t.begin_sending()
    t.log_metrics({"train/loss": 1.0}, 0)
    t.finish()
    [run] = runs_in(store, "unit")
    unsent = tmp_path / "unsent.jsonl"
    rows = outbox.Batch(metrics=[("train/loss", 1.0, 0, 0), ("train/loss", 0.5, 0, 1)])
    outbox.save(unsent, {"run_id": run.info.run_id, "tracking_uri": store,
                         "status": "FINISHED"}, rows, [])
    outbox.upload(unsent)
    assert history(store, run.info.run_id, "train/loss") == [(0, 1.0), (1, 0.5)]


def test_batches_respect_mlflows_request_limits() -> None:
    batch = outbox.Batch(metrics=[("m", 0.0, 0, i) for i in range(2500)],
                         params=[(f"p{i}", "v") for i in range(150)])
    chunks = batch.chunks()
    assert [len(c.metrics) for c in chunks] == [1000, 1000, 500]
    assert [len(c.params) for c in chunks] == [100, 50, 0]
    assert outbox.Batch().chunks() == []


def test_training_flops_are_counted_without_computing() -> None:
    model = models.build(ModelConfig(name="resnet18"), models.InputSpec(3, 32, 10))
    per_sample = flops.training_flops_per_sample(model, 3, 32)
    # CIFAR ResNet-18: ~0.56 GMACs forward = 1.1 GFLOP; backward twice that.
    assert per_sample == pytest.approx(3.3e9, rel=0.05)
    assert next(model.parameters()).device.type == "cpu"  # the model itself is untouched


def test_peak_flops_come_from_the_config_or_a_known_gpu() -> None:
    cpu = torch.device("cpu")
    assert flops.peak_tflops(cpu, "fp32", None) is None
    assert flops.peak_tflops(cpu, "fp32", 2.5) == 2.5
    names = [key for key, _, _ in flops.PEAK_TFLOPS]
    assert names.index("H100 PCIe") < names.index("H100")  # the more specific name first
