"""A user's own data, models and task for the task layer, as a lab would write them: NOT part of
train/, reached through PYTHONPATH (tests/ on it)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset

from train.tasks.base import Sums, Task


class Diabetes(Dataset):
    """scikit-learn's bundled diabetes set (442 patients, 10 features, a disease progression
    score a year later): features and target standardised (over all 442), float32; `start` and
    `stop` keep patients [start, stop) only (a training set and a separate validation set)."""

    def __init__(self, start: int = 0, stop: int | None = None) -> None:
        from sklearn.datasets import load_diabetes

        x, y = load_diabetes(return_X_y=True)
        self.x = torch.tensor((x - x.mean(0)) / x.std(0), dtype=torch.float32)[start:stop]
        self.y = torch.tensor((y - y.mean()) / y.std(), dtype=torch.float32)[start:stop]

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[index], self.y[index]


class Regressor(nn.Module):
    """A small MLP: `in_features` inputs, `num_classes` outputs (filled: one per target value)."""

    def __init__(self, num_classes: int, in_features: int = 10, hidden: int = 32) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(in_features, hidden), nn.ReLU(),
                                 nn.Linear(hidden, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class Shapes(Dataset):
    """(3, size, size) images of a rectangle and a disc on noise, with their (size, size) masks:
    0 background, 1 rectangle, 2 disc; a 1-pixel frame is 255 (ignored)."""

    classes = ["background", "rectangle", "disc"]

    def __init__(self, length: int = 48, size: int = 32, seed: int = 0) -> None:
        self.length, self.size, self.seed = length, size, seed

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= index < self.length:
            raise IndexError(index)
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        s = self.size
        image = torch.rand(3, s, s, generator=g) * 0.2
        mask = torch.zeros(s, s, dtype=torch.long)
        top, left = (int(v) for v in torch.randint(1, s // 2, (2,), generator=g))
        mask[top:top + s // 3, left:left + s // 3] = 1
        cy, cx = (int(v) for v in torch.randint(s // 4, 3 * s // 4, (2,), generator=g))
        yy, xx = torch.meshgrid(torch.arange(s), torch.arange(s), indexing="ij")
        mask[(yy - cy) ** 2 + (xx - cx) ** 2 <= (s // 6) ** 2] = 2
        image[0] += (mask == 1).float()
        image[1] += (mask == 2).float()
        mask[0, :] = mask[-1, :] = mask[:, 0] = mask[:, -1] = 255
        return image, mask


class TinySegmenter(nn.Module):
    """Per-pixel scores from three 3x3 convolutions; returns {"out": scores} as torchvision's
    segmentation models do."""

    def __init__(self, num_classes: int, in_channels: int = 3, width: int = 16) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Conv2d(in_channels, width, 3, padding=1), nn.ReLU(),
                                 nn.Conv2d(width, width, 3, padding=1), nn.ReLU(),
                                 nn.Conv2d(width, num_classes, 1))

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"out": self.net(x)}


class AbsoluteError(Task):
    """A user's task: regression scored by the absolute error (L1 loss, summed), with the
    share of predictions within `tolerance` of the target as a metric of its own."""

    name = "absolute_error"
    metrics = ("loss", "within_tolerance")

    def __init__(self, tolerance: float = 0.5) -> None:
        self.tolerance = tolerance

    def layout(self, detailed: bool) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        return {"within": ((), torch.int64)}

    def step(self, output: Any, target: Any, detailed: bool = False) -> tuple[torch.Tensor, Sums]:
        prediction = output.reshape(target.shape)
        error = (prediction - target.to(prediction.dtype)).abs()
        loss = error.sum()
        n = target.shape[0]
        return loss, {"loss": loss.detach().double(), "items": n, "samples": n,
                      "within": (error.detach() <= self.tolerance).sum()}

    def finalize(self, sums: Mapping[str, Any]) -> dict[str, float]:
        n = max(1, sums["items"])
        return {"loss": sums["loss"] / n, "within_tolerance": sums["within"] / n}


class NotATask:
    """Has neither step nor finalize."""


class TaskWithWeights(nn.Module):
    """A task that holds a trainable parameter: refused (it would escape DDP)."""

    metrics = ("loss",)

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(()))

    def step(self, output: Any, target: Any, detailed: bool = False) -> Any:
        raise AssertionError("never run")

    def finalize(self, sums: Any) -> Any:
        raise AssertionError("never run")


class BadMetricName(AbsoluteError):
    metrics = ("loss", "hits%")


class Severity(Diabetes):
    """The diabetes features with a word for a target ("mild" or "severe"): no number to regress
    on (refused by task=regression at pre-flight)."""

    def __getitem__(self, index: int) -> tuple[torch.Tensor, str]:  # type: ignore[override]
        return self.x[index], "severe" if self.y[index] > 0 else "mild"
