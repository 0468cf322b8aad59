"""The data `python -m bench.gpu` trains on, written or built the same way for every arm.

- `write_tokens`: a token file for data=tokens (and the plain GPT loop): the Python
  documentation's topic texts (pydoc_data, in every CPython), each byte mapped to one id of a
  GPT-2-sized vocabulary, repeated until the file holds the tokens asked for. Nothing is
  downloaded; the ids spread over the vocabulary as a real tokenizer's would.
- `HostImages`: uint8 images held in host memory, cropped, flipped, converted and normalised
  on the CPU in `__getitem__` - the input-bound case's data set, read by DataLoader workers in
  the service (data=custom) and its plain peer alike.
- `synthetic_images`, `service_order`: the service's data=synthetic images and labels
  (train/data/datasets.py: the same generator, seed and draws) and the order its sampler
  reads them in, so that the plain ResNet loop and Lightning train on the same batches.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

GPT2_VOCAB = 50304
"""GPT-2's 50257 tokens padded to a multiple of 64, as nanoGPT does."""
MEAN = (0.485, 0.456, 0.406)
STD = (0.229, 0.224, 0.225)


def write_tokens(folder: Path, train_tokens: int, val_tokens: int,
                 vocab: int = GPT2_VOCAB) -> Path:
    """train.bin, val.bin and meta.json as `python -m train prepare-text` writes them."""
    import pydoc_data.topics

    text = np.frombuffer(Path(pydoc_data.topics.__file__).read_bytes(), dtype=np.uint8)
    ids = np.random.default_rng(0).choice(vocab, size=256, replace=False).astype(np.uint16)
    needed = train_tokens + val_tokens
    tokens = ids[np.resize(text, needed)]  # the text again and again
    folder.mkdir(parents=True, exist_ok=True)
    tokens[:train_tokens].tofile(folder / "train.bin")
    tokens[train_tokens:].tofile(folder / "val.bin")
    meta = {"tokenizer": "bench-bytes", "vocab_size": vocab, "dtype": "uint16",
            "tokens": {"train": train_tokens, "val": val_tokens}}
    (folder / "meta.json").write_text(json.dumps(meta))
    return folder


class HostImages(Dataset):
    """`size` random uint8 images of `side + pad` pixels a side in host memory, with labels of
    `classes` classes; sample i is a random `side` crop of image i, flipped half the time,
    as normalised float32 (what a torchvision pipeline of RandomCrop, RandomHorizontalFlip,
    ToDtype and Normalize hands a DataLoader). The crop and flip are drawn from a generator
    seeded by the sample's index, not the worker's: whichever process reads sample i makes the
    same one, so two loops that read the same order train on the same batches."""

    def __init__(self, size: int, side: int = 64, pad: int = 8, classes: int = 100,
                 seed: int = 0, augment: bool = True) -> None:
        g = torch.Generator().manual_seed(seed)
        self.images = torch.randint(0, 256, (size, 3, side + pad, side + pad), dtype=torch.uint8,
                                    generator=g)
        self.labels = torch.randint(0, classes, (size,), generator=g)
        self.side, self.pad, self.augment, self.seed = side, pad, augment, seed
        self.classes = [str(c) for c in range(classes)]
        self.mean = torch.tensor(MEAN).view(3, 1, 1)
        self.std = torch.tensor(STD).view(3, 1, 1)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        image = self.images[index]
        if self.augment:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
            y, x = (int(v) for v in torch.randint(0, self.pad + 1, (2,), generator=g))
            image = image[:, y:y + self.side, x:x + self.side]
            if torch.rand((), generator=g) < 0.5:
                image = image.flip(-1)
        else:
            centre = self.pad // 2
            image = image[:, centre:centre + self.side, centre:centre + self.side]
        return image.float().div_(255).sub_(self.mean).div_(self.std), int(self.labels[index])


def synthetic_images(num_samples: int, side: int, classes: int, channels: int = 3,
                     seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """data=synthetic's uint8 images and labels (train/data/datasets.py `_synthetic`)."""
    g = torch.Generator().manual_seed(seed)
    images = torch.randint(0, 256, (num_samples, channels, side, side), dtype=torch.uint8,
                           generator=g)
    return images, torch.randint(0, classes, (num_samples,), generator=g)


def service_order(num_samples: int, seed: int = 0, val_fraction: float = 0.1,
                  split_seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows of data=synthetic's training split in the order the service's one rank reads
    them in its first epoch, and the split's rows: its own split (data.val_fraction 0.1,
    data.split_seed) and DistributedSampler's shuffle with trainer.seed. A peer that reads its
    batches in this order trains on the service's batches, so their losses can be compared
    step by step."""
    from torch.utils.data import DistributedSampler

    from train.data.batches import split

    train_idx = split(num_samples, val_fraction, split_seed).train_idx
    sampler = DistributedSampler(range(len(train_idx)), num_replicas=1, rank=0, shuffle=True,
                                 seed=seed)
    sampler.set_epoch(0)
    return train_idx[torch.tensor(list(sampler))], train_idx


def channel_stats(images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-channel mean and standard deviation of uint8 images scaled to [0, 1], shaped to
    broadcast over a batch: what the service normalises an in-memory set with."""
    scaled = images.float().div_(255)
    return (scaled.mean(dim=(0, 2, 3)).view(1, -1, 1, 1),
            scaled.std(dim=(0, 2, 3)).clamp_min(1e-6).view(1, -1, 1, 1))
