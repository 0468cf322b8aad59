"""Streamed data sets on the local Slurm cluster: an ImageFolder of real JPEGs and a user's own
Dataset (tests/userpkg, reached through PYTHONPATH only), read back from the real MLflow store."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.cluster.conftest import slurm_job
from tests.e2e.test_streaming_jobs import SMALL, USERPKG, image_folders, the_run
from tests.images import class_names


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return image_folders(tmp_path_factory.mktemp("images"))


def test_an_image_folder_on_slurm_is_one_run(cluster: None, folders: dict[str, Path],
                                             store: dict[str, str], tmp_path: Path) -> None:
    result = slurm_job(tmp_path, "data=imagefolder", f"data.root={folders['split']}", *SMALL,
                       "cluster.nodes=2", "cluster.tasks_per_node=1", "data.batch_size=16",
                       "trainer.epochs=1", env=store)
    assert result.returncode == 0, result.stdout + result.stderr
    the_run(store["MLFLOW_TRACKING_URI"], class_names(4), num_val=28, epochs=1)


def test_a_custom_dataset_from_pythonpath_on_slurm(cluster: None,
                                                   store: dict[str, str], tmp_path: Path) -> None:
    """The job inherits the submitting shell's environment (sbatch's default --export=ALL),
    PYTHONPATH with it: exported once, the same command works on the login node (pre-flight
    imports the Dataset there) and in the job."""
    result = slurm_job(tmp_path, "data=custom", "data.train._target_=userpkg.data.Lines",
                       "+data.train.length=96", "+data.train.size=12", "model.width=8",
                       "tracking.log_model=false", "cluster.nodes=2", "cluster.tasks_per_node=1",
                       "data.batch_size=16", "trainer.epochs=1", env={**store, **USERPKG})
    assert result.returncode == 0, result.stdout + result.stderr
    the_run(store["MLFLOW_TRACKING_URI"], ["horizontal", "vertical", "diagonal"], num_val=19,
            epochs=1)
