"""A rank's log lines: one format on every rank, rank 0 at INFO, the others at WARNING.

`setup_logging` is for a rank in its own process (train/engine/job.py `run_rank`);
`rank_log_format` for the one rank a local job runs inside the launching process
(train/launch/local.py), which keeps Hydra's handlers.
"""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Iterator
from pathlib import Path

DATE_FORMAT = "%H:%M:%S"
"""conf/train.yaml's job_logging (the launching process's lines) uses the same."""


def rank_format(rank: int) -> logging.Formatter:
    """One format for a rank's lines, one rank or many: `[20:06:31][rank 0][INFO] ...`."""
    return logging.Formatter(f"[%(asctime)s][rank {rank}][%(levelname)s] %(message)s",
                             DATE_FORMAT)


def setup_logging(rank: int, log_file: Path) -> None:
    """Rank 0 tells the story; the other ranks speak only about problems. On stderr, and in the
    job's log file beside its outputs (Hydra's train.log), which every rank appends to."""
    level = logging.INFO if rank == 0 else logging.WARNING
    log_file.parent.mkdir(parents=True, exist_ok=True)
    handlers: list[logging.Handler] = [logging.StreamHandler(sys.stderr),
                                       logging.FileHandler(log_file, mode="a")]
    for handler in handlers:
        handler.setFormatter(rank_format(rank))
    logging.basicConfig(level=level, force=True, handlers=handlers)


@contextlib.contextmanager
def rank_log_format(rank: int) -> Iterator[None]:
    """A rank run inside the launching process (one local rank) keeps Hydra's handlers (stderr,
    the job's train.log) but writes its lines as every rank does; put back afterwards."""
    handlers = logging.getLogger().handlers
    before = [h.formatter for h in handlers]
    for handler in handlers:
        handler.setFormatter(rank_format(rank))
    try:
        yield
    finally:
        for handler, formatter in zip(handlers, before, strict=True):
            handler.setFormatter(formatter)
