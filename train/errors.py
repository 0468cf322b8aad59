"""What the user is told when a job cannot start or did not finish: one error hierarchy.

Every error the service itself raises for the user derives from `TrainError`, which carries the
exit code and knows its one line for the terminal. `app.job` catches `TrainError` once; the
Hydra launchers (hydra_plugins/train_launcher) and the Slurm follower test `isinstance`, never
class names. Wings raise these (or their own subclasses, e.g. `UserCodeError`, `WeightsError`,
`TrackingError`), so a new refusal needs no new `except` anywhere.

Imports only the standard library: any wing may raise these, and `--help` stays fast.
"""

from __future__ import annotations

import contextlib
import json
import signal
import time
from dataclasses import asdict, dataclass
from pathlib import Path

FAILURE_REASON = "train_failure_reason"
"""The attribute a rank's failing exception carries its one-line cause in (the run's error, as
train/engine/ending.py sets it), for the local launcher to show instead of the traceback."""
SILENT_RANKS = "train_silent_ranks"
"""The attribute that carries the ranks that stopped answering (stuck, frozen or dead): the
local launcher stops them as soon as every other rank has ended."""
FAILURE_FILE = "failure.json"
"""A failed job's account in its output directory (FailureRecord)."""
USER_TRACE = "train_user_traceback"
"""The attribute that carries an error raised in the user's code as its traceback trimmed to
the user's frames (train/distributed/stacks.py user_traceback), for the terminal's block."""


@dataclass(frozen=True)
class FailureRecord:
    """A failed job's account in its output directory (FAILURE_FILE), kept by rank 0 - or by
    the rank that found rank 0 silent (train/engine/ending.py). The Slurm follower on the login
    node shows it as the local launcher shows what its ranks send back (train/launch/follow.py);
    `python -m train sweep status` reads a job's state from it (train/sweep.py)."""

    cause: str
    """The run's error: the one line the terminal shows."""
    trace: str | None
    """The user's traceback trimmed to the user's frames, where the error was raised there."""
    at: float
    """When it was kept (time.time()): a record older than a start is an earlier start's."""
    rank: int = 0
    """Who kept it: a rank other than 0 means rank 0 could not end its run."""

    @classmethod
    def now(cls, cause: str, trace: str | None, rank: int) -> FailureRecord:
        return cls(cause, trace, time.time(), rank)

    def write(self, out: Path) -> None:
        """Into `out` (best effort: a full or gone disk must not hide the error itself)."""
        with contextlib.suppress(OSError):
            (out / FAILURE_FILE).write_text(json.dumps(asdict(self)) + "\n")

    @classmethod
    def read(cls, out: Path) -> FailureRecord | None:
        """The record in `out`, or None where there is none or it cannot be read (a file cut
        short by a killed rank, or written by an older version without a field)."""
        try:
            found = json.loads((out / FAILURE_FILE).read_text())
            trace = found.get("trace")
            return cls(str(found["cause"]), None if trace is None else str(trace),
                       float(found["at"]), int(found.get("rank", 0)))
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return None

    @staticmethod
    def remove(out: Path) -> None:
        with contextlib.suppress(OSError):
            (out / FAILURE_FILE).unlink(missing_ok=True)


class TrainError(Exception):
    """A failure the user can act on; its message says what is wrong and what to do."""

    exit_code: int = 2
    """2: refused before anything started (bad input, as argparse and Hydra use it)."""

    def terminal_line(self) -> str:
        """What the terminal shows of it: one line (a root cause may add its traceback)."""
        return f"error: {self}"


class ConfigError(TrainError, ValueError):
    """A configuration the service refuses; its message is shown to the user as is."""


class DistEnvError(TrainError, RuntimeError):
    """The launch environment (RANK, SLURM_*, ...) is inconsistent, or a device cannot be
    bound as it says."""


class LaunchError(TrainError, RuntimeError):
    """Something the user must fix before the job can start (a sweep stopped, a checkpoint
    that cannot be used, a store that cannot be reached)."""


class SubmitError(TrainError, RuntimeError):
    """The job cannot be submitted to Slurm as asked; nothing was submitted."""


class JobLockedError(TrainError, RuntimeError):
    """Another live job holds the output directory."""


class JobFailedError(TrainError, RuntimeError):
    """A rank failed; the message names the root cause (the first failing rank's error).
    `failure`: the same as fields (train/launch/outcomes.py Failure) where the launcher made
    the block, for a sweep's end to show without parsing the message."""

    exit_code = 1

    def __init__(self, message: str, failure: object | None = None) -> None:
        super().__init__(message)
        self.failure = failure


class StoppedBySignal(TrainError):
    """Asked to stop (time limit, preemption, requeue, Ctrl-C) after saving a checkpoint: no
    failure. Raised by a rank (`Preempted`) or by a launcher whose ranks stopped
    (`JobStoppedError`); a Slurm task that ends with one exits 0."""

    signal_name: str = ""

    @property
    def exit_code(self) -> int:  # type: ignore[override]
        """As a shell reports a process ended by that signal."""
        number = getattr(signal.Signals, self.signal_name, None)
        return 128 + int(number) if number is not None else 1

    def terminal_line(self) -> str:
        return str(self)


class JobStoppedError(StoppedBySignal, RuntimeError):
    """The job was stopped by a signal after its ranks saved a checkpoint; the run is KILLED."""

    def __init__(self, signal_name: str, output_dir: str) -> None:
        super().__init__(
            f"stopped by {signal_name} after saving a checkpoint in {output_dir}/checkpoints; "
            f"the same command with hydra.run.dir={output_dir} resumes it")
        self.signal_name = signal_name
        self.output_dir = output_dir

    def __reduce__(self) -> tuple[type, tuple[str, str]]:
        # Pickled back to the login node in a per-node Slurm task's result (cluster.ranks=
        # per_node): the default would call __init__ with the message alone.
        return JobStoppedError, (self.signal_name, self.output_dir)
