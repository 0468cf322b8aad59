"""Stop signals: Slurm's USR2 before a time limit, TERM on preemption or `scontrol requeue`, HUP
when the terminal closes, INT (Ctrl-C), and the TERM a local rank gets when its launcher dies.

A handler only notes the signal. The ranks agree on it where they exchange numbers anyway (the
next logging step, or the epoch end), save one checkpoint together, and stop: a rank never stops
alone, so no peer is left waiting in a collective. A second INT (Ctrl-C twice) does not wait for
the checkpoint: it raises KeyboardInterrupt, as Python would.

DataLoader workers are forked from a rank and get the same signals when a whole process group
is signalled (Slurm, a closed terminal): `ignore_in_worker` makes them leave stopping to their
rank, which ends them with its DataLoader.
"""

from __future__ import annotations

import logging
import signal
from types import TracebackType
from typing import Any

log = logging.getLogger("train")

STOP_SIGNALS = (signal.SIGUSR2, signal.SIGTERM, signal.SIGHUP, signal.SIGINT)

_noted_early: str | None = None
"""A stop signal received before StopSignals was entered (a rank still starting)."""


class Preempted(Exception):
    """The job was asked to stop (time limit, preemption, requeue); a checkpoint was saved."""

    def __init__(self, signal_name: str) -> None:
        super().__init__(f"stopped by {signal_name} after saving a checkpoint")
        self.signal_name = signal_name


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
    the checkpoint); a worker that died of the group's TERM would crash the rank before."""
    for number in STOP_SIGNALS:
        signal.signal(number, signal.SIG_IGN)


class StopSignals:
    """While entered, USR2, TERM, HUP and INT set `received` instead of ending the process; on
    exit the previous handlers come back (a one-rank job runs inside the launching process)."""

    def __init__(self) -> None:
        self.received: str | None = None
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

    def _note(self, signum: int, _frame: Any) -> None:
        name = signal.Signals(signum).name
        if name == "SIGINT" and self.received == "SIGINT":
            raise KeyboardInterrupt  # Ctrl-C twice: stop now, without the checkpoint
        if self.received is None:  # the first one names the stop (a group gets several)
            self.received = name
            log.warning("received %s: checkpointing at the next step boundary", name)

    def preempted(self) -> Preempted:
        """The exception that ends training once the ranks have saved their checkpoint."""
        return Preempted(self.received or "a stop request on another rank")
