"""Where each rank is while it runs, and its stacks on request: what names a stuck rank.

- The heartbeat: the loop marks the phase it enters and the step (phase.py: no file, no host
  sync). A watchdog thread writes it to `<output dir>/ranks/rank-<N>.json` when it changed (at
  most every POLL_S), which `python -m train status` reads from the login node.
- Stacks without ptrace: the watchdog dumps every thread's Python stack with faulthandler (it
  works while the main thread sleeps or waits in C) into `stacks/rank-<N>.txt` when a rank asks
  through the job's store (`request_stacks`, after a collective timed out), and into
  `stacks/.rank-<N>.dump` on SIGUSR1 (`python -m train stacks`; USR1: USR2, TERM, INT and HUP
  stop the job). The signal only wakes the watchdog (signal.set_wakeup_fd), which dumps holding
  the GIL: faulthandler's own handler reads other threads' frames as they change, and crashed a
  rank whose MLflow thread was busy (CI). A main thread holding the GIL in C cannot answer.

The watchdog has its own store client: the main thread may hold the default one for as long as
distributed.timeout_s in a store wait. Where the files lie and how they are read back:
rankfiles.py. No torch at import: the local launcher imports it.
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import os
import socket
import threading
import time
import traceback
from collections.abc import Iterable
from pathlib import Path
from typing import Any, TextIO

from train.distributed import phase, stacks, wakeup, workers
from train.distributed.rankfiles import (
    POLL_S,
    RANKS_DIR,
    REFRESH_S,
    STACKS_DIR,
    STACKS_SIGNAL,
    beat_path,
    dump_path,
    gone,
    header,
    stacks_path,
)

QUIET_S = 2.0
"""A rank looks for a stack request only once it has been in one phase this long: a stuck rank
has (the others waited distributed.timeout_s for it)."""
START_SKEW_S = 2.0
"""How much earlier than this rank a peer of the same start may have started its watch (they
leave the process group's rendezvous together)."""
_REQUEST_KEY = "train/stacks/request"
_DONE_KEY = "train/stacks/done/"
_WAITED_KEY = "train/waited/"


_watch: Watch | None = None


def all_gone(ranks: Iterable[int]) -> bool:
    """Whether every one of `ranks` is gone (see `gone`); False without a watch."""
    watch = _watch
    # A heartbeat older than this start (less the ranks' start-up skew) is an earlier
    # start's: its process is gone, this start's rank may be alive.
    return watch is not None and all(gone(watch.out, r, watch.started - START_SKEW_S)
                                     for r in ranks)


class Watch:
    """The heartbeat file, the stack dumps and the watchdog thread of one rank."""

    def __init__(self, out: Path, rank: int, world_size: int, timeout_s: float) -> None:
        self.out, self.rank, self.world_size = out, rank, world_size
        self.birth_s = workers.birth_s(timeout_s)
        """How long this rank's new DataLoader workers may take to come out of fork()."""
        self.host, self.pid = socket.gethostname(), os.getpid()
        self.main = threading.main_thread().ident or 0
        self.waited = ""
        """The traceback of the collective this rank waited in when it timed out."""
        for folder in (RANKS_DIR, STACKS_DIR):
            (out / folder).mkdir(parents=True, exist_ok=True)
        self._dump: TextIO = dump_path(out, rank).open("a")
        self._dump.write(header(self.beat()))
        self._dump.flush()
        self._wake, self._restore = wakeup.on_signal(STACKS_SIGNAL, self._dump)
        self.started = time.time()
        with contextlib.suppress(OSError):  # at once: an earlier start's file is not this one's
            self._write_beat()
        self._client: Any = None
        with contextlib.suppress(Exception):  # no process group (a test): no requests
            self.store()
        self._answered = False
        self._answering = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="train-watchdog", daemon=True)
        self._thread.start()
        workers.follow_forks(self)

    def beat(self) -> dict[str, Any]:
        b = phase.beat
        return {"rank": self.rank, "host": self.host, "pid": self.pid, "step": b.step,
                "phase": b.phase, "since": b.since, "data_share": b.data_share,
                "written": time.time(),
                "main_thread": f"0x{self.main:016x}"}

    def close(self) -> None:
        workers.follow_forks(None)
        self._stop.set()
        self._thread.join(2 * POLL_S)
        self._restore()
        self._dump.close()

    def store(self) -> Any:
        """The watchdog's own client of the job's store (the main thread's may be busy for as
        long as distributed.timeout_s): a clone of the group's, made while it surely lives."""
        if self._client is None:
            self._client = _group_store().clone()
        return self._client

    def dump_stacks(self) -> None:
        """Every thread's stack into stacks/rank-<N>.txt: the heartbeat, the collective this
        rank waited in (if it did), faulthandler's dump, then its DataLoader workers'."""
        path = stacks_path(self.out, self.rank)
        tmp = path.with_name(path.name + ".tmp")
        with tmp.open("w") as f:
            f.write(header(self.beat()))
            if self.waited:
                f.write(f"Waited in a collective until it timed out:\n{self.waited}\n")
            f.flush()
            faulthandler.dump_traceback(f, all_threads=True)
            workers.write_stacks(f, self.out, self.rank)
        os.replace(tmp, path)

    def _run(self) -> None:
        written: tuple[int, str, float] | None = None
        last = 0.0
        while not self._stop.is_set():
            if wakeup.wait(self._wake, STACKS_SIGNAL, POLL_S, self._stop):
                with self._answering:  # every thread's stack, taken with the GIL held
                    faulthandler.dump_traceback(self._dump, all_threads=True)
                    self._dump.flush()
            b = phase.beat
            now_state = (b.step, b.phase, b.since)
            if now_state != written or time.monotonic() - last > REFRESH_S:
                with contextlib.suppress(OSError):
                    self._write_beat()
                written, last = now_state, time.monotonic()
            # Only a rank that has not moved on for a while can be the one asked for: a
            # polling rank whose store's host (rank 0) died prints c10d's warnings.
            if not self._answered and time.time() - b.since > QUIET_S:
                self.answer_request()

    def _write_beat(self) -> None:
        path = beat_path(self.out, self.rank)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(self.beat()))
        os.replace(tmp, path)

    def answer_request(self) -> None:
        """Dump the stacks once a rank asked for them, once per job: from the watchdog, or
        from the asking rank itself (request_stacks), whichever comes first."""
        with self._answering:
            if self._answered:
                return
            try:
                store = self.store()
                if not store.check([_REQUEST_KEY]):
                    return
                self.dump_stacks()
                store.set(f"{_DONE_KEY}{self.rank}", "1")
            except Exception:  # noqa: BLE001 - the store's host (rank 0) may be gone
                pass
            self._answered = True


def start(out: Path, rank: int, world_size: int, timeout_s: float) -> Watch:
    """Start this rank's watch (after its process group exists, whose collectives time out
    after `timeout_s`); `stop` ends it."""
    global _watch
    stop()
    _watch = Watch(out, rank, world_size, timeout_s)
    return _watch


def stop() -> None:
    global _watch
    phase.use_host_clock()
    if _watch is not None:
        _watch.close()
        _watch = None


def current() -> Watch | None:
    return _watch


def note_waited(exc: BaseException) -> None:
    """This rank's collective timed out: keep where it waited (for its stacks file) and say so
    in the store (for the rank that writes the job's error)."""
    watch = _watch
    if watch is None:
        return
    watch.waited = "".join(traceback.format_exception(exc))
    with contextlib.suppress(Exception):
        _group_store().set(f"{_WAITED_KEY}{watch.rank}", stacks.waited_in(exc))


def _group_store() -> Any:
    """The default group's store, as the main thread has it (its connection exists)."""
    import torch.distributed as dist

    return dist.distributed_c10d._get_default_store()


def request_stacks(wait_s: float) -> tuple[set[int], dict[int, str]]:
    """Ask every rank for its stacks and wait up to `wait_s` for them: the ranks that answered,
    and where the ranks that timed out in a collective waited."""
    watch = _watch
    if watch is None:
        return set(), {}
    answered: set[int] = set()
    waited: dict[int, str] = {}
    with contextlib.suppress(Exception):
        store = _group_store()
        store.compare_set(_REQUEST_KEY, "", "1")
        watch.answer_request()  # its own, now: its watchdog would wait for QUIET_S first
        keys = [f"{_DONE_KEY}{r}" for r in range(watch.world_size)]
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline and not store.check(keys):
            if all_gone(r for r, key in enumerate(keys) if not store.check([key])):
                break
            time.sleep(0.1)
        answered = {r for r, key in enumerate(keys) if store.check([key])}
        for r in range(watch.world_size):
            if store.check([f"{_WAITED_KEY}{r}"]):
                waited[r] = store.get(f"{_WAITED_KEY}{r}").decode()
    return answered, waited
