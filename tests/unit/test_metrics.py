"""Per-rank metric sums (Totals), their reduction over ranks and the logging-step exchange, in
process.

The collectives run over a real 1-rank gloo process group; the multi-rank reduction is covered
by the end-to-end tests (exact val/samples over 2 and 3 ranks)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist

from train.distributed import env as distenv
from train.report import metrics

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


def _filled(batches: list, classes: int | None = None) -> metrics.Totals:
    totals = metrics.Totals(CPU, num_classes=classes)
    for logits, labels, loss in batches:
        totals.add(logits, labels, loss)
    return totals


def test_totals_sum_loss_times_samples_correct_and_samples() -> None:
    batches = _batches(0, [7, 16, 1, 9])  # uneven batches: the last one of an epoch is short
    loss_sum, _, samples, confusion, _ = _filled(batches).as_host()
    assert samples == 33 and confusion is None
    assert loss_sum == pytest.approx(sum(loss.item() * len(y) for _, y, loss in batches))
    correct = sum(int((x.argmax(1) == y).sum()) for x, y, _ in batches)
    assert _filled(batches).as_host()[1] == correct
    # The sample-weighted mean is the mean over all samples, not the mean of batch means.
    everything = torch.nn.functional.cross_entropy(torch.cat([x for x, _, _ in batches]),
                                                   torch.cat([y for _, y, _ in batches]))
    assert loss_sum / samples == pytest.approx(everything.item(), rel=1e-6)


def test_the_host_copy_is_taken_once() -> None:
    totals = _filled(_batches(1, [5]))
    first = totals.as_host()
    totals.add(*_batches(2, [3])[0])
    assert totals.as_host() is first  # the epoch's figures, as read when it ended


def test_confusion_matrix_counts_true_against_predicted() -> None:
    totals = metrics.Totals(CPU, num_classes=3)
    predicted = torch.tensor([0, 1, 2, 2, 2, 0])
    labels = torch.tensor([0, 1, 2, 1, 0, 0])
    logits = torch.nn.functional.one_hot(predicted, 3).float()
    totals.add(logits, labels, torch.tensor(0.5))
    _, correct, samples, flat, _ = totals.as_host()
    assert (correct, samples) == (4, 6)
    assert flat == [2, 0, 1,   # true 0: predicted 0 twice, 2 once
                    0, 1, 1,   # true 1
                    0, 0, 1]   # true 2


def test_snapshot_and_restore_round_trip_mid_epoch() -> None:
    """A checkpoint taken mid-epoch carries the running sums; a restored run ends the epoch
    with the same totals as one that was never stopped."""
    batches = _batches(3, [8, 8, 8, 5])
    whole = _filled(batches).as_host()
    before = _filled(batches[:2])
    saved = before.snapshot()
    assert saved[1:3] == [float(before.correct), 16.0]
    resumed = metrics.Totals(CPU)
    resumed.restore(saved)
    for logits, labels, loss in batches[2:]:
        resumed.add(logits, labels, loss)
    loss_sum, correct, samples, _, _ = resumed.as_host()
    assert (correct, samples) == whole[1:3]
    assert loss_sum == pytest.approx(whole[0], rel=1e-12)
    assert resumed.correct.dtype == torch.int64 and resumed.samples.dtype == torch.int64


@pytest.fixture
def one_rank_group() -> Iterator[None]:
    """A real gloo process group of one rank, in this process; destroyed afterwards."""
    assert not dist.is_initialized()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{distenv.free_port()}",
                            rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_reduce_gives_sample_weighted_means(one_rank_group: None) -> None:
    batches = _batches(4, [10, 3, 7], classes=5)
    reduced = metrics.reduce(_filled(batches, classes=5))
    assert isinstance(reduced, metrics.Reduced)
    assert reduced.samples == 20
    loss = sum(loss.item() * len(y) for _, y, loss in batches) / 20
    accuracy = sum(int((x.argmax(1) == y).sum()) for x, y, _ in batches) / 20
    assert reduced.loss == pytest.approx(loss) and reduced.accuracy == pytest.approx(accuracy)
    assert reduced.confusion is not None and len(reduced.confusion) == 5
    assert all(len(row) == 5 for row in reduced.confusion)
    assert sum(map(sum, reduced.confusion)) == 20
    assert sum(reduced.confusion[i][i] for i in range(5)) == round(accuracy * 20)


def test_reduce_of_nothing_is_zero_not_an_error(one_rank_group: None) -> None:
    """A rank with an empty validation shard (more ranks than samples) adds nothing."""
    reduced = metrics.reduce(metrics.Totals(CPU))
    assert reduced == metrics.Reduced(loss=0.0, accuracy=0.0, samples=0, confusion=None)


def test_sync_step_carries_loss_step_time_and_both_requests(one_rank_group: None) -> None:
    quiet = metrics.sync_step(torch.tensor(0.75), 0.125, stop_requested=False,
                              checkpoint_due=False)
    assert quiet == metrics.StepSync(mean_loss=0.75, slowest_s=0.125, fastest_s=0.125,
                                     stop_requested=False, checkpoint_due=False)
    stop = metrics.sync_step(torch.tensor(2.0), 0.5, stop_requested=True, checkpoint_due=False)
    assert stop.stop_requested and not stop.checkpoint_due
    due = metrics.sync_step(torch.tensor(2.0), 0.5, stop_requested=False, checkpoint_due=True)
    assert due.checkpoint_due and not due.stop_requested


def test_reduce_weights_ranks_by_their_samples(monkeypatch: pytest.MonkeyPatch) -> None:
    """Ranks with uneven shards (strided validation): the result is the mean over all samples,
    not the mean of the ranks' means. Three ranks' sums, as the gather would return them."""
    shards = [_batches(5, [9, 4], classes=3), _batches(6, [2], classes=3),
              _batches(7, [8, 8, 1], classes=3)]
    per_rank = [_filled(b, classes=3).as_host() for b in shards]
    monkeypatch.setattr(metrics.distributed, "gather_to_all", lambda mine: per_rank)
    reduced = metrics.reduce(metrics.Totals(CPU, num_classes=3))
    everything = [batch for shard in shards for batch in shard]
    whole = _filled(everything, classes=3).as_host()
    assert reduced.samples == whole[2] == 32
    assert reduced.loss == pytest.approx(whole[0] / 32)
    assert reduced.accuracy == pytest.approx(whole[1] / 32)
    assert reduced.confusion == [whole[3][r * 3:(r + 1) * 3] for r in range(3)]
    mean_of_means = sum(h[0] / h[2] for h in per_rank) / 3
    assert reduced.loss != pytest.approx(mean_of_means)


# -- top-5 accuracy ------------------------------------------------------------------------------

def _ranked_batches() -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Two batches over 7 classes whose top-5 sets are known by construction."""
    rising = torch.arange(7.0).repeat(4, 1)  # top 5: classes 2..6, top 1: class 6
    falling = (6 - torch.arange(7.0)).repeat(2, 1)  # top 5: classes 0..4, top 1: class 0
    return [(rising, torch.tensor([6, 2, 1, 0]), torch.tensor(1.0)),
            (falling, torch.tensor([1, 5]), torch.tensor(2.0))]


def test_top5_counts_labels_among_the_five_highest_scores() -> None:
    totals = metrics.Totals(CPU, top_k=5)
    for logits, labels, loss in _ranked_batches():
        totals.add(logits, labels, loss)
    host = totals.as_host()
    # By hand: 6 and 2 are in {2..6}, 1 and 0 are not; 1 is in {0..4}, 5 is not.
    assert (host.correct_top_k, host.correct, host.samples) == (3, 1, 6)
    assert metrics.Totals(CPU).as_host().correct_top_k == 0  # not counted unless asked


def test_top5_reduces_over_ranks_and_survives_a_checkpoint(monkeypatch: pytest.MonkeyPatch
                                                          ) -> None:
    first, second = _ranked_batches()
    shards = []
    for batch in (first, second):
        totals = metrics.Totals(CPU, top_k=5)
        totals.add(*batch)
        shards.append(totals.as_host())
    monkeypatch.setattr(metrics.distributed, "gather_to_all", lambda mine: shards)
    reduced = metrics.reduce(metrics.Totals(CPU, top_k=5))
    assert reduced.accuracy_top5 == pytest.approx(3 / 6)
    assert reduced.accuracy == pytest.approx(1 / 6)
    assert metrics.reduce(metrics.Totals(CPU)).accuracy_top5 is None  # 5 classes or fewer

    saved = metrics.Totals(CPU, top_k=5)
    saved.add(*first)
    resumed = metrics.Totals(CPU, top_k=5)
    resumed.restore(saved.snapshot())
    resumed.add(*second)
    assert resumed.as_host().correct_top_k == 3
