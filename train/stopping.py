"""Stop signals: Slurm's USR2 before a time limit, TERM on preemption or `scontrol requeue`.

A handler only notes the signal. The ranks agree on it where they exchange numbers anyway (the
next logging step, or the epoch end), save one checkpoint together, and stop: a rank never stops
alone, so no peer is left waiting in a collective.
"""

from __future__ import annotations

import logging
import signal
from types import TracebackType
from typing import Any

log = logging.getLogger("train")

STOP_SIGNALS = (signal.SIGUSR2, signal.SIGTERM)


class Preempted(Exception):
    """The job was asked to stop (time limit, preemption, requeue); a checkpoint was saved."""

    def __init__(self, signal_name: str) -> None:
        super().__init__(f"stopped by {signal_name} after saving a checkpoint")
        self.signal_name = signal_name


class StopSignals:
    """While entered, USR2 and TERM set `received` instead of ending the process; on exit the
    previous handlers come back (a one-rank job runs inside the launching process)."""

    def __init__(self) -> None:
        self.received: str | None = None
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> StopSignals:
        for number in STOP_SIGNALS:
            self._previous[number] = signal.signal(number, self._note)
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> None:
        for number, handler in self._previous.items():
            signal.signal(number, handler)

    def _note(self, signum: int, _frame: Any) -> None:
        self.received = signal.Signals(signum).name
        log.warning("received %s: checkpointing at the next step boundary", self.received)

    def preempted(self) -> Preempted:
        """The exception that ends training once the ranks have saved their checkpoint."""
        return Preempted(self.received or "a stop request on another rank")
