"""Your own model on the local Slurm cluster: PYTHONPATH set in the submitting shell reaches
every rank."""

from __future__ import annotations

from pathlib import Path

from tests.cluster.conftest import slurm_job
from tests.conftest import USER_PATH, history, runs_in
from tests.e2e.test_custom_model import assert_custom_run
from tests.unit.test_custom_model import CUSTOM


def test_user_model_on_slurm(cluster: None, store: dict[str, str],
                             tmp_path: Path) -> None:
    """PYTHONPATH exported in the submitting shell reaches every rank: sbatch passes the
    environment on (--export=ALL, Slurm's default)."""
    result = slurm_job(tmp_path, *CUSTOM, "cluster.tasks_per_node=2", "trainer.epochs=1",
                       "tracking.log_model=false", env={**store, "PYTHONPATH": USER_PATH})
    assert result.returncode == 0, result.stdout + result.stderr
    uri = store["MLFLOW_TRACKING_URI"]
    [run] = runs_in(uri)
    assert run.data.tags["launcher"] == "submitit"
    assert_custom_run(uri, run, epochs=1, world_size=2)


SEGMENTATION = ("task=segmentation", "data=custom", "data.train._target_=userpkg.tasks.Shapes",
                "+data.train.length=40", "model=custom",
                "model._target_=userpkg.tasks.TinySegmenter", "optim=adamw", "optim.lr=0.01",
                "optim.weight_decay=0", "data.batch_size=8", "data.num_workers=0")
"""Generated images with rectangle and disc masks and a small segmenter of the user's
(tests/userpkg/tasks.py); 8 of the 40 images validate."""


def test_a_segmentation_task_on_two_slurm_nodes(cluster: None, store: dict[str, str],
                                                tmp_path: Path) -> None:
    """A task other than classification through +cluster=slurm: 2 nodes x 1 rank, one run
    whose val/pixel_accuracy and val/miou cover every validation pixel once (the per-class
    table's pixel counts: 8 images x 30 x 30 inside the ignored frame)."""
    import json

    from mlflow import MlflowClient

    result = slurm_job(tmp_path, *SEGMENTATION, "cluster.nodes=2", "cluster.tasks_per_node=1",
                       "trainer.epochs=2", "tracking.log_model=false",
                       env={**store, "PYTHONPATH": USER_PATH})
    assert result.returncode == 0, result.stdout + result.stderr
    uri = store["MLFLOW_TRACKING_URI"]
    [run] = runs_in(uri)
    assert run.info.status == "FINISHED" and run.data.tags["world_size"] == "2"
    assert run.data.tags["hostnames"] == "node1,node2"
    assert 0 <= run.data.metrics["val/miou"] <= 1 and "val/accuracy" not in run.data.metrics
    assert history(uri, run.info.run_id, "val/samples") == [(1, 8.0), (2, 8.0)]
    table = json.loads(Path(MlflowClient(uri).download_artifacts(
        run.info.run_id, "per_class_iou.json", str(tmp_path))).read_text())
    assert table["columns"] == ["class", "iou", "pixels"]
    assert sum(row[2] for row in table["data"]) == 8 * 30 * 30  # each pixel once, 2 nodes
