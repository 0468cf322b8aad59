"""Where a streamed data set's samples come from (`Source`: the two sides, the class names,
the shapes, a digest) and this rank's batches of it (`build`): imagefolder's files, the user's
Datasets (data=custom), token windows (train/data/tokens.py). Reading, decoding and collating
them: train/data/streaming.py.
"""

from __future__ import annotations

import hashlib
import logging
from typing import Any

import numpy as np
import torch
from torch.utils.data import ConcatDataset, DataLoader, Dataset, DistributedSampler

from train.config.groups import DataConfig
from train.data import batches as batching
from train.data import imagefolder, userdata
from train.data.batches import DataDescription
from train.data.source import Source, first_shape
from train.data.streaming import (
    ImageFiles,
    Rows,
    StreamedBatches,
    collate_pairs,
    transforms,
)
from train.distributed.env import DistEnv
from train.errors import ConfigError

log = logging.getLogger("train")


def imagefolder_source(cfg: DataConfig) -> Source:
    layout = imagefolder.find(cfg.root)
    files = ImageFiles(layout.train, transforms(cfg, train=True))
    digest = hashlib.sha256(layout.train.digest().encode())
    if layout.val is None:
        parts = batching.split(len(files), cfg.val_fraction, cfg.split_seed)
        train: Dataset = Rows(files, parts.train_idx)
        val: Dataset = Rows(files.with_transform(transforms(cfg, train=False)), parts.val_idx)
        digest.update(parts.train_idx.numpy().tobytes())
    else:
        train, val = files, ImageFiles(layout.val, transforms(cfg, train=False))
    shape = first_shape(val)
    if len(cfg.mean) != shape[0] or len(cfg.std) != shape[0]:
        raise ConfigError(f"data.mean and data.std need {shape[0]} values (one per channel).")
    rows = len(train)  # type: ignore[arg-type]

    def describe() -> DataDescription:
        return DataDescription(digest=digest.hexdigest()[:8], num_rows=rows,
                               features_shape=[rows, *shape], features_dtype="uint8")

    test = (None if layout.test is None
            else ImageFiles(layout.test, transforms(cfg, train=False)))
    return Source(train, val, layout.train.classes, shape, describe, test=test,
                  summary=f"imagefolder {layout.describe()}",
                  normalise={"mean": torch.tensor(cfg.mean).view(1, -1, 1, 1),
                             "std": torch.tensor(cfg.std).view(1, -1, 1, 1), "scale": 255.0})


def _labels_only(samples: list[Any]) -> torch.Tensor:
    return torch.as_tensor([int(label) for _, label in samples])


def _read_labels(datasets: list[Dataset], workers: int) -> torch.Tensor:
    """Every label, read once with the workers (a Dataset without `classes` or `targets`)."""
    batching.check_temp_dir(workers)
    reader = DataLoader(ConcatDataset(datasets), batch_size=256, num_workers=workers,
                        collate_fn=_labels_only,
                        multiprocessing_context=batching.WORKER_START if workers else None)
    return torch.cat(list(reader))


def custom_source(cfg: DataConfig, workers: int, classes: bool = True) -> Source:
    """The user's Datasets; `classes`: the targets are class indices, counted where the Dataset
    does not name its classes (else only its `classes` attribute is read)."""
    train_set = userdata.build(cfg.train, "data.train")
    shape, first_target = userdata.first_sample(train_set, "data.train")
    target = cfg.train["_target_"]
    if cfg.val and cfg.val.get("_target_"):
        val_set = userdata.build(cfg.val, "data.val")
        train, val, whole = train_set, val_set, [train_set, val_set]
    else:
        parts = batching.split(len(train_set), cfg.val_fraction, cfg.split_seed)
        train, val, whole = Rows(train_set, parts.train_idx), Rows(train_set, parts.val_idx), \
            [train_set]
    names = (userdata.class_names(train_set) if classes
             else userdata.class_names(train_set, labels=()) or [])
    if names is None:
        count = sum(len(d) for d in whole)  # type: ignore[arg-type]
        log.info("data: %s has no `classes` or `targets` attribute: reading its %d labels once "
                 "to count the classes", target, count)
        names = userdata.class_names(train_set, _read_labels(whole, workers))
    rows = len(train)  # type: ignore[arg-type]

    def describe() -> DataDescription:
        digest = hashlib.sha256(f"{target}\0{rows}".encode())
        for i in range(min(4, rows)):  # the length and the first samples name the data
            inputs, label = train[i]
            digest.update(np.ascontiguousarray(np.asarray(inputs)).tobytes() + _target_bytes(label))
        return DataDescription(digest=digest.hexdigest()[:8], num_rows=rows,
                               features_shape=[rows, *shape],
                               features_dtype=str(train[0][0].dtype).removeprefix("torch."))

    test = (userdata.build(cfg.test, "data.test") if cfg.test and cfg.test.get("_target_")
            else None)
    return Source(train, val, names or (["0"] if classes else []), shape, describe,
                  collate=collate_pairs, test=test,
                  target_shape=userdata.target_shape(first_target),
                  summary=f"custom {target}: {rows} training, {len(val)} validation samples")


def _target_bytes(target: Any) -> bytes:
    """A target for the data's digest: a class index as its digits (as before tasks), anything
    else by its bytes."""
    value = np.asarray(target)
    if value.ndim == 0 and np.issubdtype(value.dtype, np.integer):
        return b"%d" % int(value)
    return np.ascontiguousarray(value).tobytes()


def build(cfg: DataConfig, env: DistEnv, device: torch.device, seed: int, per_rank: int,
          channels_last: bool = False, classes: bool = True) -> batching.DataBundle:
    """This rank's streamed shards (`per_rank` samples a batch): DistributedSampler's for
    training, a strided slice of the validation set (every sample on exactly one rank) for
    validation."""
    rank, world_size = env.rank, env.world_size
    workers = (cfg.num_workers if cfg.num_workers is not None
               else batching.default_num_workers(env.local_world_size, streamed=True))
    source = _source(cfg, workers, classes)
    sampler = source.sampler(source.train, num_replicas=world_size, rank=rank, shuffle=True,
                             seed=seed, drop_last=False)
    shard = Rows(source.val, torch.arange(rank, len(source.val), world_size))  # type: ignore[arg-type]

    def batches(dataset: Dataset, sampler: DistributedSampler | None) -> StreamedBatches:
        order = batching.ShardOrder(sampler, len(dataset), per_rank)  # type: ignore[arg-type]
        return StreamedBatches(batching.loader(dataset, order, workers, device, source.collate),
                               order, device, channels_last=channels_last, **source.normalise)

    log.info("data: %s; %d DataLoader workers per rank", source.summary, workers)
    test = None if source.test is None else batches(
        Rows(source.test, torch.arange(rank, len(source.test), world_size)), None)  # type: ignore[arg-type]
    return batching.DataBundle(
        test=test, num_test=0 if source.test is None else len(source.test),  # type: ignore[arg-type]
        train=batches(source.train, sampler), val=batches(shard, None),
        num_train=len(source.train), num_val=len(source.val),  # type: ignore[arg-type]
        class_names=source.class_names, input_shape=source.input_shape,
        describe=source.describe, target_shape=source.target_shape,
        vocab_size=source.vocab_size, tokenizer=source.tokenizer, text=source.text)


def _source(cfg: DataConfig, workers: int, classes: bool) -> Source:
    if cfg.name == "imagefolder":
        return imagefolder_source(cfg)
    if cfg.name == "arrow":
        from train.data.arrow_source import arrow_source

        return arrow_source(cfg, classes)
    if cfg.name == "tokens":
        return tokens_source(cfg)
    return custom_source(cfg, workers, classes)


def tokens_source(cfg: DataConfig) -> Source:
    """data=tokens (train/data/tokens.py) as a streamed data set: windows of data.seq_len
    tokens, the vocabulary and tokenizer from meta.json."""
    from train.data import tokens

    meta = tokens.read_meta(cfg.root)
    seq_len = cfg.seq_len
    if meta.tokens["train"] < seq_len + 1:
        raise tokens.TokenDataError(f"data=tokens data.root={cfg.root}: train.bin has "
                                    f"{meta.tokens['train']} tokens, fewer than one window of "
                                    f"data.seq_len={seq_len} + 1.")
    train = tokens.windows(cfg.root, meta, "train", seq_len)
    val = tokens.windows(cfg.root, meta, "val", seq_len)
    test = tokens.windows(cfg.root, meta, "test", seq_len) if "test" in meta.tokens else None

    def describe() -> DataDescription:
        return DataDescription(digest=tokens.digest(cfg.root, meta), num_rows=len(train),
                               features_shape=[len(train), seq_len], features_dtype="int64")

    return Source(train, val, [], (seq_len,), describe, test=test, target_shape=(seq_len,),
                  summary=f"tokens {cfg.root}: {meta.tokens['train']:,} training tokens in "
                          f"{len(train):,} windows of {seq_len}, {meta.tokens['val']:,} "
                          f"validation tokens, vocabulary {meta.vocab_size} ({meta.tokenizer})",
                  vocab_size=meta.vocab_size, tokenizer=meta.tokenizer,
                  sampler=tokens.WindowSampler)
