"""Per-rank sums kept on the device, their exact reduction over ranks, and what the ranks exchange
at a logging step."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from train.distributed import process_group as distributed

Layout = dict[str, tuple[tuple[int, ...], torch.dtype]]
"""The sums a task keeps: name -> (shape, dtype); float64 for sums of values, int64 for counts."""

LEGACY_ORDER = ("loss", "correct", "samples", "correct_top5")
"""The sums a classification checkpoint held as a plain list before tasks existed."""


class Totals:
    """Named sums kept on the device and added to without host syncs: always `loss` (the
    summed loss), `items` (what the loss is a sum over: samples, pixels, tokens) and `samples`;
    a task adds its own (train/tasks/). Summed over ranks, they give exact metrics at any world
    size: sums and counts, never means of means."""

    def __init__(self, device: torch.device, layout: Layout) -> None:
        # float64 so that sums over a long epoch stay exact enough to compare across world sizes
        self.sums = {name: torch.zeros(shape, dtype=dtype, device=device)
                     for name, (shape, dtype) in {**BASE_LAYOUT, **layout}.items()}
        # Plain numbers (counts from shapes) are added on the host: a kernel per step saved,
        # and folded into `sums` when they are read.
        self._pending: dict[str, int | float] = {}
        self._host: dict[str, Any] | None = None

    def add(self, sums: Mapping[str, torch.Tensor | float | int]) -> None:
        # No no_grad context: each value is detached, and that costs less (every step adds).
        for name, value in sums.items():
            if isinstance(value, torch.Tensor):
                self.sums[name] += value.detach()  # a float32 loss adds into float64 exactly
            else:
                self._pending[name] = self._pending.get(name, 0) + value

    def _fold(self) -> None:
        for name, value in self._pending.items():
            self.sums[name] += value
        self._pending = {}

    def snapshot(self) -> dict[str, Any]:
        """The running sums, mid-epoch (for a checkpoint)."""
        self._fold()
        return {name: value.tolist() for name, value in self.sums.items()}

    def restore(self, values: Mapping[str, Any] | Sequence[float]) -> None:
        if not isinstance(values, Mapping):  # a checkpoint from before tasks: classification's
            values = dict(zip(LEGACY_ORDER, values, strict=False))
            values["items"] = values["samples"]
        for name, value in values.items():
            if name in self.sums:
                self._pending.pop(name, None)
                self.sums[name].copy_(torch.as_tensor(value, dtype=self.sums[name].dtype))

    def as_host(self) -> dict[str, Any]:
        """The one host sync of an epoch (call it once the epoch is over: the result is kept):
        every sum as a float or a nested list, counts as ints."""
        if self._host is None:
            self._fold()
            flat = torch.cat([v.double().flatten() for v in self.sums.values()]).tolist()
            self._host, at = {}, 0
            for name, value in self.sums.items():
                n = value.numel()
                part = flat[at:at + n]
                at += n
                if not value.is_floating_point():
                    part = [int(x) for x in part]
                self._host[name] = (part[0] if value.ndim == 0 else
                                    torch.tensor(part).view(value.shape).tolist())
        return self._host


BASE_LAYOUT: Layout = {"loss": ((), torch.float64), "items": ((), torch.int64),
                       "samples": ((), torch.int64)}


def _add(a: Any, b: Any) -> Any:
    if isinstance(a, list):
        return [_add(x, y) for x, y in zip(a, b, strict=True)]
    return a + b


def sum_over(host: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Several ranks' host sums, added name by name (nested lists element by element)."""
    total = dict(host[0])
    for other in host[1:]:
        total = {name: _add(total[name], other[name]) for name in total}
    return total


@dataclass
class Reduced:
    """One phase's metrics, the same on every rank: the task's finished values (`loss` and its
    own, names without the split) from every rank's sums, and those sums."""

    values: dict[str, float]
    samples: int
    sums: dict[str, Any] = field(default_factory=dict)
    items_name: str | None = None
    """What the task's items are where their count is logged ("tokens"), else None."""

    @property
    def items(self) -> int:
        """The items the loss is a mean over (samples, pixels, tokens), over every rank."""
        return int(self.sums.get("items", self.samples))

    @property
    def loss(self) -> float:
        return self.values["loss"]

    @property
    def confusion(self) -> list[list[int]] | None:
        """confusion[true][predicted], summed over ranks, where the task kept one."""
        return self.sums.get("confusion")


def reduce(totals: Totals, finalize: Callable[[dict[str, Any]], dict[str, float]],
           items_name: str | None = None) -> Reduced:
    """Every rank's sums, gathered to every rank and added, then finished by the task
    (`finalize`): all ranks hold the same numbers, so what they decide from them (stop early,
    save the best) needs no further agreement, and no rank needs to know it is rank 0."""
    summed = sum_over(distributed.gather_to_all(totals.as_host()))
    return Reduced(values=finalize(summed), samples=int(summed["samples"]), sums=summed,
                   items_name=items_name)


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
    shared: list[list[float]] = field(default_factory=list)
    """Every rank's `shared` numbers, by rank (the straggler check's times)."""


def sync_step(loss: torch.Tensor, step_time_s: float, stop_requested: bool,
              checkpoint_due: bool, shared: Sequence[float] = ()) -> StepSync:
    """One small all_gather on a logging step: loss, step time, each rank's requests and the
    few numbers it `shares` (the same count on every rank) - in this one collective rather than
    one more of their own."""
    flags = torch.tensor([step_time_s, float(stop_requested), float(checkpoint_due), *shared],
                         dtype=torch.float32, device=loss.device)
    mine = torch.cat([loss.detach().float().reshape(1), flags])
    everyone = [torch.empty_like(mine) for _ in range(torch.distributed.get_world_size())]
    torch.distributed.all_gather(everyone, mine)
    table = torch.stack(everyone).tolist()
    return StepSync(mean_loss=sum(row[0] for row in table) / len(table),
                    slowest_s=max(row[1] for row in table),
                    fastest_s=min(row[1] for row in table),
                    stop_requested=any(row[2] for row in table),
                    checkpoint_due=any(row[3] for row in table),
                    shared=[row[4:] for row in table] if shared else [])
