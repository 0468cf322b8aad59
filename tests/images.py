"""Real JPEG folders in torchvision's ImageFolder layout, for the tests and `bench.imagefolder`.

Each class has its own colour (hues spread around the colour wheel) under per-image noise and a
random bright square, so a small CNN learns the classes in an epoch or two and no two files are
alike. Everything comes from one seeded generator: the same call writes the same bytes.
"""

from __future__ import annotations

import colorsys
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from PIL import Image


def class_names(num_classes: int) -> list[str]:
    """Folder names that sort as their number does (class_00, class_01, ...)."""
    return [f"class_{k:02d}" for k in range(num_classes)]


def _picture(rng: np.random.Generator, hue: float, size: int) -> np.ndarray:
    base = np.array(colorsys.hsv_to_rgb(hue, 0.8, 0.8)) * 255
    pixels = base + rng.normal(0, 30, (size, size, 3))
    side = max(2, size // 4)
    y, x = rng.integers(0, size - side, 2)
    pixels[y:y + side, x:x + side] += 80
    return np.clip(pixels, 0, 255).astype(np.uint8)


def write_class_folder(folder: Path, classes: Sequence[str], per_class: int, size: int = 32,
                       seed: int = 0, quality: int = 90) -> list[Path]:
    """`folder/<class>/<n>.jpg`, `per_class` JPEGs of size x size pixels in each class; returns
    the files written, class by class."""
    rng = np.random.default_rng(seed)
    written = []
    for k, name in enumerate(classes):
        (folder / name).mkdir(parents=True, exist_ok=True)
        for n in range(per_class):
            path = folder / name / f"{n:05d}.jpg"
            Image.fromarray(_picture(rng, k / len(classes), size)).save(path, quality=quality)
            written.append(path)
    return written


def write_image_folder(root: Path, num_classes: int = 3, train_per_class: int = 10,
                       val_per_class: int | None = None, size: int = 32,
                       seed: int = 0) -> Path:
    """An ImageFolder data set under `root`: `root/train/<class>/...` and `root/val/<class>/...`
    with `val_per_class` set, else one folder `root/<class>/...` (split by data.val_fraction)."""
    names = class_names(num_classes)
    if val_per_class is None:
        write_class_folder(root, names, train_per_class, size, seed)
    else:
        write_class_folder(root / "train", names, train_per_class, size, seed)
        write_class_folder(root / "val", names, val_per_class, size, seed + 1)
    return root


def corrupt(path: Path, how: str = "truncated") -> Path:
    """Spoil an image file: `truncated` (half its bytes, as an interrupted copy leaves it) or
    `garbage` (bytes that are no image at all)."""
    data = path.read_bytes()
    path.write_bytes(data[:len(data) // 2] if how == "truncated" else b"not an image\n" * 20)
    return path
