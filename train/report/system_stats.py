"""System metrics of every node (tracking.system_metrics=true), sampled where they happen.

Each node's first rank samples its node at every epoch end; the samples are gathered to rank 0,
which logs them as `system/<node>/<metric>` - MLflow's UI shows the `system/` prefix on the
run's "System metrics" tab, one series per node. No other process talks to MLflow.
"""

from __future__ import annotations

import socket
from typing import Any

import psutil
import torch

from train.distributed import devices


def sample(device: torch.device) -> dict[str, float]:
    """CPU, memory and (on GPU nodes) GPU memory and utilisation of this node now."""
    memory = psutil.virtual_memory()
    stats = {"cpu_utilization_percentage": psutil.cpu_percent(interval=None),
             "system_memory_usage_megabytes": (memory.total - memory.available) / 2**20,
             "system_memory_usage_percentage": memory.percent}
    stats.update(devices.memory_stats(device))
    return stats


def node_sample(local_rank: int, device: torch.device) -> dict[str, Any] | None:
    """What this rank contributes: its node's sample if it is the node's first rank."""
    if local_rank != 0:
        return None
    return {"node": socket.gethostname(), "stats": sample(device)}


def as_metrics(samples: list[dict[str, Any] | None]) -> dict[str, float]:
    return {f"system/{s['node']}/{key}": value
            for s in samples if s is not None for key, value in s["stats"].items()}
