"""Faults of issue 14 in tracking, tried for real and at length: a permanent error mid-run, a
run that arrives through the unsent file, a store file removed mid-run, a job whose end did
not reach the store, a restart delivering what its stop left unsent (real stores, waited out);
and through the real CLI, a finished job run again, checkpoints of other jobs, a full output
disk. The fast refusals: tests/unit/test_faults_tracking.py."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import REPO, history, run_train, runs_in, skip_or_fail
from tests.unit.test_faults_tracking import HEADER, refused_upload, unsent_file
from train.config.groups import TrackingConfig
from train.distributed.env import free_port
from train.tracking import unsent
from train.tracking.records import ArtifactFile, Batch, EndRun, Text
from train.tracking.run import MlflowRun


def tracker(uri: str, out: Path, **overrides: object) -> MlflowRun:
    out.mkdir(parents=True, exist_ok=True)
    cfg = TrackingConfig(uri=uri, experiment="faults", experiment_id=None, parent_run_id=None,
                         **overrides)  # type: ignore[arg-type]
    return MlflowRun(cfg, out)


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
    message = refused_upload(t.unsent_path)  # the same refusal again: one line, file kept
    assert "was not delivered" in message and t.unsent_path.exists()


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
    stray = unsent_file(tmp_path / "stray", {"metric": ["m", 1.0, 0, 1]},
                    header={**HEADER, "tracking_uri": store})
    assert "was not delivered" in refused_upload(stray)


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
    assert [s for s, _ in history(uri, run_id, "train/loss")] == [1, 2]
    assert continued.data.tags["restarts"] == "1"


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


NO_POSTGRES_DRIVER = """
import sys

class NoDriver:  # as a Python environment without them: importing one fails as it would there
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in ("psycopg", "psycopg2"):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)

sys.meta_path.insert(0, NoDriver())
"""


def test_a_postgresql_store_without_its_driver_is_refused_at_preflight(
        tmp_path: Path) -> None:
    """`postgresql://` where no PostgreSQL driver is installed (hidden here by a sitecustomize
    on PYTHONPATH): one line that names what to install, exit 2, before any rank starts."""
    hide = tmp_path / "no-driver"
    hide.mkdir()
    (hide / "sitecustomize.py").write_text(NO_POSTGRES_DRIVER)
    uri = f"postgresql://mlflow@127.0.0.1:{free_port()}/mlflow"
    job = tmp_path / "job"
    result = run_train(f"tracking.uri={uri}", f"hydra.run.dir={job}", timeout=120,
                       env={"PYTHONPATH": os.pathsep.join([str(hide), str(REPO)])})
    assert result.returncode == 2, result.stderr
    [line] = [x for x in result.stderr.splitlines() if x.startswith("error:")]
    assert f"The MLflow store {uri} needs a database driver that is not installed here" in line
    assert "pip install 'psycopg[binary]'" in line
    assert "Traceback" not in result.stderr
    assert not (job / "checkpoints").exists() and not (job / "mlflow_run.json").exists()


@contextlib.contextmanager
def small_output_disk(tmp_path: Path, size: str) -> Iterator[Path]:
    """An empty output directory on a real tmpfs of `size` (mount's units), unmounted after."""
    if os.geteuid() != 0:
        skip_or_fail("mounting a small tmpfs needs root")
    out = tmp_path / "out"
    out.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(out)], check=True)
    try:
        yield out
    finally:
        with contextlib.suppress(OSError):
            subprocess.run(["umount", "-l", str(out)], check=False)


def test_too_little_output_disk_is_refused_before_training(store: dict[str, str],
                                                           tmp_path: Path) -> None:
    """128 KiB of output disk: room for the job's small files (config, log, heartbeat), less than
    one checkpoint needs. Said before the first step, so no epoch's work is lost to it; nothing
    is trained or checkpointed."""
    with small_output_disk(tmp_path, "128k") as out:
        result = run_train("trainer.epochs=1", "tracking.log_model=false",
                           f"hydra.run.dir={out}", env=store)
        checkpoints = sorted(p.name for p in (out / "checkpoints").glob("*"))
    assert result.returncode == 1, result.stderr
    assert re.search(f"No space left on device: {out}/checkpoints has \\d+ bytes free and one "
                     "checkpoint needs about \\d+", result.stderr), result.stderr
    assert checkpoints == []
    [run] = runs_in(store["MLFLOW_TRACKING_URI"])
    assert run.info.status == "FAILED" and "one checkpoint needs about" in run.data.tags["error"]
    assert history(store["MLFLOW_TRACKING_URI"], run.info.run_id, "train/loss") == []


def test_an_output_disk_filling_at_a_checkpoint_fails_the_run(store: dict[str, str],
                                                              tmp_path: Path) -> None:
    """1 MiB of output disk holds the first epoch's checkpoint, not a second beside it (the
    newest is never removed to make room): the run is FAILED with the line that says so, and
    the first checkpoint is kept whole, with no partial file."""
    with small_output_disk(tmp_path, "1m") as out:
        result = run_train("trainer.epochs=2", "tracking.log_model=false",
                           f"hydra.run.dir={out}", env=store)
        listing = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert result.returncode == 1, result.stderr
    expected = (f"No space left on device: the checkpoint {out}/checkpoints/step-000000046.pt "
                f"needs \\d+ bytes and {out}/checkpoints has \\d+ free")
    assert re.search(expected, result.stderr), result.stderr
    # One rank, in the launching process: the same block as from several ranks (test_hang.py).
    assert "Traceback" not in result.stderr and "tracebacks: " in result.stderr
    assert (f"  kept: {out}/checkpoints/step-000000023.pt (step 23), the newest checkpoint\n"
            f"  resume: python -m train trainer.epochs=2 tracking.log_model=false "
            f"hydra.run.dir={out}\n") in result.stderr, result.stderr
    assert listing == ["step-000000023.pt"]  # the first epoch's, no .tmp
    [run] = runs_in(store["MLFLOW_TRACKING_URI"])
    assert run.info.status == "FAILED"
    assert re.search(expected, run.data.tags["error"]), run.data.tags["error"]
    # The second epoch trained; only its checkpoint had no room.
    assert [s for s, _ in history(store["MLFLOW_TRACKING_URI"], run.info.run_id,
                                  "train/loss")] == [1, 2]


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
    assert f"python -m train outbox upload {path}" in str(incomplete.value)
    assert unsent.load(path)[0]["status"] == "FINISHED"
    logger.finish(error="a second call")  # the failure path calls it again: nothing happens
    assert len(list((tmp_path / "job").glob("mlflow_unsent*"))) == 1


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


SENDER_PROBE = """
import subprocess, sys, threading
from pathlib import Path

starts = []
popen_init = subprocess.Popen.__init__

def recording(self, *args, **kwargs):
    starts.append(threading.current_thread().name)
    popen_init(self, *args, **kwargs)

subprocess.Popen.__init__ = recording
from train.config.groups import TrackingConfig
from train.tracking.run import MlflowRun

out = Path(sys.argv[1])
run = MlflowRun(TrackingConfig(uri=f"sqlite:///{out / 'mlflow.db'}", experiment="probe",
                               experiment_id=None, parent_run_id=None), out)
run.start(tags={"world_size": "1"}, run_name="probe")
run.begin_sending()
assert run.flush() is True
run.finish()
print("sender started", starts.count("mlflow-sender"), "of", len(starts), "processes")
"""


def test_a_fresh_jobs_sender_starts_no_process_to_create_its_run(tmp_path: Path) -> None:
    """In a fresh interpreter, as in a job: mlflow is first imported by the sender thread, and
    its telemetry module ran `uname -p` there (platform.platform()) - a child that waits for
    its exec on a pipe a DataLoader worker forked meanwhile holds open (CreateRun stalled for
    minutes under load). The run's start reads what needs a process on the training thread."""
    done = subprocess.run([sys.executable, "-c", SENDER_PROBE, str(tmp_path)], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "sender started 0 of" in done.stdout, done.stdout
