"""Rank 0's MLflow run, fed from one background thread so that training never waits on it.

Rows (metrics, params, tags) logged within `tracking.batch_interval_s` travel in one log_batch
request; records (the run's creation, artifacts, the model, its end) follow in the order they
were made. A request that fails is retried until the store answers again; what it has not taken
when the run ends goes to the unsent file (train/tracking/unsent.py). The requests themselves
are train/tracking/client.py's. `NullRun` is the one do-nothing backend: every other rank, and
tracking.enabled=false.
"""

from __future__ import annotations

import contextlib
import json
import logging
import platform
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from pathlib import Path

from train.config.groups import TrackingConfig
from train.tracking import client, errors, retry, unsent
from train.tracking.attribution import run_tags
from train.tracking.backend import RUN_FILE, NullRun
from train.tracking.records import (
    CreateRun,
    EndRun,
    Loggable,
    Record,
    ResumeRun,
    Rows,
)
from train.tracking.store import resolve_uri

log = logging.getLogger(__name__)


class MlflowRun(NullRun):
    """One MLflow run, fed from a background thread; no call waits on MLflow but flush() and
    finish(), and those only for a bounded time."""

    START_DELAY_S = 10.0
    """The sender starts at begin_sending() (the first training step), or this long after."""
    POLL_S = 0.05
    """How often flush() and finish() look at the sender's progress. They poll instead of
    waiting on a Condition: a signal that interrupts Condition.wait half-way can leave its lock
    released ("RuntimeError: release unlocked lock") or held for good."""

    def __init__(self, cfg: TrackingConfig, output_dir: Path) -> None:
        self.cfg, self.uri, self.output_dir = cfg, resolve_uri(cfg), output_dir
        self.rows = Rows()
        # The sender waits on this for a new record or a hurry; callers only notify it.
        self._changed = threading.Condition()
        self._pending: deque[Record | None] = deque()  # records in order; None = the end
        self._records_queued = 0
        self._records_done = 0
        self._hurry = False  # a flush or the end: send rows now, not at the batch interval
        self._in_flight: Record | None = None
        self._request: tuple[str, float] | None = None  # what the sender waits on, since when
        self._go = threading.Event()  # see begin_sending()
        self._given_up = threading.Event()  # finish() saved the rest: stop retrying
        self.failure: str | None = None
        """Set when a request failed in a way no retry can fix: the sender stopped there."""
        self.unsent_path: Path | None = None
        self._finished: bool | None = None  # finish()'s answer, once it ran
        self._client: client.RunClient | None = None  # made by the thread (imports mlflow)
        self._started = False
        self.cpu_seconds = 0.0
        """CPU time the sender thread has used (MLflow's whole cost to this rank)."""
        self._thread = threading.Thread(target=self._loop, name="mlflow-sender", daemon=True)
        self._thread.start()

    @property
    def run_id(self) -> str | None:  # type: ignore[override]
        return self._client.run_id if self._client else None

    @property
    def experiment_id(self) -> str | None:  # type: ignore[override]
        return self._client.experiment_id if self._client else None

    def start(self, tags: Mapping[str, str], run_name: str | None = None,
              resume_run_id: str | None = None) -> None:
        """Create the run, or continue `resume_run_id` (a restarted job) as RUNNING again."""
        self._started = True
        tag_rows = [(k, str(v)) for k, v in tags.items()]
        if resume_run_id:
            self._put(ResumeRun(resume_run_id))
            self.rows.add(tags=tag_rows)
            return
        if self.cfg.parent_run_id:  # a job of a sweep
            tag_rows.append(("mlflow.parentRunId", self.cfg.parent_run_id))
        # Who and what ran it, worked out here and not by the sender thread: its `git` child
        # waited for exec on a pipe that a DataLoader worker forked meanwhile held open - the
        # run was not created for minutes. For the same reason the machine's processor name
        # is read here once (platform caches it): importing mlflow's telemetry on the sender
        # thread runs `uname -p` otherwise (platform.platform()), and stalled CreateRun the same
        # way under load.
        platform.uname().processor  # noqa: B018 - read for its cache
        self._put(CreateRun(experiment_id=self.cfg.experiment_id, experiment=self.cfg.experiment,
                            run_name=run_name, tags={**run_tags(self.uri), **dict(tag_rows)}))

    def log_params(self, params: Mapping[str, str]) -> None:
        self.rows.add(params=[(k, str(v)) for k, v in params.items()])

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        stamp = int(time.time() * 1000)
        self.rows.add(metrics=[(k, float(v), stamp, step) for k, v in metrics.items()])

    def set_tags(self, tags: Mapping[str, str]) -> None:
        self.rows.add(tags=[(k, str(v)) for k, v in tags.items()])

    def log(self, record: Loggable) -> None:
        """An artifact file, text, table, data set or model, sent in order after what came
        before (refused here, not in the sender thread, if it is none of those)."""
        if not isinstance(record, Loggable):
            raise TypeError(f"not a record a run can log: {record!r}")
        self._put(record)

    def begin_sending(self) -> None:
        """Let the sender start. Until then (the first training step, or START_DELAY_S) it
        waits: importing mlflow and opening the store cost seconds of CPU and of the GIL, which
        would otherwise hold up this rank's start-up - and every other rank with it."""
        self._go.set()

    def flush(self, timeout_s: float | None = None, created_within_s: float = 0.0) -> bool:
        """Wait until everything logged so far has been accepted, for at most `timeout_s`
        (default tracking.flush_timeout_s); False if it was not (it stays queued).

        `created_within_s`: first wait up to this long for the run itself to exist (a checkpoint
        must name its run, or a restart from it would begin another; creating the run - and a
        new store - can take seconds on a busy machine)."""
        timeout_s = self.cfg.flush_timeout_s if timeout_s is None else timeout_s
        self._go.set()
        records, rows = self._records_queued, self.rows.added
        self._hurry = True
        self._notify()
        created_by = time.monotonic() + created_within_s
        while (self._started and self.run_id is None and self._thread.is_alive()
               and time.monotonic() < created_by):
            time.sleep(self.POLL_S)
        deadline = time.monotonic() + timeout_s
        # Rows wait for a run to go to: without start() there is none, nothing to wait for.
        while not (self._records_done >= records
                   and (self.rows.taken >= rows or not self._started)):
            if not self._thread.is_alive() or time.monotonic() >= deadline:
                break
            time.sleep(self.POLL_S)
        else:
            self._hurry = False
            return True
        self._hurry = False
        why = self.failure or f"not accepted within {timeout_s:.0f} s{self._waiting_on()}"
        log.warning("MLflow has not taken this run's latest updates (%s); training goes on, "
                    "they stay queued", why)
        return False

    def finish(self, status: str = "FINISHED", error: str | None = None,
               timeout_s: float | None = None) -> bool:
        """End the run with `status` (FAILED whenever there is an `error`, kept as a tag) once
        everything before has been sent, waiting at most `timeout_s` (default
        tracking.flush_timeout_s). True when the store holds it all; otherwise what it lacks is
        in the unsent file (`unsent_path`). A second call answers the first's result."""
        if self._finished is not None:
            return self._finished
        if error is not None and status == "FINISHED":
            status = "FAILED"
        if self._started:
            self._put(EndRun(status, error))
        with self._changed:
            self._pending.append(None)
        self._hurry = True
        self._notify()
        self._go.set()
        wait_s = self.cfg.flush_timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + (wait_s if self._started else 5)
        while self._thread.is_alive() and time.monotonic() < deadline:
            self._thread.join(self.POLL_S * 4)
        problem = None
        if self._thread.is_alive() or self.failure is not None:
            self._given_up.set()
            self._save_unsent(status, self.failure or f"not accepted within {wait_s:.0f} s "
                              f"(tracking.flush_timeout_s){self._waiting_on()}")
            problem = "kept in the unsent file"
        elif self._started and self._client is not None and self._client.run_id:
            problem = self.failure = self._client.check_stored(status)
            if problem is not None:
                log.error("The MLflow store %s does not hold this run as %s: %s.", self.uri,
                          status, problem)
        self._finished = problem is None
        return self._finished

    def _put(self, record: Record) -> None:
        with self._changed:
            self._pending.append(record)
            self._records_queued += 1
            self._changed.notify_all()

    def _notify(self) -> None:
        with self._changed:
            self._changed.notify_all()

    # -- the sender thread ----------------------------------------------------------------------
    def _loop(self) -> None:
        self._go.wait(self.START_DELAY_S)
        with contextlib.suppress(retry.GivenUp):
            self._serve()

    def _serve(self) -> None:
        last_rows = 0.0
        while True:
            wait = self.cfg.batch_interval_s - (time.monotonic() - last_rows)
            if self._client is not None and self.rows and (wait <= 0 or self._hurry):
                self._send_rows()
                last_rows = time.monotonic()
                continue
            with self._changed:  # until a record, a hurry, or the rows' batch interval is up
                rows_now = self._hurry and self._client is not None and self.rows
                if not self._pending and not rows_now:
                    self._changed.wait(max(0.05, wait) if self.rows else 0.5)
                if not self._pending:
                    continue
                record = self._pending.popleft()
            if record is None:
                return
            self._send(record)

    def _send(self, record: Record) -> None:
        self._in_flight = record
        if isinstance(record, (CreateRun, ResumeRun)):
            self._retry(lambda: self._begin(record), type(record).__name__)
        else:
            if isinstance(record, EndRun):  # the rows logged before the end go first
                self._send_rows()
            self._retry(lambda: self._run_client().apply(record), type(record).__name__)
        self._in_flight = None
        self.cpu_seconds = time.thread_time()
        self._records_done += 1

    def _begin(self, record: CreateRun | ResumeRun) -> None:
        if self._client is None:
            self._client = client.RunClient(self.uri)
        if isinstance(record, ResumeRun):
            unsent.deliver_leftovers(self.output_dir, record.run_id, self.uri)
        self._client.apply(record)
        (self.output_dir / RUN_FILE).write_text(json.dumps(
            {"run_id": self.run_id, "experiment_id": self.experiment_id,
             "tracking_uri": self.uri}))

    def _run_client(self) -> client.RunClient:
        assert self._client is not None, "a record before the run's start()"
        return self._client

    def _send_rows(self) -> None:
        if self._client is None:  # no run yet: they wait for it
            return
        while batch := self.rows.peek():
            self._retry(lambda b=batch: self._run_client().send_rows(b),  # type: ignore[misc]
                        f"log_batch of {len(batch)} rows")
            self.rows.drop(batch)
            self.cpu_seconds = time.thread_time()

    def _retry(self, request: Callable[[], None], what: str) -> None:
        """Until the request succeeds (retry.until_taken), with what the sender waits on kept
        for flush's and finish's messages; a permanent failure, kept as `failure`, or finish()
        giving up ends the sender instead."""
        self._request = (what, time.monotonic())
        try:
            retry.until_taken(request, self._given_up)
        except retry.GivenUp as e:
            if e.why is not None:
                self.failure = e.why
            raise
        self._request = None

    def _waiting_on(self) -> str:
        request = self._request  # the sender may clear it meanwhile
        return "" if request is None else errors.stuck(*request, self._thread.ident)

    def _save_unsent(self, status: str, why: str) -> None:
        """Keep what MLflow did not take in a local file, with the command that delivers it."""
        with self._changed:
            waiting = [r for r in [self._in_flight, *self._pending] if r is not None]
        header = {"run_id": self.run_id, "tracking_uri": self.uri, "status": status}
        try:
            self.unsent_path = unsent.save_rest(
                self.output_dir, header, self.rows.everything(), waiting,
                self._client.logged_until if self._client is not None else None, why)
        except OSError as e:  # a full output disk: the job's own error must still be told
            log.error("what MLflow did not take could not be kept in %s (%s): it is lost",
                      self.output_dir, e)


def open_run(cfg: TrackingConfig, output_dir: Path, is_main: bool) -> NullRun:
    """MlflowRun on rank 0 with tracking enabled (writes output_dir/mlflow_run.json, and
    output_dir/mlflow_unsent.jsonl if MLflow never takes the rest); NullRun otherwise."""
    return MlflowRun(cfg, output_dir) if is_main and cfg.enabled else NullRun()
