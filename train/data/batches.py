"""What every data path shares: the fixed train/val split, a rank's order of samples for an
epoch, the batches it trains on, the DataLoader that reads them, and the bundle a job gets.

train/data/build.py (in-memory sets) and train/data/streaming.py (sets read from disk) build on
these.
An epoch can start at a batch offset (resuming mid-epoch): the samples before it are never read.
"""

from __future__ import annotations

import gc
import hashlib
import itertools
import math
import os
import signal
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler, Sampler

from train.data import shard_guard
from train.data.tempdir import temp_dir_problem
from train.distributed import devices
from train.distributed.stopping import ignore_in_worker
from train.distributed.workers import iter_with_born_workers
from train.errors import ConfigError


@dataclass
class Split:
    train_idx: torch.Tensor
    val_idx: torch.Tensor


def split(n: int, val_fraction: float, seed: int) -> Split:
    """The same train/val split on every rank and every restart."""
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    n_val = max(1, round(n * val_fraction))
    if n_val >= n:  # no training sample: a division by zero at the first epoch's end
        raise ConfigError(f"data.val_fraction={val_fraction} of {n} samples leaves none to "
                          f"train on: lower it (e.g. data.val_fraction=0.2), or give more data.")
    return Split(train_idx=perm[n_val:], val_idx=perm[:n_val])


def default_num_workers(local_world_size: int, streamed: bool = False) -> int:
    """Leave one CPU per rank for the training loop itself. In-memory batches need few workers;
    streamed ones are decoded by them, so they get at least one and up to 8."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        cpus = os.cpu_count() or 1
    spare = cpus // max(1, local_world_size) - 1
    return min(8, max(1, spare)) if streamed else min(4, max(0, spare))


class ShardOrder(Sampler[int]):
    """A rank's sample positions for one epoch: DistributedSampler's shuffled shard (training)
    or the shard in order (validation), from batch `start` on."""

    def __init__(self, sampler: DistributedSampler | None, size: int, batch_size: int) -> None:
        self.sampler, self.size, self.batch_size = sampler, size, batch_size
        self.start = 0

    def epoch_length(self) -> int:
        return len(self.sampler) if self.sampler is not None else self.size

    def __len__(self) -> int:
        return max(0, self.epoch_length() - self.start * self.batch_size)

    def __iter__(self) -> Iterator[int]:
        order = iter(self.sampler) if self.sampler is not None else iter(range(self.size))
        return itertools.islice(order, self.start * self.batch_size, None)


class Batches:
    """Iterates (inputs, labels) batches of one shard on `device`: converted to float, scaled by
    1/`scale` and normalised there, unless `scale` is None (inputs as the Dataset gives them)."""

    def __init__(self, loader: DataLoader | None, order: ShardOrder, device: torch.device,
                 mean: torch.Tensor | None = None, std: torch.Tensor | None = None,
                 scale: float | None = None, augment: bool = False,
                 channels_last: bool = False) -> None:
        self.loader, self.order, self.device = loader, order, device
        self.sampler = order.sampler
        self.mean = mean.to(device) if mean is not None else None
        self.std = std.to(device) if std is not None else None
        self.scale, self.augment, self.channels_last = scale, augment, channels_last

    def __len__(self) -> int:
        """Batches in a whole epoch (also after set_epoch with a start batch)."""
        return math.ceil(self.order.epoch_length() / self.order.batch_size)

    def samples_in(self, start: int, stop: int) -> int:
        """Samples in batches [start, stop) of a whole epoch: host arithmetic, no sync."""
        length, size = self.order.epoch_length(), self.order.batch_size
        return min(stop * size, length) - min(start * size, length)

    def set_epoch(self, epoch: int, start_batch: int = 0) -> None:
        """The epoch's order (the same as before a restart), from batch `start_batch` on: the
        batches before it are skipped without being read."""
        if self.sampler is not None:
            self.sampler.set_epoch(epoch)
        self.order.start = start_batch

    def raw(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Batches as stored (uint8 or float, any device)."""
        yield from self.loaded()

    def loaded(self) -> Iterator[Any]:
        """The loader's batches. A reader that died because a memory-mapped shard changed
        under it is told as that (shard_guard)."""
        try:
            yield from iter_with_born_workers(self.loader)
        except Exception as e:
            if (named := shard_guard.named(e)) is not e:
                raise named from e
            raise

    def __iter__(self) -> Iterator[tuple[Any, Any]]:
        for inputs, labels in self.raw():
            if not isinstance(inputs, torch.Tensor):  # a structure of the user's: moved as is
                yield to_device(inputs, self.device), to_device(labels, self.device)
                continue
            x = inputs.to(self.device, non_blocking=True)
            if self.scale is not None:
                # One new block per batch, the rest in place (a batch of 128 small images is
                # 1.5 MB of floats: three such blocks a batch fragmented the rank's heap)
                x = x.float().div_(self.scale)
                if self.mean is not None and self.std is not None:
                    x = x.sub_(self.mean).div_(self.std)
            if self.augment:
                x = crop_and_flip(x)
            if self.channels_last and x.ndim == 4:
                x = x.contiguous(memory_format=torch.channels_last)
            yield x, to_device(labels, self.device)


def to_device(batch: Any, device: torch.device) -> Any:
    """A batch of any structure (tensor, tuple, list, dict, nested) on `device`."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, dict):
        return {key: to_device(value, device) for key, value in batch.items()}
    if isinstance(batch, list | tuple):
        return type(batch)(to_device(value, device) for value in batch)
    return batch


def crop_and_flip(x: torch.Tensor, pad: int = 4) -> torch.Tensor:
    """Random crop after zero padding and random horizontal flip, per sample, on x's device."""
    n, _, h, w = x.shape
    padded = torch.nn.functional.pad(x, (pad, pad, pad, pad))
    oy = torch.randint(0, 2 * pad + 1, (n, 1, 1), device=x.device)
    ox = torch.randint(0, 2 * pad + 1, (n, 1, 1), device=x.device)
    rows = oy + torch.arange(h, device=x.device).view(1, h, 1)
    cols = ox + torch.arange(w, device=x.device).view(1, 1, w)
    flip = torch.rand(n, 1, 1, device=x.device) < 0.5
    cols = torch.where(flip, ox + (w - 1) - torch.arange(w, device=x.device).view(1, 1, w), cols)
    batch = torch.arange(n, device=x.device).view(n, 1, 1)
    return padded[batch, :, rows, cols].permute(0, 3, 1, 2)


WORKER_START = "fork" if sys.platform == "linux" else None
"""Workers are forked, whatever started this rank and whatever multiprocessing's default: a
spawned worker would import torch again (seconds per worker, and its memory). They never touch
CUDA; what they read (file lists, the data set) they share."""


def check_temp_dir(workers: int) -> None:
    """Every rank, before it makes workers: on a Slurm node, no pre-flight saw its TMPDIR."""
    if (problem := temp_dir_problem(workers)) is not None:
        raise ConfigError(problem)


def loader(dataset: torch.utils.data.Dataset, order: ShardOrder, workers: int,
           device: torch.device, collate: Callable[[Any], Any]) -> DataLoader:
    """Batches of `order` read by `workers` processes (kept for the whole job). The workers
    ignore stop signals: their rank stops them after its stop checkpoint."""
    check_temp_dir(workers)
    return WorkersBornDeaf(dataset, batch_sampler=BatchSampler(order, order.batch_size,
                                                                drop_last=False),
                            collate_fn=collate, num_workers=workers,
                            persistent_workers=workers > 0, pin_memory=devices.pin_memory(device),
                            worker_init_fn=ignore_in_worker, generator=_own_generator(order),
                            multiprocessing_context=WORKER_START if workers > 0 else None)


def _own_generator(order: ShardOrder) -> torch.Generator:
    """The loader's own random source (its workers' base seed, drawn at each new iterator),
    fixed by the sampler's seed and rank. Left to the global RNG, that draw came between a
    resumed rank's restored RNG state and its next step, so a model's dropout drew other
    masks than the uninterrupted job's."""
    sampler = order.sampler
    seed, rank = getattr(sampler, "seed", 0), getattr(sampler, "rank", 0)
    return torch.Generator().manual_seed((int(seed) * 1_000_003 + int(rank)) % 2**63)


class WorkersBornDeaf(DataLoader):
    """Workers forked with TERM blocked: a worker starts threads of its own before
    `worker_init_fn` runs (seen under Slurm: 2 of its 5 threads), and a process-directed TERM
    (Slurm's scancel signals every process of the step) went to one of those and killed the
    worker before its rank could checkpoint. Forked with it blocked, every thread of the
    worker has it blocked, and `ignore_in_worker` decides who may end the worker. Forked with
    the rank's objects frozen too (below)."""

    def _get_iterator(self) -> Any:
        if self.num_workers == 0:
            return super()._get_iterator()
        # torch's worker seeds numpy's global RNG before worker_init_fn, and numpy loads
        # numpy.random on first use: loaded once here, no forked worker dlopens its eight
        # extension modules (under the loader's locks, which glibc does not all reset in a
        # child of a multithreaded process) before it starts.
        import numpy.random  # noqa: F401
        before = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
        # The rank's objects frozen for the fork (as CPython's docs advise): a worker's garbage
        # collections then leave them, and the pages they share with the rank, alone. Unfrozen,
        # a worker's first full collection walked every object it inherited - 27,000 pages
        # copied and 0.25 s of CPU in the middle of its first batch (data=arrow, whose rows
        # make many objects), which held the job's first step back.
        gc.freeze()
        try:
            return super()._get_iterator()
        finally:
            gc.unfreeze()
            signal.pthread_sigmask(signal.SIG_SETMASK, before)


@dataclass(frozen=True)
class DataDescription:
    """What a training split holds, as plain data: a digest of its content and its shape."""

    digest: str
    """8 hex digits of a SHA-256 over the data (and which rows are in the split)."""
    num_rows: int
    features_shape: list[int]
    features_dtype: str


def describe_tensors(images: torch.Tensor, labels: torch.Tensor,
                     rows: torch.Tensor) -> DataDescription:
    """A split of an in-memory data set: its shape and a digest of the data and of which rows
    belong to the split. Reads views of the tensors: no copy on the CPU."""
    digest = hashlib.sha256()
    for tensor in (images, labels, rows):
        digest.update(tensor.detach().cpu().contiguous().numpy().data)
    n = len(rows)
    return DataDescription(digest=digest.hexdigest()[:8], num_rows=n,
                           features_shape=[n, *map(int, images.shape[1:])],
                           features_dtype=str(images.dtype).removeprefix("torch."))


@dataclass
class DataBundle:
    train: Batches
    val: Batches
    num_train: int
    num_val: int
    class_names: list[str]
    input_shape: tuple[int, ...]
    """One sample's shape as the model gets it, e.g. (3, 64, 64)."""
    describe: Callable[[], DataDescription] = field(repr=False)
    """What `description` returns (worked out when asked: it reads the data)."""
    test: Batches | None = None
    """This rank's strided shard of the test split; None: the data set has none."""
    num_test: int = 0
    target_shape: tuple[int, ...] = ()
    """One sample's target shape: () for a class index or a number, (H, W) for a mask."""
    vocab_size: int | None = None
    """data=tokens: the vocabulary (the model's output size, filled as its `vocab_size`)."""
    tokenizer: str | None = None
    """data=tokens: the tokenizer meta.json names (train/data/tokenize.py)."""
    text: tuple[int, int] | None = None
    """data=arrow with a text column: its tokenizer's vocabulary and padding id."""

    @property
    def num_classes(self) -> int:
        return len(self.class_names)

    @property
    def channels(self) -> int:
        return self.input_shape[0]

    @property
    def image_size(self) -> int:
        return self.input_shape[-1]

    def description(self) -> DataDescription:
        """The training split, described: for in-memory sets a digest of the tensors, for
        streamed ones of the file list (ImageFolder) or of the length and first samples
        (custom). The run records it as its MLflow input (train/report/runlog.py)."""
        return self.describe()
