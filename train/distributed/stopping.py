"""Stop signals: Slurm's USR2 before a time limit, TERM on preemption or `scontrol requeue`, HUP
when the terminal closes, INT (Ctrl-C), and the TERM a local rank gets when its launcher dies.

A handler only notes the signal. The ranks agree on it where they exchange numbers anyway (the
next logging step, or the epoch end), save one checkpoint together, and stop: a rank never stops
alone, so no peer is left waiting in a collective. A second INT (Ctrl-C twice) does not wait for
the checkpoint: it raises KeyboardInterrupt, as Python would.

DataLoader workers are forked from a rank and get the same signals when a whole process group
is signalled (Slurm, a closed terminal): `ignore_in_worker` makes them leave stopping to their
rank, which ends them with its DataLoader. The local launcher passes the signals it gets on to
its ranks (`PassOn`).
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import threading
from collections.abc import Sequence
from types import TracebackType
from typing import Any

from train.distributed import watch, workers
from train.errors import StoppedBySignal

log = logging.getLogger("train")

STOP_SIGNALS = (signal.SIGUSR2, signal.SIGTERM, signal.SIGHUP, signal.SIGINT)

_noted_early: str | None = None
"""A stop signal received before StopSignals was entered (a rank still starting)."""


class Preempted(StoppedBySignal):
    """The job was asked to stop (time limit, preemption, requeue); a checkpoint was saved."""

    def __init__(self, signal_name: str) -> None:
        super().__init__(f"stopped by {signal_name} after saving a checkpoint")
        self.signal_name = signal_name

    def __reduce__(self) -> tuple[type, tuple[str]]:
        # Pickled back to the login node in a Slurm rank's result (submitit): the default
        # would call __init__ with the message as the signal's name.
        return Preempted, (self.signal_name,)


def note_early() -> None:
    """From a rank process's first line: a stop signal that comes while it is still starting
    (importing torch, joining the process group) is kept for StopSignals instead of killing
    the rank unannounced."""
    def note(signum: int, _frame: Any) -> None:
        global _noted_early
        _noted_early = _noted_early or signal.Signals(signum).name

    for number in STOP_SIGNALS:
        signal.signal(number, note)


def ignore_in_worker(_worker_id: int) -> None:
    """DataLoader `worker_init_fn`: the rank decides when its workers end (at its stop, after
    the checkpoint); a worker that died of the group's TERM would crash the rank before.

    TERM is ignored only when another process sends it: from the rank itself (the DataLoader's
    shutdown, multiprocessing's terminate() at exit) it still ends the worker, or the rank
    would wait for it forever."""
    for number in STOP_SIGNALS:
        if number != signal.SIGTERM:
            signal.signal(number, signal.SIG_IGN)
    workers.in_worker(_worker_id, watch.current())  # its stacks on request, in its own file
    # A worker stuck in a user's __getitem__ never checks that its rank lives: it dies with
    # it, or it would outlive the job (and hold the terminal's pipes open).
    with contextlib.suppress(AttributeError, OSError):  # Linux only
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})  # threads made later too
    threading.Thread(target=_end_on_term_from, args=(os.getppid(),), daemon=True,
                     name="term-from-rank").start()


def _end_on_term_from(rank: int) -> None:
    while True:
        if signal.sigwaitinfo({signal.SIGTERM}).si_pid == rank:
            os._exit(0)  # as torch's own worker handler does for its parent's TERM


def ignore_time_limit_warning() -> None:
    """From here on, the process ignores USR2 (Slurm's time-limit warning): its work is over.
    SIG_IGN, unlike a Python handler, outlives the interpreter's finalisation."""
    signal.signal(signal.SIGUSR2, signal.SIG_IGN)


class StopSignals:
    """While entered, USR2, TERM, HUP and INT set `received` instead of ending the process; on
    exit the previous handlers come back (a one-rank job runs inside the launching process).

    `own_process`: a rank in a process of its own ignores USR2 from the exit on. That is Slurm's
    time-limit warning, and one that comes once the work is over (a job ending within the
    signal's lead time) has nothing left to save: the handler restored would be submitit's,
    which fails a finished job ("timed-out too many times"), and Python's finalisation puts
    back USR2's default action, which ended the ranks by the signal after the run FINISHED
    (srun then marked the job FAILED)."""

    def __init__(self, own_process: bool = False) -> None:
        self.received: str | None = None
        self.own_process = own_process
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> StopSignals:
        global _noted_early
        self.received, _noted_early = _noted_early, None
        if self.received:
            log.warning("received %s while starting: checkpointing at the first logging step",
                        self.received)
        for number in STOP_SIGNALS:
            self._previous[number] = signal.signal(number, self._note)
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> None:
        for number, handler in self._previous.items():
            signal.signal(number, handler)
        if self.own_process:
            ignore_time_limit_warning()

    def _note(self, signum: int, _frame: Any) -> None:
        name = signal.Signals(signum).name
        if name == "SIGINT" and self.received == "SIGINT":
            raise KeyboardInterrupt  # Ctrl-C twice: stop now, without the checkpoint
        # The first one names the stop (a group gets several) - but Ctrl-C's INT names it
        # over a TERM before it: the local launcher passes the terminal's INT on as TERM,
        # and under load that TERM was handled first (the job then ended "by SIGTERM", 143).
        if self.received is None or (name, self.received) == ("SIGINT", "SIGTERM"):
            self.received = name
            log.warning("received %s: checkpointing at the next step boundary", name)

    def preempted(self) -> Preempted:
        """The exception that ends training once the ranks have saved their checkpoint."""
        return Preempted(self.received or "a stop request on another rank")


class PassOn:
    """The local launcher's side, over its rank processes (multiprocessing.Process): while
    entered, TERM, HUP, INT and USR2 sent to the launcher (a `kill`, a closed terminal,
    Ctrl-C) are passed on to the ranks (INT as TERM): their coordinated stop; the launcher
    itself waits for them. Without this the launcher would die at once and its ranks
    would learn of it only through their death signal."""

    SIGNALS = (signal.SIGTERM, signal.SIGHUP, signal.SIGINT, signal.SIGUSR2)

    def __init__(self, procs: Sequence[Any]) -> None:
        self.procs = procs
        self.received: str | None = None
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> PassOn:
        for number in self.SIGNALS:
            self._previous[number] = signal.signal(number, self._forward)
        return self

    def __exit__(self, *_exc: object) -> None:
        for number, handler in self._previous.items():
            signal.signal(number, handler)

    def _forward(self, signum: int, _frame: Any) -> None:
        name = signal.Signals(signum).name
        if self.received is None:
            log.warning("received %s: the ranks checkpoint and stop", name)
        self.received = self.received or name
        # INT as TERM: the ranks of a terminal's Ctrl-C got INT already, and a second INT
        # would abort them without the checkpoint.
        to_ranks = signal.SIGTERM if signum == signal.SIGINT else signum
        for p in self.procs:
            if p.pid is not None and p.exitcode is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p.pid, to_ranks)

    def signalled_ranks(self, exits: dict[int, int | None]) -> set[int]:
        """Ranks that died of the TERM passed on here (before their handler was in place):
        stopped by the user, not the cause of a failure."""
        if self.received is None:
            return set()
        return {rank for rank, code in exits.items() if code == -signal.SIGTERM}
