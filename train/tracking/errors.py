"""Tracking errors sorted into those a retry can fix and those it cannot (no mlflow import at
module level: `is_permanent` imports it only to recognise MLflow's exceptions)."""

from __future__ import annotations

from train.errors import TrainError


class TrackingError(TrainError, RuntimeError):
    """The tracking store cannot be used; the message says why and what to do."""


PERMANENT_CODES = frozenset({
    "INVALID_PARAMETER_VALUE", "ENDPOINT_NOT_FOUND", "RESOURCE_DOES_NOT_EXIST", "NOT_FOUND",
    "PERMISSION_DENIED", "UNAUTHENTICATED", "CUSTOMER_UNAUTHORIZED", "BAD_REQUEST",
    "MALFORMED_REQUEST", "INVALID_STATE", "FEATURE_DISABLED", "RESOURCE_ALREADY_EXISTS",
    "ALREADY_EXISTS", "NOT_IMPLEMENTED", "RESOURCE_LIMIT_EXCEEDED", "MAX_LIST_SIZE_EXCEEDED"})
"""MLflow error codes that the same request will always get again."""
PERMANENT_DB_TEXT = ("readonly database", "no such table", "unable to open database file",
                     "disk i/o error", "no space left on device")
"""An SQLite store that can no longer be written (made read-only, removed, full): retrying
the same request does not help."""
RACED_INSERT_TEXT = ("unique constraint failed: datasets.", 'unique constraint "dataset_pk"')
"""Runs of one experiment logging the same data set at once: MLflow's server looks the data set
up, finds none, and each inserts it; every insert but the first fails (SQLite: "UNIQUE
constraint failed: datasets...", PostgreSQL: 'duplicate key ... "dataset_pk"'), as a 400
BAD_REQUEST. Sent again, the request finds the stored data set and succeeds. Measured with 8
runs at once: 1 round in 10 on SQLite, 5 in 10 on PostgreSQL."""


def is_permanent(error: BaseException) -> bool:
    """Whether a failed tracking request can never succeed as it is: a 4xx other than 408/429,
    an invalid name or value, a missing database driver, a store that cannot be written, a
    missing local file. Transient (retried): refused or reset connections, timeouts, 5xx, 429,
    a locked SQLite database, a data set another run stored at the same moment."""
    from mlflow.exceptions import MlflowException

    text = str(error).lower()
    if any(part in text for part in RACED_INSERT_TEXT):
        return False
    if isinstance(error, ImportError | FileNotFoundError | PermissionError | IsADirectoryError):
        return True
    if any(part in text for part in PERMANENT_DB_TEXT):
        return True
    if isinstance(error, MlflowException):
        status = error.get_http_status_code()
        return error.error_code in PERMANENT_CODES or (
            400 <= status < 500 and status not in (408, 429))
    # A request this code built wrongly will not be built better next time; OSError,
    # ConnectionError, TimeoutError, SQLAlchemy's OperationalError ("locked") are transient.
    return isinstance(error, TypeError | ValueError | KeyError | AttributeError)


def describe(error: BaseException) -> str:
    """One line: the error's type and its message, shortened."""
    # SQLAlchemy's errors start with a hint about autoflush and end with the SQL: neither
    # says what went wrong.
    lines = [line.strip() for line in str(error).splitlines()
             if line.strip() and not line.strip().startswith("(raised as a result of")]
    text = " ".join(lines).split(" [SQL:")[0]
    return f"{type(error).__name__}: {text}"[:300]


def stuck(what: str, since: float, thread_id: int | None) -> str:
    """For a warning: "waiting N s on MLflow for <what>, at <file:line function>", the innermost
    frame of the thread making the request (e.g. a database write, a socket read)."""
    import sys
    import time
    import traceback

    frame = sys._current_frames().get(thread_id) if thread_id is not None else None
    last = traceback.extract_stack(frame)[-1] if frame is not None else None
    at = f", at {last.filename.split('site-packages/')[-1]}:{last.lineno} {last.name}" \
        if last else ""
    return f"; waiting {time.monotonic() - since:.0f} s on MLflow for {what}{at}"
