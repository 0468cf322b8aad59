"""What the local launcher's ranks send back and what it makes of it: the root cause of a
failed job (one line where the rank gave one; the tracebacks then go to train.log)."""

from __future__ import annotations

import contextlib
import signal
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal


@dataclass(frozen=True)
class RankOutcome:
    """What a rank sent back before exiting: its result, its error's traceback, or the signal
    that stopped it."""

    rank: int
    kind: Literal["error", "result", "stopped"]
    payload: Any
    at: float
    """time.time() when it was sent: the earliest error is the root cause."""
    reason: str | None = None
    """An error's one line, as the rank put it in the run (train/engine/ending.py): the
    terminal shows it; the traceback goes to train.log."""
    silent: tuple[int, ...] = ()
    """The ranks it found not answering (stuck, frozen or dead)."""


def log_tracebacks(out: Path, results: list[RankOutcome]) -> None:
    """The failed ranks' tracebacks into the job's train.log: the terminal gets one line."""
    errors = [o for o in results if o.kind == "error" and o.reason is not None]
    if not errors:
        return
    with contextlib.suppress(OSError), (out / "train.log").open("a") as f:
        for o in sorted(errors, key=lambda o: (o.at, o.rank)):
            f.write(f"[rank {o.rank}] its error: {o.reason}\n{o.payload}\n")


def root_cause(exits: dict[int, int | None], outcomes: list[RankOutcome],
               stopped: set[int]) -> str:
    """Why the job failed, from every rank's exit code and what the ranks sent back.

    A rank killed by a signal that did not come from this launcher caused the rest (the others
    only noticed its closed connections); else the earliest Python error; else the exit codes.
    """
    errors = sorted((o for o in outcomes if o.kind == "error"), key=lambda o: (o.at, o.rank))
    killed = sorted((rank, -code) for rank, code in exits.items()
                    if code is not None and code < 0 and rank not in stopped)
    if killed:
        cause = f"rank {killed[0][0]} was killed by {signal_name(killed[0][1])}"
        if errors:
            cause += f"; then rank {errors[0].rank} stopped: {last_line(errors[0].payload)}"
        return cause
    if errors and errors[0].reason:  # its traceback is in train.log (_log_tracebacks)
        return f"{errors[0].reason} (tracebacks: train.log)"
    if errors:
        return f"rank {errors[0].rank} failed first:\n{errors[0].payload}"
    return ", ".join(f"rank {rank} exited with code {code}" for rank, code in sorted(exits.items())
                     if code and rank not in stopped) or "no rank reported why"


def signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def last_line(text: str) -> str:
    lines = text.strip().splitlines()
    return lines[-1] if lines else ""
