"""The data sets, each loaded whole into memory: where it comes from and in what shape.

Every data set is one tensor of images (uint8 where the source is 8-bit, so CIFAR-10 costs
150 MB per rank, not 600) and one of labels. Nothing is downloaded unless data.download=true
(compute nodes are often offline); a missing data set names the command that fetches it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from train.config.groups import DataConfig, reads_files
from train.errors import TrainError


class DataMissingError(TrainError, FileNotFoundError):
    """A data set is not on disk and data.download=false."""


@dataclass
class ImageSet:
    """A whole data set in memory: images (N, C, H, W), integer labels, and how to normalise."""

    images: torch.Tensor
    labels: torch.Tensor
    scale: float
    """Divide raw pixel values by this to get [0, 1]."""
    class_names: list[str]

    @property
    def num_classes(self) -> int:
        return len(self.class_names)

    @property
    def channels(self) -> int:
        return int(self.images.shape[1])

    @property
    def image_size(self) -> int:
        return int(self.images.shape[-1])


def _digits(cfg: DataConfig) -> ImageSet:
    # The same file sklearn.datasets.load_digits() reads, without importing scikit-learn
    # (1.6 s per rank here): 1,797 rows of 64 pixel values (0-16) and the label.
    import importlib.util

    import numpy as np

    spec = importlib.util.find_spec("sklearn")
    if spec is None or not spec.submodule_search_locations:
        raise DataMissingError("data=digits needs scikit-learn installed (pip install "
                               "scikit-learn).")
    path = Path(spec.submodule_search_locations[0]) / "datasets" / "data" / "digits.csv.gz"
    table = torch.from_numpy(np.loadtxt(path, delimiter=",", dtype=np.float32))
    images = table[:, :-1].reshape(-1, 1, 8, 8)
    return ImageSet(images, table[:, -1].long(), 16.0, [str(i) for i in range(10)])


def _synthetic(cfg: DataConfig) -> ImageSet:
    g = torch.Generator().manual_seed(cfg.split_seed)
    shape = (cfg.num_samples, cfg.channels, cfg.image_size, cfg.image_size)
    images = torch.randint(0, 256, shape, dtype=torch.uint8, generator=g)
    labels = torch.randint(0, cfg.num_classes, (cfg.num_samples,), generator=g)
    return ImageSet(images, labels, 255.0, [str(i) for i in range(cfg.num_classes)])


def _download_hint(name: str, cls: str, root: str) -> str:
    return (f"Data set {name!r} is not under data.root={root!r} and data.download=false "
            "(compute nodes are often offline). Download it once where there is internet access:"
            f"\n  python -c \"from torchvision.datasets import {cls}; {cls}('{root}', "
            "download=True)\"\nor run with data.download=true; point data.root (or "
            "TRAIN_DATA_ROOT) at a directory all nodes can read.")


def _torchvision(name: str, cls_name: str,
                 train: bool = True) -> Callable[[DataConfig], ImageSet]:
    def load(cfg: DataConfig) -> ImageSet:
        import numpy as np
        import torchvision.datasets as tvd

        cls = getattr(tvd, cls_name)
        try:
            ds = cls(cfg.root, train=train, download=cfg.download)
        except RuntimeError as e:
            if "not found" in str(e).lower():
                raise DataMissingError(_download_hint(name, cls_name, cfg.root)) from None
            raise
        data = ds.data if isinstance(ds.data, torch.Tensor) else torch.from_numpy(
            np.ascontiguousarray(ds.data))
        images = data.unsqueeze(1) if data.ndim == 3 else data.permute(0, 3, 1, 2)
        labels = torch.as_tensor(ds.targets, dtype=torch.long)
        return ImageSet(images.contiguous(), labels, 255.0, [str(c) for c in ds.classes])

    return load


CIFAR10_FOLDER = "cifar-10-batches-py"
CIFAR10_TRAIN = [f"data_batch_{i}" for i in range(1, 6)]
CIFAR10_META = "batches.meta"


def _cifar10(cfg: DataConfig) -> ImageSet:
    """CIFAR-10's training batches, read with an unpickler that builds plain arrays only
    (train/security/safe_pickle.py): torchvision's reader unpickles whatever is in data.root. A
    site's
    own copy in the same format reads the same way (torchvision insists on the official md5).
    A download goes through torchvision, which checks the md5 of what it fetched."""
    import numpy as np

    from train.security import safe_pickle

    folder = Path(cfg.root) / CIFAR10_FOLDER
    needed = [folder / name for name in [*CIFAR10_TRAIN, CIFAR10_META]]
    if cfg.download and not all(path.is_file() for path in needed):
        import torchvision.datasets as tvd

        tvd.CIFAR10(cfg.root, train=True, download=True)
    if not all(path.is_file() for path in needed):
        raise DataMissingError(_download_hint("cifar10", "CIFAR10", cfg.root))
    try:
        batches = [safe_pickle.load(folder / name) for name in CIFAR10_TRAIN]
        names = safe_pickle.load(folder / CIFAR10_META)["label_names"]
    except safe_pickle.UnsafePickleError as e:
        raise DataMissingError(str(e)) from None
    pixels = np.vstack([b["data"] for b in batches]).reshape(-1, 3, 32, 32)  # rows: R, G, B
    labels = [label for b in batches for label in b.get("labels", b.get("fine_labels", []))]
    return ImageSet(torch.from_numpy(np.ascontiguousarray(pixels)),
                    torch.as_tensor(labels, dtype=torch.long), 255.0, [str(c) for c in names])


DATASETS: dict[str, Callable[[DataConfig], ImageSet]] = {
    "digits": _digits,
    "synthetic": _synthetic,
    "mnist": _torchvision("mnist", "MNIST"),
    "fashion_mnist": _torchvision("fashion_mnist", "FashionMNIST"),
    "cifar10": _cifar10,
}


def _cifar10_test(cfg: DataConfig) -> ImageSet:
    import numpy as np

    from train.security import safe_pickle

    folder = Path(cfg.root) / CIFAR10_FOLDER
    if not (folder / "test_batch").is_file():
        raise DataMissingError(f"no {folder / 'test_batch'}")
    batch = safe_pickle.load(folder / "test_batch")
    names = safe_pickle.load(folder / CIFAR10_META)["label_names"]
    pixels = np.asarray(batch["data"]).reshape(-1, 3, 32, 32)
    return ImageSet(torch.from_numpy(np.ascontiguousarray(pixels)),
                    torch.as_tensor(batch["labels"], dtype=torch.long), 255.0,
                    [str(c) for c in names])


TEST_SETS: dict[str, Callable[[DataConfig], ImageSet]] = {
    "mnist": _torchvision("mnist", "MNIST", train=False),
    "fashion_mnist": _torchvision("fashion_mnist", "FashionMNIST", train=False),
    "cifar10": _cifar10_test,
}
"""The built-in sets' test splits (torchvision's train=False files); digits and synthetic have
none."""


def test_set(cfg: DataConfig) -> ImageSet | None:
    """The test split, or None: the data set has none, or its files are not under data.root
    (then said once in the log: training does not need them)."""
    if cfg.name not in TEST_SETS:
        return None
    try:
        return TEST_SETS[cfg.name](cfg)
    except (DataMissingError, RuntimeError, OSError) as e:
        import logging

        logging.getLogger("train").warning("data=%s: its test split cannot be read (%s): no "
                                           "test phase", cfg.name, e)
        return None


def check_available(cfg: DataConfig) -> None:
    """Pre-flight: refuse early (before ranks start) when a data set is missing."""
    if reads_files(cfg):
        DATASETS[cfg.name](cfg)
