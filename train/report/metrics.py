"""Per-rank sums kept on the device, their exact sample-weighted reduction, and what the ranks
exchange at a logging step."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from train.config.validation import TOP_K as TOP_K  # accuracy_top5: with more classes than this
from train.distributed import process_group as distributed


class HostSums(NamedTuple):
    """One rank's sums, on the host."""

    loss_sum: float
    correct: int
    samples: int
    confusion: list[int] | None
    correct_top_k: int


class Totals:
    """Loss x samples, correct predictions and samples, accumulated without host syncs.

    With `num_classes`, also the confusion matrix (rows: true class, columns: predicted); with
    `top_k`, also the samples whose label is among the k highest scores.
    """

    def __init__(self, device: torch.device, num_classes: int | None = None,
                 top_k: int | None = None) -> None:
        # float64 so that sums over a long epoch stay exact enough to compare across world sizes
        self.loss_sum = torch.zeros((), dtype=torch.float64, device=device)
        self.correct = torch.zeros((), dtype=torch.int64, device=device)
        self.samples = torch.zeros((), dtype=torch.int64, device=device)
        self.correct_top_k = torch.zeros((), dtype=torch.int64, device=device)
        self.num_classes, self.top_k = num_classes, top_k
        self.confusion = (None if num_classes is None else
                          torch.zeros(num_classes * num_classes, dtype=torch.int64, device=device))
        self._host: HostSums | None = None

    @torch.no_grad()
    def add(self, logits: torch.Tensor, labels: torch.Tensor, loss: torch.Tensor) -> None:
        n = labels.shape[0]
        predicted = logits.argmax(dim=1)
        self.loss_sum += loss.detach().double() * n
        self.correct += (predicted == labels).sum()
        self.samples += n
        if self.top_k is not None:  # one small kernel on the device, no sync
            best = logits.topk(self.top_k, dim=1).indices
            self.correct_top_k += (best == labels.unsqueeze(1)).any(dim=1).sum()
        if self.confusion is not None:
            self.confusion += torch.bincount(labels * self.num_classes + predicted,
                                             minlength=self.confusion.numel())

    def _sums(self) -> torch.Tensor:
        return torch.stack([self.loss_sum, self.correct.double(), self.samples.double(),
                            self.correct_top_k.double()])

    def snapshot(self) -> list[float]:
        """The running sums, mid-epoch (for a checkpoint)."""
        return self._sums().tolist()

    def restore(self, values: list[float]) -> None:
        self.loss_sum.fill_(values[0])
        self.correct.fill_(int(values[1]))
        self.samples.fill_(int(values[2]))
        self.correct_top_k.fill_(int(values[3]) if len(values) > 3 else 0)

    def as_host(self) -> HostSums:
        """The one host sync of an epoch (call it once the epoch is over: the result is kept)."""
        if self._host is None:
            values = self._sums().tolist()
            confusion = None if self.confusion is None else self.confusion.tolist()
            self._host = HostSums(values[0], int(values[1]), int(values[2]), confusion,
                                  int(values[3]))
        return self._host


@dataclass
class Reduced:
    loss: float
    accuracy: float
    samples: int
    confusion: list[list[int]] | None = None
    """confusion[true][predicted], summed over ranks (final validation only)."""
    accuracy_top5: float | None = None
    """Share of samples whose label is among the 5 highest scores (more than 5 classes)."""


def reduce(totals: Totals) -> Reduced:
    """Every rank's sums, gathered to every rank: the sample-weighted means, the same on all.

    All ranks hold the same numbers, so what they decide from them (stop early, save the best)
    needs no further agreement, and no rank needs to know it is rank 0 to compute them.
    """
    gathered = distributed.gather_to_all(totals.as_host())
    samples = sum(g.samples for g in gathered)
    confusion = None
    if totals.num_classes is not None:
        c = totals.num_classes
        flat = [sum(column) for column in zip(*(g.confusion for g in gathered), strict=True)]
        confusion = [flat[row * c:(row + 1) * c] for row in range(c)]
    top5 = None
    if totals.top_k is not None:
        top5 = sum(g.correct_top_k for g in gathered) / max(1, samples)
    return Reduced(loss=sum(g.loss_sum for g in gathered) / max(1, samples),
                   accuracy=sum(g.correct for g in gathered) / max(1, samples),
                   samples=samples, confusion=confusion, accuracy_top5=top5)


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
