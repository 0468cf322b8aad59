"""What a streamed data set gives the rest of the job (`Source`), whichever kind it is
(train/data/sources.py: imagefolder, custom, tokens; train/data/arrow_source.py: arrow)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from torch.utils.data import Dataset, DistributedSampler

from train.data.batches import DataDescription
from train.data.streaming import Unreadable, UnreadableBatchError, collate_readable


@dataclass
class Source:
    """A streamed data set's two sides and what the rest of the job needs to know of it."""

    train: Dataset
    val: Dataset
    class_names: list[str]
    input_shape: tuple[int, ...]
    describe: Callable[[], DataDescription]
    summary: str
    collate: Callable[[list[Any]], Any] = collate_readable
    normalise: dict[str, Any] = field(default_factory=dict)
    test: Dataset | None = None
    """The test split (data.test, or imagefolder's test/); None: no test phase."""
    target_shape: tuple[int, ...] = ()
    """One sample's target shape (() for a class index or a number)."""
    vocab_size: int | None = None
    tokenizer: str | None = None
    """data=tokens: the vocabulary and the tokenizer (train/data/tokens.py)."""
    text: tuple[int, int] | None = None
    """data=arrow with a text column: its tokenizer's vocabulary and padding id (a model's
    vocab_size and pad_token_id, filled; the task stays the data's)."""
    sampler: type[DistributedSampler] = DistributedSampler
    """The training order's sampler (data=tokens: one that keeps it as a tensor)."""


def first_shape(dataset: Dataset, tries: int = 16) -> tuple[int, ...]:
    """The input shape of the first of `tries` samples that can be read (an image a corrupt
    file left Unreadable is skipped)."""
    for i in range(min(tries, len(dataset))):  # type: ignore[arg-type]
        if not isinstance(sample := dataset[i], Unreadable):
            return tuple(map(int, sample[0].shape))
    raise UnreadableBatchError(f"none of the first {tries} validation images can be read: "
                               "check the files under data.root.")
