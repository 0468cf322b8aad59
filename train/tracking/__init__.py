"""Tracking: the only package that imports mlflow (lazily: `import train.tracking` imports
neither mlflow nor torch). One-way imports: errors <- auth <- store; records <- registry <-
client <- parent_run; client <- unsent <- backend <- run; errors <- retry <- run.

- store.py    where runs are recorded (URIs, the embedded store, reachability)
- records.py  typed records and the rows waiting to be batched
- errors.py   which failed requests a retry can fix (transient) and which not (permanent)
- registry.py the logged model (pickled or torch.export) and Model Registry versions
- client.py   every MLflow request of a run, and the store's and experiment's
- parent_run.py a sweep's parent run: single requests through client.py's one-try client
- unsent.py   the file for what MLflow never accepted, and its upload
- backend.py  NullRun, the one do-nothing backend; the job's run file
- retry.py    one request of the sender, tried until the store takes it
- run.py      rank 0's MlflowRun (a background sender thread)
"""

from train.tracking import records
from train.tracking.backend import NullRun, TrackingIncomplete, recorded_run_id
from train.tracking.run import MlflowRun, open_run
from train.tracking.store import (
    EMBEDDED_STORE_DIR,
    REPO_ROOT,
    TrackingError,
    artifact_location,
    check_reachable,
    embedded_uri,
    how_to_view,
    is_local_path_uri,
    resolve_uri,
    sqlite_path,
)

__all__ = ["EMBEDDED_STORE_DIR", "REPO_ROOT", "MlflowRun", "NullRun", "TrackingError",
           "TrackingIncomplete",
           "artifact_location", "check_reachable", "embedded_uri", "how_to_view",
           "is_local_path_uri", "open_run", "recorded_run_id", "records", "resolve_uri",
           "sqlite_path"]
