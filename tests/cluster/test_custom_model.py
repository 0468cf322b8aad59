"""Your own model on the local Slurm cluster: PYTHONPATH set in the submitting shell reaches
every rank."""

from __future__ import annotations

from pathlib import Path

from tests.cluster.conftest import slurm_job
from tests.conftest import USER_PATH, runs_in
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
