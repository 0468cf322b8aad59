"""Files a job must not lose, written so that a full disk costs nothing already kept: the
content is serialised in memory first (its size known before the disk is touched), room is made
by removing what the caller says is expendable - only if that makes enough -, and the file is
written atomically (temporary file, fsync, rename, fsync of the directory), never left partial.
"No space left on device" says which file, how many bytes it needs and how many are free.
"""

from __future__ import annotations

import errno
import io
import logging
import os
import shutil
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger("train")


class DiskFull(OSError):
    """No room for a checkpoint or the final weights; the message says where and how much.
    (An OSError of ENOSPC: a write on a full disk means the same.)"""

    errno = errno.ENOSPC


ROOM_MARGIN = 64 * 1024
"""Bytes left free beyond a file's size (filesystem blocks, the directory entry)."""


def serialised(state: dict[str, Any]) -> memoryview:
    buffer = io.BytesIO()
    torch.save(state, buffer)
    return buffer.getbuffer()


def make_room(folder: Path, needed: int, expendable: list[Path], what: str) -> None:
    """Free space for `needed` bytes in `folder`, deleting `expendable` files or directories
    (oldest first) only if that is what it takes; DiskFull if even that is not enough."""
    free = shutil.disk_usage(folder).free
    sizes = [(old, _size(old)) for old in reversed(expendable) if old.exists()]
    if free + sum(size for _, size in sizes) < needed + ROOM_MARGIN:  # delete nothing in vain
        raise DiskFull(f"No space left on device: the {what} needs {needed} bytes and {folder} "
                       f"has {free} free")
    for old, size in sizes:
        if free >= needed + ROOM_MARGIN:
            return
        if old.is_dir():  # a sharded checkpoint (train/engine/sharded.py)
            shutil.rmtree(old, ignore_errors=True)
        else:
            old.unlink(missing_ok=True)
        log.warning("removed %s (%d bytes) to make room for the %s", old, size, what)
        free = shutil.disk_usage(folder).free


def _size(path: Path) -> int:
    if path.is_dir():
        return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
    return path.stat().st_size


def write_atomically(path: Path, payload: memoryview) -> None:
    """Temporary file, fsync, rename, fsync of the directory; a failed write (the disk filled
    meanwhile) leaves no partial file behind."""
    tmp = path.with_suffix(".tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(payload)
            f.flush()
            os.fsync(f.fileno())
    except OSError as e:
        tmp.unlink(missing_ok=True)
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            raise DiskFull(f"No space left on device: writing {path} ({len(payload)} bytes) "
                           "failed") from None
        raise
    os.replace(tmp, path)
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)  # the rename itself survives a crash
    finally:
        os.close(fd)


