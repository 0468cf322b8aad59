"""What a run records about where and how it ran: params from the config, and tags.

Plain functions of the environment; rank 0's reporter calls them (train/report.py).
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from train.store import REPO_ROOT


def flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    """{"optim": {"lr": 0.1}} -> {"optim.lr": "0.1"}; lists and None as their text."""
    flat: dict[str, str] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            flat.update(flatten(value, name + "."))
        else:
            flat[name] = str(value)
    return flat


def torch_version() -> str:
    import torch

    return str(torch.__version__)


def git_commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO_ROOT, capture_output=True,
                             text=True, timeout=5)
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    return out.stdout.strip() if out.returncode == 0 else "unknown"


def recorded_run_id(output_dir: Path) -> str | None:
    """The run an earlier start of this job (same output directory) created, if any."""
    try:
        return str(json.loads((output_dir / "mlflow_run.json").read_text())["run_id"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def requeue_target() -> str | None:
    """This Slurm job's id as `scontrol requeue` wants it (array tasks included)."""
    if "SLURM_ARRAY_JOB_ID" in os.environ:
        return f"{os.environ['SLURM_ARRAY_JOB_ID']}_{os.environ['SLURM_ARRAY_TASK_ID']}"
    return os.environ.get("SLURM_JOB_ID")


def slurm_tags(ranks: list[dict[str, str]]) -> dict[str, str]:
    """Where a Slurm job ran; empty outside Slurm."""
    if "SLURM_JOB_ID" not in os.environ:
        return {}
    tags = {"slurm.job_id": os.environ.get("SLURM_ARRAY_JOB_ID", os.environ["SLURM_JOB_ID"]),
            "slurm.nodes": ",".join(sorted({r["host"] for r in ranks})),
            "slurm.partition": os.environ.get("SLURM_JOB_PARTITION", "")}
    if "SLURM_ARRAY_TASK_ID" in os.environ:
        tags["slurm.array_task_id"] = os.environ["SLURM_ARRAY_TASK_ID"]
    return tags
