"""Training through a real MLflow tracking server (`python -m train.server`): one run per job with
its artifacts proxied by the server, eight jobs at once, cluster host names, outages."""

from __future__ import annotations

import base64
import os
import re
import socket
import stat
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from mlflow import MlflowClient

from tests.conftest import REPO, history, run_train, runs_in, wait_until
from tests.servers import EPOCH_METRICS, ServerProcess, jobs_at_once, tracking_server
from train.distributed.env import free_port
from train.report.params import applicable
from train.security import server_auth
from train.tracking import errors
from train.tracking.client import RunClient
from train.tracking.records import DatasetInput

DIGITS_VAL = float(round(1797 * 0.2))
"""The jobs' validation samples, known apart from any run: scikit-learn's 1797 digits, 20 % of
them held out (data.val_fraction's default) - 359."""


def flat(tree: dict[str, Any], prefix: str = "") -> dict[str, str]:
    """config.yaml as MLflow params: dotted keys, values as text."""
    out: dict[str, str] = {}
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            out.update(flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = str(value)
    return out


def basic_auth(login: dict[str, str]) -> str:
    """The Authorization header a client sends for the server's admin login."""
    pair = f"{login['MLFLOW_TRACKING_USERNAME']}:{login['MLFLOW_TRACKING_PASSWORD']}"
    return "Basic " + base64.b64encode(pair.encode()).decode()


@pytest.fixture(scope="module")
def shared(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    """One server (its URL and folder) for the tests that neither stop it nor bind it elsewhere:
    each logs to an experiment of its own (a server start costs ~5 s of CPU, ~9 s here)."""
    root = tmp_path_factory.mktemp("shared") / "server"
    with tracking_server(root) as url:
        yield url, root


def test_a_two_rank_run_lands_once_with_its_artifacts_behind_the_server(
        tmp_path: Path, shared: tuple[str, Path]) -> None:
    url, server_root = shared
    with urllib.request.urlopen(f"{url}/health", timeout=5) as health:
        assert health.status == 200

    result = run_train("distributed.nproc_per_node=2", "trainer.epochs=2",
                       f"hydra.run.dir={tmp_path}/job", env={"MLFLOW_TRACKING_URI": url})
    assert result.returncode == 0, result.stderr[-3000:]

    [run] = runs_in(url)  # two ranks, one run
    assert run.info.status == "FINISHED"
    assert run.data.tags["world_size"] == "2"
    # The artifacts went to the server (proxied), not to a path the client had to reach ...
    assert run.info.artifact_uri.startswith("mlflow-artifacts:")
    assert [p for p in (server_root / "artifacts").rglob("config.yaml")
            if run.info.run_id in p.parts]
    # ... and come back through it.
    client = MlflowClient(tracking_uri=url)
    listed = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"config.yaml", "confusion_matrix.svg", "weights"} <= listed
    assert "weights/model.pt" in {a.path for a in client.list_artifacts(run.info.run_id,
                                                                      "weights")}
    config = Path(client.download_artifacts(run.info.run_id, "config.yaml",
                                            str(tmp_path / "download")))
    composed = yaml.safe_load(config.read_text())
    params = flat(applicable(composed))  # the keys the chosen options read
    assert params["optim.lr"] == run.data.params["optim.lr"]
    assert params["distributed.nproc_per_node"] == "2"
    assert {k: run.data.params.get(k) for k in params} == params
    # Not the synthetic set's keys, and the normalisation digits got, not ImageNet's.
    assert "data.num_samples" in flat(composed) and "data.num_samples" not in run.data.params
    assert run.data.params["data.mean"] != str(composed["data"]["mean"])


def test_eight_jobs_at_once_land_complete_in_a_new_experiment(
        tmp_path: Path, shared: tuple[str, Path]) -> None:
    url, _ = shared
    runs = jobs_at_once(url, "crowd", tmp_path)
    assert runs_in(url, "Default") == []
    for run in runs:  # every job validated on the whole validation split, each epoch
        assert history(url, run.info.run_id, "val/samples") == [(1, DIGITS_VAL),
                                                                (2, DIGITS_VAL)]
        assert run.data.params["data.num_val"] == str(int(DIGITS_VAL))


def test_runs_storing_one_data_set_at_once_all_get_it(shared: tuple[str, Path]) -> None:
    """Jobs of a sweep log the same data set at the same moment. MLflow's server can then fail
    all inserts of it but the first with a 400 (a unique-key violation); the sender must take
    that for transient and send the request again, or the run ends with its tail unsent."""
    from mlflow.exceptions import RestException

    raced = {"sqlite": "(sqlite3.IntegrityError) UNIQUE constraint failed: datasets."
                       "experiment_id, datasets.name, datasets.digest",
             "postgresql": '(psycopg.errors.UniqueViolation) duplicate key value violates '
                           'unique constraint "dataset_pk"'}  # as the two servers answered
    for store, message in raced.items():
        error = RestException({"error_code": "BAD_REQUEST", "message": message})
        assert not errors.is_permanent(error), store
    assert errors.is_permanent(RestException(  # any other unique key is not a race of this kind
        {"error_code": "BAD_REQUEST", "message": "UNIQUE constraint failed: experiments.name"}))

    url, _ = shared
    mlflow = MlflowClient(url)
    experiment = mlflow.create_experiment("one-data-set")
    races, stored = 0, {}
    for attempt in range(10):  # 8 runs at once hit the race in ~1 round in 10 (SQLite)
        record = DatasetInput(name="digits", digest=f"{attempt:08x}", num_rows=4,
                              features_shape=[4, 1, 8, 8], features_dtype="float32")
        clients = [RunClient(url, mlflow.create_run(experiment).info.run_id)
                   for _ in range(8)]
        together = threading.Barrier(len(clients))
        failed: list[tuple[RunClient, Exception]] = []

        def store(run: RunClient, record: DatasetInput = record,
                  together: threading.Barrier = together,
                  failed: list[tuple[RunClient, Exception]] = failed) -> None:
            together.wait()
            try:
                run.apply(record)
            except Exception as e:  # noqa: BLE001 - the failure is what is tested
                failed.append((run, e))

        threads = [threading.Thread(target=store, args=(c,)) for c in clients]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=120)
        for run, error in failed:  # what the sender does: transient, so send it again
            assert not errors.is_permanent(error), errors.describe(error)
            run.apply(record)
        races += len(failed)
        stored.update({str(c.run_id): record.digest for c in clients})
    for run_id, digest in stored.items():
        inputs = mlflow.get_run(run_id).inputs.dataset_inputs
        assert [(i.dataset.name, i.dataset.digest) for i in inputs] == [("digits", digest)]
    print(f"{races} raced insert(s) in 10 rounds of 8 runs, each stored on its second try")


def test_bound_to_all_interfaces_it_accepts_the_node_name_and_refuses_others(
        tmp_path: Path) -> None:
    """Jobs on other nodes send `Host: <node>:<port>`; MLflow's DNS-rebinding guard must let
    them in (and a browser's POSTs from that origin), and still refuse names and origins that
    are not this node's."""
    server = ServerProcess(tmp_path / "server", host="0.0.0.0")
    server.start()
    try:
        def status(host: str, origin: str | None = None) -> int:
            # A POST, like the UI's searches; with an Origin when it plays a browser.
            request = urllib.request.Request(
                f"{server.url}/api/2.0/mlflow/experiments/search",
                data=b'{"max_results": 1}',
                headers={"Host": host, "Content-Type": "application/json",
                         "Authorization": basic_auth(server.login),
                         **({"Origin": origin} if origin else {})})
            try:
                with urllib.request.urlopen(request, timeout=10) as r:
                    return r.status
            except urllib.error.HTTPError as e:
                return e.code

        node = socket.gethostname()
        assert status(f"{node}:{server.port}") == 200
        assert status(f"127.0.0.1:{server.port}") == 200
        assert status(f"attacker.example.com:{server.port}") == 403
        # The UI opened at http://<node>:<port> may POST; a page from elsewhere may not.
        assert status(f"{node}:{server.port}", f"http://{node}:{server.port}") == 200
        assert status(f"{node}:{server.port}", "http://attacker.example.com") == 403
        assert f"MLFLOW_TRACKING_URI=http://{node}:{server.port}" in server.tail(100_000)
    finally:
        server.stop()


def test_a_server_outage_loses_no_metric(tmp_path: Path) -> None:
    server = ServerProcess(tmp_path / "server")
    server.start()
    epochs = 12
    job = subprocess.Popen(
        [sys.executable, "-m", "train", f"trainer.epochs={epochs}", "trainer.log_every_n_steps=5",
         f"hydra.run.dir={tmp_path}/job"], cwd=REPO,
        env={**os.environ, "MLFLOW_TRACKING_URI": server.url}, stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE, text=True)
    log_file = tmp_path / "job" / "train.log"

    def epochs_ended() -> int:  # rank 0's "epoch 3/12  train/loss=..." lines
        return len(re.findall(rf"epoch \d+/{epochs} ", log_file.read_text()))

    def logging_epochs() -> bool:
        runs = runs_in(server.url)
        return bool(runs) and len(history(server.url, runs[0].info.run_id, "train/loss")) >= 2

    try:
        wait_until(logging_epochs, 120, "two epochs in the run", job=job)
        server.stop()
        before = epochs_ended()
        # Training goes on while nobody listens: an epoch ends (its checkpoint waits on MLflow
        # for tracking.checkpoint_flush_s only); the sender retries until the server is back.
        wait_until(lambda: epochs_ended() > before, 120, "epoch ended during the outage", job=job)
        server.start()
        _, stderr = job.communicate(timeout=400)
        assert job.returncode == 0, stderr[-3000:]
        [run] = runs_in(server.url)
        assert run.info.status == "FINISHED"
        for key in EPOCH_METRICS:
            assert [s for s, _ in history(server.url, run.info.run_id, key)] == \
                list(range(1, epochs + 1)), key
        steps = [s for s, _ in history(server.url, run.info.run_id, "train/step_loss")]
        assert steps == list(range(5, epochs * 23 + 1, 5))  # 23 steps of 64 per epoch
    finally:
        job.kill()
        job.wait()
        server.stop()


def test_what_the_server_never_took_is_kept_and_uploaded_later(tmp_path: Path) -> None:
    server = ServerProcess(tmp_path / "server")
    server.start()
    epochs, job_dir = 3, tmp_path / "job"
    job = subprocess.Popen(
        [sys.executable, "-m", "train", f"trainer.epochs={epochs}", "tracking.flush_timeout_s=3",
         "trainer.log_every_n_steps=5", "trainer.checkpoint_every=0",  # no flush per epoch
         f"hydra.run.dir={job_dir}"], cwd=REPO,
        env={**os.environ, "MLFLOW_TRACKING_URI": server.url}, stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE, text=True)
    try:
        wait_until((job_dir / "mlflow_run.json").exists, 120, "run created", job=job)
        server.stop()  # as soon as the run exists, and down until the job has ended
        _, stderr = job.communicate(timeout=400)
        # Trained, but not all in the store: no success claimed, the way to deliver it said.
        assert job.returncode == 1, stderr[-3000:]
        assert not re.search(r"MLflow run \w+ FINISHED", stderr)
        unsent = job_dir / "mlflow_unsent.jsonl"
        assert unsent.exists() and f"python -m train outbox upload {unsent}" in stderr
        assert "training finished, but the MLflow store" in stderr
        # Nothing to resume: the block says the training is kept, and no command re-runs it.
        assert f"  kept: the finished training: {job_dir}/summary.json" in stderr
        assert "  resume: " not in stderr and "Traceback" not in stderr

        server.start()
        # The file names its store: a stray MLFLOW_TRACKING_URI does not divert the upload.
        upload = subprocess.run([sys.executable, "-m", "train", "outbox", "upload", str(unsent)],
                                cwd=REPO, capture_output=True, text=True, timeout=120,
                                env={**os.environ, "MLFLOW_TRACKING_URI": "sqlite:///elsewhere.db"})
        assert upload.returncode == 0, upload.stderr
        assert not unsent.exists() and unsent.with_suffix(".uploaded").exists()
        [run] = runs_in(server.url)
        assert run.info.status == "FINISHED"
        for key in EPOCH_METRICS:  # every epoch once
            assert [s for s, _ in history(server.url, run.info.run_id, key)] == \
                list(range(1, epochs + 1)), key
        steps = [s for s, _ in history(server.url, run.info.run_id, "train/step_loss")]
        assert steps == list(range(5, epochs * 23 + 1, 5))
        # What was logged besides metrics arrived too: params, config, weights, figures.
        assert run.data.params["data.num_train"] == "1438"
        assert run.data.params["trainer.epochs"] == str(epochs)
        client = MlflowClient(tracking_uri=server.url)
        listed = {a.path for a in client.list_artifacts(run.info.run_id)}
        assert {"config.yaml", "weights", "confusion_matrix.svg",
                "per_class_accuracy.json"} <= listed
    finally:
        job.kill()
        job.wait()
        server.stop()


def test_make_ui_serves_a_store_and_prints_its_url(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    store = tmp_path / "mlruns"
    result = run_train("trainer.epochs=1", "tracking.run_name=shown", "tracking.log_model=false",
                       f"hydra.run.dir={tmp_path}/job",
                       env={"MLFLOW_TRACKING_URI": f"sqlite:///{store / 'mlflow.db'}"})
    assert result.returncode == 0, result.stderr[-3000:]
    # The job's closing hint: this command, and where its login will be (not the password).
    assert f"`make ui UI_STORE={store}`" in result.stderr
    assert f"user admin, password MLFLOW_TRACKING_PASSWORD in {store}/server-auth.env" in \
        result.stderr
    port = free_port()
    ui = subprocess.Popen(["make", "ui", f"UI_PORT={port}", f"UI_STORE={store}"], cwd=REPO,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          start_new_session=True)
    url = f"http://127.0.0.1:{port}"

    def healthy() -> bool:
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as health:
                return health.status == 200
        except OSError:
            return False

    try:
        wait_until(healthy, 120, "answer from `make ui`", job=ui)
        with pytest.raises(urllib.error.HTTPError) as refused:  # no login, no runs
            urllib.request.urlopen(f"{url}/api/2.0/mlflow/experiments/search?max_results=1")
        assert refused.value.code == 401
        login = server_auth.read_env_file(store / "server-auth.env")
        for name in ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD"):
            monkeypatch.setenv(name, login[name])
        [run] = runs_in(url)
        assert run.info.run_name == "shown"
        config = MlflowClient(tracking_uri=url).download_artifacts(
            run.info.run_id, "config.yaml", str(tmp_path / "download"))
        assert "optim:" in Path(config).read_text()
    finally:
        os.killpg(ui.pid, 9)
        output, _ = ui.communicate(timeout=30)
    assert f"MLflow UI: {url}" in output
    # Logins on, and the user told where the generated password is (never the password).
    secrets = store / "server-auth.env"
    assert f"password in {secrets}" in output
    assert stat.S_IMODE(secrets.stat().st_mode) == 0o600
    password = server_auth.read_env_file(secrets)["MLFLOW_TRACKING_PASSWORD"]
    assert password not in output
