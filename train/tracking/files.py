"""A finished run's files, fetched from its store: its config, weights and params for
train/load.py, and the weights `eval` and `predict` take from the store where the run's output
directory is out of sight (`runs:/<run_id>/<path>`, MLflow's own way of naming a run's file)."""

from __future__ import annotations

import json
from pathlib import Path, PurePosixPath

RUNS_SCHEME = "runs:/"
FINAL_WEIGHTS = "weights/model.pt"
"""Where every training run's final weights are in the store (train/engine/outputs.py)."""
EPOCHS_METRIC = "epoch_time_s"
"""Logged once per epoch at the epoch's number by every training run: how far its weights got."""


def run_files(uri: str, run_id: str, dst: Path) -> tuple[Path, Path, dict[str, str]]:
    """(config.yaml, weights/model.pt, params) of run `run_id` in the store at `uri`."""
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    params = dict(client.get_run(run_id).data.params)
    config = Path(client.download_artifacts(run_id, "config.yaml", str(dst)))
    weights = Path(client.download_artifacts(run_id, FINAL_WEIGHTS, str(dst)))
    return config, weights, params


def runs_uri(run_id: str, path: str = FINAL_WEIGHTS) -> str:
    return f"{RUNS_SCHEME}{run_id}/{path}"


def split_runs_uri(ref: str) -> tuple[str, str] | None:
    """(run id, artifact path) of `runs:/<run_id>/<path>`; None for anything else (a path)."""
    if not ref.startswith(RUNS_SCHEME):
        return None
    run_id, _, path = ref[len(RUNS_SCHEME):].partition("/")
    return (run_id, path.strip("/")) if run_id and path.strip("/") else None


def artifact_size(uri: str, run_id: str, path: str) -> int | None:
    """The size in bytes of run `run_id`'s file `path` in the store; None if it holds none (or
    has no such run: a `runs:/` URI the user typed)."""
    from train.tracking.client import one_try_client

    folder = path.rpartition("/")[0] or None
    try:
        listed = one_try_client(uri).list_artifacts(run_id, folder)
    except Exception:  # noqa: BLE001 - MLflow's error for an unknown run; the caller says it
        return None
    found = [f for f in listed if f.path == path and not f.is_dir]
    return int(found[0].file_size or 0) if found else None


def local_copy(folder: Path, path: str) -> Path:
    """Where `download_weights` puts the store's file `path` in `folder`: under its own name."""
    return folder / PurePosixPath(path).name


def download_weights(uri: str, ref: str, folder: Path) -> Path:
    """The weights file `ref` (`runs:/<run_id>/<path>`) downloaded into `folder` (made private:
    weights are the user's); a run's final weights get the summary.json their output directory
    has beside them, with how many epochs the run trained (what eval logs its metrics at)."""
    from train.tracking.client import one_try_client

    run_id, path = split_runs_uri(ref) or ("", "")
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    client = one_try_client(uri)
    weights = Path(client.download_artifacts(run_id, path, str(folder)))
    if weights != local_copy(folder, path):
        weights = weights.replace(local_copy(folder, path))
    weights.chmod(0o600)
    if path.startswith("weights/"):  # final weights: model.pt, trainer.ema's model_raw.pt
        steps = [m.step for m in client.get_metric_history(run_id, EPOCHS_METRIC)]
        (weights.parent / "summary.json").write_text(json.dumps(
            {"run_id": run_id, "epochs": max(steps) if steps else None, "from": ref}))
    return weights
