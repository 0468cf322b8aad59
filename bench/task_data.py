"""The data and models of `python -m bench.tasks`: synthetic, generated in memory from a fixed
seed, the same for the service (`data.train._target_=bench.task_data.Features`,
`model._target_=bench.task_data.MLP`, ...) and for bench/plain_tasks.py.

- regression: `Features` (64 standard-normal features, a scalar target = a fixed linear part
  plus a fixed non-linear part plus noise) and `MLP`;
- segmentation: `Shapes` (3x64x64 images of rectangles and discs on noise, HxW masks: 0
  background, 1 rectangle, 2 disc, a 2-pixel frame 255 = ignored) and `SegNet`, a small
  encoder-decoder of convolutions.

The Datasets are built as a tutorial's would be: tensors generated once, `__getitem__`
returning one (input, target) sample (for segmentation a float image scaled to [0, 1] from
stored uint8, and an int64 mask).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import Dataset

SPLIT_SEEDS = {"train": 0, "val": 1}
IGNORE = 255


def _generator(split: str, seed: int) -> torch.Generator:
    if split not in SPLIT_SEEDS:
        raise ValueError(f"split must be one of {sorted(SPLIT_SEEDS)}, not {split!r}")
    return torch.Generator().manual_seed(seed * 1000 + SPLIT_SEEDS[split])


class Features(Dataset):
    """`length` samples of `features` float32 features and a float32 scalar target. The target
    function (weights drawn from `seed` alone) is the same for both splits."""

    def __init__(self, length: int = 20_000, features: int = 64, split: str = "train",
                 seed: int = 0, noise: float = 0.1) -> None:
        w = torch.Generator().manual_seed(seed)
        linear = torch.randn(features, generator=w) / features ** 0.5
        mixing = torch.randn(features, 8, generator=w) / features ** 0.5
        g = _generator(split, seed)
        self.x = torch.randn(length, features, generator=g)
        y = self.x @ linear + torch.sin(self.x @ mixing).sum(dim=1) / 8 ** 0.5
        self.y = (y + noise * torch.randn(length, generator=g)).float()

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[index], self.y[index]


class MLP(nn.Module):
    """in_features -> hidden -> hidden -> num_classes (the service fills num_classes with the
    target's size per sample: 1)."""

    def __init__(self, num_classes: int = 1, in_features: int = 64, hidden: int = 256) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(in_features, hidden), nn.ReLU(),
                                 nn.Linear(hidden, hidden), nn.ReLU(),
                                 nn.Linear(hidden, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class Shapes(Dataset):
    """`length` (3, size, size) images, each with 1-3 rectangles and discs of class colours
    (plus noise) drawn over a noisy background, and their (size, size) class masks."""

    classes = ["background", "rectangle", "disc"]

    def __init__(self, length: int = 2_000, size: int = 64, split: str = "train",
                 seed: int = 0, frame: int = 2) -> None:
        g = _generator(split, seed)
        colours = torch.tensor([[0.2, 0.2, 0.2], [0.8, 0.3, 0.2], [0.2, 0.4, 0.8]])
        rows, cols = torch.meshgrid(torch.arange(size), torch.arange(size), indexing="ij")
        rows, cols = rows[None], cols[None]  # against (length, 1, 1) shape parameters
        masks = torch.zeros(length, size, size, dtype=torch.uint8)
        count = torch.randint(1, 4, (length,), generator=g)
        for slot in range(3):  # each image's shapes in turn, vectorised over the images
            r0, c0 = torch.randint(0, size - 12, (2, length, 1, 1), generator=g)
            h, w = torch.randint(8, size // 2, (2, length, 1, 1), generator=g)
            disc = torch.rand(length, 1, 1, generator=g) < 0.5
            radius = torch.minimum(h, w) / 2
            inside_disc = (rows - r0 - radius) ** 2 + (cols - c0 - radius) ** 2 <= radius ** 2
            inside_rect = (rows >= r0) & (rows < r0 + h) & (cols >= c0) & (cols < c0 + w)
            drawn = torch.where(disc, inside_disc, inside_rect) & (slot < count)[:, None, None]
            masks = torch.where(drawn, torch.where(disc, 2, 1).to(torch.uint8), masks)
        pixels = colours.T[:, masks.long()].transpose(0, 1)  # (length, 3, size, size)
        pixels += 0.15 * torch.randn(pixels.shape, generator=g)
        self.images = (pixels.clamp(0, 1) * 255).round().to(torch.uint8)
        if frame:
            masks[:, :frame, :] = masks[:, -frame:, :] = IGNORE
            masks[:, :, :frame] = masks[:, :, -frame:] = IGNORE
        self.masks = masks

    def __len__(self) -> int:
        return len(self.masks)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.images[index].float().div_(255.0), self.masks[index].long()


class SegNet(nn.Module):
    """A small encoder-decoder: two strided 3x3 convolutions down (x4), two transposed ones
    back up, a 1x1 convolution to one score map per class."""

    def __init__(self, num_classes: int = 3, in_channels: int = 3, width: int = 16) -> None:
        super().__init__()

        def block(cin: int, cout: int, stride: int = 1) -> nn.Sequential:
            return nn.Sequential(nn.Conv2d(cin, cout, 3, stride, 1, bias=False),
                                 nn.BatchNorm2d(cout), nn.ReLU(inplace=True))

        self.encoder = nn.Sequential(block(in_channels, width), block(width, 2 * width, 2),
                                     block(2 * width, 4 * width, 2))
        self.decoder = nn.Sequential(
            nn.ConvTranspose2d(4 * width, 2 * width, 2, stride=2), nn.ReLU(inplace=True),
            nn.ConvTranspose2d(2 * width, width, 2, stride=2), nn.ReLU(inplace=True),
            nn.Conv2d(width, num_classes, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.decoder(self.encoder(x))
