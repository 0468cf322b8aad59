"""Per-rank sums kept on the device, and their exact, sample-weighted reduction on rank 0."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from train import distributed


class Totals:
    """Loss x samples, correct predictions and samples, accumulated without host syncs.

    With `num_classes`, also the confusion matrix (rows: true class, columns: predicted).
    """

    def __init__(self, device: torch.device, num_classes: int | None = None) -> None:
        # float64 so that sums over a long epoch stay exact enough to compare across world sizes
        self.loss_sum = torch.zeros((), dtype=torch.float64, device=device)
        self.correct = torch.zeros((), dtype=torch.int64, device=device)
        self.samples = torch.zeros((), dtype=torch.int64, device=device)
        self.num_classes = num_classes
        self.confusion = (None if num_classes is None else
                          torch.zeros(num_classes * num_classes, dtype=torch.int64, device=device))
        self._host: tuple[float, int, int, list[int] | None] | None = None

    @torch.no_grad()
    def add(self, logits: torch.Tensor, labels: torch.Tensor, loss: torch.Tensor) -> None:
        n = labels.shape[0]
        predicted = logits.argmax(dim=1)
        self.loss_sum += loss.detach().double() * n
        self.correct += (predicted == labels).sum()
        self.samples += n
        if self.confusion is not None:
            self.confusion += torch.bincount(labels * self.num_classes + predicted,
                                             minlength=self.confusion.numel())

    def snapshot(self) -> list[float]:
        """The running sums, mid-epoch (for a checkpoint)."""
        return torch.stack([self.loss_sum, self.correct.double(), self.samples.double()]).tolist()

    def restore(self, values: list[float]) -> None:
        self.loss_sum.fill_(values[0])
        self.correct.fill_(int(values[1]))
        self.samples.fill_(int(values[2]))

    def as_host(self) -> tuple[float, int, int, list[int] | None]:
        """The one host sync of an epoch (call it once the epoch is over: the result is kept)."""
        if self._host is None:
            self._host = self._to_host()
        return self._host

    def _to_host(self) -> tuple[float, int, int, list[int] | None]:
        values = torch.stack([self.loss_sum, self.correct.double(), self.samples.double()]).tolist()
        confusion = None if self.confusion is None else self.confusion.tolist()
        return values[0], int(values[1]), int(values[2]), confusion


@dataclass
class Reduced:
    loss: float
    accuracy: float
    samples: int
    confusion: list[list[int]] | None = None
    """confusion[true][predicted], summed over ranks (final validation only)."""


def reduce_to_main(totals: Totals) -> Reduced | None:
    """Gather every rank's sums on rank 0 and return the sample-weighted means there."""
    gathered = distributed.gather_to_main(totals.as_host())
    if gathered is None:
        return None
    loss_sum = sum(g[0] for g in gathered)
    correct = sum(g[1] for g in gathered)
    samples = sum(g[2] for g in gathered)
    confusion = None
    if totals.num_classes is not None:
        c = totals.num_classes
        flat = [sum(column) for column in zip(*(g[3] for g in gathered), strict=True)]
        confusion = [flat[row * c:(row + 1) * c] for row in range(c)]
    return Reduced(loss=loss_sum / max(1, samples), accuracy=correct / max(1, samples),
                   samples=samples, confusion=confusion)


def step_stats_to_all(loss: torch.Tensor, step_time_s: float,
                      request: float) -> tuple[float, float, float, float]:
    """On a logging step, on every rank: the mean loss over ranks, the slowest and fastest
    rank's step time, and the strongest checkpoint request of any rank (see Checkpointer)."""
    extra = torch.tensor([step_time_s, request], dtype=torch.float32, device=loss.device)
    mine = torch.cat([loss.detach().float().reshape(1), extra])
    everyone = [torch.empty_like(mine) for _ in range(torch.distributed.get_world_size())]
    torch.distributed.all_gather(everyone, mine)
    table = torch.stack(everyone).tolist()
    losses = [row[0] for row in table]
    times = [row[1] for row in table]
    return sum(losses) / len(losses), max(times), min(times), max(row[2] for row in table)
