"""A run's logged model, and its versions in MLflow's Model Registry (mlflow and torch are
imported lazily).

`log_model` logs the job's final model as the run's artifact `model`, with its signature (input
tensor shape and dtype, class scores out), an input example, the model card as metadata
(train/report/modelcard.py: normalisation, layout, image size, class names) and pip requirements
(torch and torchvision pinned at the versions that trained it, nothing of this project).

A model that is to be registered is logged as a torch.export program ("pt2", MLflow 3's default
format), not pickled: a pickled module names its class (`train.models.build...` or the user's
package), so loading it needs that code importable, and unpickling runs whatever the file says.
The exported program holds the graph of aten operations and the weights: it loads with
`mlflow.pytorch.load_model("models:/<name>/<version>")` where neither this project nor the
user's model code is installed, and also with MLFLOW_ALLOW_PICKLE_DESERIALIZATION=false.
(`code_paths` would ship this package - or the user's - with the model and still unpickle it;
TorchScript is deprecated and fails on more models than torch.export.) The program is exported
from a CPU copy in eval mode, with a dynamic batch dimension (train/models/exportable.py, which
pre-flight asks too where the input shape is known). A model torch.export cannot trace
is logged pickled instead, as before, and is not registered (the reason in one line and a tag).
Runs that register nothing keep the pickled module: it loads as the model's own class, which
`.eval()`, `.train()` and fine-tuning need (an exported program refuses them).

`register` makes a new version of a registered model from a run's logged model; the version's
tags and description carry the model card. It never raises: a job's run is complete whether or
not its model could be registered, so the outcome comes back as tags for the run.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from importlib import metadata as dist_metadata
from typing import Any

from train.tracking.errors import describe, is_permanent
from train.tracking.records import Model

log = logging.getLogger(__name__)

ARTIFACT = "model"
TAG, ERROR_TAG = "registered_model", "registered_model_error"
"""The run's tags: `<name>/<version>` once registered; why not, if it failed."""
TRIES = 3
"""Registration requests tried this often on transient failures (then given up: the run ends)."""


def requirements(pickled: bool) -> list[str]:
    """torch (and torchvision, where installed) pinned without the local build tag (+cu130:
    pip finds that build only on PyTorch's own index); cloudpickle for a pickled module."""
    pins = []
    for dist in ("torch", "torchvision", *(("cloudpickle",) if pickled else ())):
        try:
            pins.append(f"{dist}=={dist_metadata.version(dist).split('+')[0]}")
        except dist_metadata.PackageNotFoundError:
            continue
    return pins


def _signature(example: Any, card: dict[str, Any] | None) -> Any:
    import numpy as np
    from mlflow.models import ModelSignature
    from mlflow.types import Schema, TensorSpec

    if card is None:
        return None
    inputs = TensorSpec(np.dtype(example.dtype), (-1, *example.shape[1:]))
    outputs = TensorSpec(np.dtype("float32"), tuple(card["output"]["shape"]))
    return ModelSignature(inputs=Schema([inputs]), outputs=Schema([outputs]))


@contextmanager
def _active_run(uri: str, run_id: str) -> Iterator[None]:
    """The fluent API wants a tracking URI and an active run; set_tracking_uri also sets
    MLFLOW_TRACKING_URI, which is put back so that nothing after this job sees it."""
    import mlflow

    before = os.environ.get("MLFLOW_TRACKING_URI")
    mlflow.set_tracking_uri(uri)
    mlflow.start_run(run_id=run_id)
    try:
        yield
    finally:
        mlflow.end_run()  # no active run left behind; EndRun sets the real status next
        if before is None:
            os.environ.pop("MLFLOW_TRACKING_URI", None)
        else:
            os.environ["MLFLOW_TRACKING_URI"] = before


def log_model(uri: str, run_id: str, record: Model) -> None:
    """The run's logged model: exported (pt2) when `record.export` and torch.export can, else
    the pickled module (its metadata then says why it was not exported)."""
    import mlflow.pytorch

    from train.models.copies import copy_on
    from train.models.exportable import exportable

    model, example, problem = record.model, record.input_example, None
    if record.export:
        inference, exported_example, problem = exportable(model, example)
        if problem is None:
            model, example = inference, exported_example
        else:
            log.error("torch.export cannot trace this model (%s): the run's model is logged "
                      "pickled and will not be registered", problem)
    fmt = "pt2" if record.export and problem is None else "pickle"
    if fmt == "pickle" and any(p.device.type != "cpu" for p in model.parameters()):
        model = copy_on(model, "cpu")  # a pickle of GPU tensors loads only where CUDA is
    meta: dict[str, Any] = {"serialization_format": fmt}
    if record.card is not None:
        meta["model_card"] = record.card
    if problem is not None:
        meta["export_error"] = problem
    # Its warnings about pickle (for models from strangers; this one is our own) and about
    # where torch.export's weights live say nothing to the user.
    logging.getLogger("mlflow.pytorch").setLevel(logging.ERROR)
    import warnings

    warnings.filterwarnings("ignore", message="No complete tensor found in the group")
    with _active_run(uri, run_id):
        mlflow.pytorch.log_model(
            model, name=ARTIFACT, serialization_format=fmt, input_example=example,
            signature=_signature(example, record.card), metadata=meta,
            # explicit: inferring requirements imports the model in a subprocess (slow)
            pip_requirements=requirements(pickled=fmt == "pickle"))


# -- the Model Registry ------------------------------------------------------------------------

def _logged_model(uri: str, mlflow_client: Any, run_id: str) -> tuple[str, dict[str, Any]]:
    """(model id, MLmodel metadata) of the run's newest logged model `model`."""
    import mlflow.artifacts
    from mlflow.models import Model as MlflowModel

    outputs = mlflow_client.get_run(run_id).outputs
    ids = [o.model_id for o in sorted(outputs.model_outputs if outputs else [],
                                      key=lambda o: o.step)]
    models = [m for m in map(mlflow_client.get_logged_model, ids) if m.name == ARTIFACT]
    if not models:
        raise LookupError(f"run {run_id} has no logged model '{ARTIFACT}' (tracking.log_model "
                          "was false, or logging it failed)")
    newest = max(models, key=lambda m: m.creation_timestamp)
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")  # no bar in logs
    with tempfile.TemporaryDirectory() as tmp:
        path = mlflow.artifacts.download_artifacts(
            artifact_uri=f"{newest.artifact_location.rstrip('/')}/MLmodel", dst_path=tmp,
            tracking_uri=uri)
        return newest.model_id, MlflowModel.load(path).metadata or {}


def version_tags(card: dict[str, Any]) -> dict[str, str]:
    """The model card as version tags: what a caller must feed the model, at a glance."""
    steps = card.get("preprocessing", {})
    tags = {"input.shape": json.dumps(card["input"]["shape"]),
            "input.dtype": card["input"]["dtype"], "input.layout": card["input"]["layout"],
            "input.image_size": str(card["input"]["image_size"]),
            "preprocessing": steps.get("pixels", ""), "class_names": json.dumps(
                card["class_names"])[:5000], "data": card.get("data", "")}
    tags.update({f"preprocessing.{k}": json.dumps(steps[k]) if not isinstance(steps[k], str)
                 else steps[k] for k in ("scale", "mean", "std", "resize") if k in steps})
    return tags


def description(card: dict[str, Any], run_id: str) -> str:
    steps = card.get("preprocessing", {})
    lines = [f"Trained by run {run_id} on data={card.get('data')}.",
             f"Input: {card['input']['dtype']} {card['input']['layout']} tensor of shape "
             f"{card['input']['shape']} (-1: any batch size).",
             f"Preprocessing: {steps.get('pixels', '')}."]
    if "mean" in steps:
        lines.append(f"mean {steps['mean']}, std {steps['std']}.")
    if "resize" in steps:
        lines.append(f"Images resized: {steps['resize']}.")
    lines.append(f"Output: {card['output']['meaning']}; class_names = "
                 f"{json.dumps(card['class_names'])[:2000]}.")
    lines.append("Load: mlflow.pytorch.load_model('models:/<name>/<version>') - a torch.export "
                 "program (no Python class needed); it is in inference mode already.")
    return "\n".join(lines)


def _new_version(uri: str, mlflow_client: Any, run_id: str, name: str) -> str:
    from mlflow.exceptions import MlflowException

    model_id, meta = _logged_model(uri, mlflow_client, run_id)
    if meta.get("serialization_format") != "pt2":
        raise ValueError(f"run {run_id}'s logged model is pickled, not a torch.export program "
                         f"({meta.get('export_error') or 'tracking.register_model was unset'}); "
                         "it would need the model's code to load")
    try:
        mlflow_client.create_registered_model(name)
    except MlflowException as e:  # it exists (made by an earlier job, or one at this moment)
        if e.error_code not in ("RESOURCE_ALREADY_EXISTS", "ALREADY_EXISTS"):
            raise
    card = meta.get("model_card") or {}
    version = mlflow_client.create_model_version(
        name, source=f"models:/{model_id}", run_id=run_id, model_id=model_id,
        tags={**(version_tags(card) if card else {}), "serialization_format": "pt2"},
        description=description(card, run_id) if card else None, await_creation_for=60)
    return str(version.version)


def register(uri: str, mlflow_client: Any, run_id: str, name: str) -> dict[str, str]:
    """A new version of registered model `name` from run `run_id`'s logged model; returns the
    run's tags that say how it went (TAG or ERROR_TAG). Never raises; transient failures are
    tried TRIES times."""
    for attempt in range(1, TRIES + 1):
        try:
            version = _new_version(uri, mlflow_client, run_id, name)
        except Exception as e:  # noqa: BLE001 - reported as a tag; the run is complete anyway
            why = describe(e)
            if attempt < TRIES and not is_permanent(e) and not isinstance(e, LookupError):
                time.sleep(attempt)
                continue
            log.error("Model registry: the model of run %s was NOT registered as %r: %s", run_id,
                      name, why)
            return {ERROR_TAG: why}
        log.info("Model registry: registered the model of run %s as %r version %s; load it with "
                 "mlflow.pytorch.load_model('models:/%s/%s')", run_id, name, version, name, version)
        return {TAG: f"{name}/{version}"}
    raise AssertionError("unreachable")
