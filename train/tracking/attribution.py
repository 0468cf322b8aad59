"""Who and what made a run: MLflow's own attribution tags, which MlflowClient.create_run (unlike
the fluent API) leaves unset, so runs showed user "unknown".

- mlflow.user: the login the server accepted (train/tracking/auth.py) when there is one, else
  the Unix user; `unix_user` keeps the Unix user either way;
- mlflow.source.name / type, mlflow.source.git.commit: this project at the commit it ran.
"""

from __future__ import annotations

import functools
import getpass
import subprocess

from train.tracking.auth import credentials
from train.tracking.store import REPO_ROOT


@functools.cache
def source_commit() -> str:
    try:
        done = subprocess.run(["git", "-C", str(REPO_ROOT), "rev-parse", "HEAD"],
                              capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return done.stdout.strip() if done.returncode == 0 else ""


def run_tags(uri: str) -> dict[str, str]:
    """The attribution tags of a new run logged to `uri`."""
    unix_user = getpass.getuser()
    login = credentials(uri) if uri.startswith(("http://", "https://")) else None
    tags = {"mlflow.user": login[0] if login else unix_user, "unix_user": unix_user,
            "mlflow.source.name": "python -m train", "mlflow.source.type": "JOB"}
    if commit := source_commit():
        tags["mlflow.source.git.commit"] = commit
    return tags
