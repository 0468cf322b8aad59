"""The unsent file: what MLflow had not accepted when a run ended, and its later delivery.

If MLflow is still unreachable when the run ends, `save()` writes what is left to
<output dir>/mlflow_unsent.jsonl - one JSON object per line: the run's identity first, then the
records ({"record": KIND, ...its fields}) and the rows ({"metric": [...]}, {"param": [...]},
{"tag": [...]}) - and `python -m train outbox upload <file>` delivers it once the store is back.
Only the MLflow model cannot be written there (it is a Python object); the weights are an
artifact file record, and so survive.

No mlflow import here: `upload` makes its requests through train/tracking/client.py.
"""

from __future__ import annotations

import json
import logging
import os
import stat
import types
import typing
from dataclasses import asdict, fields
from pathlib import Path
from typing import Any

from train.tracking import client, errors
from train.tracking.records import (
    SAVABLE,
    ArtifactFile,
    Batch,
    CreateRun,
    EndRun,
    Record,
    ResumeRun,
    Table,
    Text,
)

UNSENT_FILE = "mlflow_unsent.jsonl"
RUN_FILE = "mlflow_run.json"
"""The job's run (train/tracking/run.py writes it; an upload that creates the run too)."""

log = logging.getLogger(__name__)


def free_path(output_dir: Path) -> Path:
    """Where a run's unsent file goes: mlflow_unsent.jsonl, or the first free
    mlflow_unsent.<n>.jsonl - an earlier start's file is never overwritten (it may be the only
    copy of that start's metrics)."""
    path, number = output_dir / UNSENT_FILE, 1
    while path.exists():
        number += 1
        path = output_dir / f"mlflow_unsent.{number}.jsonl"
    return path


def save(path: Path, header: dict[str, Any], rows: Batch, records: list[Record]) -> list[str]:
    """Write the unsent file; returns the kinds of the records that could not be kept."""
    lost = [r.KIND for r in records if r.KIND not in SAVABLE]
    # Private whatever the umask: the upload refuses a file others could have written to.
    with open(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as f:
        f.write(json.dumps(header) + "\n")
        for record in records:
            if record.KIND in SAVABLE:
                f.write(json.dumps({"record": record.KIND, **asdict(record)}) + "\n")
        for m in rows.metrics:
            f.write(json.dumps({"metric": list(m)}) + "\n")
        for p in rows.params:
            f.write(json.dumps({"param": list(p)}) + "\n")
        for t in rows.tags:
            f.write(json.dumps({"tag": list(t)}) + "\n")
    return lost


def load(path: Path) -> tuple[dict[str, Any], Batch, list[Record]]:
    """The header, the rows and the records of an unsent file; ValueError, naming the line, for
    anything that is not a row or a record this version writes."""
    lines = path.read_text().splitlines()
    if not lines:
        raise ValueError(f"{path} is empty: not an unsent file")
    try:
        header = json.loads(lines[0])
    except ValueError:
        header = None
    if not (isinstance(header, dict) and {"run_id", "tracking_uri", "status"} <= set(header)
            and isinstance(header["tracking_uri"], str) and isinstance(header["status"], str)
            and isinstance(header["run_id"], str | None)):
        raise ValueError(f"{path}:1: not the header of an unsent file: {lines[0][:200]!r}")
    rows, records = Batch(), []
    for number, line in enumerate(lines[1:], start=2):
        try:
            _read_line(json.loads(line), rows, records)
        except (ValueError, TypeError, IndexError, KeyError) as e:
            raise ValueError(f"{path}:{number}: {e}: {line[:200]}") from None
    return header, rows, records


def _read_line(item: Any, rows: Batch, records: list[Record]) -> None:
    if not isinstance(item, dict):
        raise ValueError("not a JSON object")
    if "record" in item:
        records.append(_record(item))
    elif set(item) == {"metric"}:
        key, value, stamp, step = item["metric"]
        rows.metrics.append((_text(key), float(value), int(stamp), int(step)))
    elif set(item) == {"param"}:
        key, value = item["param"]
        rows.params.append((_text(key), _text(value)))
    elif set(item) == {"tag"}:
        key, value = item["tag"]
        rows.tags.append((_text(key), _text(value)))
    else:
        raise ValueError("neither a record nor a metric, param or tag row")


def _record(item: dict[str, Any]) -> Record:
    """The record a line describes, built field by field after checking each one's type."""
    data = dict(item)
    kind = data.pop("record")
    cls = SAVABLE.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise ValueError(f"unknown record kind {kind!r} (known: {', '.join(SAVABLE)})")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in fields(cls)}
    if unknown := set(data) - names:
        raise ValueError(f"{kind} record with unknown fields {sorted(unknown)}")
    for name, value in data.items():
        if not _matches(value, hints[name]):
            expected = getattr(hints[name], "__name__", hints[name])  # str, not <class 'str'>
            raise ValueError(f"{kind} record: {name}={value!r} is not {expected}")
    return cls(**data)  # TypeError (missing fields) is reported with the line


def _matches(value: Any, hint: Any) -> bool:
    """Whether JSON `value` fits a record field's type (str, int, str | None, list[int], ...)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return any(_matches(value, arg) for arg in args)
    if hint is type(None):
        return value is None
    if origin is list:
        return isinstance(value, list) and all(_matches(v, args[0]) for v in value)
    if origin is dict:
        return isinstance(value, dict) and all(
            _matches(k, args[0]) and _matches(v, args[1]) for k, v in value.items())
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, hint)


def _text(value: Any) -> str:
    if not isinstance(value, str):
        raise ValueError(f"{value!r} is not text")
    return value


class UnsafeFile(ValueError):
    """An unsent file that asks for something its job could not have written."""


def check_safe(path: Path, header: dict[str, Any], records: list[Record],
               tracking_uri: str | None) -> None:
    """Refuse a file that is not plainly its job's own before any request: owned by someone
    else or writable by others; artifact files outside the job's output directory (the file's
    own directory) or artifact names that climb out of the run's artifacts; a run to resume
    other than its header's; a store other than mlflow_run.json's unless `tracking_uri` says
    where the run lives now."""
    info = path.stat()
    if info.st_uid != os.getuid() or info.st_mode & 0o022:
        raise UnsafeFile(f"{path} is not yours alone (owner uid {info.st_uid}, mode "
                         f"{stat.filemode(info.st_mode)}): refusing to act on it.")
    job_dir = path.resolve().parent
    for record in records:
        if isinstance(record, ArtifactFile):
            _inside(Path(record.path), job_dir)
            _artifact_name(record.artifact_path)
        elif isinstance(record, Text | Table):
            _artifact_name(record.artifact_file)
        elif isinstance(record, ResumeRun) and record.run_id != header["run_id"]:
            raise UnsafeFile(f"{path}: resumes run {record.run_id}, but the file is run "
                             f"{header['run_id']}'s.")
    recorded = _recorded(job_dir)
    if tracking_uri is None and recorded.get("tracking_uri") not in (None,
                                                                     header["tracking_uri"]):
        raise UnsafeFile(f"{path} names the store {header['tracking_uri']}, but this job logged "
                         f"to {recorded['tracking_uri']} ({job_dir / RUN_FILE}); give "
                         "--tracking-uri to say where its run lives.")
    if header["run_id"] and recorded.get("run_id") not in (None, header["run_id"]):
        raise UnsafeFile(f"{path} is for run {header['run_id']}, but this job's run is "
                         f"{recorded['run_id']} ({job_dir / RUN_FILE}).")


def _inside(file: Path, job_dir: Path) -> None:
    resolved = file.resolve()
    if not resolved.is_relative_to(job_dir) or not resolved.is_file():
        raise UnsafeFile(f"artifact {file} is not a file inside the job's output directory "
                         f"{job_dir}: refusing to upload it.")


def _artifact_name(name: str | None) -> None:
    if name is not None and (name.startswith("/") or ".." in Path(name).parts or not name):
        raise UnsafeFile(f"artifact name {name!r} must be a plain relative path.")


def _recorded(job_dir: Path) -> dict[str, Any]:
    try:
        recorded = json.loads((job_dir / RUN_FILE).read_text())
    except (OSError, ValueError):
        return {}
    return recorded if isinstance(recorded, dict) else {}


def upload(path: Path, tracking_uri: str | None = None) -> str:
    """Deliver an unsent file: the run (created now if it never was), the rows the run does not
    hold yet - so a second upload changes nothing -, the artifacts, and the final status.
    Returns the run's id; the file is renamed to .uploaded.

    The run lives where the job logged it (the file's first line) unless `tracking_uri` says the
    store has moved; MLFLOW_TRACKING_URI is not consulted, as it may name another store by now.
    """
    header, rows, records = load(path)
    check_safe(path, header, records, tracking_uri)
    uri = tracking_uri or header["tracking_uri"]
    run = client.RunClient(uri, header["run_id"])
    begin = [r for r in records if isinstance(r, (CreateRun, ResumeRun))]
    end = [r for r in records if isinstance(r, EndRun)]
    for record in begin:
        run.apply(record)
    held = run.held_steps({m[0] for m in rows.metrics})
    unheld = Batch([m for m in rows.metrics if m[3] not in held[m[0]]], rows.params, rows.tags)
    for chunk in unheld.chunks():
        run.send_rows(chunk)
    middle = [r for r in records if not isinstance(r, (CreateRun, ResumeRun, EndRun))]
    for record in middle + end:
        run.apply(record)
    if not end:  # the end request itself had gone through
        run.apply(EndRun(header["status"]))
    # The job's directory now names its run (created just now, perhaps): running the job again
    # continues this run instead of starting another.
    (path.parent / RUN_FILE).write_text(json.dumps(
        {"run_id": run.run_id, "experiment_id": run.experiment_id, "tracking_uri": uri}))
    path.rename(path.with_suffix(".uploaded"))
    return str(run.run_id)


def deliver_leftovers(output_dir: Path, run_id: str, uri: str) -> None:
    """An earlier start of this job left an unsent file for this run (it was stopped while the
    store was away): deliver it before the run continues, so that nothing waits for someone to
    remember the upload. One that cannot be delivered stays for the user."""
    for path in sorted(output_dir.glob("mlflow_unsent*.jsonl")):
        try:
            header = load(path)[0]
            if header["run_id"] != run_id or header["tracking_uri"] != uri:
                continue
            upload(path)
            log.info("delivered %s, left by an earlier start of this job", path)
        except Exception as e:  # noqa: BLE001 - the file stays; the run goes on
            log.warning("could not deliver %s (%s); it stays for `python -m train outbox "
                        "upload %s`", path, errors.describe(e), path)


def save_rest(output_dir: Path, header: dict[str, Any], rows: Batch, waiting: list[Record],
              logged_until: dict[str, int] | None, why: str) -> Path:
    """What MLflow did not take when a run ended, kept in a new unsent file (never over an
    earlier one), and the one error line saying where it is and how to deliver it.
    `logged_until`: the last step of each metric the run already holds (a resumed run), not
    kept twice."""
    if logged_until is not None:
        rows.metrics = [m for m in rows.metrics if m[3] > logged_until.get(m[0], -1)]
    path = free_path(output_dir)
    lost = save(path, header, rows, waiting)
    log.error("MLflow did not take this run's last updates (%s): %d metric values, %d params, "
              "%d tags and %d other requests are in %s%s. Deliver them (and end the run %s) "
              "once the store is fixed:\n  python -m train outbox upload %s",
              why, len(rows.metrics), len(rows.params), len(rows.tags),
              len(waiting) - len(lost), path,
              f" (not kept: {', '.join(lost)})" if lost else "", header["status"], path)
    return path
