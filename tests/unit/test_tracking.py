"""Rank 0's MLflow run in-process, against real MLflow stores: batching, flush, outages, the
unsent file and its typed records, the do-nothing run; and the model FLOP figures behind
train/mfu."""

from __future__ import annotations

import json
import re
import threading
import time
from dataclasses import asdict
from pathlib import Path

import pytest
import torch
from mlflow import MlflowClient

from tests.conftest import history, new_store, runs_in
from train import outbox
from train.config.groups import ModelConfig, TrackingConfig
from train.data.batches import describe_tensors
from train.distributed.env import free_port
from train.models import build as models
from train.report import flops
from train.tracking import NullRun, open_run, unsent
from train.tracking.records import (
    ArtifactFile,
    Batch,
    CreateRun,
    DatasetInput,
    EndRun,
    Model,
    ResumeRun,
    Table,
    Text,
)
from train.tracking.run import MlflowRun


def unit_config(uri: str, **overrides: object) -> TrackingConfig:
    return TrackingConfig(uri=uri, experiment="unit", experiment_id=None, parent_run_id=None,
                          **overrides)  # type: ignore[arg-type]


def tracker(uri: str, out: Path, **overrides: object) -> MlflowRun:
    out.mkdir(parents=True, exist_ok=True)
    return MlflowRun(unit_config(uri, **overrides), out)


def test_rows_logged_together_travel_together_and_none_is_lost(
        tmp_path: Path, store_template: Path) -> None:
    uri = new_store(tmp_path / "mlflow.db", store_template)
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


def test_a_store_never_reached_leaves_a_file_that_creates_the_run_later(
        tmp_path: Path, store_template: Path) -> None:
    """The server is gone before the run could even be created: everything waits in the unsent
    file, and the upload - pointed at where the store is now - creates the run with it all."""
    dead = f"http://127.0.0.1:{free_port()}"
    job = tmp_path / "job"
    t = tracker(dead, job, flush_timeout_s=1.0)
    t.start(tags={"world_size": 1}, run_name="late")
    t.log_params({"optim.lr": "0.1"})
    t.log(Text(text="optim:\n  lr: 0.1\n", artifact_file="config.yaml"))
    for epoch in range(3):
        t.log_metrics({"train/loss": 3.0 - epoch, "val/samples": 359.0}, epoch)
    weights = job / "model.pt"
    torch.save({"w": torch.ones(2)}, weights)
    t.log(ArtifactFile(path=str(weights), artifact_path="weights"))
    described = describe_tensors(images=torch.zeros(4, 1, 8, 8), labels=torch.zeros(4),
                                 rows=torch.arange(3))
    dataset = DatasetInput(name="digits-train", **asdict(described))
    t.log(dataset)
    t.log(Model(model=torch.nn.Linear(2, 2), input_example=None))  # cannot wait in a file
    t.finish(error="rank 1 on node2: ValueError: boom")

    unsent_file = job / unsent.UNSENT_FILE
    header, rows, waiting = unsent.load(unsent_file)
    assert header == {"run_id": None, "tracking_uri": dead, "status": "FAILED"}
    # Everything but the model, the data set record included.
    assert [type(r) for r in waiting] == [CreateRun, Text, ArtifactFile, DatasetInput, EndRun]
    assert waiting[3] == dataset and dataset.features_shape == [3, 1, 8, 8]
    assert len(rows.metrics) == 6 and rows.params == [("optim.lr", "0.1")]

    store = new_store(tmp_path / "mlflow.db", store_template)
    unsent.upload(unsent_file, tracking_uri=store)
    [run] = runs_in(store, "unit")
    assert run.info.run_name == "late" and run.info.status == "FAILED"
    assert run.data.tags["error"] == "rank 1 on node2: ValueError: boom"
    assert run.data.params == {"optim.lr": "0.1"}
    assert history(store, run.info.run_id, "train/loss") == [(0, 3.0), (1, 2.0), (2, 1.0)]
    client = MlflowClient(tracking_uri=store)
    assert {a.path for a in client.list_artifacts(run.info.run_id)} == {"config.yaml", "weights"}
    [logged] = client.get_run(run.info.run_id).inputs.dataset_inputs
    assert (logged.dataset.name, logged.dataset.digest) == ("digits-train", dataset.digest)
    assert json.loads(logged.dataset.profile)["features_shape"] == [3, 1, 8, 8]
    assert unsent_file.with_suffix(".uploaded").exists() and not unsent_file.exists()


def test_upload_adds_only_the_steps_the_run_lacks(tmp_path: Path, store_template: Path) -> None:
    store = new_store(tmp_path / "mlflow.db", store_template)
    t = tracker(store, tmp_path / "job")
    t.start(tags={}, run_name="partial")
    t.begin_sending()
    t.log_metrics({"train/loss": 1.0}, 0)
    t.finish()
    [run] = runs_in(store, "unit")
    unsent_file = tmp_path / "unsent.jsonl"
    rows = Batch(metrics=[("train/loss", 1.0, 0, 0), ("train/loss", 0.5, 0, 1)])
    unsent.save(unsent_file, {"run_id": run.info.run_id, "tracking_uri": store,
                              "status": "FINISHED"}, rows, [])
    unsent.upload(unsent_file)
    assert history(store, run.info.run_id, "train/loss") == [(0, 1.0), (1, 0.5)]


def test_batches_respect_mlflows_request_limits() -> None:
    batch = Batch(metrics=[("m", 0.0, 0, i) for i in range(2500)],
                         params=[(f"p{i}", "v") for i in range(150)])
    chunks = batch.chunks()
    assert [len(c.metrics) for c in chunks] == [1000, 1000, 500]
    assert [len(c.params) for c in chunks] == [100, 50, 0]
    assert Batch().chunks() == []


def test_flush_returns_once_the_rows_are_in_the_store(tmp_path: Path, store_template: Path) -> None:
    uri = new_store(tmp_path / "mlflow.db", store_template)
    # Rows would otherwise wait a minute for their batch: flush sends them at once.
    t = tracker(uri, tmp_path / "job", batch_interval_s=60.0, flush_timeout_s=60.0)
    t.start(tags={}, run_name="flushed")
    t.begin_sending()
    t.log_metrics({"train/loss": 2.0}, 0)
    t.flush()  # the run's creation, then the row
    [run] = runs_in(uri, "unit")
    assert history(uri, run.info.run_id, "train/loss") == [(0, 2.0)]
    t.log_metrics({"train/loss": 1.0}, 1)
    t.set_tags({"stage": "two"})
    time.sleep(1)  # not a wait for an event: the sender is now idle until the batch is due
    began = time.monotonic()
    t.flush()  # wakes it: the rows go now, not at the batch interval
    assert time.monotonic() - began < 10
    assert history(uri, run.info.run_id, "train/loss") == [(0, 2.0), (1, 1.0)]
    assert runs_in(uri, "unit")[0].data.tags["stage"] == "two"
    t.finish()
    assert runs_in(uri, "unit")[0].info.status == "FINISHED"


def test_the_sender_starts_no_process_to_create_the_run(tmp_path: Path, store_template: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """A child process the sender thread starts waits for its exec on a pipe that a DataLoader
    worker forked meanwhile by the training thread holds open: the run was not created for
    minutes (CI, twice). Who and what ran the run (`git rev-parse`) is found by the caller."""
    import subprocess

    starts: list[str] = []
    popen_init = subprocess.Popen.__init__

    def recording(self: subprocess.Popen, *args: object, **kwargs: object) -> None:
        starts.append(threading.current_thread().name)
        popen_init(self, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(subprocess.Popen, "__init__", recording)
    uri = new_store(tmp_path / "mlflow.db", store_template)
    t = tracker(uri, tmp_path / "job")
    t.start(tags={"world_size": "1"}, run_name="attributed")
    t.begin_sending()
    assert t.flush() is True
    assert "mlflow-sender" not in starts
    [run] = runs_in(uri, "unit")
    assert len(run.data.tags["mlflow.source.git.commit"]) == 40
    assert run.data.tags["mlflow.user"] == run.data.tags["unix_user"]
    t.finish()


def test_typed_records_survive_the_unsent_file(tmp_path: Path) -> None:
    saved = [CreateRun(experiment_id=None, experiment="unit", run_name="r", tags={"a": "1"}),
             ResumeRun(run_id="abc"),
             ArtifactFile(path="/tmp/model.pt", artifact_path="weights"),
             ArtifactFile(path="/tmp/confusion_matrix.svg"),
             Text(text="optim:\n  lr: 0.1\n", artifact_file="config.yaml"),
             Table(table={"class": ["0", "1"], "accuracy": [0.5, 1.0]},
                   artifact_file="per_class_accuracy.json"),
             DatasetInput(name="digits-train", digest="0123abcd", num_rows=3,
                          features_shape=[3, 1, 8, 8], features_dtype="float32"),
             Model(model=object(), input_example=None),
             EndRun(status="FAILED", error="boom")]
    rows = Batch(metrics=[("m", 0.5, 1000, 3)], params=[("p", "v")], tags=[("t", "x")])
    path = tmp_path / unsent.UNSENT_FILE
    header = {"run_id": None, "tracking_uri": "http://x", "status": "FAILED"}
    assert unsent.save(path, header, rows, saved) == ["model"]
    assert json.loads(path.read_text().splitlines()[1])["record"] == "create"
    assert unsent.load(path) == (header, rows, [r for r in saved if not isinstance(r, Model)])


@pytest.mark.parametrize(("line", "problem"), [
    ({"record": "confusion", "confusion": [[1]], "class_names": ["a"]},
     "unknown record kind 'confusion'"),
    ({"record": "text", "text": 3, "artifact_file": "config.yaml"}, "text=3 is not str"),
    ({"record": "file", "path": "a", "event": "x"}, "unknown fields ['event']"),
    ({"record": "end"}, "missing 1 required positional argument: 'status'"),
    ({"metric": ["m", 1.0]}, "not enough values"),
    ({"something": 1}, "neither a record nor"),
])
def test_the_unsent_file_accepts_only_known_records(tmp_path: Path, line: dict[str, object],
                                                     problem: str) -> None:
    path = tmp_path / unsent.UNSENT_FILE
    header = {"run_id": "abc", "tracking_uri": "http://x", "status": "FINISHED"}
    path.write_text(json.dumps(header) + "\n" + '{"tag": ["t", "x"]}\n' + json.dumps(line) + "\n")
    with pytest.raises(ValueError, match=f"{re.escape(str(path))}:3: .*{re.escape(problem)}"):
        unsent.load(path)
    # The command refuses the file with that message, before any request.
    with pytest.raises(SystemExit, match=f"{re.escape(str(path))}:3"):
        outbox.main(["upload", str(path)])
    assert path.exists()


def test_null_run_does_nothing(tmp_path: Path) -> None:
    threads = threading.active_count()
    for run in (open_run(unit_config("http://127.0.0.1:1"), tmp_path, is_main=False),
                open_run(unit_config("http://127.0.0.1:1", enabled=False), tmp_path,
                         is_main=True)):
        assert type(run) is NullRun
        run.start(tags={"a": "1"}, run_name="n", resume_run_id=None)
        run.log_params({"p": "1"})
        run.log_metrics({"m": 1.0}, step=0)
        run.set_tags({"t": "x"})
        run.log(Text(text="t", artifact_file="t.txt"))
        run.begin_sending()
        run.flush()
        run.finish(status="FAILED", error="boom")
        assert (run.run_id, run.experiment_id, run.uri, run.cpu_seconds) == (None, None, "", 0.0)
    assert list(tmp_path.iterdir()) == [] and threading.active_count() == threads


def test_a_run_refuses_what_is_not_a_record(tmp_path: Path) -> None:
    t = tracker("http://127.0.0.1:1", tmp_path / "job", flush_timeout_s=1.0)
    with pytest.raises(TypeError, match="not a record"):
        t.log(("text", "config.yaml"))  # type: ignore[arg-type]
    t.finish()


def test_training_flops_are_counted_without_computing() -> None:
    model = models.build(ModelConfig(name="resnet18"), models.InputSpec(3, 32, 10))
    per_sample = flops.training_flops_per_sample(model, (3, 32, 32))
    # CIFAR ResNet-18: ~0.56 GMACs forward = 1.1 GFLOP; backward twice that.
    assert per_sample == pytest.approx(3.3e9, rel=0.05)
    assert next(model.parameters()).device.type == "cpu"  # the model itself is untouched


@pytest.mark.parametrize("auto_class", ["sequence_classification", "token_classification"])
def test_a_text_classifier_with_padding_has_its_flops_counted(auto_class: str) -> None:
    """model=hf on data=arrow's padded texts: token ids in, the padding masked out of attention.
    transformers asks whether the mask masks anything (a value a meta tensor has not): the count
    runs on fake tensors, which it takes for a trace, and the mask changes no FLOP."""
    pytest.importorskip("transformers")
    from train.models import hf

    sizes = {"model_type": "bert", "hidden_size": 32, "num_hidden_layers": 2,
             "num_attention_heads": 2, "intermediate_size": 64}
    counted = []
    for pad in (0, None):
        torch.manual_seed(0)
        model = hf.build(auto_class, config=dict(sizes), vocab_size=512, num_classes=3,
                         pad_token_id=pad)
        assert (model.pad_id is None) == (pad is None)
        counted.append(flops.training_flops_per_sample(model, (16,), tokens=True))
    masked, unmasked = counted
    assert masked is not None and masked == unmasked
    # Mostly the layers' weights, at 6 FLOPs per weight and token (forward 2, backward 4).
    weights = 2 * (4 * 32 * 32 + 2 * 32 * 64)
    assert 6 * weights * 16 <= masked <= 3 * 6 * weights * 16


def test_a_models_copies_on_the_meta_device_and_the_host_are_made_there() -> None:
    """The FLOPs count's shapes and the logged model's host copy (train/models/copies.py):
    each tensor made on the target device, not copied where the model is first (on a GPU, the
    whole model again for a moment); tied weights stay tied, the model is untouched."""
    from train.models.copies import copy_on
    from train.models.gpt import GPT

    model = GPT(vocab_size=64, seq_len=8, n_layer=1, n_head=2, n_embd=16)
    model.lm_head.weight.requires_grad_(False)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    ghost, host = copy_on(model, "meta"), copy_on(model, "cpu")
    for copied, device in ((ghost, "meta"), (host, "cpu")):
        assert copied.lm_head.weight is copied.wte.weight  # still tied
        assert not copied.wte.weight.requires_grad
        for (name, theirs), ours in zip(copied.state_dict().items(), before.values(), strict=True):
            assert theirs.device.type == device and theirs.shape == ours.shape, name
    assert all(torch.equal(host.state_dict()[k], v) for k, v in before.items())
    assert all(p.data_ptr() != q.data_ptr() for p, q in zip(host.parameters(), model.parameters(),
                                                             strict=True))
    assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items())
    assert next(model.parameters()).device.type == "cpu"


def test_peak_flops_come_from_the_config_or_a_known_gpu() -> None:
    cpu = torch.device("cpu")
    assert flops.peak_tflops(cpu, "fp32", None) is None
    assert flops.peak_tflops(cpu, "fp32", 2.5) == 2.5
    names = [key for key, _, _ in flops.PEAK_TFLOPS]
    assert names.index("H100 PCIe") < names.index("H100")  # the more specific name first
    # Names as CUDA gives them: each its own data sheet's dense peak, none taken for another
    # whose name is a part of its own (an L40 is no L4: its MFU came out 1.5x too high).
    sheets = {"NVIDIA H100 80GB HBM3": (989.4, 66.9), "NVIDIA H100 PCIe": (756.0, 51.2),
              "NVIDIA H200": (989.4, 66.9), "NVIDIA A100-SXM4-80GB": (312.0, 19.5),
              "NVIDIA L40S": (362.1, 91.6), "NVIDIA L40": (181.0, 90.5),
              "NVIDIA L4": (121.0, 30.3), "NVIDIA A10G": (70.0, 31.2)}
    for name, (half, single) in sheets.items():
        assert (flops.peak_of(name, "bf16-mixed"), flops.peak_of(name, "fp32")) == \
            (half, single), name
    assert flops.peak_of("NVIDIA GeForce RTX 4090", "bf16-mixed") is None
