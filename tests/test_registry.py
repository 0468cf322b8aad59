"""tracking.register_model: the job's final model as a new version in MLflow's Model Registry,
loadable with `mlflow.pytorch.load_model("models:/<name>/<version>")` where neither this project
nor the user's model package can be imported; a sweep's best job only; refusals."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from mlflow import MlflowClient

from tests.conftest import run_train, runs_in
from tests.test_custom_model import USER_PATH

NET = ("model=custom", "model._target_=userpkg.models.TinyConvNet")
"""The user's own model class: pickled, it would need `userpkg` to load."""

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
                   allow_pickle: bool = False) -> subprocess.CompletedProcess[str]:
    """Load `model_uri` in a fresh interpreter (-I: no PYTHONPATH, no cwd on the path) that
    cannot import this project, by default with pickle deserialisation refused; its output on
    `example` is in tmp_path/out.npy."""
    np.save(tmp_path / "example.npy", example)
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path),
           "MLFLOW_ALLOW_PICKLE_DESERIALIZATION": str(allow_pickle).lower()}
    return subprocess.run([sys.executable, "-I", "-c", LOADER, uri, model_uri,
                           str(tmp_path / "example.npy"), str(tmp_path / "out.npy")],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180)


def versions(uri: str, name: str) -> list:
    found = MlflowClient(tracking_uri=uri).search_model_versions(f"name = '{name}'")
    return sorted(found, key=lambda v: int(v.version))


@pytest.mark.slow
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
