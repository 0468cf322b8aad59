"""data=arrow as a streamed data set (`arrow_source`): a sharded Arrow set's splits
(train/data/arrow.py finds and checks them; train/data/arrow_samples.py reads them) with the
training order, transforms, tokenizer and shapes the rest of the job needs."""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset, DistributedSampler

from train.config.groups import DataConfig
from train.data import arrow, arrow_split
from train.data import batches as batching
from train.data.arrow_samples import ArrowSamples
from train.data.batches import DataDescription
from train.data.shard_order import ShardWindowSampler
from train.data.source import Source, first_shape
from train.data.staging import staged
from train.data.streaming import Rows, collate_pairs, collate_readable, transforms
from train.errors import ConfigError


def text_encoder(cfg: DataConfig, layout: Any, column: str) -> Any:
    """data.tokenizer's encoder for a text input column (or a column of words, a target per
    word: task=token_classification); None for other columns. A text column without a
    tokenizer is refused, naming the keys."""
    from train.data.tokenize import TextEncoder
    from train.data.tokens import TokenDataError

    feature = arrow_split.split_features(layout.splits["train"])[column]
    if not (arrow_split.is_text(feature) or arrow_split.is_words(feature)):
        return None
    if cfg.tokenizer is None:
        raise ConfigError(f"data.input_column={column!r} of {cfg.root} holds text: give "
                          "data.tokenizer=<a tokenizers JSON file, or a directory holding "
                          "tokenizer.json> (and data.max_length) to turn it into token ids.")
    try:
        encoder = TextEncoder(cfg.tokenizer, cfg.max_length, by_words=arrow_split.is_words(feature))
    except TokenDataError as e:
        raise ConfigError(str(e)) from None
    if encoder.by_words and cfg.tokenize == "map":
        raise ConfigError(f"data.input_column={column!r} holds words, a target each: they are "
                          "tokenized in the DataLoader's workers (data.tokenize=workers); "
                          "data.tokenize=map does not align their targets yet.")
    return encoder


def arrow_source(cfg: DataConfig, classes: bool = True) -> Source:
    """data=arrow (train/data/arrow.py): the set's own validation split where it has one (and
    then the shard-local training order of data.shuffle=shards), else data.val_fraction of the
    training split; images decoded and transformed as imagefolder's, other inputs as stored."""
    layout = arrow.find(staged(cfg.root, cfg.stage_to) if cfg.stage_to else cfg.root)
    input_column, target_column = arrow_split.columns(layout, cfg.input_column, cfg.target_column)
    where = f"{cfg.root} (staged to {layout.root})" if cfg.stage_to else cfg.root
    encoder, digest, tokenized = text_encoder(cfg, layout, input_column), arrow.digest(layout), ""
    text = None if encoder is None else (encoder.vocab_size, encoder.pad_id)
    cfg_tokenizer = None if encoder is None else encoder.file
    if encoder is not None and cfg.tokenize == "map":  # read as ids, tokenized once per node
        from train.data import pretokenize

        layout = pretokenize.tokenized(layout, input_column, encoder, cfg.tokenized_to, digest)
        input_column, encoder, tokenized = pretokenize.COLUMN, None, ", tokenized once per node"
    whole = ArrowSamples(layout.splits["train"], input_column, target_column,
                         transforms(cfg, train=True), encoder)
    images = whole.is_image
    train, val, test, sampler = _splits(cfg, layout, whole)
    names = arrow_split.class_names(whole.data, target_column) if classes else None
    if classes and names is None:
        raise ConfigError(f"data=arrow: column {target_column!r} of {cfg.root} holds no class "
                          "indices (a ClassLabel or integers): choose data.target_column, or a "
                          "task for its targets (task=regression).")
    sample = val[0] if not images else (first_shape(val), None)
    shape = tuple(map(int, sample[0].shape)) if not images else sample[0]
    rows = len(train)  # type: ignore[arg-type]

    def describe() -> DataDescription:
        return DataDescription(digest=digest, num_rows=rows, features_shape=[rows, *shape],
                               features_dtype="uint8" if images else str(sample[0].dtype)
                               .removeprefix("torch."))

    normalise = ({"mean": torch.tensor(cfg.mean).view(1, -1, 1, 1),
                  "std": torch.tensor(cfg.std).view(1, -1, 1, 1), "scale": 255.0}
                 if images else {})
    return Source(train, val, names or [], shape, describe, test=test, normalise=normalise,
                  collate=collate_readable if images else collate_pairs,
                  target_shape=() if images else tuple(np.shape(sample[1])), sampler=sampler,
                  text=text, tokenizer=None if text is None else cfg_tokenizer,
                  summary=f"arrow {where}: {rows} training, {len(val)} validation samples "
                          f"({input_column!r} -> {target_column!r}; shuffle={cfg.shuffle}"
                          f"{tokenized})")


def _splits(cfg: DataConfig, layout: arrow.Layout, whole: ArrowSamples,
            ) -> tuple[Dataset, Dataset, Dataset | None, Any]:
    """Training, validation and test samples (None: no test split), and the training order's
    sampler: the set's own validation split where it has one, else data.val_fraction of the
    training split, which then keeps DistributedSampler's global order."""
    evaluation = transforms(cfg, train=False) if whole.is_image else None
    columns = whole.input_column, whole.target_column
    test = (ArrowSamples(layout.splits["test"], *columns, evaluation, whole.encoder)
            if "test" in layout.splits else None)
    if "val" not in layout.splits:
        parts = batching.split(len(whole), cfg.val_fraction, cfg.split_seed)
        return (Rows(whole, parts.train_idx),
                Rows(whole.with_transform(evaluation), parts.val_idx), test, DistributedSampler)
    val = ArrowSamples(layout.splits["val"], *columns, evaluation, whole.encoder)
    sampler: Any = DistributedSampler
    if cfg.shuffle == "shards":
        sampler = functools.partial(ShardWindowSampler, shard_sizes=arrow.shard_rows(whole.files),
                                    window=cfg.shuffle_window)
    return whole, val, test, sampler
