"""Mixed precision, torch.compile and channels_last, run for real on the CPU (2 gloo ranks).

These are the options a GPU user turns on; every one of them that torch can run on a CPU runs
here, end to end, and is read back from MLflow. What only CUDA can run is in
tests/{unit,e2e}/test_gpu.py.

Tolerances against fp32 eager (the same job, same seeds, same data order, 2 epochs on digits);
measured on 2026-11-23: bf16 and fp16 epoch losses within 0.1 % of fp32's, validation accuracy
within 0.9 points. The tolerances leave room for other CPUs' kernels:
- bf16-mixed: bfloat16 keeps 8 bits of mantissa (about 2-3 significant digits) in every conv
  and matmul, so the weights follow another trajectory from the first step on: epoch losses
  within 2 %, validation accuracy within 2.5 points (9 of 359 samples).
- fp16-mixed: float16 keeps 11 bits, so closer: epoch losses within 1 %, accuracy within 1.5
  points. The GradScaler multiplies the loss by 65536 and divides the gradients back exactly
  (a power of two), so it adds no error of its own.
- torch.compile (fp32): the same arithmetic, fused and reordered by Inductor, so only rounding
  differs: epoch losses within 1 %, accuracy within 1 point.
- channels_last (fp32): the same convolutions on another memory layout; only the summation
  order inside a kernel can change, so gradients agree to float32 rounding (checked in
  process: tests/unit/test_precision.py).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from tests.conftest import (
    USER_PATH,
    history,
    kill_job_after_checkpoints,
    run_train,
    runs_in,
)

EPOCHS = 2
STEPS_PER_EPOCH = 23  # 1438 digits, 2 ranks, 32 per rank
# A narrow CNN: fp16 and bf16 run on a CPU without half-precision units (emulated, slow), and
# what is checked here - numbers, skipped steps, checkpoints - does not need a wide one.
WIDTH = 8
JOB = ("distributed.nproc_per_node=2", f"trainer.epochs={EPOCHS}", "trainer.log_every_n_steps=5",
       f"model.width={WIDTH}")
EPOCH_KEYS = ("train/loss", "train/samples", "val/accuracy", "val/samples", "lr")


@dataclass
class Job:
    uri: str
    out: Path
    run_id: str
    stderr: str

    def series(self, key: str) -> list[float]:
        return [v for _, v in history(self.uri, self.run_id, key)]


@pytest.fixture(scope="module")
def uri(tmp_path_factory: pytest.TempPathFactory) -> str:
    """One store for the module's jobs: each is found by the run id its directory names."""
    return f"sqlite:///{tmp_path_factory.mktemp('store') / 'mlflow.db'}"


def _job(uri: str, out: Path, *overrides: str, env: dict[str, str] | None = None) -> Job:
    result = run_train(*JOB, *overrides, f"hydra.run.dir={out}",
                       env={"MLFLOW_TRACKING_URI": uri, **(env or {})}, timeout=600)
    assert result.returncode == 0, result.stderr
    run_id = json.loads((out / "summary.json").read_text())["run_id"]
    return Job(uri, out, run_id, result.stderr)


@pytest.fixture(scope="module")
def fp32_eager(uri: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[float]]:
    """The reference: fp32, eager, the default layout. Its histories, read once."""
    job = _job(uri, tmp_path_factory.mktemp("fp32"), "tracking.log_model=false")
    return {key: job.series(key) for key in ("train/loss", "val/loss", "val/accuracy")}


def _assert_close(job: Job, reference: dict[str, list[float]], rel_loss: float,
                  accuracy_points: float) -> None:
    for key in ("train/loss", "val/loss"):
        got = job.series(key)
        assert len(got) == EPOCHS and all(math.isfinite(v) for v in got), key
        assert got == pytest.approx(reference[key], rel=rel_loss), key
    assert job.series("val/accuracy") == pytest.approx(reference["val/accuracy"],
                                                       abs=accuracy_points / 100)


@pytest.mark.parametrize(("precision", "rel_loss", "accuracy_points"), [
    ("bf16-mixed", 0.02, 2.5), ("fp16-mixed", 0.01, 1.5)])
def test_mixed_precision_trains_within_tolerance_of_fp32(
        uri: str, tmp_path: Path, fp32_eager: dict[str, list[float]], precision: str,
        rel_loss: float, accuracy_points: float) -> None:
    job = _job(uri, tmp_path / "job", f"trainer.precision={precision}",
               "tracking.log_model=false")
    [run] = [r for r in runs_in(uri) if r.info.run_id == job.run_id]
    assert run.info.status == "FINISHED" and run.data.params["trainer.precision"] == precision
    _assert_close(job, fp32_eager, rel_loss, accuracy_points)
    skipped = history(uri, job.run_id, "train/skipped_steps")
    if precision == "fp16-mixed":  # the scaler reports at every logging step and epoch end
        steps = [s for s, _ in skipped]
        assert steps == sorted({*range(5, EPOCHS * STEPS_PER_EPOCH + 1, 5),
                                *(STEPS_PER_EPOCH * e for e in range(1, EPOCHS + 1))})
        assert all(math.isfinite(v) for _, v in history(uri, job.run_id, "train/loss_scale"))
    else:  # bf16 has fp32's range: no scaler, nothing to skip
        assert skipped == []


def test_fp16_overflowing_steps_are_skipped_and_training_goes_on(uri: str,
                                                                 tmp_path: Path) -> None:
    """A loss the batch size times too loud (a user's summed loss, which the service takes for a
    mean: tests/userpkg/losses.py) makes the first scaled gradients (x 65536) overflow float16:
    a real overflow, not a mocked scaler. Those steps are skipped, the scale halves, training
    goes on."""
    job = _job(uri, tmp_path / "job", "trainer.precision=fp16-mixed",
               "trainer.loss._target_=userpkg.losses.SummedCrossEntropy", "optim.lr=0.002",
               "tracking.log_model=false", env={"PYTHONPATH": USER_PATH})
    [run] = [r for r in runs_in(uri) if r.info.run_id == job.run_id]
    assert run.info.status == "FINISHED"
    skipped = history(uri, job.run_id, "train/skipped_steps")
    scales = history(uri, job.run_id, "train/loss_scale")
    assert 0 < skipped[-1][1] < EPOCHS * STEPS_PER_EPOCH  # some skipped, most applied
    assert scales[0][1] < 65536  # GradScaler's initial scale fell
    assert [v for _, v in skipped] == sorted(v for _, v in skipped)  # a running count
    # The skipped steps were not applied: the weights never saw an inf, and training learned.
    weights = torch.load(job.out / "model.pt", weights_only=True)
    assert all(torch.isfinite(w).all() for w in weights.values())
    assert job.series("val/accuracy")[-1] > 0.5  # chance is 0.1


def test_fp16_divergence_still_stops_with_rank_and_step(uri: str, tmp_path: Path) -> None:
    result = run_train(*JOB, "trainer.precision=fp16-mixed", "optim.lr=1e12",
                       "trainer.log_every_n_steps=1", f"hydra.run.dir={tmp_path}/job",
                       env={"MLFLOW_TRACKING_URI": uri})
    assert result.returncode == 1
    assert "NonFiniteLossError" in result.stderr
    assert "on rank" in result.stderr and "at step" in result.stderr
    [run] = [r for r in runs_in(uri) if r.data.tags.get("output_dir") == f"{tmp_path}/job"]
    assert run.info.status == "FAILED" and "diverged" in run.data.tags["error"]


def test_a_compiled_job_killed_resumes_and_its_checkpoints_serve_eager_jobs(
        uri: str, tmp_path: Path, fp32_eager: dict[str, list[float]]) -> None:
    out = tmp_path / "compiled"
    kill_job_after_checkpoints(out, {"MLFLOW_TRACKING_URI": uri}, 1, *JOB, "trainer.compile=true",
                               timeout=300)  # compiling on 2 busy cores
    resumed = _job(uri, out, "trainer.compile=true")
    assert "resumed from" in resumed.stderr and "continuing MLflow run" in resumed.stderr
    [run] = [r for r in runs_in(uri) if r.info.run_id == resumed.run_id]
    assert run.info.status == "FINISHED" and run.data.tags["restarts"] == "1"
    for key in EPOCH_KEYS:  # every epoch once, across the kill
        assert [s for s, _ in history(uri, run.info.run_id, key)] == list(range(1, EPOCHS + 1)), key
    _assert_close(resumed, fp32_eager, rel_loss=0.01, accuracy_points=1)

    newest = sorted((out / "checkpoints").glob("step-*.pt"))[-1]
    state = torch.load(newest, weights_only=True)
    assert not [k for k in state["model"] if "_orig_mod." in k]  # the bare model's names

    # The logged model of a compiled job is the plain module: it loads and predicts what the
    # job's own weights predict.
    import mlflow.pytorch

    from train.config.groups import ModelConfig
    from train.models import build as models

    mlflow.set_tracking_uri(uri)
    logged = mlflow.pytorch.load_model(f"runs:/{run.info.run_id}/model").eval()
    eager = models.build(ModelConfig(width=WIDTH), models.InputSpec.of((1, 8, 8), 10)).eval()
    eager.load_state_dict(torch.load(out / "model.pt", weights_only=True))
    images = torch.randn(5, 1, 8, 8)
    with torch.no_grad():
        assert torch.equal(logged(images).argmax(1), eager(images).argmax(1))

    # An eager job (channels_last) continues the finished compiled job (more epochs, in its
    # directory: a checkpoint named from another directory would start a new run), and a
    # compiled job continues that eager one's checkpoint: one run, every epoch once.
    eager_job = _job(uri, out, f"trainer.epochs={EPOCHS + 1}", "trainer.channels_last=true",
                     "tracking.log_model=false")
    assert "resumed from" in eager_job.stderr and newest.name in eager_job.stderr
    again = _job(uri, out, f"trainer.epochs={EPOCHS + 2}", "trainer.compile=true",
                 "tracking.log_model=false")
    assert eager_job.run_id == again.run_id == run.info.run_id
    [run] = [r for r in runs_in(uri) if r.info.run_id == again.run_id]
    assert run.info.status == "FINISHED" and run.data.tags["restarts"] == "3"
    for key in EPOCH_KEYS:
        assert [s for s, _ in history(uri, run.info.run_id, key)] == list(range(1, EPOCHS + 3)), key
    assert all(math.isfinite(v) for v in again.series("train/loss"))


def test_everything_at_once_on_resnet18(uri: str, tmp_path: Path) -> None:
    """compile + bf16 + channels_last on resnet18 (small synthetic images: compiling is the
    cost here, not the data). It trains, its numbers stay finite, and on a CPU there is no
    train/mfu (no known peak) while train/tflops_per_sec is measured.

    One rank: Inductor compiles resnet18's training and evaluation graphs in ~2 minutes of CPU
    per rank with a cold cache (two ranks compiled it side by side: 177 s of the suite's wall
    time); compile under DDP's graph breaks is the 2-rank job's above."""
    job = _job(uri, tmp_path / "job", "distributed.nproc_per_node=1", "model=resnet18",
               "data=synthetic", "data.num_samples=256",
               "data.image_size=8", "data.batch_size=32", "trainer.epochs=1",
               "trainer.compile=true", "trainer.precision=bf16-mixed",
               "trainer.channels_last=true", "tracking.log_model=false")
    [run] = [r for r in runs_in(uri) if r.info.run_id == job.run_id]
    assert run.info.status == "FINISHED"
    metrics = run.data.metrics
    assert all(math.isfinite(metrics[k]) for k in ("train/loss", "val/loss", "val/accuracy"))
    assert metrics["train/tflops_per_sec"] > 0 and "train/mfu" not in metrics
    state = torch.load(sorted((job.out / "checkpoints").glob("step-*.pt"))[-1],
                       weights_only=True)
    assert not [k for k in state["model"] if "_orig_mod." in k]
    assert any("bn" in k or "running_mean" in k for k in state["model"])


def test_sync_batchnorm_is_refused_without_cuda_before_any_rank(tmp_path: Path) -> None:
    """What the issue's user met: both ranks started, a run was created, then a traceback. With
    device=cpu it is refused on any machine; without CUDA, with device=auto too."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"  # not even the store is created
    cases = [("distributed.sync_batchnorm=true", "distributed.device=cpu")]
    if not torch.cuda.is_available():
        cases.append(("distributed.sync_batchnorm=true",))
    for overrides in cases:
        result = run_train("distributed.nproc_per_node=2", "model=resnet18", *overrides,
                           f"hydra.run.dir={tmp_path}/job", env={"MLFLOW_TRACKING_URI": uri})
        assert result.returncode == 2
        [line] = [x for x in result.stderr.splitlines() if x.strip()]
        assert "distributed.sync_batchnorm=true needs" in line and "drop it" in line
        assert not (tmp_path / "mlflow.db").exists()
        assert not list((tmp_path / "job").glob("checkpoints"))
    # torchrun and srun start the ranks themselves, with no pre-flight: each rank refuses alone,
    # before it creates a run. (No collective is reached, so the port is never opened.)
    ranked = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
              "MASTER_PORT": "29400", "MLFLOW_TRACKING_URI": uri}
    result = run_train("distributed.sync_batchnorm=true", "distributed.device=cpu",
                       f"hydra.run.dir={tmp_path}/ranked", env=ranked)
    assert result.returncode == 2, result.stderr
    assert "distributed.sync_batchnorm=true needs GPU tensors" in result.stderr
    assert not (tmp_path / "mlflow.db").exists()
