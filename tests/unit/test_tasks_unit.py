"""The built-in tasks' arithmetic, in process: sums from uneven "ranks" (or micro-batches) added
and finalized give what the metric's textbook definition gives on the whole set at once."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from tests.conftest import composed, history, new_store, runs_in
from train.app import run
from train.tasks.base import Task, summed
from train.tasks.classification import Classification
from train.tasks.regression import Regression
from train.tasks.segmentation import Segmentation

UNEVEN = (7, 1, 13, 4)
"""Sizes of the shards (ranks or micro-batches) a batch of 25 is split into."""


def _task(task: Task, loss: Callable[..., torch.Tensor], num_classes: int = 0) -> Task:
    task.setup(summed(loss), num_classes, [str(i) for i in range(num_classes)])
    return task


def _added(task: Task, outputs: Iterable[torch.Tensor], targets: Iterable[torch.Tensor]
           ) -> dict[str, Any]:
    """Each shard's sums, added as the ranks' all-reduce adds them, as plain numbers and lists
    (what `finalize` is handed)."""
    total: dict[str, Any] = {}
    for output, target in zip(outputs, targets, strict=True):
        _, sums = task.step(output, target)
        for key, value in sums.items():
            total[key] = total.get(key, 0) + torch.as_tensor(value).double()
    return {k: v.tolist() for k, v in total.items()}


def test_regression_metrics_from_uneven_shards_equal_sklearn_on_the_whole_set() -> None:
    from sklearn import metrics as skm  # here: 0.8 s to import, in this test's worker only

    g = torch.Generator().manual_seed(0)
    target = torch.randn(sum(UNEVEN), generator=g) * 3 + 1
    output = (target + torch.randn(sum(UNEVEN), generator=g)).unsqueeze(1)  # (n, 1), a model's
    task = _task(Regression(), torch.nn.MSELoss())
    values = task.finalize(_added(task, output.split(UNEVEN), target.split(UNEVEN)))
    y, p = target.double().numpy(), output.squeeze(1).double().numpy()
    assert values["mse"] == pytest.approx(skm.mean_squared_error(y, p), rel=1e-6)
    assert values["loss"] == pytest.approx(values["mse"], rel=1e-6)  # MSELoss, summed
    assert values["mae"] == pytest.approx(skm.mean_absolute_error(y, p), rel=1e-6)
    assert values["r2"] == pytest.approx(skm.r2_score(y, p), rel=1e-6)
    assert 0.5 < values["r2"] < 1  # a meaningful value, not the 0.0 of a constant target


def test_regression_r2_of_targets_of_several_values_per_sample() -> None:
    """Targets of shape (n, 2): r2 over every value (sklearn's, flattened)."""
    from sklearn import metrics as skm  # here: 0.8 s to import, in this test's worker only

    g = torch.Generator().manual_seed(1)
    target = torch.randn(sum(UNEVEN), 2, generator=g)
    output = target + 0.5 * torch.randn(sum(UNEVEN), 2, generator=g)
    task = _task(Regression(), torch.nn.MSELoss())
    values = task.finalize(_added(task, output.split(UNEVEN), target.split(UNEVEN)))
    y, p = target.flatten().double().numpy(), output.flatten().double().numpy()
    assert values["r2"] == pytest.approx(skm.r2_score(y, p), rel=1e-6)
    assert values["mse"] == pytest.approx(skm.mean_squared_error(y, p), rel=1e-6)


def test_segmentation_metrics_from_a_hand_made_confusion() -> None:
    """Rows true, columns predicted; class 3 neither present nor predicted (not averaged)."""
    confusion = [[50, 5, 0, 0],
                 [10, 20, 0, 0],
                 [0, 5, 10, 0],
                 [0, 0, 0, 0]]
    task = _task(Segmentation(), torch.nn.CrossEntropyLoss(ignore_index=255), 4)
    values = task.finalize({"confusion": confusion, "loss": 20.0, "items": 100, "samples": 2})
    # IoU: 50 / (60 + 55 - 50), 20 / (30 + 30 - 20), 10 / (15 + 10 - 10)
    assert values["miou"] == pytest.approx((50 / 65 + 20 / 40 + 10 / 15) / 3)
    assert values["pixel_accuracy"] == pytest.approx(80 / 100)
    assert values["loss"] == pytest.approx(0.2)


def test_segmentation_sums_of_uneven_shards_ignore_the_frame() -> None:
    from sklearn import metrics as skm  # here: 0.8 s to import, in this test's worker only

    g = torch.Generator().manual_seed(2)
    masks = torch.randint(0, 3, (sum(UNEVEN), 6, 6), generator=g)
    masks[:, 0, :] = 255  # a frame row ignored
    scores = torch.randn(sum(UNEVEN), 3, 6, 6, generator=g)
    task = _task(Segmentation(), torch.nn.CrossEntropyLoss(ignore_index=255), 3)
    sums = _added(task, ({"out": s} for s in scores.split(UNEVEN)), masks.split(UNEVEN))
    assert sums["items"] == sum(UNEVEN) * 5 * 6 == sum(map(sum, sums["confusion"]))
    values = task.finalize(sums)
    valid = masks != 255
    truth, predicted = masks[valid], scores.argmax(dim=1)[valid]
    assert values["pixel_accuracy"] == pytest.approx(
        skm.accuracy_score(truth.numpy(), predicted.numpy()))
    assert values["miou"] == pytest.approx(
        skm.jaccard_score(truth.numpy(), predicted.numpy(), average="macro"))
    assert values["loss"] == pytest.approx(
        F.cross_entropy(scores, masks, ignore_index=255).item(), rel=1e-6)


@pytest.mark.parametrize("loss", [torch.nn.CrossEntropyLoss(), F.cross_entropy,
                                  lambda logits, labels: F.cross_entropy(logits, labels)],
                         ids=["module", "function-with-reduction", "mean-only-function"])
def test_a_batch_in_uneven_micro_batches_gives_the_whole_batchs_loss_and_gradient(
        loss: Callable[..., torch.Tensor]) -> None:
    """The summed losses of the micro-batches over the step's item count: the whole batch's mean
    loss and its gradient, however the batch is split (a mean of the micro-batches' means is
    not: it weighs the lone sample of a micro-batch of 1 as much as the 13 of another)."""
    g = torch.Generator().manual_seed(3)
    inputs = torch.randn(sum(UNEVEN), 5, generator=g)
    labels = torch.randint(0, 4, (sum(UNEVEN),), generator=g)
    model = torch.nn.Linear(5, 4)
    task = _task(Classification(), loss, 4)

    whole = F.cross_entropy(model(inputs), labels)
    [expected] = torch.autograd.grad(whole, model.weight)
    total = sum(task.step(model(x), y)[0] for x, y in zip(inputs.split(UNEVEN),
                                                          labels.split(UNEVEN), strict=True))
    [gradient] = torch.autograd.grad(total / sum(UNEVEN), model.weight)
    assert (total / sum(UNEVEN)).item() == pytest.approx(whole.item(), rel=1e-6)
    torch.testing.assert_close(gradient, expected, rtol=1e-5, atol=1e-7)
    means = torch.stack([F.cross_entropy(model(x), y) for x, y in
                         zip(inputs.split(UNEVEN), labels.split(UNEVEN), strict=True)]).mean()
    assert means.item() != pytest.approx(whole.item(), rel=1e-3)  # the bug this avoids


# -- a regression job in process: bf16, early stopping, the best weights, the test split -----

def test_a_regression_job_keeps_the_services_other_duties(
        tmp_path: Path, store_template: Path, no_launcher_env: None, user_path: None) -> None:
    """What holds for classification holds for another task: bf16-mixed on the CPU, the best
    checkpoint of val/loss (min), early stopping, and the test split evaluated once with the
    best weights (patients 400-441 of the diabetes set; training on 0-399)."""
    uri = new_store(tmp_path / "mlflow.db", store_template)
    cfg = composed("task=regression", "data=custom", "data.train._target_=userpkg.tasks.Diabetes",
                   "+data.train.stop=400", "data.test._target_=userpkg.tasks.Diabetes",
                   "+data.test.start=400", "model=custom", "model._target_=userpkg.tasks.Regressor",
                   "optim=adamw", "optim.lr=0.05", "optim.weight_decay=0", "data.batch_size=40",
                   "trainer.epochs=40", "trainer.precision=bf16-mixed", "trainer.save_best=true",
                   "trainer.test_on=best", "trainer.early_stopping_patience=2",
                   "trainer.checkpoint_every=0", "data.num_workers=0",
                   "tracking.batch_interval_s=0", f"tracking.uri={uri}")
    out = tmp_path / "job"
    objective = run(cfg, str(out), "python -m train (test)")
    [mlflow_run] = runs_in(uri)
    metrics, tags = mlflow_run.data.metrics, mlflow_run.data.tags
    assert mlflow_run.info.status == "FINISHED" and tags["final_weights"] == "best"
    assert "early stopping" in tags["stop_reason"]  # 40 epochs at lr 0.05: it stops first
    epochs = len(history(uri, mlflow_run.info.run_id, "val/loss"))
    assert epochs < 40
    best = min(value for _, value in history(uri, mlflow_run.info.run_id, "val/loss"))
    assert objective == metrics["val/loss"] and metrics["best/val/loss"] == best
    assert (metrics["test/samples"], mlflow_run.data.params["data.num_test"]) == (42.0, "42")
    assert {"test/mse", "test/mae", "test/r2"} <= set(metrics)
    assert torch.load(out / "checkpoints" / "best.pt", weights_only=True)["monitor"] == "val/loss"
