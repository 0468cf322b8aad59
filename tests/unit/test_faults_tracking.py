"""Faults and bad input of issue 14 (tracking, checkpoints, input), tried for real: refusals at
pre-flight in one line, tracking errors classified, checkpoints from another job refused before
any run is touched, a full disk, the unsent file and its upload refusing what its job could not
have written.

Configs composed with Hydra's compose API, the real pre-flight, real MLflow clients and a real
(small) tmpfs, all in process; the real CLI and the long waits on real stores are in
tests/e2e/test_faults_tracking.py.
"""

from __future__ import annotations

import functools
import http.server
import json
import os
import re
import shutil
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from tests.conftest import composed, skip_or_fail
from train import outbox
from train.config.groups import ConfigError
from train.config.schema import to_container, to_typed
from train.distributed.env import free_port
from train.engine import checkpoint_folder, checkpoint_match
from train.launch import preflight
from train.launch.local import LaunchError
from train.tracking import client, unsent


@functools.cache
def _composed(options: tuple[str, ...]) -> dict:
    return to_container(composed(*options))


def typed(*overrides: str):
    """As `python -m train <overrides>` composes it: group options through Hydra (composed once
    per set of options), values merged onto that, so that each case costs milliseconds."""
    options = tuple(o for o in overrides if "." not in o.split("=")[0])
    values = [o for o in overrides if o not in options]
    merged = OmegaConf.merge(_composed(options), OmegaConf.from_dotlist(values))
    return to_typed(OmegaConf.to_container(merged, resolve=True))


def one_line(error: BaseException) -> str:
    text = str(error)
    assert "\n" not in text.strip() and "Traceback" not in text, text
    return text


# -- case 11 and the names of case 1: refused at pre-flight, nothing created --------------------

@pytest.mark.parametrize(("overrides", "expected"), [
    (("trainer.resume=/nonexistent/ckpt",), "trainer.resume=/nonexistent/ckpt: no such file"),
    (("data.num_workers=-1",), "data.num_workers must be 0 or more"),
    (("data=synthetic", "data.num_classes=0"), "data.num_classes must be positive (got 0)"),
    (("tracking.experiment=''",), "tracking.experiment must be a name of 1 to 250"),
    ((f"tracking.experiment={'x' * 1000}",), "(got 1000)"),
])
def test_bad_input_is_refused_at_preflight_in_one_line(tmp_path: Path, overrides: tuple[str, ...],
                                                        expected: str) -> None:
    store = tmp_path / "store"
    cfg = typed(*overrides, f"tracking.uri=sqlite:///{store}/mlflow.db")
    with pytest.raises(ConfigError) as refused:
        preflight.preflight([cfg], output_dir=str(tmp_path / "job"))
    assert expected in one_line(refused.value)
    assert not store.exists()  # no store, so no run


class NotMlflow(http.server.BaseHTTPRequestHandler):
    """A web service that answers /health, as many do, but is no MLflow server."""

    def do_GET(self) -> None:
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()
        self.wfile.write(b"<html>not here</html>")

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def not_mlflow() -> Iterator[str]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), NotMlflow)
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_port}"
    server.shutdown()
    server.server_close()


def test_stores_that_can_never_work_are_refused_at_preflight(not_mlflow: str) -> None:
    import mlflow  # noqa: F401 - imported before the clock starts (seconds under load)

    expected = {"file:///nonexistent/x": "filesystem tracking backend",
                "foo://bar": "unsupported URI 'foo://bar'",
                not_mlflow: "not an MLflow server"}
    for uri, problem in expected.items():
        began = time.monotonic()
        with pytest.raises(LaunchError) as refused:
            preflight.check_tracking(typed(f"tracking.uri={uri}"), on_slurm=False, prepare=False)
        assert problem in one_line(refused.value), uri
        assert time.monotonic() - began < 30, uri  # one try, not MLflow's minutes of retries


def test_tracking_errors_are_classified_from_real_requests(not_mlflow: str) -> None:
    from mlflow import MlflowClient

    def error_of(uri: str) -> Exception:
        client.one_try_client(not_mlflow)  # sets the one-try limits first
        try:
            MlflowClient(tracking_uri=uri).search_experiments(max_results=1)
        except Exception as e:  # noqa: BLE001 - the error is what is tested
            return e
        raise AssertionError(f"{uri} answered")

    error_of(not_mlflow)  # mlflow imported before the clock starts
    began = time.monotonic()
    refused = error_of(f"http://127.0.0.1:{free_port()}")  # nobody listens: try again later
    assert time.monotonic() - began < 30  # one try: MLflow alone would retry for minutes
    assert not client.is_permanent(refused)
    assert client.is_permanent(error_of(not_mlflow))  # 404: the same answer every time
    assert client.is_permanent(error_of("file:///nonexistent/x"))
    assert client.is_permanent(ModuleNotFoundError("No module named 'psycopg'"))
    assert not client.is_permanent(ConnectionResetError("reset by peer"))


# -- case 4: a checkpoint from another job ----------------------------------------------------

def _checkpoint_state(*overrides: str, world_size: int = 2, batch_in_epoch: int = 0) -> dict:
    config = preflight.config_dict(typed(*overrides))
    return {"config": OmegaConf.to_yaml(config), "world_size": world_size,
            "batch_in_epoch": batch_in_epoch}


def test_a_checkpoint_of_another_model_or_batch_is_named_as_such() -> None:
    cnn = _checkpoint_state("model=cnn")
    mlp = preflight.config_dict(typed("model=mlp"))
    problem = checkpoint_match.mismatch(cnn, mlp, world_size=2)
    assert problem is not None and "model.name='cnn' there, 'mlp' here" in problem
    same = preflight.config_dict(typed("model=cnn", "model.dropout=0.3", "optim.lr=0.01"))
    assert checkpoint_match.mismatch(cnn, same, world_size=1) is None  # epoch end: any world size
    # Mid-epoch: any world size too (the position counts global batches), not another batch.
    mid_epoch = _checkpoint_state("model=cnn", batch_in_epoch=7)
    assert checkpoint_match.mismatch(mid_epoch, same, world_size=1) is None
    bigger = preflight.config_dict(typed("model=cnn", "data.batch_size=128"))
    problem = checkpoint_match.mismatch(mid_epoch, bigger, world_size=2)
    assert problem is not None and "mid-epoch with data.batch_size=" in problem
    synthetic = _checkpoint_state("data=synthetic", "data.num_classes=4")
    other = preflight.config_dict(typed("data=synthetic", "data.num_classes=7"))
    problem = checkpoint_match.mismatch(synthetic, other, 2)
    assert "data.num_classes=4 there, 7 here" in (problem or "")
    # Another task shapes the model's outputs otherwise; a checkpoint from before the task
    # group existed (no `task` in its config) is a classifier's and continues as one.
    regression = preflight.config_dict(typed("model=cnn", "task=regression"))
    assert "task.name='classification' there, 'regression' here" in (
        checkpoint_match.mismatch(cnn, regression, 1) or "")
    before_tasks = {**cnn, "config": OmegaConf.to_yaml(
        {k: v for k, v in preflight.config_dict(typed("model=cnn")).items() if k != "task"})}
    assert checkpoint_match.mismatch(before_tasks, same, world_size=1) is None


# -- case 6: a full disk ------------------------------------------------------------------------

@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A real 1 MiB filesystem (tmpfs), unmounted afterwards."""
    if os.geteuid() != 0 or shutil.which("mount") is None:
        skip_or_fail("mounting a small tmpfs needs root")
    folder = tmp_path / "small"
    folder.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(folder)], check=True)
    try:
        yield folder
    finally:
        subprocess.run(["umount", "-l", str(folder)], check=False)


def _state(step: int, kilobytes: int) -> dict:
    return {"step": step, "model": {"w": torch.zeros(kilobytes * 256)}}


def test_a_full_disk_keeps_the_previous_checkpoint_and_rescues_the_weights(
        small_disk: Path) -> None:
    folder = small_disk / "checkpoints"
    first = checkpoint_folder.save(folder, _state(1, 300), keep=2)
    second = checkpoint_folder.save(folder, _state(2, 300), keep=2)
    # A third does not fit beside both: the older one goes, never the newest.
    third = checkpoint_folder.save(folder, _state(3, 300), keep=2)
    assert not first.exists() and second.exists() and third.exists()
    with pytest.raises(OSError, match="No space left on device") as full:
        checkpoint_folder.save(folder, _state(4, 700), keep=2)
    assert re.search(f"checkpoint {folder}/step-000000004.pt needs 7\\d{{5}} bytes and {folder} "
                     "has \\d+ free", str(full.value))
    assert sorted(p.name for p in folder.iterdir()) == [second.name, third.name]  # no .tmp
    assert torch.load(third, weights_only=True)["step"] == 3

    weights = checkpoint_folder.save_weights({"w": torch.ones(700 * 256)},
                                             small_disk / "model.pt", folder)
    assert weights.parent != small_disk and torch.equal(
        torch.load(weights, weights_only=True)["w"], torch.ones(700 * 256))
    assert third.exists()  # the newest checkpoint outlives the rescue
    shutil.rmtree(weights.parent)


def _sharded_state(width: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A Linear sharded by FSDP2 with AdamW's state after a step: ~12 x width^2 bytes."""
    from torch.distributed.fsdp import fully_shard

    model = torch.nn.Linear(width, width, bias=False)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, width)).sum().backward()
    optimizer.step()
    return model, optimizer


def test_a_sharded_checkpoint_makes_room_or_is_refused_before_any_shard_is_written(
        small_disk: Path) -> None:
    """As for single files: older checkpoints (directories) but the newest go when that makes
    room; when even that is not enough, DiskFull before dcp writes anything (no .tmp), the
    newest kept."""
    import torch.distributed as dist

    from train.engine import sharded

    folder = small_disk / "checkpoints"
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0,
                            world_size=1)
    try:
        model, optimizer = _sharded_state(96)  # ~110 KB a checkpoint
        saved = [sharded.save(folder, step, model, optimizer, {"step": step},
                              checkpoint_folder.candidates(folder)[1:]) for step in range(1, 10)]
        kept = checkpoint_folder.candidates(folder)
        assert kept[0] == saved[-1] and saved[0] not in kept  # the oldest went, for room
        big, big_optimizer = _sharded_state(320)  # ~1.2 MB: more than the whole disk
        with pytest.raises(OSError, match="No space left on device: the checkpoint "
                                          f"{folder}/step-000000010.dcp needs"):
            sharded.save(folder, 10, big, big_optimizer, {"step": 10},
                         checkpoint_folder.candidates(folder)[1:])
    finally:
        dist.destroy_process_group()
    assert checkpoint_folder.candidates(folder) == kept  # nothing removed in vain
    assert not list(folder.glob("*.tmp"))
    assert checkpoint_folder.load_newest(kept).state["step"] == 9


# -- case 10 and issue 12 item 4: the outbox refuses what its job could not have written -------

HEADER = {"run_id": "0123456789abcdef", "tracking_uri": "http://127.0.0.1:1", "status": "FINISHED"}


def unsent_file(job: Path, *lines: object, header: dict | None = None) -> Path:
    job.mkdir(parents=True, exist_ok=True)
    path = job / unsent.UNSENT_FILE
    path.write_text("".join(json.dumps(line) + "\n" for line in [header or HEADER, *lines]))
    path.chmod(0o600)
    return path


def refused_upload(path: Path, *extra: str) -> str:
    with pytest.raises(SystemExit) as refused:
        outbox.main(["upload", str(path), *extra])
    message = str(refused.value.code)
    assert message.startswith("python -m train outbox: ") and "\n" not in message, message
    return message


def test_upload_refuses_damaged_files_in_one_line(tmp_path: Path) -> None:
    job = tmp_path / "job"
    good = unsent_file(job, {"metric": ["m", 1.0, 0, 1]})
    text = good.read_text()
    for content, problem in [("", "is empty"), (text[:len(text) // 2], "not the header"),
                             ("\x00\xff garbage\n", "not the header"),
                             (text + '{"metric": ["m", 1.0]}\n', "not enough values"),
                             (text + "{not json\n", ":3:")]:
        good.write_text(content)
        assert problem in refused_upload(good)
    assert "No such file" in refused_upload(tmp_path / "missing.jsonl")


def test_upload_refuses_a_crafted_file(tmp_path: Path) -> None:
    secret = tmp_path / "home" / ".ssh" / "id_ed25519"
    secret.parent.mkdir(parents=True)
    secret.write_text("PRIVATE KEY")
    secret.chmod(0o600)
    job = tmp_path / "job"
    inside = job / "model.pt"
    job.mkdir()
    inside.write_bytes(b"weights")
    crafted = {
        "outside": {"record": "file", "path": str(secret), "artifact_path": None},
        "climbing": {"record": "file", "path": str(job / ".." / "home" / ".ssh" / "id_ed25519")},
        "link": {"record": "file", "path": str(job / "link")},
        "name": {"record": "text", "text": "x", "artifact_file": "../../escaped.txt"},
        "kind": {"record": "shell", "command": "touch /tmp/pwned"},
        "other run": {"record": "resume", "run_id": "someone-elses-run"},
    }
    (job / "link").symlink_to(secret)
    for name, record in crafted.items():
        message = refused_upload(unsent_file(job, record))
        assert any(part in message for part in ("not a file inside the job's output directory",
                                                "must be a plain relative path",
                                                "unknown record kind", "resumes run")), name
    # The store the job logged to is where the upload goes, unless the user says otherwise.
    (job / "mlflow_run.json").write_text(json.dumps(
        {"run_id": HEADER["run_id"], "tracking_uri": "sqlite:////real/mlflow.db"}))
    path = unsent_file(job, {"record": "file", "path": str(inside), "artifact_path": None})
    assert "give --tracking-uri" in refused_upload(path)
    path.chmod(0o666)  # writable by anyone: anyone could have written it
    assert "not yours alone" in refused_upload(path, "--tracking-uri", "http://127.0.0.1:1")
    assert path.exists() and secret.read_text() == "PRIVATE KEY"
