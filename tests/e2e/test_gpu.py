"""The CUDA-only branches of train/distributed/devices.py (and FSDP on nccl), run for real where
a GPU exists.

Without CUDA every test here skips with its reason - under CI=true too: no GPU machine serves
this project's CI, and tests/conftest.py lets the `gpu` marker's skips (and only those) pass.
`make test` runs them on a machine with CUDA. What torch runs on a CPU is in
tests/e2e/test_precision.py; in-process CUDA branches: tests/unit/test_gpu.py.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from tests.conftest import REPO, USER_PATH, history, run_train, runs_in

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(),
                                 reason="CUDA-only branch: this machine has no CUDA device")]


USERPKG = {"PYTHONPATH": os.pathsep.join([USER_PATH, str(REPO), os.environ.get("PYTHONPATH", "")])}
SMALL_TEXT = Path(textwrap.__file__)
"""A 20 KB standard-library module: the language model's text."""


def _ranks() -> int:
    return min(2, torch.cuda.device_count())


def _job(store: dict[str, str], out: Path, *overrides: str) -> tuple[object, dict]:
    result = run_train(f"distributed.nproc_per_node={_ranks()}", *overrides,
                       f"hydra.run.dir={out}", env=store, timeout=600)
    assert result.returncode == 0, result.stderr
    run_id = json.loads((out / "summary.json").read_text())["run_id"]
    [run] = [r for r in runs_in(store["MLFLOW_TRACKING_URI"]) if r.info.run_id == run_id]
    assert run.info.status == "FINISHED"
    return run, run.data.metrics


def test_an_nccl_job_on_the_gpus(store: dict[str, str], tmp_path: Path) -> None:
    run, metrics = _job(store, tmp_path / "job", "distributed.backend=nccl",
                        "trainer.epochs=2", "tracking.log_model=true")
    assert run.data.tags["backend"] == "nccl" and run.data.tags["devices"] != "cpu"
    assert metrics["val/accuracy"] > 0.8
    steps = [s for s, _ in history(store["MLFLOW_TRACKING_URI"], run.info.run_id, "train/loss")]
    assert steps == [1, 2]
    # The final weights and the logged model load on a machine without CUDA: written from
    # host memory (a pickle of GPU tensors loads back onto the GPU, where there is one).
    import mlflow.pytorch

    weights = torch.load(tmp_path / "job" / "model.pt", weights_only=True)
    assert {t.device.type for t in weights.values()} == {"cpu"}
    mlflow.set_tracking_uri(store["MLFLOW_TRACKING_URI"])  # put back: no_leaked_tracking_uri
    logged = mlflow.pytorch.load_model(f"runs:/{run.info.run_id}/model")
    assert {p.device.type for p in logged.parameters()} == {"cpu"}


def test_sync_batchnorm_trains_resnet18(store: dict[str, str], tmp_path: Path) -> None:
    run, metrics = _job(store, tmp_path / "job", "model=resnet18",
                        "distributed.sync_batchnorm=true", "trainer.epochs=1",
                        "tracking.log_model=false")
    assert run.data.params["distributed.sync_batchnorm"] == "True"
    state = torch.load(sorted((tmp_path / "job" / "checkpoints").glob("step-*.pt"))[-1],
                       weights_only=True)
    means = [v for k, v in state["model"].items() if k.endswith("running_mean")]
    assert means and all(torch.isfinite(m).all() for m in means)
    assert all(math.isfinite(metrics[k]) for k in ("train/loss", "val/loss", "val/accuracy"))


def test_bf16_compile_channels_last_resnet18_reports_mfu(store: dict[str, str],
                                                          tmp_path: Path) -> None:
    from train.report import flops

    # A GPU without a data-sheet entry gets an upper bound of any current GPU's dense bf16 peak,
    # so that train/mfu is still computed (and must then still lie in (0, 1)).
    known = flops.peak_tflops(torch.device("cuda", 0), "bf16-mixed", None)
    peak = [] if known is not None else ["trainer.peak_tflops=2500"]
    _, metrics = _job(store, tmp_path / "job", "model=resnet18", "data=synthetic",
                      "trainer.epochs=2", "trainer.compile=true", "trainer.precision=bf16-mixed",
                      "trainer.channels_last=true", "tracking.log_model=false", *peak)
    assert 0 < metrics["train/mfu"] < 1
    assert metrics["val/accuracy"] >= 0  # synthetic labels are random: it ran to the end


def test_fsdp_jobs_on_the_gpus(store: dict[str, str], tmp_path: Path) -> None:
    """distributed.strategy=fsdp over nccl, bf16-mixed, the model built whole in host memory
    (the default, init_on=auto: FSDP moves each block to the GPU as it shards it) and on the
    meta device (init_on=meta) - each of these jobs
    failed on a GPU before: model=cnn with optim=sgd (fused SGD has no DTensor rule: at the
    first step; BatchNorm's bf16 weights beside its fp32 statistics: at the first forward), and
    a language model with cpu_offload=true (shards in host memory: the step's token count was
    all-reduced there, which nccl refuses); and with cpu_offload, clipping and best.pt not
    yet run on a GPU (below). On the CPU: tests/e2e/test_fsdp.py,
    tests/unit/test_fsdp.py."""
    common = ("distributed.backend=nccl", "distributed.strategy=fsdp",
              "trainer.precision=bf16-mixed", "tracking.log_model=false")
    run, metrics = _job(store, tmp_path / "cnn", *common, "trainer.epochs=2")
    assert run.data.tags["backend"] == "nccl" and run.data.tags["devices"] != "cpu"
    assert run.data.params["distributed.strategy"] == "fsdp"
    assert run.data.tags["fsdp.init_on"] == "cpu"
    assert metrics["val/accuracy"] > 0.8
    tokens = tmp_path / "tokens"
    done = subprocess.run([sys.executable, "-m", "train.prepare_text", str(SMALL_TEXT),
                           str(tokens)], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    run, metrics = _job(store, tmp_path / "lm", *common, "distributed.fsdp.cpu_offload=true",
                        "distributed.fsdp.init_on=meta",
                        "data=tokens", f"data.root={tokens}", "model=gpt", "task=language_model",
                        "data.seq_len=64", "optim=adamw", "optim.lr=3e-3", "trainer.epochs=2")
    assert run.data.params["distributed.fsdp.cpu_offload"] == "True"
    assert metrics["val/loss"] < math.log(256)  # better than a uniform guess over the bytes
    assert sorted((tmp_path / "lm" / "checkpoints").glob("step-*.dcp"))
    # Offloaded shards with BatchNorm's statistics on the GPU, clipped: clipping's norm of
    # host gradients is all-reduced on gloo beside nccl, and best.pt (a full state dict) loads
    # into a model whose buffers and shards live on two devices.
    run, metrics = _job(store, tmp_path / "offload", *common, "distributed.fsdp.cpu_offload=true",
                        "optim.grad_clip=1.0", "trainer.save_best=true", "trainer.test_on=best",
                        "trainer.epochs=2")
    assert run.data.tags["final_weights"] == "best"
    assert metrics["train/grad_norm"] > 0 and metrics["val/accuracy"] > 0.5


def test_a_rank_out_of_gpu_memory_leaves_its_allocator_snapshot(store: dict[str, str],
                                                                tmp_path: Path) -> None:
    """trainer.memory_snapshot=true: rank 0 asks for twice its GPU's memory at its third step;
    the job fails with CUDA's error, its snapshot is where the failure block says and in the
    run, and it is the allocator's history (a pickle of PyTorch's, read here: our own)."""
    import pickle

    from mlflow import MlflowClient

    out = tmp_path / "job"
    result = run_train(f"distributed.nproc_per_node={_ranks()}", "model=custom",
                       "model._target_=userpkg.models.GreedyOnRank", "trainer.epochs=1",
                       "trainer.memory_snapshot=true", "tracking.log_model=false",
                       f"hydra.run.dir={out}", env={**store, **USERPKG}, timeout=600)
    assert result.returncode != 0 and "OutOfMemoryError" in result.stderr, result.stderr
    snapshot = out / "memory" / "rank-0.pickle"
    assert f"GPU memory snapshots: {out / 'memory'}" in result.stderr
    with snapshot.open("rb") as f:
        history_of = pickle.load(f)  # noqa: S301 - the file this test's job just wrote
    assert history_of["segments"] and history_of["device_traces"]
    [run] = runs_in(store["MLFLOW_TRACKING_URI"])
    assert run.info.status == "FAILED"
    artifacts = MlflowClient(store["MLFLOW_TRACKING_URI"]).list_artifacts(run.info.run_id,
                                                                          "memory")
    assert [a.path for a in artifacts] == ["memory/rank-0.pickle"]
