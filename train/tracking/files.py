"""A finished run's files, fetched for train/load.py: its config, weights and params."""

from __future__ import annotations

from pathlib import Path


def run_files(uri: str, run_id: str, dst: Path) -> tuple[Path, Path, dict[str, str]]:
    """(config.yaml, weights/model.pt, params) of run `run_id` in the store at `uri`."""
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    params = dict(client.get_run(run_id).data.params)
    config = Path(client.download_artifacts(run_id, "config.yaml", str(dst)))
    weights = Path(client.download_artifacts(run_id, "weights/model.pt", str(dst)))
    return config, weights, params
