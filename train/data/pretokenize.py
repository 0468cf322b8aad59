"""data.tokenize=map: a data=arrow text column tokenized once, before training, and cached.

The default (data.tokenize=workers) tokenizes each batch's texts in the DataLoader's workers as
they are read: nothing is written, and it costs every epoch of every job. `map` runs `datasets`'
own batched `map` over every split once and keeps the result (token ids padded and truncated to
data.max_length, the other columns as they were, the rows in their order) in
data.tokenized_to, by default `<data.root>/.tokenized` - so later jobs and requeues reuse it.

Once per node, never once per rank (trl#7223 is the bug this avoids): on each node the first
rank to get there takes a lock (named for the node) and tokenizes into a directory of its own,
renamed into place when whole; the node's other ranks wait on the lock and read the result. A
node that finds the cache already there (another node, an earlier job) tokenizes nothing; two
nodes racing each write their own copy and the second rename yields to the first. Each
tokenizing run appends one line (host, pid, rows, seconds) to `tokenize.log` there: the record
of what was done where.

The cache's name holds a key of everything the ids depend on: the data (its digest), the
tokenizer file's bytes, max_length and the column - a change of any is a new cache.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import shutil
import socket
import time
from pathlib import Path

from train.data import arrow
from train.data.tokenize import TextEncoder

log = logging.getLogger("train")
COLUMN = "input_ids"
"""The tokenized column's name in the cache (transformers' own)."""
RECORD = "tokenize.log"
ROLE_NAMES = {"train": "train", "val": "validation", "test": "test"}


def cache_root(root: str | Path, tokenized_to: str | None) -> Path:
    """data.tokenized_to (`$VARS` expanded on the node), or `<data.root>/.tokenized`."""
    if tokenized_to:
        return Path(os.path.expandvars(tokenized_to)).expanduser()
    return Path(root).expanduser() / ".tokenized"


def writable_problem(root: str | Path, tokenized_to: str | None) -> str | None:
    """Pre-flight: one line where the cache can be neither found nor written."""
    base = cache_root(root, tokenized_to)
    probe = base
    while not probe.exists() and probe != probe.parent:  # the directory it would be made in
        probe = probe.parent
    if probe.is_dir() and os.access(probe, os.W_OK | os.X_OK):
        return None
    return (f"data.tokenize=map caches the tokenized set in {base}, which cannot be written "
            "here: set data.tokenized_to=<a writable directory every node sees>, or "
            "data.tokenize=workers.")


def key(digest: str, encoder: TextEncoder, column: str) -> str:
    """12 hex digits of what the ids depend on: the data's `digest` (arrow.digest), the
    tokenizer file's bytes, max_length and the column."""
    h = hashlib.sha256(f"{digest}\0{encoder.max_length}\0{column}\0".encode())
    h.update(Path(encoder.file).read_bytes())
    return h.hexdigest()[:12]


def tokenized(layout: arrow.Layout, column: str, encoder: TextEncoder,
              tokenized_to: str | None, digest: str) -> arrow.Layout:
    """The set with `column` replaced by COLUMN's token ids, from the cache - made here first
    where this node finds none (see the module's docstring). `digest`: arrow.digest(layout),
    which the caller has."""
    base = cache_root(layout.root, tokenized_to)
    target = base / f"{layout.root.name}-{key(digest, encoder, column)}"
    if not (target / "dataset_dict.json").is_file():
        base.mkdir(parents=True, exist_ok=True)
        with open(base / f".{target.name}.{socket.gethostname()}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # the node's other ranks wait here
            if not (target / "dataset_dict.json").is_file():
                _tokenize_into(target, layout, column, encoder)
    return arrow.find(target)


def _tokenize_into(target: Path, layout: arrow.Layout, column: str,
                   encoder: TextEncoder) -> None:
    import datasets

    started, host = time.monotonic(), socket.gethostname()
    work = target.parent / f".{target.name}.{host}.{os.getpid()}.tmp"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    try:  # whatever happens, no working copy is left behind
        splits, rows = {}, 0
        for role, path in layout.splits.items():
            split = arrow.open_split(path)
            # map's own cache goes into our working directory: the data's may be read-only
            splits[ROLE_NAMES[role]] = split.map(
                lambda batch: {COLUMN: encoder(batch[column])}, batched=True, batch_size=1000,
                remove_columns=[column], cache_file_name=str(work / f"{role}.map.arrow"),
                desc=f"tokenizing {role}")
            rows += len(split)
        whole = work / "set"
        datasets.DatasetDict(splits).save_to_disk(str(whole))
        try:
            os.replace(whole, target)
        except OSError:  # another node's copy came first: it is the same, keep it
            if not (target / "dataset_dict.json").is_file():
                raise
    finally:
        shutil.rmtree(work, ignore_errors=True)
    seconds = time.monotonic() - started
    with open(target.parent / RECORD, "a") as record:
        record.write(f"{target.name} host={host} pid={os.getpid()} rows={rows} "
                     f"seconds={seconds:.1f}\n")
    log.info("data: tokenized %s (%d texts, %.1f s) into %s on %s", layout.root, rows,
             seconds, target, host)

