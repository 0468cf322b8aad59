"""The `elastic_launch` variant of train/launch/local.py that `python -m bench.launcher` compared
with
the hand-written launcher (docs/benchmarks.md, "Local launcher"; kept for repeating that).

Not imported by the service. To measure it, put it in place of train/launch/local.py in a copy of
the
tree, e.g.:

    mkdir /tmp/elastic && git archive HEAD | tar -x -C /tmp/elastic
    cp bench/elastic_launch.py /tmp/elastic/train/launch/local.py
    python -m bench.launcher --tree hand=. --tree elastic=/tmp/elastic

Ranks start under torch's elastic agent (c10d rendezvous on 127.0.0.1:0, no restarts); each
rank's @record error file (the agent wraps the entry point in @record) gives the root cause.
`start_method="fork"` instead of "spawn" is the fork variant measured there.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import tempfile
import traceback
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from train.distributed import env as distenv

log = logging.getLogger("train")

GRACE_S = 15
"""After one rank fails, how long the others get to end (close the MLflow run) before SIGKILL."""


class LaunchError(RuntimeError):
    """Something the user must fix before the job can start."""


class JobFailedError(RuntimeError):
    """A rank failed; the message names the root cause."""


@dataclass(frozen=True)
class RankFailure:
    """How one rank ended badly: killed by a signal, or a Python error (from its error file)."""

    rank: int
    exitcode: int | None = None
    error: str | None = None
    """The traceback the rank's @record error file holds."""
    at: float | None = None
    """When the error file was written (its mtime: finer than the file's whole-second stamp)."""

    @property
    def signal_name(self) -> str | None:
        if self.exitcode is None or self.exitcode >= 0:
            return None
        with contextlib.suppress(ValueError):
            return signal.Signals(-self.exitcode).name
        return f"signal {-self.exitcode}"


def run_in_process(config: dict[str, Any], output_dir: str, command: str) -> dict[str, float]:
    """A one-rank job in this process: no second interpreter to start (seconds saved per job,
    and per job of a local sweep). Its torchrun-style variables are removed again afterwards,
    so that the next job of a sweep is launched afresh."""
    env = distenv.torchrun_env(0, 0, 1, 1, "127.0.0.1", distenv.free_port())
    saved = {key: os.environ.get(key) for key in env}
    os.environ.update(env)
    try:
        from train.engine.job import run_rank

        return run_rank(config, output_dir, command, own_process=False)
    except Exception as e:
        # As from several ranks: the job failed, with the error and where it happened.
        raise JobFailedError("the training job failed; rank 0 failed:\n"
                             + "".join(traceback.format_exception(e))) from None
    finally:
        _restore_environ(saved)


def _rank_entry(config: dict[str, Any], output_dir: str, command: str) -> dict[str, float]:
    # The agent runs this in each rank under @record: an exception leaves its traceback in the
    # rank's error file, which root_cause reads.
    from train.engine.job import run_rank

    return run_rank(config, output_dir, command)


def start_local_ranks(config: dict[str, Any], output_dir: str, command: str,
                      nproc: int) -> dict[str, float]:
    """Start `nproc` ranks on this machine under torch's elastic agent; rank 0's final metrics.

    When a rank ends badly the agent stops the others (SIGTERM, SIGKILL after GRACE_S): they
    have already failed at their next collective or do so now. No restarts: a failed job is
    resumed from its checkpoint by the user or by Slurm, not retried here.
    """
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    agent_log = logging.getLogger("torch.distributed.elastic.multiprocessing.api")
    agent_log.addFilter(_without_traceback)
    with tempfile.TemporaryDirectory(prefix="train-ranks-") as error_dir, _caller_kept():
        launch_config = LaunchConfig(
            min_nodes=1, max_nodes=1, nproc_per_node=nproc, max_restarts=0,
            run_id=f"train-{os.getpid()}", rdzv_backend="c10d", rdzv_endpoint="127.0.0.1:0",
            local_addr="127.0.0.1", start_method="spawn", shutdown_timeout=GRACE_S,
            logs_specs=DefaultLogsSpecs(log_dir=error_dir))
        try:
            returned = elastic_launch(launch_config, _rank_entry)(config, output_dir, command)
        except ChildFailedError as e:
            failures = {rank: RankFailure(rank, failure.exitcode)
                        for rank, failure in e.failures.items()}
            cause = root_cause([*failures.values(), *errors_in(Path(error_dir))])
            raise JobFailedError(f"the training job failed; {cause}") from None
    return returned.get(0) or {}


def _without_traceback(record: logging.LogRecord) -> bool:
    # The agent logs a failed rank's traceback wrapped in its own; JobFailedError shows it once.
    record.exc_info = record.exc_text = None
    return True


def errors_in(error_dir: Path) -> list[RankFailure]:
    """Every rank's @record error file under the agent's log directory (one node: the local
    rank directory is the global rank)."""
    found = []
    for path in error_dir.glob("*/attempt_*/*/error.json"):
        with contextlib.suppress(OSError, ValueError, KeyError):
            message = json.loads(path.read_text())["message"]
            text = (message["extraInfo"]["py_callstack"] if isinstance(message, dict)
                    else str(message))
            found.append(RankFailure(int(path.parent.name), error=text,
                                     at=path.stat().st_mtime))
    return found


def root_cause(failures: list[RankFailure]) -> str:
    """A rank killed by a signal caused the rest (the agent signals the others only after it);
    else the earliest Python error; else the exit codes."""
    errors = sorted((f for f in failures if f.error), key=lambda f: (f.at or 0.0, f.rank))
    killed = sorted((f for f in failures if f.signal_name), key=lambda f: f.rank)
    if killed:
        cause = f"rank {killed[0].rank} was killed by {killed[0].signal_name}"
        if others := [f for f in errors if f.rank != killed[0].rank]:
            cause += f"; then rank {others[0].rank} stopped: {_last_line(others[0].error)}"
        return cause
    if errors:
        return f"rank {errors[0].rank} failed first:\n{errors[0].error}"
    exited = sorted((f for f in failures if f.exitcode), key=lambda f: f.rank)
    return ", ".join(f"rank {f.rank} exited with code {f.exitcode}" for f in exited) or "unknown"


def _last_line(text: str | None) -> str:
    lines = (text or "").strip().splitlines()
    return lines[-1] if lines else ""


@contextlib.contextmanager
def _caller_kept() -> Iterator[None]:
    """The agent installs signal handlers and sets TORCHELASTIC_* variables in this process and
    leaves them; put them back (a local sweep runs its next job in this process)."""
    numbers = [signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT]
    handlers = {number: signal.getsignal(number) for number in numbers}
    environ = dict(os.environ)
    try:
        yield
    finally:
        for number, handler in handlers.items():
            signal.signal(number, handler)
        _restore_environ({key: environ.get(key) for key in {*environ, *os.environ}})


def _restore_environ(saved: Mapping[str, str | None]) -> None:
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        elif os.environ.get(key) != value:
            os.environ[key] = value
