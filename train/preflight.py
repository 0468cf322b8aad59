"""Everything that can be refused before a rank starts or a job is submitted.

Light on purpose (no torch, torchvision or mlflow at import time): `--help`, `--cfg` and a refused
configuration answer in well under a second.
"""

from __future__ import annotations

from train import config as config_lib
from train.config import ConfigError, TrainConfig
from train.launch import LaunchError


def preflight(cfg: TrainConfig, world_size: int, local_ranks: int) -> None:
    """Everything that can be refused before a rank starts, each with what to do about it."""
    config_lib.validate(cfg, world_size)
    if cfg.model.source == "torchvision":
        from train.models import torchvision_builders

        if cfg.model.name not in (builders := torchvision_builders()):
            raise ConfigError(f"model=torchvision model.name={cfg.model.name!r} is not a "
                              f"torchvision classification model; choose one of {builders}.")
    if cfg.data.name not in ("digits", "synthetic") and not cfg.data.download:
        from train import datasets  # torch and torchvision: only for data sets on disk

        try:
            datasets.check_available(cfg.data)
        except datasets.DataMissingError as e:
            raise LaunchError(str(e)) from None
    if cfg.distributed.backend == "nccl" or cfg.distributed.device == "cuda":
        import torch

        gpus = torch.cuda.device_count()
        if local_ranks > gpus:
            raise LaunchError(
                f"distributed.nproc_per_node={local_ranks} ranks need as many GPUs with "
                f"backend={cfg.distributed.backend} device={cfg.distributed.device}, but this "
                f"machine has {gpus}. Lower nproc_per_node, or use distributed.device=cpu "
                "distributed.backend=gloo.")
    if cfg.tracking.enabled:
        from train.store import TrackingError, check_reachable, resolve_uri

        try:
            check_reachable(resolve_uri(cfg.tracking))
        except TrackingError as e:
            raise LaunchError(str(e)) from None
