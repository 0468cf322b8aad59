"""distributed.strategy=fsdp in process on one gloo rank: what differs from the GPT jobs of
tests/e2e/test_fsdp.py - a model with BatchNorm under bf16-mixed, and cpu_offload=true (which
a CPU job takes too). On nccl: tests/e2e/test_gpu.py."""

from __future__ import annotations

import math
from pathlib import Path

from tests.conftest import composed, history, new_store, runs_in
from train.app import run

SMALL = ("data=synthetic", "data.num_samples=96", "data.val_fraction=0.2", "data.image_size=8",
         "data.batch_size=16", "model=cnn", "trainer.log_every_n_steps=2",
         "data.num_workers=0", "tracking.batch_interval_s=0", "tracking.log_model=false")


def test_batchnorm_under_bf16_and_cpu_offload_trains(tmp_path: Path, store_template: Path,
                                                      no_launcher_env: None) -> None:
    """Both failed at the first forward: BatchNorm's parameters cast to bf16 beside its fp32
    running statistics ("expected scalar type BFloat16 but found Float"; BatchNorm now keeps
    fp32 parameters), and the offloaded shards pinned on a machine without CUDA."""
    uri = new_store(tmp_path / "mlflow.db", store_template)
    cfg = composed(*SMALL, "distributed.strategy=fsdp", "trainer.precision=bf16-mixed",
                   "distributed.fsdp.cpu_offload=true", "trainer.epochs=1", f"tracking.uri={uri}")
    run(cfg, str(tmp_path / "job"), "python -m train (test)")

    [mlflow_run] = runs_in(uri)
    assert mlflow_run.info.status == "FINISHED"
    losses = [v for _, v in history(uri, mlflow_run.info.run_id, "train/step_loss")]
    assert len(losses) == 2 and all(math.isfinite(v) for v in losses)
    assert math.isfinite(mlflow_run.data.metrics["val/loss"])
    assert sorted((tmp_path / "job" / "checkpoints").glob("step-*.dcp"))
