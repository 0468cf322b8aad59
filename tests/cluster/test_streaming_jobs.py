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


def test_arrow_shards_on_two_nodes_staged_once_per_node(cluster: None, folders: dict[str, Path],
                                                        store: dict[str, str],
                                                        tmp_path: Path) -> None:
    """prepare-data's shards in the shared directory; 2 nodes of 2 ranks each read their share
    from a copy staged to node-local storage (one per node: `$SLURMD_NODENAME` tells the two
    local nodes of this cluster apart), into one run with every validation sample once."""
    from train.data import shard_plan, shards

    out = tmp_path / "shards"
    shards.prepare(shard_plan.plan_image_folder(folders["split"], limit=20_000), out, workers=1,
                   command="test")
    result = slurm_job(tmp_path, "data=arrow", f"data.root={out}", *SMALL, "cluster.nodes=2",
                       "cluster.tasks_per_node=2", "data.batch_size=16", "trainer.epochs=1",
                       f"data.stage_to='{tmp_path}/local-$SLURMD_NODENAME'", env=store)
    assert result.returncode == 0, result.stdout + result.stderr
    the_run(store["MLFLOW_TRACKING_URI"], class_names(4), num_val=28, epochs=1)
    copies = sorted(p.relative_to(tmp_path) for p in tmp_path.glob("local-*/shards-*"))
    assert [str(p.parent) for p in copies] == ["local-node1", "local-node2"], copies
