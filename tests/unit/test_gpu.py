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


def test_the_device_clock_holds_the_devices_time_of_each_phase_without_a_sync() -> None:
    """time/* on a GPU (train/distributed/device_clock.py): a phase holds its kernels' time on
    the device, not the microseconds the host took to queue them, and the device's idle time
    waiting for the host lands in the phase the host was in; marking syncs nothing."""
    import time

    from train.distributed.device_clock import DeviceClock

    device = torch.device("cuda", 0)
    a = torch.randn(4096, 4096, device=device)
    # cuBLAS starts at its first matmul (a handle, a workspace: host time with the device idle):
    # started here, it is counted neither in `queued` nor in the phase below.
    a = a @ a / 4096
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # a sync while marking would raise
    try:
        clock = DeviceClock(device, "data")
        time.sleep(0.2)  # the host reads a batch; the device has nothing to do
        clock.mark("forward")
        queued = time.perf_counter()
        for _ in range(50):
            a = a @ a / 4096
        queued = time.perf_counter() - queued
        clock.mark("backward")
    finally:
        torch.cuda.set_sync_debug_mode("default")
    spent = clock.take()
    assert spent["data"] >= 0.15
    assert spent["forward"] > 5 * queued, (spent, queued)
    assert clock.take() == {}  # taken: the next interval starts at the last mark
