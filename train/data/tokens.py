"""Token data (`data=tokens`): flat token files written once by `python -m train prepare-text`,
read memory-mapped in windows of data.seq_len + 1 tokens, never whole in RAM.

Under data.root: `train.bin`, `val.bin` (and `test.bin`, optional), each a flat array of token
ids (uint16 where the vocabulary fits, else uint32), and `meta.json` naming the tokenizer, the
vocabulary size, the dtype and each file's token count.

Sample i of a split is the window starting at token i * seq_len: the input is its seq_len tokens,
the target the same tokens shifted by one (next-token prediction).
- Training: epochs over the NON-OVERLAPPING windows of train.bin, in DistributedSampler's
  shuffled order. Every token is trained once per epoch, and a job resumed mid-epoch skips
  exactly the windows it trained (the order is the sampler's, from the checkpoint's batch on);
  nanoGPT's random windows would train some tokens twice and others never within a budget, and
  could not be resumed without repeating. The last tokens that do not fill a window are left
  out of training (fewer than seq_len of them).
- Validation and test: every token of the file is predicted exactly once at any world size:
  the windows are split over the ranks (strided), and the last, partial window is included,
  its missing targets padded with IGNORE_INDEX (counted nowhere). `val/tokens` is the file's
  token count minus one (the first token has nothing before it to be predicted from).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset, DistributedSampler

META = "meta.json"
IGNORE_INDEX = -100
"""The target of a padded position: torch's cross_entropy default ignore_index."""
DTYPES = {"uint16": np.uint16, "uint32": np.uint32}
SPLITS = ("train", "val", "test")
SCAN_CHUNK = 1 << 24
"""Tokens read at a time when a file is scanned for its largest id (64 MB of uint32)."""


class TokenDataError(ValueError):
    """data.root does not hold usable token files; the message says what to do."""


@dataclass(frozen=True)
class TokenMeta:
    """meta.json: what prepare_text wrote."""

    tokenizer: str
    """"bytes" (the byte-level default, vocabulary 256) or the tokenizer file's name."""
    vocab_size: int
    dtype: str
    tokens: dict[str, int]
    """Each split's token count."""

    def path(self, root: Path, split: str) -> Path:
        return root / f"{split}.bin"


def read_meta(root: str | Path) -> TokenMeta:
    """meta.json of data.root, checked: the dtype, the vocabulary, and each split's file of
    exactly the recorded size (a truncated copy is refused)."""
    root = Path(root)
    where = f"data=tokens data.root={root}"
    try:
        raw = json.loads((root / META).read_text())
        meta = TokenMeta(str(raw["tokenizer"]), int(raw["vocab_size"]), str(raw["dtype"]),
                         {k: int(v) for k, v in dict(raw["tokens"]).items()})
    except FileNotFoundError:
        raise TokenDataError(f"{where}: no {META} there; write the token files with "
                             "`python -m train prepare-text <text files> <dir>`.") from None
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise TokenDataError(f"{where}: {META} is not prepare_text's ({e}); write the token "
                             "files again with `python -m train prepare-text`.") from None
    if meta.dtype not in DTYPES or meta.vocab_size < 2:
        raise TokenDataError(f"{where}: {META} names dtype {meta.dtype!r} and vocabulary "
                             f"{meta.vocab_size}; prepare the files again.")
    for split in ("train", "val", *(["test"] if "test" in meta.tokens else [])):
        _check_file(meta, root, split, where)
    return meta


def _check_file(meta: TokenMeta, root: Path, split: str, where: str) -> None:
    path = meta.path(root, split)
    expected = meta.tokens.get(split, 0) * np.dtype(DTYPES[meta.dtype]).itemsize
    if not path.is_file():
        raise TokenDataError(f"{where}: {path.name} is missing; prepare the files again.")
    if (size := path.stat().st_size) != expected:
        raise TokenDataError(f"{where}: {path.name} holds {size} bytes, but {META} says "
                             f"{meta.tokens.get(split, 0)} {meta.dtype} tokens ({expected} "
                             "bytes): a truncated or changed copy; copy or prepare it again.")
    if meta.tokens.get(split, 0) < 2:
        raise TokenDataError(f"{where}: {path.name} has fewer than 2 tokens; give "
                             "prepare_text more text.")


def check(root: str | Path, seq_len: int, vocab_limit: int | None = None) -> TokenMeta:
    """Pre-flight: the files are whole, train.bin holds at least one training window, and no
    token id reaches `vocab_limit` (the model's vocabulary; default the data's own). Scans the
    files in chunks: memory stays flat whatever their size."""
    meta = read_meta(root)
    where = f"data=tokens data.root={root}"
    if meta.tokens["train"] < seq_len + 1:
        raise TokenDataError(f"{where}: train.bin has {meta.tokens['train']} tokens, fewer "
                             f"than one window of data.seq_len={seq_len} + 1; lower "
                             "data.seq_len or prepare more text.")
    limit = meta.vocab_size if vocab_limit is None else vocab_limit
    for split in meta.tokens:
        if (largest := largest_id(open_tokens(root, meta, split))) >= limit:
            raise TokenDataError(
                f"{where}: {split}.bin holds token id {largest}, outside the vocabulary of "
                f"{limit} ({'the model' if vocab_limit is not None else META}); prepare the "
                "files with the tokenizer the model is built for.")
    return meta


def largest_id(tokens: np.ndarray) -> int:
    return max(int(tokens[i:i + SCAN_CHUNK].max()) for i in range(0, len(tokens), SCAN_CHUNK))


def open_tokens(root: str | Path, meta: TokenMeta, split: str) -> np.ndarray:
    """The split's tokens, memory-mapped read-only: pages are read as windows need them."""
    return np.memmap(meta.path(Path(root), split), dtype=DTYPES[meta.dtype], mode="r")


class TokenWindows(Dataset):
    """The windows of one split (module docstring). The memory map is opened in the process
    that reads (a DataLoader worker opens its own): nothing but the path is pickled."""

    def __init__(self, path: Path, dtype: str, count: int, seq_len: int, cover_all: bool) -> None:
        self.path, self.dtype, self.count, self.seq_len = path, dtype, count, seq_len
        predicted = count - 1  # every token but the first is a target once
        self.windows = -(-predicted // seq_len) if cover_all else predicted // seq_len
        self._tokens: np.ndarray | None = None

    def __len__(self) -> int:
        return self.windows

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_tokens": None}

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= index < self.windows:
            raise IndexError(index)
        if self._tokens is None:
            self._tokens = np.memmap(self.path, dtype=DTYPES[self.dtype], mode="r")
        start = index * self.seq_len
        chunk = torch.from_numpy(self._tokens[start:start + self.seq_len + 1].astype(np.int64))
        inputs, target = chunk[:-1], chunk[1:]
        if (short := self.seq_len - len(target)) > 0:  # the last window of an evaluated split
            inputs = torch.cat([inputs, torch.zeros(short, dtype=torch.int64)])
            target = torch.cat([target, torch.full((short,), IGNORE_INDEX, dtype=torch.int64)])
        return inputs, target


class WindowSampler(DistributedSampler):
    """DistributedSampler's order (the same shuffle, padding and shard per rank), kept as an
    int32 tensor and handed out in chunks: 4 bytes per window instead of the Python list of
    every window DistributedSampler builds (~36 bytes each), so a rank's memory hardly grows
    with the token file (a window of 128 uint16 tokens is 256 bytes of file)."""

    CHUNK = 1 << 16

    def global_order(self) -> torch.Tensor:
        """The epoch's order of every sample, before padding and dealing (a subclass may keep
        reads local: train/data/shard_order.py's ShardWindowSampler)."""
        g = torch.Generator()
        g.manual_seed(self.seed + self.epoch)
        return torch.randperm(len(self.dataset), generator=g, dtype=torch.int32)  # type: ignore[arg-type]

    def __iter__(self) -> Any:
        n = len(self.dataset)  # type: ignore[arg-type]
        order = self.global_order() if self.shuffle else torch.arange(n, dtype=torch.int32)
        if self.drop_last:
            order = order[:self.total_size]
        elif (missing := self.total_size - n) > 0:
            order = torch.cat([order, order.repeat(-(-missing // n))[:missing]])
        for chunk in order[self.rank:self.total_size:self.num_replicas].split(self.CHUNK):
            yield from chunk.tolist()


def windows(root: str | Path, meta: TokenMeta, split: str, seq_len: int) -> TokenWindows:
    return TokenWindows(meta.path(Path(root), split), meta.dtype, meta.tokens[split], seq_len,
                        cover_all=split != "train")


def digest(root: str | Path, meta: TokenMeta) -> str:
    """8 hex digits naming the training tokens: meta.json and the first and last MB of
    train.bin (reading all of a large file to name it would cost a pass over it)."""
    h = hashlib.sha256(json.dumps(meta.__dict__, sort_keys=True).encode())
    with meta.path(Path(root), "train").open("rb") as f:
        h.update(f.read(1 << 20))
        f.seek(max(0, meta.tokens["train"] * np.dtype(DTYPES[meta.dtype]).itemsize - (1 << 20)))
        h.update(f.read(1 << 20))
    return h.hexdigest()[:8]
