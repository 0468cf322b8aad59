"""Per-rank sums kept on the device, and their exact, sample-weighted reduction on rank 0."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from train import distributed


class Totals:
    """Loss x samples, correct predictions and samples, accumulated without host syncs."""

    def __init__(self, device: torch.device) -> None:
        # float64 so that sums over a long epoch stay exact enough to compare across world sizes
        self.loss_sum = torch.zeros((), dtype=torch.float64, device=device)
        self.correct = torch.zeros((), dtype=torch.int64, device=device)
        self.samples = torch.zeros((), dtype=torch.int64, device=device)

    @torch.no_grad()
    def add(self, logits: torch.Tensor, labels: torch.Tensor, loss: torch.Tensor) -> None:
        n = labels.shape[0]
        self.loss_sum += loss.detach().double() * n
        self.correct += (logits.argmax(dim=1) == labels).sum()
        self.samples += n

    def as_host(self) -> tuple[float, int, int]:
        """The one host sync of an epoch."""
        values = torch.stack([self.loss_sum, self.correct.double(), self.samples.double()]).tolist()
        return values[0], int(values[1]), int(values[2])


@dataclass
class Reduced:
    loss: float
    accuracy: float
    samples: int


def reduce_to_main(totals: Totals) -> Reduced | None:
    """Gather every rank's sums on rank 0 and return the sample-weighted means there."""
    gathered = distributed.gather_to_main(totals.as_host())
    if gathered is None:
        return None
    loss_sum = sum(g[0] for g in gathered)
    correct = sum(g[1] for g in gathered)
    samples = sum(g[2] for g in gathered)
    return Reduced(loss=loss_sum / max(1, samples), accuracy=correct / max(1, samples),
                   samples=samples)


def step_stats_to_all(loss: torch.Tensor, step_time_s: float) -> tuple[float, float, float]:
    """On a logging step: mean loss over ranks, and the slowest and fastest rank's step time."""
    mine = torch.stack([loss.detach().float(),
                        torch.tensor(step_time_s, dtype=torch.float32, device=loss.device)])
    everyone = [torch.empty_like(mine) for _ in range(torch.distributed.get_world_size())]
    torch.distributed.all_gather(everyone, mine)
    table = torch.stack(everyone).tolist()
    losses = [row[0] for row in table]
    times = [row[1] for row in table]
    return sum(losses) / len(losses), max(times), min(times)
