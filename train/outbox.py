"""What rank 0 has logged and MLflow has not accepted yet, and the file it goes to if it never is.

Metric, param and tag rows wait in `Rows` until the sender thread takes them, as many as one
MLflow request may carry, so that everything logged within `tracking.batch_interval_s` travels
in one request. Everything else (the run's creation, artifact files, texts, the confusion
matrix, the model, the end of the run) is a `Record`, sent in the order it was made.

If MLflow is still unreachable when the run ends, `save()` writes what is left to
<output dir>/mlflow_unsent.jsonl - one JSON object per line, the run's identity first - and
`python -m train.outbox upload <file>` delivers it once the store is back. Only the data set
input and the MLflow model cannot be written there (they are Python objects); the weights are
a file record, and so survive.

No mlflow import here (`upload` makes its requests through train/tracking.py).
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

UNSENT_FILE = "mlflow_unsent.jsonl"
# MLflow's limits for one log_batch request.
MAX_METRICS, MAX_PARAMS, MAX_TAGS = 1000, 100, 100
# Records that hold Python objects, not data: they cannot wait in a file.
UNSAVABLE = ("dataset", "model")

Metric = tuple[str, float, int, int]
"""key, value, timestamp (ms), step"""


@dataclass
class Batch:
    metrics: list[Metric] = field(default_factory=list)
    params: list[tuple[str, str]] = field(default_factory=list)
    tags: list[tuple[str, str]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.metrics or self.params or self.tags)

    def chunks(self) -> list[Batch]:
        """This batch cut to MLflow's per-request limits."""
        out, metrics, params, tags = [], self.metrics, self.params, self.tags
        while metrics or params or tags:
            out.append(Batch(metrics[:MAX_METRICS], params[:MAX_PARAMS], tags[:MAX_TAGS]))
            metrics, params = metrics[MAX_METRICS:], params[MAX_PARAMS:]
            tags = tags[MAX_TAGS:]
        return out


class Rows:
    """Rows logged and not yet accepted, oldest first; the training thread adds, the sender
    peeks, sends and only then drops, so a failed request loses nothing."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pending = Batch()

    def add(self, metrics: list[Metric] | None = None, params: list[tuple[str, str]] | None = None,
            tags: list[tuple[str, str]] | None = None) -> None:
        with self._lock:
            self._pending.metrics.extend(metrics or [])
            self._pending.params.extend(params or [])
            self._pending.tags.extend(tags or [])

    def peek(self) -> Batch:
        """The oldest rows, at most one request's worth."""
        with self._lock:
            return Batch(self._pending.metrics[:MAX_METRICS],
                         self._pending.params[:MAX_PARAMS], self._pending.tags[:MAX_TAGS])

    def drop(self, sent: Batch) -> None:
        with self._lock:
            del self._pending.metrics[:len(sent.metrics)]
            del self._pending.params[:len(sent.params)]
            del self._pending.tags[:len(sent.tags)]

    def everything(self) -> Batch:
        with self._lock:
            return Batch(list(self._pending.metrics), list(self._pending.params),
                         list(self._pending.tags))

    def __bool__(self) -> bool:
        with self._lock:
            return bool(self._pending)


@dataclass
class Record:
    """One request other than rows: kind and what it needs (JSON data unless UNSAVABLE)."""

    kind: str
    data: dict[str, Any] = field(default_factory=dict)


def save(path: Path, header: dict[str, Any], rows: Batch, records: list[Record]) -> list[str]:
    """Write the unsent file; returns the kinds of records that could not be kept."""
    lost = [r.kind for r in records if r.kind in UNSAVABLE]
    with open(path, "w") as f:
        f.write(json.dumps(header) + "\n")
        for record in records:
            if record.kind not in UNSAVABLE:
                f.write(json.dumps({"record": record.kind, **record.data}) + "\n")
        for m in rows.metrics:
            f.write(json.dumps({"metric": list(m)}) + "\n")
        for p in rows.params:
            f.write(json.dumps({"param": list(p)}) + "\n")
        for t in rows.tags:
            f.write(json.dumps({"tag": list(t)}) + "\n")
    return lost


def load(path: Path) -> tuple[dict[str, Any], Batch, list[Record]]:
    """The header, the rows and the records of an unsent file."""
    lines = path.read_text().splitlines()
    header, rows, records = json.loads(lines[0]), Batch(), []
    for line in lines[1:]:
        item = json.loads(line)
        if "metric" in item:
            key, value, stamp, step = item["metric"]
            rows.metrics.append((key, float(value), int(stamp), int(step)))
        elif "param" in item:
            rows.params.append(tuple(item["param"]))  # type: ignore[arg-type]
        elif "tag" in item:
            rows.tags.append(tuple(item["tag"]))  # type: ignore[arg-type]
        else:
            kind = item.pop("record")
            records.append(Record(kind, item))
    return header, rows, records


def upload(path: Path, tracking_uri: str | None = None) -> str:
    """Deliver an unsent file: the run (created now if it never was), the rows the run does not
    hold yet - so a second upload changes nothing -, the artifacts, and the final status.

    The run lives where the job logged it (the file's first line) unless `tracking_uri` says the
    store has moved; MLFLOW_TRACKING_URI is not consulted, as it may name another store by now.
    """
    from train.tracking import Sender

    header, rows, records = load(path)
    sender = Sender(tracking_uri or header["tracking_uri"], header["run_id"])
    begin = [r for r in records if r.kind in ("create", "resume")]
    end = [r for r in records if r.kind == "end"]
    for record in begin:
        sender.record(record)
    for chunk in _unheld(sender, rows).chunks():
        sender.rows(chunk)
    for record in [r for r in records if r.kind not in ("create", "resume", "end")] + end:
        sender.record(record)
    if not end:  # the end request itself had gone through
        sender.client.set_terminated(sender.run_id, header["status"])
    path.rename(path.with_suffix(".uploaded"))
    return str(sender.run_id)


def _unheld(sender: Any, rows: Batch) -> Batch:
    """The rows without the metric steps the run already holds."""
    held = {key: {m.step for m in sender.client.get_metric_history(sender.run_id, key)}
            for key in {m[0] for m in rows.metrics}}
    return Batch([m for m in rows.metrics if m[3] not in held[m[0]]], rows.params, rows.tags)


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(prog="python -m train.outbox")
    commands = parser.add_subparsers(dest="command", required=True)
    command = commands.add_parser("upload", help=f"deliver a job's {UNSENT_FILE} to MLflow")
    command.add_argument("file", type=Path)
    command.add_argument("--tracking-uri", help="where the run lives now, if not where the job "
                         "logged it (the file's first line)")
    args = parser.parse_args()
    header = json.loads(args.file.read_text().splitlines()[0])
    run_id = upload(args.file, args.tracking_uri)
    print(f"delivered {args.file} to run {run_id} ({header['status']}); the file is now "
          f"{args.file.with_suffix('.uploaded')}")
