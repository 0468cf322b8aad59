"""The CUDA-only branch of in-memory data, in process, where a GPU exists.

Without CUDA it skips with its reason - under CI=true too (tests/conftest.py lets the `gpu`
marker's skips pass). The whole CUDA jobs: tests/e2e/test_gpu.py."""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(),
                                 reason="CUDA-only branch: this machine has no CUDA device")]


def test_in_memory_data_is_kept_and_batched_on_the_gpu() -> None:
    from train.config.groups import DataConfig
    from train.data import build as data
    from train.distributed.env import DistEnv

    device = torch.device("cuda", 0)
    bundle = data.build(DataConfig(), DistEnv.on_one_node(0, 1), device=device, seed=0)
    assert isinstance(bundle.train, data.ResidentBatches)
    images, labels = next(iter(bundle.train))
    assert images.is_cuda and labels.is_cuda and images.dtype == torch.float32
