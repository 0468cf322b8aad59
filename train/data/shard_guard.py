"""Shards that change under a running job, named.

data=arrow's shards are memory-mapped (train/data/arrow_samples.py). A shard truncated or
rewritten in place while a job reads it raises nothing Python sees: the process that touches the
lost pages dies of SIGBUS. A DataLoader worker's death reaches its rank as "killed by signal:
Bus error ... out of shared memory" (the wrong lead); a rank reading in its own process
(data.num_workers=0) dies without a word. So each process keeps the size and modification time
of the shards it opened, and whoever sees a reader die - the rank, for its workers
(data/batches.py as it waits for a batch, engine/job.py wherever else torch's SIGCHLD handler
raised their death), the launcher, for its ranks (launch/local.py) - compares them with the
files as they are now: the failure then names the file that changed. Only on a failure: no stat
per step.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

from train.data import arrow
from train.errors import TrainError

Stamp = tuple[int, int] | None
"""A file's (size, mtime in ns); None: it is not there."""

_opened: dict[str, Stamp] = {}
"""Every shard this process opened for reading, as it was then."""


class ShardChangedError(TrainError, ValueError):
    """A shard of the data set changed while the job read it: the file, and what to do."""


def stamp(path: Path) -> Stamp:
    try:
        st = path.stat()
    except FileNotFoundError:
        return None
    return st.st_size, st.st_mtime_ns


def stamps(files: Iterable[Path]) -> dict[str, Stamp]:
    return {str(f): stamp(Path(f)) for f in files}


def opened(files: Iterable[Path]) -> None:
    """Remember `files` as this process opens them (the first look at each is kept)."""
    for path, now in stamps(files).items():
        _opened.setdefault(path, now)


def forget() -> None:
    """A new job in this process (a local sweep runs its one-rank jobs in turn): the shards an
    earlier job opened are not this one's, and one changed since is not this job's failure."""
    _opened.clear()


def named(error: BaseException) -> BaseException:
    """`error` as a ShardChangedError naming the shard, where this process's reader (or its
    DataLoader worker) died because a shard it opened changed; else `error` itself. A worker's
    death reaches its rank anywhere - torch's SIGCHLD handler raises it in whatever the rank is
    doing, a backward pass as well as the wait for a batch - so the rank asks where it fails."""
    if isinstance(error, TrainError) or not isinstance(error, Exception):
        return error
    line = changed()
    if line is None:
        return error
    named_error = ShardChangedError(line)
    named_error.__cause__ = error  # the reader's own error stays in the job's train.log
    return named_error


def changed(before: dict[str, Stamp] | None = None) -> str | None:
    """The line naming the first file of `before` (default: those this process opened) that is
    not as it was, or None when all are."""
    for path, then in (_opened if before is None else before).items():
        now = stamp(Path(path))
        if now == then:
            continue
        if now is None:
            detail = "it is gone"
        elif then is None or now[0] != then[0]:
            detail = f"{'no file' if then is None else f'{then[0]} bytes'} when the job " \
                     f"opened it, {now[0]} bytes now"
        else:
            detail = "rewritten since the job opened it"
        return (f"{path} changed while the job read it ({detail}): a data set's shards are "
                "memory-mapped and must stay as they are while a job reads them; put the data "
                "set back as it was to resume, or prepare the new one in another directory for "
                "a new run.")
    return None


def watch(data: dict[str, Any]) -> dict[str, Stamp] | None:
    """data=arrow's shards as a job begins, for its launcher to compare with after a rank died
    of SIGBUS (`changed`); None for any other data (a staged copy is its ranks' to watch)."""
    if data.get("name") != "arrow":
        return None
    try:
        return stamps(arrow.every_shard(arrow.find(data["root"])))
    except TrainError:  # pre-flight said what is wrong, or the ranks will
        return None
