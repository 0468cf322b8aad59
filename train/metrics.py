"""Per-rank sums kept on the device, their exact sample-weighted reduction, and what the ranks
exchange at a logging step."""

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


def reduce(totals: Totals) -> Reduced:
    """Every rank's sums, gathered to every rank: the sample-weighted means, the same on all.

    All ranks hold the same numbers, so what they decide from them (stop early, save the best)
    needs no further agreement, and no rank needs to know it is rank 0 to compute them.
    """
    gathered = distributed.gather_to_all(totals.as_host())
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


@dataclass
class StepSync:
    """What the ranks exchange at a logging step (the only steps that wait for the device)."""

    mean_loss: float
    """train/step_loss: the mean of every rank's last loss."""
    slowest_s: float
    fastest_s: float
    """The slowest and fastest rank's mean step time since the previous logging step."""
    stop_requested: bool
    """Some rank received a stop signal: every rank checkpoints and stops."""
    checkpoint_due: bool
    """Some rank's checkpoint interval ran out: every rank checkpoints."""


def sync_step(loss: torch.Tensor, step_time_s: float, stop_requested: bool,
              checkpoint_due: bool) -> StepSync:
    """One small all_gather on a logging step: loss, step time and each rank's requests."""
    flags = torch.tensor([step_time_s, float(stop_requested), float(checkpoint_due)],
                         dtype=torch.float32, device=loss.device)
    mine = torch.cat([loss.detach().float().reshape(1), flags])
    everyone = [torch.empty_like(mine) for _ in range(torch.distributed.get_world_size())]
    torch.distributed.all_gather(everyone, mine)
    table = torch.stack(everyone).tolist()
    return StepSync(mean_loss=sum(row[0] for row in table) / len(table),
                    slowest_s=max(row[1] for row in table),
                    fastest_s=min(row[1] for row in table),
                    stop_requested=any(row[2] for row in table),
                    checkpoint_due=any(row[3] for row in table))
