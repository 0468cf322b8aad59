"""What a run sends to MLflow, as plain data: typed records, and the rows waiting to be batched.

Metric, param and tag rows wait in `Rows` until the sender thread takes them, as many as one
MLflow request may carry, so that everything logged within `tracking.batch_interval_s` travels
in one request. Everything else is a record, sent in the order it was made: the ones callers
log (`ArtifactFile`, `Text`, `Table`, `DatasetInput`, `Model`, `RegisterModel`) and the run's own
(`CreateRun`, `ResumeRun`, `EndRun`). Every record but `Model` holds JSON data only, so it can
wait in the unsent file (train/tracking/unsent.py) when the store is gone; `RegisterModel` is not
kept there either (it registers the `Model`, which cannot wait). No mlflow or torch import here.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, ClassVar

# MLflow's limits for one log_batch request.
MAX_METRICS, MAX_PARAMS, MAX_TAGS = 1000, 100, 100

Metric = tuple[str, float, int, int]
"""key, value, timestamp (ms), step"""


# -- records callers log -----------------------------------------------------------------------

@dataclass
class ArtifactFile:
    """A file copied into the run's artifacts (under `artifact_path`, if given)."""

    KIND: ClassVar[str] = "file"
    path: str
    artifact_path: str | None = None


@dataclass
class Text:
    KIND: ClassVar[str] = "text"
    text: str
    artifact_file: str


@dataclass
class Table:
    """Columns of equal length, shown as a table in the MLflow UI."""

    KIND: ClassVar[str] = "table"
    table: dict[str, list]
    artifact_file: str


@dataclass
class DatasetInput:
    """The run's training data: what MLflow shows as its input (the data wing's
    `DataDescription` under a name)."""

    KIND: ClassVar[str] = "dataset"
    name: str
    digest: str
    num_rows: int
    features_shape: list[int]
    features_dtype: str
    context: str = "training"


@dataclass
class Model:
    """The model as an MLflow model; a Python object, so it cannot wait in the unsent file."""

    KIND: ClassVar[str] = "model"
    model: Any
    input_example: Any
    card: dict[str, Any] | None = None
    """train/report/modelcard.py's description: the logged model's metadata and signature."""
    export: bool = False
    """Logged as a torch.export program (loads without the model's Python code), as a model to
    be registered must be; else the pickled module."""


@dataclass
class RegisterModel:
    """The run's logged model as a new version of registered model `name` (after `Model`)."""

    KIND: ClassVar[str] = "register"
    name: str
    outcome: dict[str, str] | None = None
    """The run's tags saying how it went, once tried: a retry (the tags' request failed) sends
    them again without registering a second version."""


# -- the run's own records ---------------------------------------------------------------------

@dataclass
class CreateRun:
    KIND: ClassVar[str] = "create"
    experiment_id: str | None  # None: a local job, rank 0 finds or creates `experiment`
    experiment: str
    run_name: str | None
    tags: dict[str, str]


@dataclass
class ResumeRun:
    """Continue an existing run (a restarted job): RUNNING again, steps it holds not repeated."""

    KIND: ClassVar[str] = "resume"
    run_id: str


@dataclass
class EndRun:
    KIND: ClassVar[str] = "end"
    status: str
    error: str | None = None  # recorded as the `error` tag


Loggable = ArtifactFile | Text | Table | DatasetInput | Model | RegisterModel
"""What a caller may pass to a run's log()."""
Record = Loggable | CreateRun | ResumeRun | EndRun
SAVABLE: dict[str, type[Any]] = {cls.KIND: cls for cls in (
    CreateRun, ResumeRun, ArtifactFile, Text, Table, DatasetInput, EndRun)}
"""The records an unsent file may hold, by the name it writes them under."""


# -- rows --------------------------------------------------------------------------------------

@dataclass
class Batch:
    metrics: list[Metric] = field(default_factory=list)
    params: list[tuple[str, str]] = field(default_factory=list)
    tags: list[tuple[str, str]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.metrics or self.params or self.tags)

    def __len__(self) -> int:
        return len(self.metrics) + len(self.params) + len(self.tags)

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
    peeks, sends and only then drops, so a failed request loses nothing. `added` and `taken`
    count rows ever added and dropped: a flush waits until `taken` reaches its `added`."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pending = Batch()
        self.added = 0
        self.taken = 0

    def add(self, metrics: list[Metric] | None = None, params: list[tuple[str, str]] | None = None,
            tags: list[tuple[str, str]] | None = None) -> None:
        with self._lock:
            self._pending.metrics.extend(metrics or [])
            self._pending.params.extend(params or [])
            self._pending.tags.extend(tags or [])
            self.added += len(metrics or []) + len(params or []) + len(tags or [])

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
            self.taken += len(sent)

    def everything(self) -> Batch:
        with self._lock:
            return Batch(list(self._pending.metrics), list(self._pending.params),
                         list(self._pending.tags))

    def __bool__(self) -> bool:
        with self._lock:
            return bool(self._pending)
