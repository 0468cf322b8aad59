"""trainer.ema through the real CLI on gloo ranks, read back from the checkpoints, the weights
files and the MLflow store: the average is the EMA rule applied to the trained weights the
checkpoints hold; validation, the test and model.pt are the average's, and model_raw.pt the
trained weights; `python -m train eval` of the average computed here from the checkpoints gives
the run's own val metrics; an FSDP job killed mid-epoch at world 2 and resumed at world 3 ends
with the average of a DDP job never killed (the average resharded from its checkpoint), and
one in this process: a DDP job's single-file checkpoint continued under FSDP (whole tensors
into each rank's shards) ends with the average of a job never stopped."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.conftest import (
    TINY_GPT,
    assert_refused,
    composed,
    kill_job_after_checkpoints,
    new_store,
    run_train,
    runs_in,
)
from train.app import run

DECAY = 0.75
EMA = (*TINY_GPT, "trainer.max_steps=8", "tracking.log_model=false",
       # A checkpoint at every step (each is a logging step), all of them kept.
       "trainer.checkpoint_interval_min=0", "trainer.keep_checkpoints=20",
       "trainer.ema.enabled=true", f"trainer.ema.decay={DECAY}",
       # A copy of the weights at step 4, one averaging step at step 8: the trained weights
       # of those two checkpoints make the average by hand.
       "trainer.ema.start_step=4", "trainer.ema.every=4")
TOLERANCE = 1e-5
"""DDP at world 2 against FSDP resumed at world 3 (tests/e2e/test_fsdp.py's parity): float32
sums in another order."""


def _checkpoint(out: Path, step: int) -> dict:
    return torch.load(out / "checkpoints" / f"step-{step:09d}.pt", weights_only=True)


def _worst(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


@pytest.fixture(scope="module")
def reference(small_tokens: Path, tmp_path_factory: pytest.TempPathFactory,
              store_template: Path) -> dict:
    """A DDP job at world 2, never killed: its output directory, store and run."""
    root = tmp_path_factory.mktemp("ema")
    store = {"MLFLOW_TRACKING_URI": new_store(root / "mlflow.db", store_template)}
    out = root / "job"
    done = run_train(*EMA, f"data.root={small_tokens}", "distributed.nproc_per_node=2",
                     f"hydra.run.dir={out}", env=store, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    [run] = runs_in(store["MLFLOW_TRACKING_URI"])
    return {"out": out, "store": store, "run": run}


def test_the_average_is_validated_tested_and_saved_and_the_trained_weights_kept(
        reference: dict, tmp_path: Path) -> None:
    out, run, store = reference["out"], reference["run"], reference["store"]
    first, last = _checkpoint(out, 4), _checkpoint(out, 8)
    # The average: a copy at step 4, then decay x it + (1 - decay) x the weights.
    assert _worst(first["ema"], first["model"]) == 0.0
    by_hand = {k: DECAY * first["model"][k] + (1 - DECAY) * last["model"][k]
               for k in last["model"]}
    assert _worst(last["ema"], by_hand) < 1e-6
    assert _worst(last["ema"], last["model"]) > 1e-3  # the two differ: the test can fail
    final = torch.load(out / "model.pt", weights_only=True)
    raw = torch.load(out / "model_raw.pt", weights_only=True)
    assert _worst(final, last["ema"]) == 0.0 and _worst(raw, last["model"]) == 0.0
    from mlflow import MlflowClient

    logged = {Path(a.path).name for a in MlflowClient(tracking_uri=store["MLFLOW_TRACKING_URI"])
              .list_artifacts(run.info.run_id, "weights")}
    assert logged == {"model.pt", "model_raw.pt"}
    # Validation used the average: evaluating the one computed here from the trained weights
    # of the two checkpoints, on the validation split, gives the run's last val metrics.
    torch.save(by_hand, tmp_path / "by-hand.pt")
    done = run_train("eval", run.info.run_id, f"eval.weights={tmp_path / 'by-hand.pt'}",
                     "eval.split=val", "eval.name=by-hand", f"hydra.run.dir={tmp_path / 'eval'}",
                     env=store, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    [evaluated] = runs_in(store["MLFLOW_TRACKING_URI"])
    metrics = evaluated.data.metrics
    assert metrics["eval/by-hand/loss"] == pytest.approx(metrics["val/loss"], abs=1e-6)
    assert metrics["eval/by-hand/tokens"] == metrics["val/tokens"]


def test_an_fsdp_job_killed_and_resumed_at_another_world_size_keeps_the_average(
        reference: dict, small_tokens: Path, tmp_path: Path, store_template: Path) -> None:
    """Killed after step 5 (after the average's first copy: the checkpoints hold it, sharded
    over 2 ranks), resumed at world 3: the average and the trained weights of the DDP job
    never killed."""
    store = {"MLFLOW_TRACKING_URI": new_store(tmp_path / "mlflow.db", store_template)}
    args = (*EMA, f"data.root={small_tokens}", "distributed.strategy=fsdp")
    out = tmp_path / "job"
    kill_job_after_checkpoints(out, store, 5, *args, "distributed.nproc_per_node=2")
    meta = torch.load(sorted((out / "checkpoints").glob("step-*.dcp"))[-1] / "meta.pt",
                      weights_only=True)
    assert meta["step"] >= 5 and meta["ema_in_shards"] is True
    resumed = run_train(*args, "distributed.nproc_per_node=3", f"hydra.run.dir={out}",
                        env=store, timeout=240)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stderr
    ref = reference["out"]
    for name in ("model.pt", "model_raw.pt"):
        worst = _worst(torch.load(out / name, weights_only=True),
                       torch.load(ref / name, weights_only=True))
        assert worst < TOLERANCE, (name, worst)
    [run] = runs_in(store["MLFLOW_TRACKING_URI"])
    assert run.data.metrics["val/loss"] == pytest.approx(
        reference["run"].data.metrics["val/loss"], abs=TOLERANCE)


@pytest.mark.parametrize(("override", "expected"), [
    ("trainer.ema.decay=1.0", "trainer.ema.decay=1.0: the average's decay must be between 0"),
    ("trainer.ema.every=0", "trainer.ema.every=0 and trainer.ema.start_step=0: every must be"),
])
def test_a_bad_average_is_refused_before_any_rank(override: str, expected: str,
                                                  store: dict[str, str],
                                                  tmp_path: Path) -> None:
    done = run_train("data=synthetic", "trainer.ema.enabled=true", override,
                     f"hydra.run.dir={tmp_path / 'job'}", env=store, timeout=60)
    assert_refused(done, expected, store)
    assert not (tmp_path / "job" / "checkpoints").exists()


SMALL_CNN = ("data=synthetic", "data.num_samples=96", "data.val_fraction=0.2",
             "data.image_size=8", "data.batch_size=16", "model=cnn",
             "trainer.log_every_n_steps=2", "data.num_workers=0", "tracking.batch_interval_s=0",
             "tracking.log_model=false", "trainer.ema.enabled=true", "trainer.ema.decay=0.6",
             "trainer.ema.start_step=2", "trainer.ema.every=2",
             "optim.schedule=constant")  # a job of one epoch continued to two: the same steps
"""One rank in the test's own process: jobs of a few seconds each (a conv net for BatchNorm)."""


def test_a_ddp_checkpoint_continued_under_fsdp_keeps_the_average(
        tmp_path: Path, store_template: Path, no_launcher_env: None) -> None:
    """One epoch under DDP (a single-file checkpoint holding the whole average), the second
    under FSDP (each rank's shards of it): the average and the trained weights of a DDP job of
    two epochs, BatchNorm's statistics included."""
    uri = new_store(tmp_path / "mlflow.db", store_template)
    whole, split = tmp_path / "whole", tmp_path / "split"
    run(composed(*SMALL_CNN, "trainer.epochs=2", f"tracking.uri={uri}"), str(whole), "test")
    run(composed(*SMALL_CNN, "trainer.epochs=1", f"tracking.uri={uri}"), str(split), "test")
    run(composed(*SMALL_CNN, "trainer.epochs=2", "distributed.strategy=fsdp",
                 f"tracking.uri={uri}"), str(split), "test")
    assert len(runs_in(uri)) == 2  # the second start continued the first's run
    for name in ("model.pt", "model_raw.pt"):
        ours = torch.load(split / name, weights_only=True)
        reference = torch.load(whole / name, weights_only=True)
        worst = max(float((ours[k].float() - reference[k].float()).abs().max())
                    for k in reference)
        assert worst < 1e-5, (name, worst)
    assert not torch.equal(torch.load(whole / "model.pt", weights_only=True)["0.weight"],
                           torch.load(whole / "model_raw.pt", weights_only=True)["0.weight"])
