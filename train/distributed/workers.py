"""DataLoader workers' stacks: a worker stuck in a user's `__getitem__` is where its rank is
stuck. Each worker (forked from its rank, the rank's watch inherited) answers SIGUSR1 into a
dump file of its own; the rank's watchdog asks its live workers when it dumps its own stacks
(train/distributed/watch.py). A worker that never comes out of its fork (a lock inherited
held) is replaced (`iter_with_born_workers`). Not importing watch.py (which imports this): the
worker's rank is passed in (`in_worker`), the files' layout is rankfiles.py's."""

from __future__ import annotations

import contextlib
import faulthandler
import json
import logging
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol, TextIO

from train.distributed.rankfiles import (
    POLL_S,
    STACKS_SIGNAL,
    WORKER_SECTION,
    header,
    worker_dump_path,
)

log = logging.getLogger("train")


class Owner(Protocol):
    """What a worker needs of its rank's watch (watch.Watch, inherited through the fork)."""

    out: Path
    rank: int
    host: str
    main: int
    birth_s: float
    """How long its new workers may take to come out of fork() (`birth_s`)."""


def follow_forks(own: Owner | None) -> None:
    """While `own` (a rank's watch) is set, every child forked from this process answers
    SIGUSR1 from its first moment (`_answer_from_birth`): a DataLoader worker stuck before its
    worker_init_fn - in torch's own set-up after the fork, where a child of a multithreaded
    rank can wait forever for a lock another thread held when it forked - is named with its
    line instead of only its kernel state."""
    global _owner, _hooked
    _owner = own
    if own is not None and not _hooked:
        os.register_at_fork(after_in_child=_answer_from_birth)
        _hooked = True


def _answer_from_birth() -> None:
    """In a child just forked from a watched rank: its own dump file, header and faulthandler
    on SIGUSR1 (in C: it answers even when stuck in a lock, the GIL held). Its own children
    are not the rank's, so it follows no forks itself."""
    global _owner
    own, _owner = _owner, None
    if own is not None:
        with contextlib.suppress(OSError):
            _open_dump(own, UNKNOWN_WORKER)


def in_worker(worker_id: int, own: Owner | None) -> None:
    """In a DataLoader worker (forked from its rank, the rank's watch `own` inherited): SIGUSR1
    dumps into the worker's own file, whose header names its process for the rank to ask. The
    file its birth opened (follow_forks) takes the worker's number."""
    global _dump_path
    if own is None:
        return
    if _worker_dump is None or _dump_pid != os.getpid() or _dump_path is None:
        _open_dump(own, worker_id)
        return
    path = _worker_path(own, worker_id)
    with contextlib.suppress(OSError):
        os.replace(_dump_path, path)
    _dump_path = path
    _answer_into(_worker_dump, own, worker_id)


UNKNOWN_WORKER = "?"
"""A child's number until its worker_init_fn names it (write_stacks shows it as is)."""
ANSWER_S = 4 * POLL_S
"""How long a rank waits for its asked workers' dumps (a stuck worker answers in C at once;
one starved of the CPU later)."""


def _worker_path(own: Owner, worker: int | str) -> Path:
    # One file per process: the training, validation and test loaders' workers share ids.
    return worker_dump_path(own.out, own.rank, f"{worker}.{os.getpid()}")


def _open_dump(own: Owner, worker: int | str) -> None:
    global _worker_dump, _dump_path, _dump_pid
    _dump_path, _dump_pid = _worker_path(own, worker), os.getpid()
    _worker_dump = _dump_path.open("a")
    _answer_into(_worker_dump, own, worker)


def _answer_into(dump: TextIO, own: Owner, worker: int | str) -> None:
    """A header (the last one is what the rank reads), then SIGUSR1 dumps every thread."""
    dump.write(header({"rank": own.rank, "worker": worker, "pid": os.getpid(),
                       "host": own.host, "main_thread": f"0x{own.main:016x}"}))
    dump.flush()
    faulthandler.register(STACKS_SIGNAL, file=dump, all_threads=True)


_worker_dump: TextIO | None = None
_dump_path: Path | None = None
_dump_pid = 0
_owner: Owner | None = None
_hooked = False


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
    _wait_for_answers(asked)
    return {path: path.read_bytes()[size:].decode(errors="replace")
            for path, size in asked.items()}


def _wait_for_answers(asked: dict[Path, int]) -> None:
    """Until every asked dump grew and stopped growing (faulthandler answers in C at once, in
    several writes), or ANSWER_S: a worker on a loaded machine may not run for a while."""
    deadline = time.monotonic() + ANSWER_S
    last: dict[Path, int] = {}
    while asked and time.monotonic() < deadline:
        time.sleep(0.05)
        sizes = {path: path.stat().st_size if path.exists() else -1 for path in asked}
        if sizes == last and all(sizes[path] > size for path, size in asked.items()):
            return
        last = sizes


def write_stacks(f: TextIO, out: Path, rank: int) -> None:
    """Each live worker's stacks appended to its rank's stacks file `f`, each after
    WORKER_SECTION and its number (stacks.stuck_in splits the file there)."""
    answered: set[int] = set()
    for worker, text in stacks_of_workers(out, rank).items():
        number, _, pid = worker.stem.rsplit("-", 1)[1].partition(".")
        if pid.isdigit():
            answered.add(int(pid))
        f.write(f"{WORKER_SECTION}{number}{f' (pid {pid})' if pid else ''}:\n{text}")
    # A child with no dump (started by exec, forked while no watch ran, or stuck inside fork()
    # itself, before Python's after-fork callbacks) is not signalled (SIGUSR1 could kill it):
    # its kernel state says whether it runs, or waits - and on what.
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


BIRTH_S = 10.0
"""How long a new worker may take to come out of fork() (its birth dump file written); one that
has not by then is stuck inside fork itself, on a C lock another thread of the rank held."""
BIRTH_TRIES = 3
"""Iterators made (their workers forked) before a stuck worker is left to the hang watch."""
SHORTEST_BIRTH_S = 2.0
"""The least `birth_s` waits: a fork of a busy rank on a loaded node takes a good part of a
second, and a healthy worker taken for a stuck one costs its loader's start again."""


def birth_s(timeout_s: float) -> float:
    """How long a rank waits for its new workers' birth with distributed.timeout_s =
    `timeout_s`: BIRTH_S, or less where the peers would time out first. Up to BIRTH_TRIES - 1
    waits can follow one another while the peers wait in a collective; a quarter of the timeout
    each keeps them within half of it."""
    return max(SHORTEST_BIRTH_S, min(BIRTH_S, timeout_s / 4))


_born: set[int] = set()
"""The workers seen born (persistent workers are checked once)."""


def iter_with_born_workers(loader: Any) -> Iterator[Any]:
    """`iter(loader)`, its new workers seen to come out of their fork: a worker that does not
    within the owner's `birth_s` is killed and the loader's workers made again, with a warning.
    A rank's gloo and MLflow threads run while it forks its workers, and a child of a
    multithreaded process can wait forever for a lock one of them held (the stall this ends
    cost a rank distributed.timeout_s and the job). Without a watch (no birth files) it is
    iter(loader)."""
    own, tries = _owner, 1
    while True:
        batches = iter(loader)
        workers = getattr(batches, "_workers", None)
        if own is None or not workers or tries == BIRTH_TRIES:
            return batches
        stuck = _unborn(own, [w.pid for w in workers if w.pid not in _born])
        if not stuck:
            return batches
        log.warning("rank %d: DataLoader worker(s) %s stuck inside fork() for %.0f s (a lock "
                    "another thread held as they were forked): their loader's workers are "
                    "started again", own.rank, ", ".join(f"pid {p}" for p in stuck), own.birth_s)
        _discard(loader, batches, stuck)
        tries += 1


def _unborn(own: Owner, pids: list[int]) -> list[int]:
    """Those of `pids` whose birth dump file (named with their pid; worker_init_fn renames it
    with the worker's number) is not there within `own.birth_s`."""
    deadline = time.monotonic() + own.birth_s
    files = {pid: worker_dump_path(own.out, own.rank, f"*.{pid}") for pid in pids}
    while True:
        for pid, path in list(files.items()):
            if next(path.parent.glob(path.name), None) is not None:
                _born.add(pid)
                del files[pid]
        if not files or time.monotonic() > deadline:
            return sorted(files)
        time.sleep(0.01)


def _discard(loader: Any, batches: Any, stuck: list[int]) -> None:
    """Shut `batches` down (the stuck workers killed: their signal handlers, inherited, would
    only note a TERM) without torch's SIGCHLD check taking their death for a crash."""
    from torch.utils.data import _utils

    if getattr(batches, "_worker_pids_set", False):
        _utils.signal_handling._remove_worker_pids(id(batches))
        batches._worker_pids_set = False
    for pid in stuck:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    batches._shutdown_workers()
    if getattr(loader, "_iterator", None) is batches:  # persistent workers: made anew
        loader._iterator = None
