"""What the local launcher's ranks send back and what it makes of it: the root cause of a
failed job (one line where the rank gave one; the tracebacks then go to train.log), and the
block the terminal shows for it: the cause, the user's trimmed traceback where the user's code
raised, what was kept and the command that resumes."""

from __future__ import annotations

import re
import shlex
import signal
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from train.distributed import rankfiles


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
    trace: str | None = None
    """Where the user's code raised: its traceback trimmed to the user's frames (errors.
    USER_TRACE), shown under the one line."""


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
    if errors and errors[0].reason:  # its traceback is in train.log (engine/ending.py)
        return errors[0].reason
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


def root_trace(outcomes: list[RankOutcome], cause: str) -> str | None:
    """The user's trimmed traceback behind `cause`: the failing rank's own (the ranks that only
    saw it fail report the same cause, without one)."""
    return next((o.trace for o in outcomes if o.kind == "error" and o.trace
                 and o.reason == cause), None)


_CHECKPOINT = re.compile(r"step-(\d+)\.(pt|dcp)$")
"""A whole checkpoint as train/engine/checkpoint.py names it (written to a .tmp, then renamed:
a name that matches is complete); read here without importing torch."""


def newest_checkpoint(out: Path) -> tuple[Path, int] | None:
    """The job's newest checkpoint and its global step; None before the first."""
    found = [(int(m.group(1)), p) for p in (out / "checkpoints").glob("step-*")
             if (m := _CHECKPOINT.search(p.name))]
    if not found:
        return None
    step, path = max(found)
    return path, step


_PLACING = ("hydra.run.dir=", "hydra.sweep.dir=", "hydra.sweep.subdir=")


@dataclass(frozen=True)
class Failure:
    """A failed job as the terminal tells it: the cause (rank, host, error), the user's trimmed
    traceback where the user's code raised, and the lines after it (what was kept, the command
    that continues the job, where the tracebacks are). The local launcher's JobFailedError
    carries it, so that a sweep's end can show its lines without parsing the text."""

    cause: str
    trace: str | None
    after: tuple[str, ...]
    job: str = "training"
    """What the job did: training, evaluating or predicting (`python -m train eval`, `predict`)."""

    def block(self) -> str:
        lines = [f"the {self.job} job failed; {self.cause}"]
        lines += ["  " + line for line in (self.trace or "").splitlines()]
        return "\n".join([*lines, *("  " + line for line in self.after)])


def failure_block(cause: str, out: Path, command: str, trace: str | None = None,
                  placed: list[str] | None = None, logs: str | None = None,
                  since: float | None = None) -> str:
    """`failure(...)`'s block, as the terminal shows it."""
    return failure(cause, out, command, trace, placed, logs, since).block()


def failure(cause: str, out: Path, command: str, trace: str | None = None,
            placed: list[str] | None = None, logs: str | None = None,
            since: float | None = None) -> Failure:
    """A failed job: the cause, the user's traceback, what was kept and the command that
    continues the job (trainer.resume=auto, the default, in the same output directory: the
    same MLflow run), where its run and tracebacks are. `placed`: the overrides that put a job
    in `out` (a Slurm job's sweep directory and subdirectory; hydra.run.dir for a local one);
    `logs`: where its ranks' own logs are, besides train.log; `since`: when this start of the
    job began (the run it recorded since then is named)."""
    where = f"tracebacks: {out / 'train.log'}" + (f"; each rank's log: {logs}" if logs else "")
    snapshots = [p.stat().st_mtime for p in (out / rankfiles.MEMORY_DIR).glob("rank-*.pickle")]
    if snapshots and max(snapshots) >= (since or 0.0):  # trainer.memory_snapshot, this start's
        where += (f"; GPU memory snapshots: {out / rankfiles.MEMORY_DIR} (open them at "
                  "pytorch.org/memory_viz)")
    run = _run_line(out, since) if since is not None else None
    tail = (where,) if run is None else (run, where)
    kept = newest_checkpoint(out)
    if _finished_training(out, kept):  # only its run's end did not reach the store
        return Failure(cause, trace, (f"kept: the finished training: {out / 'summary.json'}, "
                                      "the weights and checkpoints beside it", *tail))
    words = [w for w in command.split()[3:] if not w.startswith(_PLACING)]
    if words[:1] in (["eval"], ["predict"]):  # nothing to resume: it starts again
        again = " ".join(["python -m train", *map(shlex.quote, words)])
        return Failure(cause, trace, (f"start again: {again}", *tail),
                       job="evaluating" if words[0] == "eval" else "predicting")
    if kept is not None:  # it resumes from its own checkpoint, not from where it began
        words = [w for w in words if not w.startswith("trainer.resume=")]
    again = " ".join(["python -m train", *map(shlex.quote, words),
                      *map(shlex.quote, placed or [f"hydra.run.dir={out}"])])
    if kept is None:
        return Failure(cause, trace, ("kept: nothing: no checkpoint yet",
                                      f"start again: {again}", *tail))
    return Failure(cause, trace, (f"kept: {kept[0]} (step {kept[1]}), the newest checkpoint",
                                  f"resume: {again}", *tail))


def _run_line(out: Path, since: float) -> str | None:
    """The job's MLflow run and how to view it, where this start of the job made or continued
    one (its status is the run's own: FAILED, or RUNNING where its end did not reach the
    store)."""
    from train.tracking.abandoned import recorded_run
    from train.tracking.store import how_to_view

    if (run := recorded_run(out, since)) is None:
        return None
    return (f"run: MLflow run {run['run_id']}; view it: "
            f"{how_to_view(run['tracking_uri'], run['experiment_id'], run['run_id'])}")


def _finished_training(out: Path, kept: tuple[Path, int] | None) -> bool:
    """Whether the job trained to its end (its summary.json is written after its final
    checkpoint; one older than the newest checkpoint is an earlier start's)."""
    try:
        summary = (out / "summary.json").stat().st_mtime
        return kept is None or summary >= kept[0].stat().st_mtime
    except OSError:
        return False
