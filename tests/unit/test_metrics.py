"""Per-rank metric sums (Totals, as task=classification keeps them), their reduction over ranks
and the logging-step exchange, in process.

The collectives run over a real 1-rank gloo process group; the multi-rank reduction is covered
by the end-to-end tests (exact val/samples over 2 and 3 ranks)."""

from __future__ import annotations

import pytest
import torch

from train.report import metrics
from train.tasks.base import summed
from train.tasks.classification import Classification

CPU = torch.device("cpu")


def _batches(seed: int, sizes: list[int], classes: int = 4
             ) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Random (logits, labels, mean loss) batches of the given sizes."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in sizes:
        logits = torch.randn(n, classes, generator=g)
        labels = torch.randint(0, classes, (n,), generator=g)
        out.append((logits, labels, torch.nn.functional.cross_entropy(logits, labels)))
    return out


def _task(classes: int) -> Classification:
    task = Classification()
    task.setup(summed(torch.nn.CrossEntropyLoss()), classes, [str(i) for i in range(classes)])
    return task


def _filled(batches: list, classes: int = 4, detailed: bool = False) -> metrics.Totals:
    """The sums of task=classification over `batches`, as a rank keeps them."""
    task = _task(classes)
    totals = metrics.Totals(CPU, task.layout(detailed))
    for logits, labels, _ in batches:
        totals.add(task.step(logits, labels, detailed)[1])
    return totals


def _reduce(totals: metrics.Totals, classes: int = 4) -> metrics.Reduced:
    return metrics.reduce(totals, _task(classes).finalize)


def test_totals_sum_the_loss_correct_and_samples() -> None:
    batches = _batches(0, [7, 16, 1, 9])  # uneven batches: the last one of an epoch is short
    host = _filled(batches).as_host()
    assert (host["samples"], host["items"]) == (33, 33) and "confusion" not in host
    assert host["loss"] == pytest.approx(sum(loss.item() * len(y) for _, y, loss in batches))
    correct = sum(int((x.argmax(1) == y).sum()) for x, y, _ in batches)
    assert host["correct"] == correct
    # The summed loss over the samples is the mean over all samples, not the mean of means.
    everything = torch.nn.functional.cross_entropy(torch.cat([x for x, _, _ in batches]),
                                                   torch.cat([y for _, y, _ in batches]))
    assert host["loss"] / host["samples"] == pytest.approx(everything.item(), rel=1e-6)


def test_the_host_copy_is_taken_once() -> None:
    totals = _filled(_batches(1, [5]))
    first = totals.as_host()
    logits, labels, _ = _batches(2, [3])[0]
    totals.add(_task(4).step(logits, labels)[1])
    assert totals.as_host() is first  # the epoch's figures, as read when it ended


def test_confusion_matrix_counts_true_against_predicted() -> None:
    predicted = torch.tensor([0, 1, 2, 2, 2, 0])
    labels = torch.tensor([0, 1, 2, 1, 0, 0])
    logits = torch.nn.functional.one_hot(predicted, 3).float()
    host = _filled([(logits, labels, None)], classes=3, detailed=True).as_host()
    assert (host["correct"], host["samples"]) == (4, 6)
    assert host["confusion"] == [[2, 0, 1],   # true 0: predicted 0 twice, 2 once
                                 [0, 1, 1],   # true 1
                                 [0, 0, 1]]   # true 2


def test_snapshot_and_restore_round_trip_mid_epoch() -> None:
    """A checkpoint taken mid-epoch carries the running sums; a restored run ends the epoch
    with the same totals as one that was never stopped."""
    batches = _batches(3, [8, 8, 8, 5])
    whole = _filled(batches).as_host()
    saved = _filled(batches[:2]).snapshot()
    assert saved["samples"] == 16 and saved["items"] == 16
    task = _task(4)
    resumed = metrics.Totals(CPU, task.layout(False))
    resumed.restore(saved)
    for logits, labels, _ in batches[2:]:
        resumed.add(task.step(logits, labels)[1])
    host = resumed.as_host()
    assert (host["correct"], host["samples"]) == (whole["correct"], whole["samples"])
    assert host["loss"] == pytest.approx(whole["loss"], rel=1e-12)
    assert resumed.sums["correct"].dtype == torch.int64


def test_a_checkpoint_from_before_tasks_restores_its_classification_sums() -> None:
    """Checkpoints written before the task layer held [loss, correct, samples, top-5]."""
    task = _task(7)
    totals = metrics.Totals(CPU, task.layout(False))
    totals.restore([12.5, 3.0, 8.0, 5.0])
    host = totals.as_host()
    assert (host["loss"], host["correct"], host["samples"], host["items"],
            host["correct_top5"]) == (12.5, 3, 8, 8, 5)


def test_reduce_gives_sample_weighted_means(one_rank_group: None) -> None:
    batches = _batches(4, [10, 3, 7], classes=5)
    reduced = _reduce(_filled(batches, classes=5, detailed=True), classes=5)
    assert isinstance(reduced, metrics.Reduced)
    assert reduced.samples == 20
    loss = sum(loss.item() * len(y) for _, y, loss in batches) / 20
    accuracy = sum(int((x.argmax(1) == y).sum()) for x, y, _ in batches) / 20
    assert reduced.loss == pytest.approx(loss)
    assert reduced.values["accuracy"] == pytest.approx(accuracy)
    assert reduced.confusion is not None and len(reduced.confusion) == 5
    assert all(len(row) == 5 for row in reduced.confusion)
    assert sum(map(sum, reduced.confusion)) == 20
    assert sum(reduced.confusion[i][i] for i in range(5)) == round(accuracy * 20)


def test_reduce_of_nothing_is_zero_not_an_error(one_rank_group: None) -> None:
    """A rank with an empty validation shard (more ranks than samples) adds nothing."""
    reduced = _reduce(metrics.Totals(CPU, _task(4).layout(False)))
    assert (reduced.values, reduced.samples, reduced.confusion) == \
        ({"loss": 0.0, "accuracy": 0.0}, 0, None)


def test_sync_step_carries_loss_step_time_both_requests_and_shared(one_rank_group: None) -> None:
    quiet = metrics.sync_step(torch.tensor(0.75), 0.125, stop_requested=False,
                              checkpoint_due=False)
    assert quiet == metrics.StepSync(mean_loss=0.75, slowest_s=0.125, fastest_s=0.125,
                                     stop_requested=False, checkpoint_due=False)
    # The straggler check's numbers ride in the same all_gather.
    timed = metrics.sync_step(torch.tensor(0.75), 0.125, stop_requested=False,
                              checkpoint_due=False, shared=[0.5, 2.25])
    assert timed.shared == [[0.5, 2.25]] and timed.mean_loss == 0.75
    stop = metrics.sync_step(torch.tensor(2.0), 0.5, stop_requested=True, checkpoint_due=False)
    assert stop.stop_requested and not stop.checkpoint_due
    due = metrics.sync_step(torch.tensor(2.0), 0.5, stop_requested=False, checkpoint_due=True)
    assert due.checkpoint_due and not due.stop_requested
    # The straggler check's times ride in the same all_gather, by rank.
    shared = metrics.sync_step(torch.tensor(2.0), 0.5, False, False, [0.25, 1.5])
    assert shared.shared == [[0.25, 1.5]] and shared.mean_loss == 2.0


def test_reduce_weights_ranks_by_their_samples(monkeypatch: pytest.MonkeyPatch) -> None:
    """Ranks with uneven shards (strided validation): the result is the mean over all samples,
    not the mean of the ranks' means. Three ranks' sums, as the gather would return them."""
    shards = [_batches(5, [9, 4], classes=3), _batches(6, [2], classes=3),
              _batches(7, [8, 8, 1], classes=3)]
    per_rank = [_filled(b, classes=3, detailed=True).as_host() for b in shards]
    monkeypatch.setattr(metrics.distributed, "gather_to_all", lambda mine: per_rank)
    reduced = _reduce(metrics.Totals(CPU, {}), classes=3)
    everything = [batch for shard in shards for batch in shard]
    whole = _filled(everything, classes=3, detailed=True).as_host()
    assert reduced.samples == whole["samples"] == 32
    assert reduced.loss == pytest.approx(whole["loss"] / 32)
    assert reduced.values["accuracy"] == pytest.approx(whole["correct"] / 32)
    assert reduced.confusion == whole["confusion"]
    mean_of_means = sum(h["loss"] / h["samples"] for h in per_rank) / 3
    assert reduced.loss != pytest.approx(mean_of_means)


# -- top-5 accuracy ------------------------------------------------------------------------------

def _ranked_batches() -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Two batches over 7 classes whose top-5 sets are known by construction."""
    rising = torch.arange(7.0).repeat(4, 1)  # top 5: classes 2..6, top 1: class 6
    falling = (6 - torch.arange(7.0)).repeat(2, 1)  # top 5: classes 0..4, top 1: class 0
    return [(rising, torch.tensor([6, 2, 1, 0]), torch.tensor(1.0)),
            (falling, torch.tensor([1, 5]), torch.tensor(2.0))]


def _top5_filled(batches: list) -> metrics.Totals:
    task = _task(7)
    totals = metrics.Totals(CPU, task.layout(False))
    for logits, labels, _ in batches:
        totals.add(task.step(logits, labels)[1])
    return totals


def test_top5_counts_labels_among_the_five_highest_scores() -> None:
    host = _top5_filled(_ranked_batches()).as_host()
    # By hand: 6 and 2 are in {2..6}, 1 and 0 are not; 1 is in {0..4}, 5 is not.
    assert (host["correct_top5"], host["correct"], host["samples"]) == (3, 1, 6)
    assert "correct_top5" not in _filled([]).as_host()  # 5 classes or fewer: not counted


def test_top5_reduces_over_ranks_and_survives_a_checkpoint(monkeypatch: pytest.MonkeyPatch
                                                          ) -> None:
    first, second = _ranked_batches()
    shards = [_top5_filled([batch]).as_host() for batch in (first, second)]
    monkeypatch.setattr(metrics.distributed, "gather_to_all", lambda mine: shards)
    reduced = _reduce(metrics.Totals(CPU, {}), classes=7)
    assert reduced.values["accuracy_top5"] == pytest.approx(3 / 6)
    assert reduced.values["accuracy"] == pytest.approx(1 / 6)
    monkeypatch.setattr(metrics.distributed, "gather_to_all", lambda mine: [mine])
    assert "accuracy_top5" not in _reduce(_filled([]), classes=4).values  # 5 classes or fewer

    saved = _top5_filled([first])
    task = _task(7)
    resumed = metrics.Totals(CPU, task.layout(False))
    resumed.restore(saved.snapshot())
    resumed.add(task.step(*second[:2])[1])
    assert resumed.as_host()["correct_top5"] == 3
