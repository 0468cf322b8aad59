"""Whether torch.export can trace a model as a registered model is logged (a CPU copy in eval
mode, a dynamic batch dimension; train/tracking/registry.py), asked twice:

- at pre-flight (`check_registrable`), where the data's input shape is known without reading
  the data: the model is built on the meta device (no memory, no initialisation, seconds even
  for a ViT) and exported there, so a model that cannot be registered is refused before hours
  of training rather than found untraceable at the job's end;
- at the job's end (`exportable`), on the trained model and a real batch: a custom Dataset's
  inputs reach the model as it returns them (any dtype: token ids, say), so they are tried
  there, and so is a job no pre-flight saw (torchrun, srun); the run still ends FINISHED, its
  model logged pickled and unregistered.

No MLflow and nothing of this project but its ConfigError: the pre-flight must not import
MLflow for this, and the tracking package, which asks at the job's end, stays apart from the
models.
"""

from __future__ import annotations

import contextlib
import io
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch.export import Dim

from train.errors import ConfigError
from train.models.copies import copy_on


def _export(model: torch.nn.Module, example: torch.Tensor) -> None:
    # A failing export prints the partial graph to stderr: pages, where one line is due.
    with contextlib.redirect_stderr(io.StringIO()):
        torch.export.export(model, (example,), dynamic_shapes=({0: Dim.AUTO},))


def exportable(model: Any, example: np.ndarray) -> tuple[Any, np.ndarray | None, str | None]:
    """(CPU copy in eval mode, an example of batch > 1, None) if torch.export traces the model
    as MLflow will export it (dynamic batch); else (None, None, why not)."""
    if example.shape[0] < 2:  # a batch of 1 would fix the exported batch size at 1
        example = np.concatenate([example, example])
    try:
        inference = copy_on(model, "cpu").eval()
        _export(inference, torch.from_numpy(example))
    except Exception as e:  # noqa: BLE001 - the user's model: any failure means "not this way"
        return None, None, one_line(e)
    return inference, example, None


def one_line(error: BaseException) -> str:
    """torch.export's message without its debugging advice: what failed, and where."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    kept = lines[:1] + [line for line in lines[1:] if line.startswith("Caused by")]
    return f"{type(error).__name__}: {' '.join(kept)}"[:400]


def check_registrable(build: Callable[[], torch.nn.Module], input_shape: tuple[int, ...],
                      model: str, name: str) -> None:
    """Raises ConfigError when torch.export cannot trace the model `build` makes (`model`: as
    the user chose it) for `name`'s versions. Tried on the meta device first; a model that
    fails there is tried for real on the CPU (the user's code may do what the meta device
    cannot, e.g. read a tensor it made itself)."""
    problem = None
    for device in ("meta", "cpu"):
        try:
            with torch.device(device):
                built = build().eval()
                example = torch.zeros((2, *input_shape))
            _export(built, example)
            return
        except Exception as e:  # noqa: BLE001 - the user's model: any failure is the answer
            problem = one_line(e)  # the CPU's, where both fail: the meta device's may be its own
    raise ConfigError(
        f"tracking.register_model={name!r}: torch.export cannot trace {model} ({problem}), so "
        "no version could be registered; make its forward traceable (no Python decisions on "
        "tensor values) or drop tracking.register_model.")
