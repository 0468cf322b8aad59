"""Streamed data sets, whole jobs through the real CLI, read back from the real MLflow store: an
ImageFolder of real JPEGs and a user's own Dataset (tests/userpkg, reached through PYTHONPATH
only) on 2 local ranks and under torchrun (on the local Slurm cluster:
tests/cluster/test_streaming_jobs.py); a killed job resumed into the same run; bad input refused
before anything starts."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from mlflow import MlflowClient

from tests.conftest import REPO, history, kill_job_after_checkpoints, run_train, runs_in
from tests.images import class_names, write_image_folder

USERPKG = {"PYTHONPATH": str(REPO / "tests")}
"""The user's package is found through PYTHONPATH only (an absolute path, as on a cluster)."""
SMALL = ("data.image_size=16", "model.width=8", "tracking.log_model=false")


def image_folders(root: Path) -> dict[str, Path]:
    """train/ + val/ (4 classes, 24 + 7 JPEGs each) and one folder (4 x 40) to split."""
    return {"split": write_image_folder(root / "split", 4, 24, 7, size=32),
            "flat": write_image_folder(root / "flat", 4, 40, size=32, seed=3)}


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return image_folders(tmp_path_factory.mktemp("images"))


def the_run(uri: str, classes: list[str], num_val: int, epochs: int) -> str:
    """The store's one run: finished, exact validation counts, the classes in its table."""
    [run] = runs_in(uri)
    assert run.info.status == "FINISHED"
    run_id = run.info.run_id
    epochs_logged = [(e, float(num_val)) for e in range(1, epochs + 1)]
    assert history(uri, run_id, "val/samples") == epochs_logged
    client = MlflowClient(tracking_uri=uri)
    path = client.download_artifacts(run_id, "per_class_accuracy.json",
                                     str(Path(uri.removeprefix("sqlite:///")).parent))
    table = json.loads(Path(path).read_text())
    column = table["columns"].index("class")
    assert [row[column] for row in table["data"]] == classes
    assert sum(row[table["columns"].index("samples")] for row in table["data"]) == num_val
    return run_id


def test_an_image_folder_on_two_local_ranks_is_one_run(folders: dict[str, Path],
                                                       store: dict[str, str],
                                                       tmp_path: Path) -> None:
    result = run_train("data=imagefolder", f"data.root={folders['split']}", *SMALL,
                       "distributed.nproc_per_node=2", "data.batch_size=16", "trainer.epochs=2",
                       f"hydra.run.dir={tmp_path}/job", env=store)
    assert result.returncode == 0, result.stderr
    uri = store["MLFLOW_TRACKING_URI"]
    run_id = the_run(uri, class_names(4), num_val=28, epochs=2)
    assert history(uri, run_id, "train/samples") == [(1, 96.0), (2, 96.0)]
    run = MlflowClient(tracking_uri=uri).get_run(run_id)
    assert run.data.params["data.input_shape"] == "3x16x16"
    [dataset] = run.inputs.dataset_inputs
    assert dataset.dataset.name == "imagefolder-train" and len(dataset.dataset.digest) == 8
    assert json.loads(dataset.dataset.profile)["features_shape"] == [96, 3, 16, 16]


def test_an_image_folder_under_torchrun_is_one_run(folders: dict[str, Path],
                                                   store: dict[str, str], tmp_path: Path) -> None:
    """One folder split by data.val_fraction: of 160 images, 21 held out (an odd count)."""
    result = run_train("data=imagefolder", f"data.root={folders['flat']}", *SMALL,
                       "data.val_fraction=0.13", "data.batch_size=16", "trainer.epochs=1",
                       f"hydra.run.dir={tmp_path}/job", env=store,
                       module=("-m", "torch.distributed.run", "--standalone",
                               "--nproc_per_node=2", "-m", "train"))
    assert result.returncode == 0, result.stderr
    run_id = the_run(store["MLFLOW_TRACKING_URI"], class_names(4), num_val=21, epochs=1)
    [run] = runs_in(store["MLFLOW_TRACKING_URI"])
    assert run.info.run_id == run_id and run.data.tags["launcher"] == "torchrun"


def test_a_custom_dataset_from_pythonpath_on_two_local_ranks(store: dict[str, str],
                                                             tmp_path: Path) -> None:
    result = run_train("data=custom", "data.train._target_=userpkg.data.Lines",
                       "+data.train.length=120", "data.val._target_=userpkg.data.Lines",
                       "+data.val.length=31", "+data.val.seed=1", "model.width=8",
                       "tracking.log_model=false", "distributed.nproc_per_node=2",
                       "data.batch_size=16", "trainer.epochs=2", f"hydra.run.dir={tmp_path}/job",
                       env={**store, **USERPKG})
    assert result.returncode == 0, result.stderr
    uri = store["MLFLOW_TRACKING_URI"]
    run_id = the_run(uri, ["horizontal", "vertical", "diagonal"], num_val=31, epochs=2)
    run = MlflowClient(tracking_uri=uri).get_run(run_id)
    assert run.data.params["data.input_shape"] == "1x16x16"  # the first sample's shape
    assert history(uri, run_id, "train/samples") == [(1, 120.0), (2, 120.0)]


def test_a_killed_streaming_job_resumes_mid_epoch_into_the_same_run(
        folders: dict[str, Path], store: dict[str, str], tmp_path: Path) -> None:
    """128 training images, 8 steps an epoch; a checkpoint at every logging step (2 steps):
    killed after the third (step 6, mid-epoch), resumed from there."""
    out_dir, uri = tmp_path / "job", store["MLFLOW_TRACKING_URI"]
    args = ("data=imagefolder", f"data.root={folders['flat']}", *SMALL, "data.batch_size=16",
            "trainer.epochs=3", "trainer.log_every_n_steps=2",
            "trainer.checkpoint_interval_min=0", "trainer.keep_checkpoints=10")
    kill_job_after_checkpoints(out_dir, store, 3, "distributed.nproc_per_node=2", *args)
    [killed] = runs_in(uri)
    result = run_train("distributed.nproc_per_node=2", *args, f"hydra.run.dir={out_dir}",
                       env=store)
    assert result.returncode == 0, result.stderr
    assert "resumed from" in result.stderr and "continuing MLflow run" in result.stderr
    [run] = runs_in(uri)
    assert run.info.run_id == killed.info.run_id and run.data.tags["restarts"] == "1"
    for key in ("train/loss", "train/samples", "val/samples", "lr"):
        assert [s for s, _ in history(uri, run.info.run_id, key)] == [1, 2, 3], key
    assert {v for _, v in history(uri, run.info.run_id, "train/samples")} == {128.0}
    assert {v for _, v in history(uri, run.info.run_id, "val/samples")} == {32.0}
    steps = [s for s, _ in history(uri, run.info.run_id, "train/step_loss")]
    assert steps == list(range(2, 3 * 8 + 1, 2))


@pytest.mark.parametrize(("overrides", "expected"), [
    (("data=imagefolder", "data.root=TMP/classes"), "class 'class_01' is in"),
    (("data=imagefolder", "data.root=TMP/none"), "does not exist"),
    (("data=imagefolder", "data.root=TMP/classes/val"),  # class_00 alone
     "data=imagefolder has 1 class: task=classification needs 2 or more"),
    (("data=custom", "data.train._target_=userpkg.data.Lines"),
     "no module named 'userpkg' is found. PYTHONPATH=''"),
    (("data=custom", "data.train._target_=collections.OrderedDict"),
     "not a map-style torch.utils.data.Dataset"),
])
def test_bad_data_is_refused_before_anything_starts(store: dict[str, str], tmp_path: Path,
                                                    overrides: tuple[str, ...],
                                                    expected: str) -> None:
    write_image_folder(tmp_path / "classes", 2, 2, 2, size=8)
    shutil.rmtree(tmp_path / "classes" / "val" / "class_01")  # a class with no val/ images
    overrides = tuple(o.replace("TMP", str(tmp_path)) for o in overrides)
    result = run_train(*overrides, "distributed.nproc_per_node=2",
                       env={**store, "PYTHONPATH": ""})
    assert result.returncode == 2, result.stderr
    assert expected in result.stderr and "Traceback" not in result.stderr
    assert runs_in(store["MLFLOW_TRACKING_URI"]) == []
