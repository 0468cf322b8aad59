"""Rank 0's MLflow run, fed from one background thread so that training never waits on it.

Rows (metrics, params, tags) logged within `tracking.batch_interval_s` travel in one log_batch
request; other requests (the run's creation, artifacts, the model, its end) follow in the order
they were made. A request that fails is retried until the store answers again; what it has not
taken when the run ends goes to the unsent file (train/outbox.py). The requests themselves are
train/tracking.py's, the only module that imports mlflow.
"""

from __future__ import annotations

import contextlib
import json
import logging
import queue
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from train import outbox
from train.config import TrackingConfig
from train.outbox import Record
from train.store import resolve_uri

log = logging.getLogger(__name__)


class _GivenUp(Exception):
    """The run ended without MLflow; what was left went to the unsent file."""


class NullTracker:
    """What every rank but 0 (and a run with tracking.enabled=false) gets."""

    run_id: str | None = None
    experiment_id: str | None = None
    uri = ""

    def start(self, **_: Any) -> None: ...
    def set_tags(self, tags: Mapping[str, Any]) -> None: ...
    def log_params(self, params: Mapping[str, str]) -> None: ...
    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None: ...
    def log(self, kind: str, **data: Any) -> None: ...
    def begin_sending(self) -> None: ...
    def flush(self) -> None: ...
    cpu_seconds = 0.0
    def finish(self, error: str | None = None, status: str | None = None) -> None: ...


class RunTracker(NullTracker):
    """One MLflow run, fed from a background thread; calls never block on MLflow."""

    START_DELAY_S = 10.0
    """The sender starts at the first training step, or this long after the tracker was made."""

    def __init__(self, cfg: TrackingConfig, run_id_file: Path) -> None:
        self.cfg, self.uri, self.run_id_file = cfg, resolve_uri(cfg), run_id_file
        self.rows = outbox.Rows()
        self._queue: queue.Queue[Record | None] = queue.Queue()
        self._in_flight: Record | None = None
        self._hurry = threading.Event()  # a flush or the end: send rows now
        self._go = threading.Event()  # see begin_sending()
        self._given_up = False  # finish() timed out and saved the rest: stop retrying
        self._sender: Any = None  # train.tracking.Sender, made by the thread (imports mlflow)
        self._started = False
        self._cpu_seconds = 0.0
        self._thread = threading.Thread(target=self._loop, name="mlflow-sender", daemon=True)
        self._thread.start()

    @property
    def run_id(self) -> str | None:  # type: ignore[override]
        return self._sender.run_id if self._sender else None

    @property
    def experiment_id(self) -> str | None:  # type: ignore[override]
        return self._sender.experiment_id if self._sender else None

    def start(self, *, tags: Mapping[str, Any], run_name: str | None,
              resume_run_id: str | None = None, **_: Any) -> None:
        """Create the run, or continue `resume_run_id` (a restarted job) as RUNNING again."""
        self._started = True
        tag_rows = [(k, str(v)) for k, v in tags.items()]
        if resume_run_id:
            self._queue.put(Record("resume", {"run_id": resume_run_id}))
            self.rows.add(tags=tag_rows)
            return
        if self.cfg.parent_run_id:  # a job of a sweep
            tag_rows.append(("mlflow.parentRunId", self.cfg.parent_run_id))
        self._queue.put(Record("create", {
            "experiment_id": self.cfg.experiment_id, "experiment": self.cfg.experiment,
            "run_name": run_name, "tags": dict(tag_rows)}))

    def set_tags(self, tags: Mapping[str, Any]) -> None:
        self.rows.add(tags=[(k, str(v)) for k, v in tags.items()])

    def log_params(self, params: Mapping[str, str]) -> None:
        self.rows.add(params=[(k, str(v)) for k, v in params.items()])

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        stamp = int(time.time() * 1000)
        self.rows.add(metrics=[(k, float(v), stamp, step) for k, v in metrics.items()])

    def log(self, kind: str, **data: Any) -> None:
        """Any other request, in order: file, text, confusion, dataset, model (Sender._<kind>)."""
        self._queue.put(Record(kind, data))

    def begin_sending(self) -> None:
        """Let the sender start. Until then (the first training step, or START_DELAY_S) it
        waits: importing mlflow and opening the store cost seconds of CPU and of the GIL, which
        would otherwise hold up this rank's start-up - and every other rank with it."""
        self._go.set()

    def flush(self) -> None:
        """Wait until everything logged so far has been accepted (or tracking.flush_timeout_s)."""
        self._go.set()
        done = threading.Event()
        self._queue.put(Record("flushed", {"event": done}))
        self._hurry.set()
        if not done.wait(self.cfg.flush_timeout_s):
            log.warning("MLflow has not accepted this run's updates for %.0f s; going on, they "
                        "stay queued", self.cfg.flush_timeout_s)

    def finish(self, error: str | None = None, status: str | None = None) -> None:
        """End the run FINISHED, FAILED with `error` as a tag, or `status` (e.g. KILLED), once
        everything before has been sent; what MLflow never takes goes to a file."""
        status = status or ("FAILED" if error else "FINISHED")
        if self._started:
            self._queue.put(Record("end", {"status": status, "error": error}))
        self._queue.put(None)
        self._hurry.set()
        self._go.set()
        self._thread.join(timeout=self.cfg.flush_timeout_s if self._started else 5)
        if self._thread.is_alive():
            self._given_up = True
            self._save_unsent(status)

    # -- the sender thread --------------------------------------------------------------------
    def _loop(self) -> None:
        self._go.wait(self.START_DELAY_S)
        with contextlib.suppress(_GivenUp):
            self._serve()

    @property
    def cpu_seconds(self) -> float:
        """CPU time the sender thread has used (MLflow's whole cost to this rank)."""
        return self._cpu_seconds

    def _serve(self) -> None:
        last_rows = 0.0
        while True:
            wait = self.cfg.batch_interval_s - (time.monotonic() - last_rows)
            if self._sender is not None and self.rows and (wait <= 0 or self._hurry.is_set()):
                self._send_rows()
                last_rows = time.monotonic()
                self._cpu_seconds = time.thread_time()
                continue
            try:
                record = self._queue.get(timeout=max(0.05, wait) if self.rows else 0.5)
            except queue.Empty:
                continue
            if record is None:
                return
            self._in_flight = record
            if record.kind in ("create", "resume"):
                self._retry(lambda r=record: self._begin(r))
            elif record.kind == "flushed":
                self._send_rows()
                record.data["event"].set()
                self._hurry.clear()
            else:
                if record.kind == "end":
                    self._send_rows()
                self._retry(lambda r=record: self._sender.record(r))  # type: ignore[union-attr]
            self._in_flight = None
            self._cpu_seconds = time.thread_time()

    def _begin(self, record: Record) -> None:
        if self._sender is None:
            from train.tracking import Sender

            self._sender = Sender(self.uri)
        self._sender.record(record)
        self._write_run_id_file()

    def _send_rows(self) -> None:
        if self._sender is None:  # no run yet: they wait for it
            return
        while batch := self.rows.peek():
            self._retry(lambda b=batch: self._sender.rows(b))  # type: ignore[union-attr]
            self.rows.drop(batch)

    def _retry(self, request: Any) -> None:
        delay = 0.5
        while True:
            try:
                return request()
            except Exception as e:  # noqa: BLE001 - a tracking outage must not stop training
                if self._given_up:
                    raise _GivenUp from None
                log.warning("MLflow request failed (%s); retrying in %.0f s", e, delay)
                time.sleep(delay)
                delay = min(delay * 2, 30.0)

    def _write_run_id_file(self) -> None:
        self.run_id_file.write_text(json.dumps(
            {"run_id": self.run_id, "experiment_id": self.experiment_id,
             "tracking_uri": self.uri}))

    def _save_unsent(self, status: str) -> None:
        """Keep what MLflow did not take in a local file, with the command that delivers it."""
        waiting = [r for r in [self._in_flight, *list(self._queue.queue)]
                   if r is not None and r.kind != "flushed"]
        rows = self.rows.everything()
        if self._sender is not None:  # what a resumed run already holds is not kept twice
            until = self._sender.logged_until
            rows.metrics = [m for m in rows.metrics if m[3] > until.get(m[0], -1)]
        path = self.run_id_file.parent / outbox.UNSENT_FILE
        header = {"run_id": self.run_id, "tracking_uri": self.uri, "status": status}
        lost = outbox.save(path, header, rows, waiting)
        log.error("MLflow did not accept this run's last updates within %.0f s "
                  "(tracking.flush_timeout_s): %d metric values, %d params, %d tags and %d other "
                  "requests are in %s%s. Deliver them (and end the run %s) once the store is "
                  "back:\n  python -m train.outbox upload %s", self.cfg.flush_timeout_s,
                  len(rows.metrics), len(rows.params), len(rows.tags), len(waiting) - len(lost),
                  path, f" (not kept: {', '.join(lost)})" if lost else "", status, path)


def open_tracker(cfg: TrackingConfig, run_id_file: Path) -> NullTracker:
    """For rank 0 (see report.open_reporter): MLflow unless tracking.enabled=false."""
    return RunTracker(cfg, run_id_file) if cfg.enabled else NullTracker()
