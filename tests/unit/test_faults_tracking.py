"""Faults and bad input of issue 14 (tracking, checkpoints, input), tried for real: refusals at
pre-flight in one line, tracking errors classified (permanent ones end the sender at once),
checkpoints from another job refused before any run is touched, a full disk, a finished job run
again, the unsent file and its upload refusing what its job could not have written.

The fast tests compose configs with Hydra's compose API and call the real pre-flight, real
MLflow clients and a real (small) tmpfs; the slow ones run the real CLI and read the real store.
"""

from __future__ import annotations

import contextlib
import functools
import http.server
import json
import os
import re
import shutil
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from tests.conftest import REPO, history, run_train, runs_in, skip_or_fail
from train import outbox
from train.config.groups import ConfigError, TrackingConfig
from train.config.schema import register_schema, to_container, to_typed
from train.distributed.env import free_port
from train.engine import checkpoint
from train.launch import preflight
from train.launch.local import LaunchError
from train.tracking import client, unsent
from train.tracking.records import ArtifactFile, Batch, EndRun, Text
from train.tracking.run import MlflowRun


@functools.cache
def _composed(options: tuple[str, ...]) -> dict:
    register_schema()
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        return to_container(compose(config_name="train", overrides=list(options)))


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


def test_a_checkpoint_of_another_model_or_world_size_is_named_as_such() -> None:
    cnn = _checkpoint_state("model=cnn")
    mlp = preflight.config_dict(typed("model=mlp"))
    problem = checkpoint.mismatch(cnn, mlp, world_size=2)
    assert problem is not None and "model.name='cnn' there, 'mlp' here" in problem
    same = preflight.config_dict(typed("model=cnn", "model.dropout=0.3", "optim.lr=0.01"))
    assert checkpoint.mismatch(cnn, same, world_size=1) is None  # epoch end: any world size
    mid_epoch = _checkpoint_state("model=cnn", batch_in_epoch=7)
    problem = checkpoint.mismatch(mid_epoch, same, world_size=1)
    assert problem is not None and "mid-epoch by 2 ranks and this job has 1" in problem
    synthetic = _checkpoint_state("data=synthetic", "data.num_classes=4")
    other = preflight.config_dict(typed("data=synthetic", "data.num_classes=7"))
    assert "data.num_classes=4 there, 7 here" in (checkpoint.mismatch(synthetic, other, 2) or "")


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
    first = checkpoint.save(folder, _state(1, 300), keep=2)
    second = checkpoint.save(folder, _state(2, 300), keep=2)
    # A third does not fit beside both: the older one goes, never the newest.
    third = checkpoint.save(folder, _state(3, 300), keep=2)
    assert not first.exists() and second.exists() and third.exists()
    with pytest.raises(OSError, match="No space left on device") as full:
        checkpoint.save(folder, _state(4, 700), keep=2)
    assert re.search(f"checkpoint {folder}/step-000000004.pt needs 7\\d{{5}} bytes and {folder} "
                     "has \\d+ free", str(full.value))
    assert sorted(p.name for p in folder.iterdir()) == [second.name, third.name]  # no .tmp
    assert torch.load(third, weights_only=True)["step"] == 3

    weights = checkpoint.save_weights({"w": torch.ones(700 * 256)}, small_disk / "model.pt",
                                      folder)
    assert weights.parent != small_disk and torch.equal(
        torch.load(weights, weights_only=True)["w"], torch.ones(700 * 256))
    assert third.exists()  # the newest checkpoint outlives the rescue
    shutil.rmtree(weights.parent)


# -- case 10 and issue 12 item 4: the outbox refuses what its job could not have written -------

HEADER = {"run_id": "0123456789abcdef", "tracking_uri": "http://127.0.0.1:1", "status": "FINISHED"}


def _unsent(job: Path, *lines: object, header: dict | None = None) -> Path:
    job.mkdir(parents=True, exist_ok=True)
    path = job / unsent.UNSENT_FILE
    path.write_text("".join(json.dumps(line) + "\n" for line in [header or HEADER, *lines]))
    path.chmod(0o600)
    return path


def _refused(path: Path, *extra: str) -> str:
    with pytest.raises(SystemExit) as refused:
        outbox.main(["upload", str(path), *extra])
    message = str(refused.value.code)
    assert message.startswith("python -m train.outbox: ") and "\n" not in message, message
    return message


def test_upload_refuses_damaged_files_in_one_line(tmp_path: Path) -> None:
    job = tmp_path / "job"
    good = _unsent(job, {"metric": ["m", 1.0, 0, 1]})
    text = good.read_text()
    for content, problem in [("", "is empty"), (text[:len(text) // 2], "not the header"),
                             ("\x00\xff garbage\n", "not the header"),
                             (text + '{"metric": ["m", 1.0]}\n', "not enough values"),
                             (text + "{not json\n", ":3:")]:
        good.write_text(content)
        assert problem in _refused(good)
    assert "No such file" in _refused(tmp_path / "missing.jsonl")


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
        message = _refused(_unsent(job, record))
        assert any(part in message for part in ("not a file inside the job's output directory",
                                                "must be a plain relative path",
                                                "unknown record kind", "resumes run")), name
    # The store the job logged to is where the upload goes, unless the user says otherwise.
    (job / "mlflow_run.json").write_text(json.dumps(
        {"run_id": HEADER["run_id"], "tracking_uri": "sqlite:////real/mlflow.db"}))
    path = _unsent(job, {"record": "file", "path": str(inside), "artifact_path": None})
    assert "give --tracking-uri" in _refused(path)
    path.chmod(0o666)  # writable by anyone: anyone could have written it
    assert "not yours alone" in _refused(path, "--tracking-uri", "http://127.0.0.1:1")
    assert path.exists() and secret.read_text() == "PRIVATE KEY"


# -- slow: real stores, the real CLI --------------------------------------------------------------

def tracker(uri: str, out: Path, **overrides: object) -> MlflowRun:
    out.mkdir(parents=True, exist_ok=True)
    cfg = TrackingConfig(uri=uri, experiment="faults", experiment_id=None, parent_run_id=None,
                         **overrides)  # type: ignore[arg-type]
    return MlflowRun(cfg, out)


@pytest.mark.slow
def test_a_permanent_error_mid_run_ends_the_sender_at_once(tmp_path: Path) -> None:
    """A request the store refuses for good (here: a param whose value changes, which MLflow
    never accepts) stops the sender: no checkpoint or end waits on it, the rest is in the
    unsent file, the job is told it did not all arrive, and the upload names the problem."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    job = tmp_path / "job"
    t = tracker(uri, job, batch_interval_s=0.0, flush_timeout_s=120.0)
    t.start(tags={"world_size": "1"}, run_name="refused")
    t.begin_sending()
    t.log_params({"optim.lr": "0.1"})
    assert t.flush(30)
    t.log_params({"optim.lr": "0.2"})  # refused for good
    t.log_metrics({"train/loss": 1.0}, 0)
    began = time.monotonic()
    assert not t.flush(30)
    assert not t.finish()
    assert time.monotonic() - began < 60  # not 2 x 120 s of retries
    assert t.failure is not None and "optim.lr" in t.failure
    [run] = runs_in(uri, "faults")
    assert run.info.status == "RUNNING"  # the store's truth: its end never arrived ...
    assert t.unsent_path.stat().st_mode & 0o777 == 0o600  # private, whatever the umask
    header, rows, records = unsent.load(t.unsent_path)  # ... and is kept here
    assert header["status"] == "FINISHED" and isinstance(records[-1], EndRun)
    assert rows.metrics[0][:2] == ("train/loss", 1.0)
    message = _refused(t.unsent_path)  # the same refusal again: one line, file kept
    assert "was not delivered" in message and t.unsent_path.exists()


@pytest.mark.slow
def test_a_run_that_arrives_through_the_unsent_file_is_the_jobs_run(tmp_path: Path) -> None:
    """Never created (the store was gone); the upload creates it and the job directory then
    names it, so running the job again continues that run."""
    from train.tracking import recorded_run_id

    job = tmp_path / "job"
    t = tracker(f"http://127.0.0.1:{free_port()}", job, flush_timeout_s=1.0)
    t.start(tags={"world_size": "1"}, run_name="late")
    t.log_metrics({"train/loss": 0.5}, 0)
    (job / "model.pt").write_bytes(b"weights")
    t.log(ArtifactFile(path=str(job / "model.pt"), artifact_path="weights"))
    t.log(Text(text="a: 1\n", artifact_file="config.yaml"))
    assert not t.finish()
    assert recorded_run_id(job) is None
    store = f"sqlite:///{tmp_path / 'mlflow.db'}"
    run_id = unsent.upload(t.unsent_path, tracking_uri=store)
    assert recorded_run_id(job) == run_id
    [run] = runs_in(store, "faults")
    assert run.info.run_id == run_id and run.info.status == "FINISHED"
    assert history(store, run_id, "train/loss") == [(0, 0.5)]
    # An unknown run id is one line too, not a traceback.
    stray = _unsent(tmp_path / "stray", {"metric": ["m", 1.0, 0, 1]},
                    header={**HEADER, "tracking_uri": store})
    assert "was not delivered" in _refused(stray)


@pytest.mark.slow
def test_a_store_file_removed_mid_run_is_not_reported_as_finished(tmp_path: Path) -> None:
    db = tmp_path / "mlflow.db"
    t = tracker(f"sqlite:///{db}", tmp_path / "job", batch_interval_s=0.0)
    t.start(tags={}, run_name="orphaned")
    t.begin_sending()
    t.log_metrics({"train/loss": 1.0}, 0)
    assert t.flush(60)
    db.unlink()
    t.log_metrics({"train/loss": 0.5}, 1)
    assert not t.finish(timeout_s=20)
    # Writes to the removed file's inode fail (read-only) or the file is found replaced.
    assert t.failure is not None and ("readonly database" in t.failure
                                      or "was removed or replaced" in t.failure)


@pytest.mark.slow
def test_a_finished_job_and_checkpoints_of_other_jobs(store: dict[str, str],
                                                       tmp_path: Path) -> None:
    """One 2-rank job, then what the issue did to it: its validation shard on rank 1 is empty
    (case 8); run again it changes nothing (7); another model from its checkpoint is refused
    before any run is touched (4); more epochs on another world size continue its run (7)."""
    uri = store["MLFLOW_TRACKING_URI"]
    job = tmp_path / "cnn"
    first = run_train("distributed.nproc_per_node=2", "data.val_fraction=0.0001",
                      "trainer.epochs=1", "tracking.log_model=false", f"hydra.run.dir={job}",
                      env=store)
    assert first.returncode == 0, first.stderr
    [run] = runs_in(uri)
    run_id = run.info.run_id
    assert run.info.status == "FINISHED" and run.data.metrics["val/samples"] == 1.0
    assert run.data.params["data.num_val"] == "1"  # rank 0 held it, rank 1 none
    summary = (job / "summary.json").read_text()

    again = run_train("data.val_fraction=0.0001", "trainer.epochs=1", "tracking.log_model=false",
                      f"hydra.run.dir={job}", env=store)  # (1 rank: cheaper, and all the same)
    assert again.returncode == 0, again.stderr
    assert f"this job finished already: MLflow run {run_id}" in again.stderr
    assert (job / "summary.json").read_text() == summary

    for overrides in ([f"trainer.resume={job}/checkpoints", f"hydra.run.dir={tmp_path}/mlp"],
                      [f"hydra.run.dir={job}", "trainer.epochs=2"]):
        refused = run_train("model=mlp", *overrides, env=store)
        assert refused.returncode == 2, refused.stderr
        assert "Refusing to resume from" in refused.stderr
        assert "model.name='cnn' there, 'mlp' here" in refused.stderr
        assert "Traceback" not in refused.stderr
    [same] = runs_in(uri)
    assert same.info.status == "FINISHED" and same.data.tags == run.data.tags
    assert history(uri, run_id, "train/loss") == history(uri, same.info.run_id, "train/loss")

    more = run_train("data.val_fraction=0.0001", "trainer.epochs=2", "tracking.log_model=false",
                     f"hydra.run.dir={job}", env=store)  # 1 rank now: at an epoch's end
    assert more.returncode == 0, more.stderr
    [continued] = runs_in(uri)
    assert continued.info.run_id == run_id and continued.info.status == "FINISHED"
    assert [s for s, _ in history(uri, run_id, "train/loss")] == [0, 1]
    assert continued.data.tags["restarts"] == "1"


@pytest.mark.slow
def test_a_full_output_disk_still_keeps_the_finished_training(
        store: dict[str, str], tmp_path: Path, request: pytest.FixtureRequest) -> None:
    """1 MiB of output disk: one checkpoint fits, the final weights no longer do - they are
    saved to $TMPDIR instead, said so, and the run (with them) is FINISHED."""
    if os.geteuid() != 0:
        skip_or_fail("mounting a small tmpfs needs root")
    out = tmp_path / "out"
    out.mkdir()
    # The rescue directory is the job's TMPDIR: short, as the pre-flight wants it for the
    # DataLoader workers' sockets (tmp_path is longer under pytest-xdist).
    rescue = Path(tempfile.mkdtemp(prefix="rescue-", dir="/tmp"))
    request.addfinalizer(lambda: shutil.rmtree(rescue, ignore_errors=True))
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(out)], check=True)
    try:
        result = run_train("trainer.epochs=1", "tracking.log_model=false",
                           f"hydra.run.dir={out}", env={**store, "TMPDIR": str(rescue)})
        listing = sorted(p.name for p in (out / "checkpoints").iterdir())
    finally:
        with contextlib.suppress(OSError):
            subprocess.run(["umount", "-l", str(out)], check=False)
    assert result.returncode == 0, result.stderr
    assert "No space left on device" in result.stderr and "model.pt" in result.stderr
    [saved] = rescue.glob("train-weights-*/model.pt")
    assert f"saved to {saved}" in result.stderr
    assert listing == ["step-000000023.pt"]  # no partial file
    [run] = runs_in(store["MLFLOW_TRACKING_URI"])
    assert run.info.status == "FINISHED"


@pytest.mark.slow
def test_a_job_whose_end_did_not_reach_the_store_does_not_claim_success(tmp_path: Path) -> None:
    """The run logger of a finished training, over a store that never answered: no FINISHED
    line, but an error that says where the rest is and how to deliver it."""
    from train.config.groups import TrainConfig
    from train.report.progress import Progress
    from train.report.runlog import RunLogger
    from train.tracking import TrackingIncomplete

    cfg = TrainConfig()
    cfg.tracking = TrackingConfig(uri=f"http://127.0.0.1:{free_port()}", flush_timeout_s=1.0,
                                  checkpoint_flush_s=0.5)
    logger = RunLogger(cfg, tracker(cfg.tracking.uri, tmp_path / "job", flush_timeout_s=1.0),
                       Progress(False, 1, 64))
    logger.run.start(tags={"world_size": "1"})
    logger.run.log_metrics({"val/accuracy": 0.9}, 0)
    with pytest.raises(TrackingIncomplete) as incomplete:
        logger.finish()
    path = tmp_path / "job" / unsent.UNSENT_FILE
    assert f"python -m train.outbox upload {path}" in str(incomplete.value)
    assert unsent.load(path)[0]["status"] == "FINISHED"
    logger.finish(error="a second call")  # the failure path calls it again: nothing happens
    assert len(list((tmp_path / "job").glob("mlflow_unsent*"))) == 1


@pytest.mark.slow
def test_a_restart_delivers_what_its_stopped_start_left_unsent(tmp_path: Path) -> None:
    """A stop while the store was away left the last rows in the unsent file; the next start
    of the job (same directory, same run) delivers them before it continues the run."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    job = tmp_path / "job"
    first = tracker(uri, job)
    first.start(tags={}, run_name="stopped")
    first.begin_sending()
    first.log_metrics({"train/loss": 1.0}, 0)
    assert first.finish(status="KILLED")
    run_id = first.run_id
    left = Batch(metrics=[("train/loss", 0.5, 0, 1)], tags=[("stopped_by", "SIGTERM")])
    unsent.save(job / unsent.UNSENT_FILE, {"run_id": run_id, "tracking_uri": uri,
                                           "status": "KILLED"}, left, [])
    again = tracker(uri, job)
    again.start(tags={"restarts": "1"}, resume_run_id=run_id)
    again.begin_sending()
    again.log_metrics({"train/loss": 0.25}, 2)
    assert again.finish()
    assert history(uri, run_id, "train/loss") == [(0, 1.0), (1, 0.5), (2, 0.25)]
    [run] = runs_in(uri, "faults")
    assert run.info.status == "FINISHED" and run.data.tags["stopped_by"] == "SIGTERM"
    assert (job / "mlflow_unsent.uploaded").exists()
