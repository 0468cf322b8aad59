"""A run's trained model, loaded without running code from the run's files.

    from train.load import load_model
    model = load_model("<run_id>")            # MLFLOW_TRACKING_URI (and login) as for jobs
    scores = model(images)                    # (batch, num_classes)
    logits = model(token_ids)                 # data=tokens: (batch, seq_len, vocab_size)

The architecture is rebuilt from the run's config.yaml (read with yaml.safe_load: plain data)
with this project's code (and, for model=custom, your own package's), and the weights are a
state dict read with `torch.load(weights_only=True)`, which refuses any pickled object but
tensors. `mlflow.pytorch.load_model("runs:/<id>/model")` instead unpickles the logged model:
whoever can replace that artifact runs code as the user who loads it (docs/security.md).
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import torch
import yaml
from torch import nn

from train.config.schema import to_typed
from train.models import build as models


def load_model(run_id: str, tracking_uri: str | None = None) -> nn.Module:
    """The model of run `run_id`, in eval mode on the CPU."""
    from train.tracking import embedded_uri
    from train.tracking.files import run_files

    uri = tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or embedded_uri()
    with tempfile.TemporaryDirectory() as tmp:
        config_path, weights_path, params = run_files(uri, run_id, Path(tmp))
        config = to_typed(yaml.safe_load(config_path.read_text()))
        state = torch.load(weights_path, map_location="cpu", weights_only=True)
    shape = tuple(int(n) for n in params["data.input_shape"].split("x"))
    outputs = int(params.get("model.outputs") or params["data.classes"])  # before tasks: classes
    vocab = outputs if config.data.name == "tokens" else None  # a language model's vocabulary
    model = models.build(config.model, models.InputSpec.of(shape, outputs, vocab_size=vocab))
    model.load_state_dict(state)
    return model.eval()
