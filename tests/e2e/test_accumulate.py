"""Gradient accumulation (trainer.accumulate_grad_batches) through the real CLI: the same global
batch gives the same training whatever its split into ranks and micro-batches."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.conftest import assert_refused, history, run_train, runs_in

# An MLP without dropout, no augmentation: training is a deterministic function of the samples
# in each optimiser step, so different splits of the same steps must give the same weights.
PLAIN = ("model=mlp", "model.dropout=0", "data=digits", "data.augment=false",
         "trainer.log_every_n_steps=4")


def _weights(out_dir: Path) -> dict[str, torch.Tensor]:
    return torch.load(out_dir / "model.pt", map_location="cpu", weights_only=True)


def _assert_same_weights(a: Path, b: Path, atol: float) -> None:
    first, second = _weights(a), _weights(b)
    assert first.keys() == second.keys()
    for key in first:
        torch.testing.assert_close(first[key], second[key], atol=atol, rtol=0, msg=key)


def _run(name: str, uri: str) -> object:
    [run] = [r for r in runs_in(uri) if r.info.run_name == name]
    assert run.info.status == "FINISHED"
    return run


def _assert_same_steps(uri: str, a: object, b: object) -> None:
    """The same optimiser steps logged (step_loss, lr), and the same samples per epoch."""
    for key in ("train/step_loss", "lr", "train/samples", "val/samples"):
        mine = history(uri, a.info.run_id, key)  # type: ignore[attr-defined]
        theirs = history(uri, b.info.run_id, key)  # type: ignore[attr-defined]
        assert [s for s, _ in mine] == [s for s, _ in theirs], key
        assert [v for _, v in mine] == pytest.approx([v for _, v in theirs], abs=1e-5), key


def test_two_ranks_accumulating_two_equal_four_ranks(store: dict[str, str],
                                                     tmp_path: Path) -> None:
    """K=2 on 2 ranks and K=1 on 4 ranks: 48 samples per optimiser step, 12 per micro-batch.
    1440 training samples (val_fraction) split over 4 and 2 ranks without padding, so every
    optimiser step of both jobs sees the same 48 samples. The accumulating job streams its
    batches through a DataLoader worker per rank (the path files take), the other reads them
    from memory: the same training either way."""
    uri = store["MLFLOW_TRACKING_URI"]
    common = (*PLAIN, "data.val_fraction=0.1987", "data.batch_size=48", "trainer.epochs=2")
    jobs = {"k2": ("distributed.nproc_per_node=2", "trainer.accumulate_grad_batches=2",
                   "data.on_device=false", "data.num_workers=1"),
            "k1": ("distributed.nproc_per_node=4",)}
    for name, extra in jobs.items():
        result = run_train(*common, *extra, f"tracking.run_name={name}",
                           f"hydra.run.dir={tmp_path / name}", env=store)
        assert result.returncode == 0, result.stderr
    _assert_same_weights(tmp_path / "k2", tmp_path / "k1", atol=1e-5)
    accumulated, plain = _run("k2", uri), _run("k1", uri)
    assert accumulated.data.params["data.num_train"] == "1440"
    assert accumulated.data.params["trainer.accumulate_grad_batches"] == "2"
    # 1440 / 48 = 30 optimiser steps an epoch: state.step counts them, not micro-batches.
    steps = [s for s, _ in history(uri, accumulated.info.run_id, "train/step_loss")]
    assert steps == list(range(4, 61, 4))
    assert history(uri, accumulated.info.run_id, "train/samples") == [(1, 1440.0), (2, 1440.0)]
    _assert_same_steps(uri, accumulated, plain)


def test_accumulation_on_one_rank_equals_the_whole_batch_and_resumes_exactly(
        store: dict[str, str], tmp_path: Path) -> None:
    """K=3 of 32 and one batch of 96 on one rank: 1438 samples make 14 full steps and a last
    one of 94 (32 + 32 + 30), still the mean over its samples; clipping acts on the step's
    summed gradient (this clip of 0.1 changes the weights). A copy resumed from a
    mid-epoch checkpoint ends with the same weights; with another K it is refused."""
    uri = store["MLFLOW_TRACKING_URI"]
    common = (*PLAIN, "data.batch_size=96", "trainer.epochs=2", "optim.grad_clip=0.1")
    k3 = tmp_path / "k3"
    result = run_train(*common, "trainer.accumulate_grad_batches=3", "tracking.run_name=k3",
                       "trainer.checkpoint_interval_min=0", "trainer.keep_checkpoints=20",
                       f"hydra.run.dir={k3}", env=store)
    assert result.returncode == 0, result.stderr
    result = run_train(*common, "tracking.run_name=k1", f"hydra.run.dir={tmp_path / 'k1'}",
                       env=store)
    assert result.returncode == 0, result.stderr
    _assert_same_weights(k3, tmp_path / "k1", atol=1e-5)
    _assert_same_steps(uri, _run("k3", uri), _run("k1", uri))

    # Checkpoints at every logging step (interval 0): step 8 is mid-epoch 1 (15 steps each),
    # 24 micro-batches in.
    mid = k3 / "checkpoints" / "step-000000008.pt"
    assert torch.load(mid, weights_only=True)["batch_in_epoch"] == 24
    log = (k3 / "train.log").read_text()  # epochs numbered from 1, as everywhere
    assert f"checkpoint {mid} (inside epoch 1, batch 24, step 8)" in log
    assert f"checkpoint {k3 / 'checkpoints' / 'step-000000015.pt'} (epoch 1, step 15)" in log
    resumed = tmp_path / "resumed"
    result = run_train(*common, "trainer.accumulate_grad_batches=3", f"trainer.resume={mid}",
                       "tracking.run_name=resumed", f"hydra.run.dir={resumed}", env=store)
    assert result.returncode == 0, result.stderr
    _assert_same_weights(resumed, k3, atol=0)
    steps = [s for s, _ in history(uri, _run("resumed", uri).info.run_id, "train/step_loss")]
    assert steps == list(range(12, 31, 4))

    refused = run_train(*common, f"trainer.resume={mid}", f"hydra.run.dir={tmp_path / 'other'}",
                        env=store)
    assert refused.returncode == 2  # the pre-flight reads the checkpoint
    assert "trainer.accumulate_grad_batches=3" in refused.stderr
    assert "Traceback" not in refused.stderr
    assert len(runs_in(uri)) == 3


@pytest.mark.parametrize(("overrides", "expected"), [
    (("data.batch_size=64", "distributed.nproc_per_node=2", "trainer.accumulate_grad_batches=3"),
     "must split evenly over 2 ranks x 3 micro-batches (trainer.accumulate_grad_batches=3); "
     "use a multiple of 6, e.g. data.batch_size=66."),
    (("data.batch_size=64", "trainer.accumulate_grad_batches=5"),
     "over 1 rank x 5 micro-batches (trainer.accumulate_grad_batches=5); use a multiple of 5, "
     "e.g. data.batch_size=65."),
    (("trainer.accumulate_grad_batches=0",), "trainer.accumulate_grad_batches must be 1 or more"),
    (("trainer.accumulate_grad_batches=2", "distributed.static_graph=true"),
     "cannot be combined with distributed.static_graph=true"),
])
def test_bad_accumulation_is_refused_before_anything_starts(store: dict[str, str],
                                                            overrides: tuple[str, ...],
                                                            expected: str) -> None:
    assert_refused(run_train(*overrides, "trainer.epochs=1", env=store, timeout=120),
                   expected, store)
