"""tracking.register_model: the job's final model as a new version in MLflow's Model Registry,
loadable with `mlflow.pytorch.load_model("models:/<name>/<version>")` where neither this project
nor the user's model package can be imported; a sweep's best job only; refusals."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from mlflow import MlflowClient

from tests.conftest import USER_PATH, assert_refused, run_train, runs_in
from tests.servers import LOGIN_VARS, tracking_server

NET = ("model=custom", "model._target_=userpkg.models.TinyConvNet")
"""The user's own model class: pickled, it would need `userpkg` to load."""
LINES = ("data=custom", "data.train._target_=userpkg.data.Lines", "+data.train.length=48",
         "data.val._target_=userpkg.data.Lines", "+data.val.length=16")
"""The user's own Dataset (grey 16x16 images, 3 classes): its inputs are tried for export on
a real batch, at the job's end."""

LOADER = r'''
import importlib.abc, sys

PROJECT = {"train", "tests", "hydra_plugins", "userpkg"}


class NoProject(importlib.abc.MetaPathFinder):
    """This project and the user's model package are not there (the editable install of
    `train` would otherwise make it importable even under -I)."""

    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in PROJECT:
            raise ModuleNotFoundError(f"No module named {name!r} (blocked by the test)")
        return None


sys.meta_path.insert(0, NoProject())
import mlflow, mlflow.pytorch, numpy as np, torch

uri, model_uri, example, out = sys.argv[1:]
mlflow.set_tracking_uri(uri)
model = mlflow.pytorch.load_model(model_uri)
with torch.no_grad():
    np.save(out, model(torch.from_numpy(np.load(example))).numpy())
assert not [m for m in sys.modules if m.partition(".")[0] in PROJECT]
'''


def load_elsewhere(uri: str, model_uri: str, example: np.ndarray, tmp_path: Path,
                   allow_pickle: bool = False, env: dict[str, str] | None = None,
                   ) -> subprocess.CompletedProcess[str]:
    """Load `model_uri` in a fresh interpreter (-I: no PYTHONPATH, no cwd on the path) that
    cannot import this project, by default with pickle deserialisation refused; its output on
    `example` is in tmp_path/out.npy."""
    np.save(tmp_path / "example.npy", example)
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path),
           "MLFLOW_ALLOW_PICKLE_DESERIALIZATION": str(allow_pickle).lower(), **(env or {})}
    return subprocess.run([sys.executable, "-I", "-c", LOADER, uri, model_uri,
                           str(tmp_path / "example.npy"), str(tmp_path / "out.npy")],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180)


def versions(uri: str, name: str) -> list:
    found = MlflowClient(tracking_uri=uri).search_model_versions(f"name = '{name}'")
    return sorted(found, key=lambda v: int(v.version))


def test_each_job_registers_a_version_that_loads_without_the_project(
        store: dict[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    uri = store["MLFLOW_TRACKING_URI"]
    env = {**store, "PYTHONPATH": USER_PATH}
    jobs = []
    for i in (1, 2):
        result = run_train(*NET, "trainer.epochs=1", "tracking.register_model=digits-net",
                           f"hydra.run.dir={tmp_path}/job{i}", env=env)
        assert result.returncode == 0, result.stderr[-3000:]
        assert f"'digits-net' version {i}" in result.stderr
        assert f"models:/digits-net/{i}" in result.stderr
        jobs.append(json.loads((tmp_path / f"job{i}" / "mlflow_run.json").read_text())["run_id"])

    registered = versions(uri, "digits-net")
    assert [str(v.version) for v in registered] == ["1", "2"]
    assert [v.run_id for v in registered] == jobs
    runs = {r.info.run_id: r for r in runs_in(uri)}
    for version, run_id in zip(registered, jobs, strict=True):
        assert runs[run_id].info.status == "FINISHED"
        assert runs[run_id].data.tags["registered_model"] == f"digits-net/{version.version}"
    # What a caller must feed the model: digits' pixels 0-16, normalised with the training
    # split's statistics, one 8x8 grey channel, ten classes.
    tags = registered[0].tags
    assert tags["input.shape"] == "[-1, 1, 8, 8]" and tags["input.dtype"] == "float32"
    assert tags["preprocessing.scale"] == "16.0"
    [mean], [std] = json.loads(tags["preprocessing.mean"]), json.loads(tags["preprocessing.std"])
    assert 0 < mean < 1 and 0 < std < 1
    assert json.loads(tags["class_names"]) == [str(d) for d in range(10)]
    assert "mean" in registered[0].description and "class_names" in registered[0].description

    # The registered files: the logged model's metadata says the same; requirements pin torch
    # and hold nothing of this project.
    import mlflow.artifacts

    mlflow.set_tracking_uri(uri)  # models:/ URIs are resolved in the registry, this store
    files = Path(mlflow.artifacts.download_artifacts(artifact_uri="models:/digits-net/1",
                                                     dst_path=str(tmp_path / "v1")))
    card = yaml_metadata(files)["model_card"]
    assert card["preprocessing"]["mean"] == [mean] and card["input"]["shape"] == [-1, 1, 8, 8]
    requirements = (files / "requirements.txt").read_text().split()
    assert f"torch=={torch.__version__.split('+')[0]}" in requirements
    assert not [r for r in requirements if r.startswith(("train", "userpkg"))]

    # Loaded where neither `train` nor `userpkg` can be imported (and nothing is unpickled), it
    # gives on its input example what the job's model.pt gives.
    example = np.asarray(json.loads((files / "input_example.json").read_text()), np.float32)
    assert example.shape[1:] == (1, 8, 8)
    loaded = load_elsewhere(uri, "models:/digits-net/1", example, tmp_path)
    assert loaded.returncode == 0, loaded.stderr[-3000:]
    monkeypatch.syspath_prepend(USER_PATH)
    from train.load import load_model

    with torch.no_grad():
        expected = load_model(jobs[0], uri)(torch.from_numpy(example)).numpy()
    np.testing.assert_allclose(np.load(tmp_path / "out.npy"), expected, rtol=1e-5, atol=1e-6)


def yaml_metadata(model_dir: Path) -> dict:
    import yaml

    return yaml.safe_load((model_dir / "MLmodel").read_text())["metadata"]


def test_a_model_torch_export_cannot_trace_is_not_registered_and_the_run_finishes(
        store: dict[str, str], tmp_path: Path) -> None:
    """The user's model reads a value back to the host in forward: torch.export cannot trace
    it. On the user's own Dataset (inputs of any dtype) it is tried on a real batch, at the
    job's end: the run ends FINISHED with the model logged pickled; the
    registration fails in one line and a tag."""
    uri = store["MLFLOW_TRACKING_URI"]
    result = run_train("model=custom", "model._target_=userpkg.models.ChecksOnTheHost",
                       *LINES, "trainer.epochs=1", "tracking.register_model=host-checks",
                       f"hydra.run.dir={tmp_path}/job", env={**store, "PYTHONPATH": USER_PATH})
    assert result.returncode == 0, result.stderr[-3000:]
    [run] = runs_in(uri)
    assert run.info.status == "FINISHED"
    assert "registered_model" not in run.data.tags
    error = run.data.tags["registered_model_error"]
    assert "pickled, not a torch.export program" in error and "data-dependent" in error
    [line] = [x for x in result.stderr.splitlines() if "was NOT registered" in x]
    assert "'host-checks'" in line
    assert "def forward" not in result.stderr  # torch.export's partial graph is not printed
    assert versions(uri, "host-checks") == []
    # The pickled model needs the user's package: where it cannot be imported, loading fails -
    # what the exported program of a registered model avoids.
    loaded = load_elsewhere(uri, f"runs:/{run.info.run_id}/model",
                            np.zeros((2, 1, 16, 16), np.float32), tmp_path, allow_pickle=True)
    assert loaded.returncode != 0 and "No module named 'userpkg'" in loaded.stderr


def test_a_model_torch_export_cannot_trace_is_refused_where_its_input_is_known(
        store: dict[str, str], tmp_path: Path) -> None:
    """On a built-in data set (or an image folder) the input shape is known before any data is
    read: pre-flight exports the model - on the meta device, then on the CPU, where this one's
    `.item()` needs real values - and refuses it in one line, before any run or training (the
    test above: on the user's own Dataset it is tried at the job's end)."""
    result = run_train("model=custom", "model._target_=userpkg.models.ChecksOnTheHost",
                       "trainer.epochs=1", "tracking.register_model=host-checks",
                       f"hydra.run.dir={tmp_path}/job", env={**store, "PYTHONPATH": USER_PATH},
                       timeout=120)
    assert_refused(result, "tracking.register_model='host-checks': torch.export cannot trace "
                   "model=custom model._target_=userpkg.models.ChecksOnTheHost (", store)
    assert "data-dependent" in result.stderr and "def forward" not in result.stderr
    assert not (tmp_path / "job" / "checkpoints").exists()


def test_a_sweep_behind_a_server_registers_only_its_best_job(tmp_path: Path) -> None:
    """Two jobs through a tracking server with logins: the better one becomes version 1 (its
    objective read back from MLflow), the other registers nothing; the version loads, through
    the server, where this project cannot be imported."""
    with tracking_server(tmp_path / "server") as url:
        result = run_train("-m", "optim.lr=0.1,0.0005", "trainer.epochs=1",
                           "tracking.register_model=best-digits",
                           "tracking.register_best_of_sweep=true",
                           f"hydra.sweep.dir={tmp_path}/sweep",
                           env={"MLFLOW_TRACKING_URI": url}, timeout=600)
        assert result.returncode == 0, result.stderr[-3000:]
        runs = runs_in(url)
        [parent] = [r for r in runs if r.data.tags.get("sweep") == "true"]
        children = [r for r in runs
                    if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id]
        assert len(children) == 2
        best = max(children, key=lambda c: c.data.metrics["val/accuracy"])
        [version] = versions(url, "best-digits")
        assert version.run_id == best.info.run_id
        assert parent.data.tags["registered_model"] == "best-digits/1"
        assert parent.data.tags["registered_run_id"] == best.info.run_id
        assert {c.info.run_id: c.data.tags.get("registered_model") for c in children} == {
            c.info.run_id: "best-digits/1" if c is best else None for c in children}
        assert "registered as best-digits/1" in result.stdout

        login = {k: os.environ[k] for k in LOGIN_VARS}
        loaded = load_elsewhere(url, "models:/best-digits/1", np.zeros((3, 1, 8, 8), np.float32),
                                tmp_path, env=login)
        assert loaded.returncode == 0, loaded.stderr[-3000:]
        assert np.load(tmp_path / "out.npy").shape == (3, 10)


@pytest.mark.parametrize(("overrides", "expected"), [
    (("tracking.register_model=m", "tracking.log_model=false"),
     "tracking.register_model needs tracking.log_model=true"),
    (("tracking.register_model=team/model",), "holds / (a models:/<name>/<version> URI"),
    (("tracking.register_model=..",), "would be read as a path"),
    (("tracking.register_model='a\tb'",), "tracking.register_model='a\\tb' holds a control"),
    (("tracking.register_best_of_sweep=true",),
     "tracking.register_best_of_sweep=true needs tracking.register_model=<name>"),
])
def test_bad_registry_settings_are_refused_before_anything_starts(
        store: dict[str, str], overrides: tuple[str, ...], expected: str) -> None:
    assert_refused(run_train(*overrides, "trainer.epochs=1", env=store, timeout=120),
                   expected, store)
