"""distributed.strategy=fsdp in process on one gloo rank: what differs from the GPT jobs of
tests/e2e/test_fsdp.py - a model with BatchNorm under bf16-mixed, and cpu_offload=true (which
a CPU job takes too). On nccl: tests/e2e/test_gpu.py."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

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
    # init_on=auto: the model fits in this machine's memory, so it was built whole, as DDP's.
    assert mlflow_run.data.tags["fsdp.init_on"] == "cpu"


def test_auto_builds_whole_where_the_model_fits_else_shard_by_shard(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """distributed.fsdp.init_on=auto against the host's available memory (half of it for all
    of this node's ranks' whole copies); model.weights always builds whole; cpu and meta are
    taken as set."""
    import psutil
    import torch

    from tests.conftest import typed
    from train.engine import fsdp, fsdp_init
    from train.models.build import InputSpec

    spec = InputSpec.of((1, 8, 8), 10)
    model = fsdp.meta_copy(typed(*SMALL), spec)
    model_bytes = sum(t.numel() * t.element_size() for t in (*model.parameters(),
                                                              *model.buffers()))
    cpu = torch.device("cpu")

    def available(nbytes: float) -> None:
        memory = psutil.virtual_memory()._replace(available=int(nbytes))
        monkeypatch.setattr(psutil, "virtual_memory", lambda: memory)

    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    auto = typed(*SMALL, "distributed.strategy=fsdp")
    available(2 * 4 * model_bytes * 1.01)
    assert fsdp_init.init_place(auto, spec, cpu) == "cpu"
    available(2 * 4 * model_bytes * 0.99)  # four whole copies would take over half of it
    with caplog.at_level("WARNING", "train"):
        assert fsdp_init.init_place(auto, spec, cpu) == "meta"
    assert "initial weights differ from a DDP job's" in caplog.text
    assert fsdp_init.init_place(typed(*SMALL, "distributed.strategy=fsdp",
                                      "model.weights=/some/weights.pt"), spec, cpu) == "cpu"
    for chosen in ("cpu", "meta"):
        assert fsdp_init.init_place(typed(*SMALL, "distributed.strategy=fsdp",
                                          f"distributed.fsdp.init_on={chosen}"),
                                    spec, cpu) == chosen
