"""DataLoader workers' stacks: a worker stuck in a user's `__getitem__` is where its rank is
stuck. Each worker (forked from its rank, the rank's watch inherited) answers SIGUSR1 into a
dump file of its own; the rank's watchdog asks its live workers when it dumps its own stacks
(train/distributed/watch.py). Not importing watch.py (which imports this): the worker's rank
is passed in (`in_worker`), the files' layout is rankfiles.py's."""

from __future__ import annotations

import contextlib
import faulthandler
import json
import os
import time
from pathlib import Path
from typing import Protocol, TextIO

from train.distributed.rankfiles import (
    POLL_S,
    STACKS_SIGNAL,
    WORKER_SECTION,
    header,
    worker_dump_path,
)


class Owner(Protocol):
    """What a worker needs of its rank's watch (watch.Watch, inherited through the fork)."""

    out: Path
    rank: int
    host: str
    main: int


def in_worker(worker_id: int, own: Owner | None) -> None:
    """In a DataLoader worker (forked from its rank, the rank's watch `own` inherited): SIGUSR1
    dumps into the worker's own file, whose header names its process for the rank to ask."""
    global _worker_dump
    if own is None:
        return
    # One file per process: the training, validation and test loaders' workers share ids.
    path = worker_dump_path(own.out, own.rank, f"{worker_id}.{os.getpid()}")
    _worker_dump = path.open("a")
    _worker_dump.write(header({"rank": own.rank, "worker": worker_id,
                               "pid": os.getpid(), "host": own.host,
                               "main_thread": f"0x{own.main:016x}"}))
    _worker_dump.flush()
    faulthandler.register(STACKS_SIGNAL, file=_worker_dump, all_threads=True)


_worker_dump: TextIO | None = None


def _children() -> set[int]:
    children: set[int] = set()
    for task in Path("/proc/self/task").glob("*/children"):
        with contextlib.suppress(OSError, ValueError):
            children |= {int(p) for p in task.read_text().split()}
    return children


def stacks_of_workers(out: Path, rank: int) -> dict[Path, str]:
    """Each live DataLoader worker of this rank asked for its stacks: {worker dump: its new
    text}. Only this process's children that wrote a worker header are signalled."""
    children = _children()
    asked: dict[Path, int] = {}
    pattern = worker_dump_path(out, rank, "*")
    for path in pattern.parent.glob(pattern.name):
        heads = [line for line in path.read_text(errors="replace").splitlines()
                 if line.startswith("# ")]
        pid = json.loads(heads[-1][2:]).get("pid") if heads else None
        if pid in children:
            asked[path] = path.stat().st_size
            with contextlib.suppress(OSError):
                os.kill(pid, STACKS_SIGNAL)
    if asked:
        time.sleep(POLL_S)  # faulthandler answers in C at once
    return {path: path.read_bytes()[size:].decode(errors="replace")
            for path, size in asked.items()}


def write_stacks(f: TextIO, out: Path, rank: int) -> None:
    """Each live worker's stacks appended to its rank's stacks file `f`, each after
    WORKER_SECTION and its number (stacks.stuck_in splits the file there)."""
    answered: set[int] = set()
    for worker, text in stacks_of_workers(out, rank).items():
        number, _, pid = worker.stem.rsplit("-", 1)[1].partition(".")
        if pid.isdigit():
            answered.add(int(pid))
        f.write(f"{WORKER_SECTION}{number}{f' (pid {pid})' if pid else ''}:\n{text}")
    # A child that has not reached worker_init_fn has no dump (and SIGUSR1 would kill it): its
    # kernel state says whether it runs, or waits - and on what.
    for pid in sorted(_children() - answered):
        f.write(f"{WORKER_SECTION}? (pid {pid}, not answering: {_kernel_state(pid)}):\n")


def _kernel_state(pid: int) -> str:
    proc = Path(f"/proc/{pid}")
    try:
        state = next((line.split(":", 1)[1].strip() for line in
                      (proc / "status").read_text().splitlines() if line.startswith("State:")),
                     "?")
        threads = [f"{t.name}: {(t / 'wchan').read_text() or '-'}"
                   for t in sorted((proc / "task").iterdir())]
        return f"state {state}; threads waiting in {', '.join(threads)}"
    except OSError as e:
        return f"unknown ({e.strerror})"
