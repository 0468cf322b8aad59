"""Training through a real MLflow tracking server: proxied artifacts, concurrency, outages."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from mlflow import MlflowClient

from tests.conftest import REPO, history, run_train, runs_in
from tests.mlflow_server import Server, tracking_server

pytestmark = pytest.mark.slow


def test_a_two_rank_run_through_the_server(tmp_path: Path) -> None:
    with tracking_server(tmp_path / "server") as server:
        env = {"MLFLOW_TRACKING_URI": server.url}
        result = run_train("distributed.nproc_per_node=2", "trainer.epochs=2",
                           f"hydra.run.dir={tmp_path}/job", env=env)
        assert result.returncode == 0, result.stderr
        [run] = runs_in(server.url)
        assert run.info.status == "FINISHED"
        # Artifacts went through the server (proxied): the client reads them back from it.
        config = Path(MlflowClient(tracking_uri=server.url).download_artifacts(
            run.info.run_id, "config.yaml", str(tmp_path)))
        assert yaml.safe_load(config.read_text())["optim"]["lr"] == \
            float(run.data.params["optim.lr"])
        assert list((tmp_path / "server" / "artifacts").rglob("config.yaml"))


def test_eight_jobs_at_once_into_a_new_experiment(tmp_path: Path) -> None:
    with tracking_server(tmp_path / "server") as server:
        env = {**os.environ, "MLFLOW_TRACKING_URI": server.url}
        jobs = [subprocess.Popen(
            [sys.executable, "-m", "train", "trainer.epochs=2", "model=mlp",
             "tracking.experiment=crowd", f"tracking.run_name=job{i}",
             f"hydra.run.dir={tmp_path}/job{i}"], cwd=REPO, env=env,
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True) for i in range(8)]
        errors = [job.communicate(timeout=600)[1] for job in jobs]
        assert [job.returncode for job in jobs] == [0] * 8, errors
        runs = runs_in(server.url, "crowd")
        assert sorted(r.info.run_name for r in runs) == [f"job{i}" for i in range(8)]
        assert runs_in(server.url, "Default") == []
        for run in runs:
            assert run.info.status == "FINISHED"
            for key in ("train/loss", "val/accuracy", "val/samples"):
                assert [s for s, _ in history(server.url, run.info.run_id, key)] == [0, 1]
            assert {v for _, v in history(server.url, run.info.run_id, "val/samples")} == {359}


def test_a_server_outage_loses_no_metric(tmp_path: Path) -> None:
    root = tmp_path / "server"
    root.mkdir()
    server = Server(root)
    server.start()
    epochs = 15
    job = subprocess.Popen(
        [sys.executable, "-m", "train", f"trainer.epochs={epochs}", "trainer.log_every_n_steps=5",
         f"hydra.run.dir={tmp_path}/job"], cwd=REPO,
        env={**os.environ, "MLFLOW_TRACKING_URI": server.url}, stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:  # training is under way and logging
            runs = runs_in(server.url)
            if runs and len(history(server.url, runs[0].info.run_id, "train/loss")) >= 2:
                break
            time.sleep(0.5)
        server.stop()
        time.sleep(8)  # epochs go on while nobody listens
        server.start()
        _, stderr = job.communicate(timeout=400)
    finally:
        job.kill()
        try:
            [run] = runs_in(server.url)
            assert job.returncode == 0, stderr
            assert run.info.status == "FINISHED"
            for key in ("train/loss", "val/accuracy", "val/samples", "epoch_time_s"):
                assert [s for s, _ in history(server.url, run.info.run_id, key)] == \
                    list(range(epochs)), key
            steps = [s for s, _ in history(server.url, run.info.run_id, "train/step_loss")]
            assert steps == list(range(5, epochs * 23 + 1, 5))  # 23 steps of 64 per epoch
        finally:
            server.stop()


def test_metrics_the_server_never_took_are_kept_and_uploaded_later(tmp_path: Path) -> None:
    root = tmp_path / "server"
    root.mkdir()
    server = Server(root)
    server.start()
    epochs, job_dir = 5, tmp_path / "job"
    job = subprocess.Popen(
        [sys.executable, "-m", "train", f"trainer.epochs={epochs}", "tracking.flush_timeout_s=3",
         "trainer.checkpoint_every=0",
         f"hydra.run.dir={job_dir}"], cwd=REPO,
        env={**os.environ, "MLFLOW_TRACKING_URI": server.url}, stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not (job_dir / "mlflow_run.json").exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        time.sleep(1)
        server.stop()  # and it stays down until the job has ended
        _, stderr = job.communicate(timeout=400)
        assert job.returncode == 0, stderr
        unsent = job_dir / "mlflow_unsent.jsonl"
        assert unsent.exists() and f"python -m train.tracking upload {unsent}" in stderr

        server.start()
        upload = subprocess.run([sys.executable, "-m", "train.tracking", "upload", str(unsent)],
                                cwd=REPO, capture_output=True, text=True, timeout=120)
        assert upload.returncode == 0, upload.stderr
        [run] = runs_in(server.url)
        assert run.info.status == "FINISHED"
        for key in ("train/loss", "val/accuracy", "val/samples"):
            assert [s for s, _ in history(server.url, run.info.run_id, key)] == \
                list(range(epochs)), key
    finally:
        job.kill()
        server.stop()
