"""DataLoader workers' stacks: a worker stuck in a user's `__getitem__` is where its rank is
stuck. Each worker (forked from its rank, the rank's watch inherited) answers SIGUSR1 into a
dump file of its own; the rank's watchdog asks its live workers when it dumps its own stacks
(train/distributed/watch.py)."""

from __future__ import annotations

import contextlib
import faulthandler
import json
import os
import time
from pathlib import Path
from typing import TextIO

from train.distributed import watch


def in_worker(worker_id: int) -> None:
    """In a DataLoader worker (forked from its rank, the rank's watch inherited): SIGUSR1
    dumps into the worker's own file, whose header names its process for the rank to ask."""
    global _worker_dump
    own = watch.current()
    if own is None:
        return
    path = own.out / watch.STACKS_DIR / f".rank-{own.rank}-worker-{worker_id}.dump"
    _worker_dump = path.open("a")
    _worker_dump.write(watch.header({"rank": own.rank, "worker": worker_id,
                                     "pid": os.getpid(), "host": own.host,
                                     "main_thread": f"0x{own.main:016x}"}))
    _worker_dump.flush()
    faulthandler.register(watch.STACKS_SIGNAL, file=_worker_dump, all_threads=True)


_worker_dump: TextIO | None = None


def stacks_of_workers(out: Path, rank: int) -> dict[Path, str]:
    """Each live DataLoader worker of this rank asked for its stacks: {worker dump: its new
    text}. Only this process's children that wrote a worker header are signalled."""
    children: set[int] = set()
    for task in Path("/proc/self/task").glob("*/children"):
        with contextlib.suppress(OSError, ValueError):
            children |= {int(p) for p in task.read_text().split()}
    asked: dict[Path, int] = {}
    for path in (out / watch.STACKS_DIR).glob(f".rank-{rank}-worker-*.dump"):
        heads = [line for line in path.read_text(errors="replace").splitlines()
                 if line.startswith("# ")]
        pid = json.loads(heads[-1][2:]).get("pid") if heads else None
        if pid in children:
            asked[path] = path.stat().st_size
            with contextlib.suppress(OSError):
                os.kill(pid, watch.STACKS_SIGNAL)
    if asked:
        time.sleep(watch.POLL_S)  # faulthandler answers in C at once
    return {path: path.read_bytes()[size:].decode(errors="replace")
            for path, size in asked.items()}
