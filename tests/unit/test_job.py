"""The fast layer's end-to-end: a config composed with Hydra's compose API, trained in-process on
one gloo rank in seconds, and read back from a real MLflow store; checkpoints saved, found and
restored; stop signals noted and their handlers put back."""

from __future__ import annotations

import json
import logging
import os
import platform
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tests.conftest import composed, history, new_store, runs_in, typed
from train.app import run
from train.config.groups import TrainConfig
from train.distributed import env as distenv
from train.distributed import process_group as distributed
from train.distributed import stopping
from train.engine import checkpoint, checkpoint_folder
from train.engine import state as train_state
from train.models import build as models

SMALL = ("data=synthetic", "data.num_samples=96", "data.val_fraction=0.2", "data.image_size=8",
         "data.batch_size=16", "model=mlp", "model.width=16", "trainer.log_every_n_steps=2",
         "data.num_workers=0", "tracking.batch_interval_s=0")


def test_train_in_process_records_one_complete_run(tmp_path: Path, no_launcher_env: None,
                                                  store_template: Path,
                                                  caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, "train")
    uri = new_store(tmp_path / "mlflow.db", store_template)
    (tmp_path / "server-auth.env").write_text("export MLFLOW_TRACKING_PASSWORD=s3cret-password\n")
    cfg = composed(*SMALL, "trainer.epochs=2", f"tracking.uri={uri}", "tracking.run_name=fast")
    out = tmp_path / "job"
    objective = run(cfg, str(out), "python -m train (test)")

    [mlflow_run] = runs_in(uri)
    assert mlflow_run.info.status == "FINISHED" and mlflow_run.info.run_name == "fast"
    assert objective == mlflow_run.data.metrics["val/accuracy"]
    # 96 samples, 20 % validation: 77 train (5 steps of 16), 19 validation, each epoch.
    run_id = mlflow_run.info.run_id
    assert history(uri, run_id, "train/samples") == [(1, 77.0), (2, 77.0)]
    assert history(uri, run_id, "val/samples") == [(1, 19.0), (2, 19.0)]  # epochs 1 and 2
    assert [s for s, _ in history(uri, run_id, "train/step_loss")] == [2, 4, 6, 8, 10]
    # One epoch numbering (1-based) in the log, the best_epoch tag and the metrics' steps.
    said = [r.getMessage() for r in caplog.records]
    assert [m.split()[1] for m in said if m.startswith("epoch ")] == ["1/2", "2/2"]
    best_epoch = [m for m in said if m.startswith("best val/accuracy so far")][-1].split()[-1]
    assert mlflow_run.data.tags["best_epoch"] == best_epoch
    best = history(uri, run_id, "best/val/accuracy")
    assert str(best[-1][0]) == best_epoch
    assert dict(history(uri, run_id, "val/accuracy"))[int(best_epoch)] == best[-1][1]
    # The closing hint: how to view the run, and where the UI's login is - not the password.
    [view] = [m for m in said if "view it:" in m]
    assert f"`make ui UI_STORE={tmp_path}`" in view and run_id in view
    assert f"user admin, password MLFLOW_TRACKING_PASSWORD in {tmp_path}/server-auth.env" in view
    assert "s3cret-password" not in "\n".join(said)
    assert mlflow_run.data.params["data.num_train"] == "77"
    assert mlflow_run.data.tags["world_size"] == "1"
    # distributed.keep_host_memory (default true) as glibc took it; other libcs: their defaults.
    kept = platform.libc_ver()[0] == "glibc"
    assert mlflow_run.data.tags["host_memory"] == ("kept" if kept else "allocator defaults")
    summary = json.loads((out / "summary.json").read_text())
    assert summary["run_id"] == run_id
    assert summary["metrics"]["val/accuracy"] == objective
    assert (out / "model.pt").stat().st_size > 0 and (out / "confusion_matrix.svg").exists()
    assert [p.name for p in checkpoint_folder.candidates(checkpoint_folder.directory(out))] == [
        "step-000000010.pt", "step-000000005.pt"]
    # The launcher's variables are gone again: the next job of a sweep starts afresh.
    assert "RANK" not in os.environ and not torch.distributed.is_initialized()


def test_max_steps_ends_training_mid_epoch_and_a_larger_one_continues_it(
        tmp_path: Path, store_template: Path, no_launcher_env: None) -> None:
    uri = new_store(tmp_path / "mlflow.db", store_template)
    out = tmp_path / "job"
    # 5 optimiser steps per epoch (77 samples, batches of 16): step 7 is in the second epoch.
    cfg = composed(*SMALL, "trainer.epochs=3", "trainer.max_steps=7", f"tracking.uri={uri}",
                   "optim.schedule=cosine", "optim.min_lr_ratio=0.1")
    run(cfg, str(out), "python -m train (test)")
    [mlflow_run] = runs_in(uri)
    run_id = mlflow_run.info.run_id
    assert mlflow_run.info.status == "FINISHED"
    assert history(uri, run_id, "train/samples") == [(1, 77.0), (2, 32.0)]  # 2 steps of 16
    assert history(uri, run_id, "val/samples") == [(1, 19.0), (2, 19.0)]  # evaluated at the end
    assert [s for s, _ in history(uri, run_id, "train/step_loss")] == [2, 4, 6]
    # The cosine schedule spans the 7 steps: after the last one the lr is at its floor.
    assert history(uri, run_id, "lr")[-1][1] == pytest.approx(0.05 * 0.1)
    newest = checkpoint_folder.candidates(checkpoint_folder.directory(out))[0]
    assert newest.name == "step-000000007.pt"
    assert json.loads((out / "summary.json").read_text())["max_steps"] == 7

    run(cfg, str(out), "python -m train (test)")  # the same command: nothing to do
    assert len(runs_in(uri)) == 1 and len(history(uri, run_id, "val/samples")) == 2

    more = composed(*SMALL, "trainer.epochs=3", "trainer.max_steps=9", f"tracking.uri={uri}",
                    "optim.schedule=cosine", "optim.min_lr_ratio=0.1")
    run(more, str(out), "python -m train (test)")  # continues the same run, to step 9
    [mlflow_run] = runs_in(uri)
    assert mlflow_run.info.run_id == run_id and mlflow_run.info.status == "FINISHED"
    assert history(uri, run_id, "train/samples")[-1] == (3, 32.0)
    newest = checkpoint_folder.candidates(checkpoint_folder.directory(out))[0]
    assert newest.name == "step-000000009.pt"


@pytest.fixture
def one_rank(no_launcher_env: None, monkeypatch: pytest.MonkeyPatch) -> Iterator[distenv.DistEnv]:
    for key, value in distenv.torchrun_env(0, 0, 1, 1, "127.0.0.1", distenv.free_port()).items():
        monkeypatch.setenv(key, value)
    env = distenv.detect()
    distributed.init(env, "gloo", torch.device("cpu"), timeout_s=30)
    yield env
    distributed.shutdown()


def _state(cfg: TrainConfig) -> train_state.TrainState:
    torch.manual_seed(0)
    return train_state.build(cfg, models.InputSpec(1, 8, 10), steps_per_epoch=4,
                             device=torch.device("cpu"))


def _one_step(state: train_state.TrainState) -> None:
    loss = state.model(torch.randn(8, 1, 8, 8)).logsumexp(dim=1).mean()
    state.optimizer.zero_grad()
    loss.backward()
    state.optimizer.step()
    state.scheduler.step()
    state.step += 1


def test_checkpoint_round_trip_restores_everything(tmp_path: Path, one_rank: distenv.DistEnv
                                                   ) -> None:
    cfg = typed("model=mlp", "model.width=16", "optim=adamw")
    flushed: list[str] = []
    saver = checkpoint.Checkpointer(tmp_path, cfg.trainer, 0, 1,
                                    before_write=lambda: flushed.append("flush"),
                                    run_fields=lambda: {"run_id": "abc", "restarts": 1})
    trained = _state(cfg)
    for _ in range(3):
        _one_step(trained)
    saver.save(trained, None, 0)
    assert flushed == ["flush"]  # MLflow is flushed before the file exists
    expected_next = torch.rand(3)  # the RNG stream the restored job must continue

    resumed = checkpoint_folder.find(str(tmp_path), output_dir=tmp_path / "elsewhere")
    assert resumed is not None and resumed.state["run_id"] == "abc"
    fresh = _state(cfg)
    checkpoint.restore(fresh, resumed, rank=0, world_size=1)
    assert fresh.step == 3 and fresh.scheduler.last_epoch == 3
    for key, value in trained.module.state_dict().items():
        assert torch.equal(value, fresh.module.state_dict()[key]), key
    moments = [s["exp_avg"] for s in fresh.optimizer.state_dict()["state"].values()]
    assert moments and all(m.abs().sum() > 0 for m in moments)
    assert torch.equal(torch.rand(3), expected_next)


def test_a_corrupt_newest_checkpoint_falls_back_to_the_previous(tmp_path: Path,
                                                                one_rank: distenv.DistEnv) -> None:
    cfg = typed("model=mlp", "model.width=16")
    saver = checkpoint.Checkpointer(tmp_path, cfg.trainer, 0, 1, before_write=lambda: None,
                                    run_fields=dict)
    state = _state(cfg)
    _one_step(state)
    saver.save(state, None, 0)
    _one_step(state)
    saver.save(state, None, 0)
    newest = checkpoint_folder.candidates(tmp_path)[0]
    newest.write_bytes(newest.read_bytes()[:100])  # truncated, as by a crash mid-copy
    resumed = checkpoint_folder.load_newest(checkpoint_folder.candidates(tmp_path))
    assert resumed is not None and resumed.state["step"] == 1


def test_stop_signals_are_noted_and_handlers_put_back() -> None:
    before = signal.getsignal(signal.SIGTERM)
    with stopping.StopSignals() as stop:
        assert stop.received is None
        signal.raise_signal(signal.SIGUSR2)
        assert stop.received == "SIGUSR2"
        assert stop.preempted().signal_name == "SIGUSR2"
    assert signal.getsignal(signal.SIGTERM) is before


def test_the_closing_line_shows_the_test_metrics(tmp_path: Path, no_launcher_env: None,
                                                 store_template: Path,
                                                 user_path: None,
                                                 caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, "train")
    uri = new_store(tmp_path / "mlflow.db", store_template)
    cfg = composed("data=custom", "data.train._target_=userpkg.data.Lines",
                   "+data.train.length=48", "data.test._target_=userpkg.data.Lines",
                   "+data.test.length=20", "model.width=8", "trainer.epochs=1",
                   "data.batch_size=16", "data.num_workers=0", "tracking.log_model=false",
                   f"tracking.uri={uri}")
    run(cfg, str(tmp_path / "job"), "python -m train (test)")
    [mlflow_run] = runs_in(uri)
    [closing] = [r.getMessage() for r in caplog.records if "FINISHED" in r.getMessage()]
    accuracy = mlflow_run.data.metrics["test/accuracy"]
    assert f"test/accuracy={accuracy:.4g}" in closing and "val/accuracy=" in closing


def test_a_slurm_jobs_closing_line_shows_its_val_and_test_metrics(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """What the login node prints as a followed job ends, read from the job's own files."""
    from types import SimpleNamespace

    from train.launch import follow

    (tmp_path / "summary.json").write_text(json.dumps({"run_id": "r1", "metrics": {
        "val/accuracy": 0.841225626740947, "test/accuracy": 0.8, "train/samples": 9.0}}))
    (tmp_path / "mlflow_run.json").write_text(json.dumps({
        "tracking_uri": "http://mlflow:5000", "experiment_id": "1"}))
    follow.report_finished([SimpleNamespace(working_dir=str(tmp_path))])
    printed = capsys.readouterr().out
    assert "MLflow run r1 FINISHED  val/accuracy=0.8412  test/accuracy=0.8\n" in printed
    assert "http://mlflow:5000/#/experiments/1/runs/r1" in printed


def test_a_failed_slurm_jobs_log_shown_is_the_rank_with_an_error_of_its_own(
        tmp_path: Path) -> None:
    """srun writes into rank 0's log that a peer exited and the step was cancelled: the log
    shown is still rank 1's, whose own error says why."""
    from types import SimpleNamespace

    from train.launch import follow

    logs = {0: ["[rank 0][INFO] model: ...", "srun: error: node2: task 1: Exited with exit code 1",
                "slurmstepd-node1: error: *** STEP 7.0 ON node1 CANCELLED ***"],
            1: ["[rank 1][ERROR] Submitted job triggered an exception",
                "[rank1]: RuntimeError: Timed out waiting 10000ms for recv operation"]}
    for rank, lines in logs.items():
        (tmp_path / f"7_{rank}_log.err").write_text("\n".join(lines) + "\n")
    job = SimpleNamespace(num_tasks=2, task=lambda r: SimpleNamespace(paths=SimpleNamespace(
        stderr=tmp_path / f"7_{r}_log.err")))
    shown = follow.failing_log_tail(job)
    assert shown.startswith(f"--- {tmp_path / '7_1_log.err'} ") and "Timed out waiting" in shown
    (tmp_path / "7_1_log.err").write_text("[rank 1][INFO] killed\n")  # no rank has an error
    assert follow.failing_log_tail(job).startswith(f"--- {tmp_path / '7_0_log.err'} ")


def test_a_failure_record_cut_short_or_from_an_older_start_shows_no_block(tmp_path: Path) -> None:
    """The login node reads the cause a rank kept (failure.json): shown where it is whole and
    of this submission; a file a killed rank cut short, or an earlier start's, is not taken for
    this job's cause (its log's tail is shown instead)."""
    from types import SimpleNamespace

    from train.errors import FAILURE_FILE, FailureRecord
    from train.launch import follow

    where = follow.JobPlace(out=tmp_path, command="python -m train", placed=[])
    job = SimpleNamespace(job_id="7", task=lambda r: SimpleNamespace(paths=SimpleNamespace(
        stdout=tmp_path / f"7_{r}_log.out", stderr=tmp_path / f"7_{r}_log.err")))
    FailureRecord.now("ValueError: bad label 11", None, rank=0).write(tmp_path)
    assert FailureRecord.read(tmp_path).cause == "ValueError: bad label 11"
    block = follow._failure_block(job, where, since=0.0)
    assert block is not None and "ValueError: bad label 11" in block
    assert follow._failure_block(job, where, since=FailureRecord.read(tmp_path).at + 1) is None
    whole = (tmp_path / FAILURE_FILE).read_text()
    (tmp_path / FAILURE_FILE).write_text(whole[: len(whole) // 2])
    assert FailureRecord.read(tmp_path) is None
    assert follow._failure_block(job, where, since=0.0) is None


def test_a_one_rank_job_starts_though_its_free_port_was_taken_meanwhile(
        tmp_path: Path, no_launcher_env: None, store_template: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Jobs started together on one machine: the port the launcher found free was another
    process's by the time the job's store bound it (EADDRINUSE: the job failed). A one-rank
    job's store takes the port the OS gives it as it binds."""
    import socket

    uri = new_store(tmp_path / "mlflow.db", store_template)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        monkeypatch.setattr(distenv, "free_port", lambda: taken.getsockname()[1])
        run(composed(*SMALL, "trainer.epochs=1", f"tracking.uri={uri}"), str(tmp_path / "job"),
            "python -m train (test)")
    [mlflow_run] = runs_in(uri)
    assert mlflow_run.info.status == "FINISHED"
    assert "MASTER_PORT" not in os.environ and not torch.distributed.is_initialized()


def test_a_job_failing_before_its_run_starts_says_nothing_of_mlflow(
        tmp_path: Path, no_launcher_env: None, store_template: Path,
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """A job that fails right after its process group (before the run is asked for) shows its
    cause; its train.log is not sent to a run that never existed - which was retried, given up
    after 5 s and left an "unsent" file with an `outbox upload` command that had nothing to do."""
    from train.errors import JobFailedError

    uri = new_store(tmp_path / "mlflow.db", store_template)
    monkeypatch.setenv("TRAIN_FAIL_DRILL", "0:0")
    with pytest.raises(JobFailedError, match="FailureDrill"):
        run(composed(*SMALL, f"tracking.uri={uri}"), str(tmp_path / "job"), "python -m train")
    said = "\n".join(r.getMessage() for r in caplog.records)
    assert "MLflow" not in said and not list((tmp_path / "job").glob("mlflow_unsent*"))
    assert runs_in(uri) == []


def test_a_shard_an_earlier_job_of_the_process_read_is_not_a_later_jobs_failure(
        tmp_path: Path, no_launcher_env: None, store_template: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A local sweep runs its one-rank jobs in turn in one process: a shard an earlier job
    memory-mapped and that changed since is not named as the cause of a later job's failure."""
    from train.data import shard_guard
    from train.errors import JobFailedError

    shard = tmp_path / "data-00000-of-00001.arrow"
    shard.write_bytes(b"an earlier job's shard")
    shard_guard.opened([shard])
    shard.write_bytes(b"rewritten since")
    uri = new_store(tmp_path / "mlflow.db", store_template)
    monkeypatch.setenv("TRAIN_FAIL_DRILL", "0:1")
    with pytest.raises(JobFailedError, match="FailureDrill") as failed:
        run(composed(*SMALL, f"tracking.uri={uri}"), str(tmp_path / "job"), "python -m train")
    assert "changed while the job read it" not in str(failed.value)
