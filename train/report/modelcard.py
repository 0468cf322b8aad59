"""What a logged model says about itself: the inputs it expects and how to make them from an
image (scale, normalisation, resizing), the class scores it returns and the classes' names.

Written into the logged model's metadata (MLmodel) and, for a registered model, into the
version's tags and description (train/tracking/registry.py), so that whoever loads the model
with `mlflow.pytorch.load_model("models:/<name>/<version>")` can feed it what training fed it.
Plain data only (JSON): no torch import here, no mlflow.
"""

from __future__ import annotations

from typing import Any

from train.config.groups import DataConfig

RESIZE_RATIO = 0.875
"""train/data/streaming.py's default evaluation resize: the short side to image_size / 0.875."""


def _values(tensor: Any) -> list[float] | None:
    """A per-channel (1, C, 1, 1) tensor as a plain list, rounded for people to read."""
    return None if tensor is None else [round(float(v), 6) for v in tensor.flatten().tolist()]


def _steps(cfg: DataConfig, image_size: int) -> str:
    """The evaluation resizing of an image folder, as text."""
    if cfg.eval_transforms is None:
        return (f"Resize(short side {round(image_size / RESIZE_RATIO)}) + "
                f"CenterCrop({image_size})")
    return " + ".join(str(dict(step).get("_target_", step)).rsplit(".", 1)[-1] + "("
                      + ", ".join(f"{k}={v}" for k, v in dict(step).items() if k != "_target_")
                      + ")" for step in cfg.eval_transforms)


def describe(val: Any, cfg: DataConfig, input_shape: tuple[int, ...],
             class_names: list[str], output: dict[str, Any] | None = None) -> dict[str, Any]:
    """The model card of a job: `val` is its validation Batches (train/data/batches.py), whose
    scale, mean and std are exactly what training applied to every batch on the device;
    `output`: what the model returns, as the task says (default: a classifier's scores)."""
    shape = [int(d) for d in input_shape]
    scale = getattr(val, "scale", None)
    if scale is None:  # data=custom: the user's Dataset gives the model its inputs as they are
        steps = {"pixels": f"as {cfg.train.get('_target_') if cfg.train else 'the Dataset'} "
                           "returns them: no scaling or normalisation by the training job"}
    else:
        steps = {"pixels": f"raw values / {float(scale):g} (to [0, 1]), then (x - mean) / std "
                           "per channel",
                 "scale": float(scale), "mean": _values(val.mean), "std": _values(val.std)}
        if cfg.name == "imagefolder":
            steps["resize"] = _steps(cfg, shape[-1])
    return {
        "input": {"dtype": "float32", "layout": "NCHW" if len(shape) == 3 else "N + sample",
                  "shape": [-1, *shape], "image_size": shape[-1]},
        "preprocessing": steps,
        "output": output or {"dtype": "float32", "shape": [-1, len(class_names)],
                             "meaning": "one score (logit) per class; argmax = index into "
                                        "class_names"},
        "class_names": list(class_names),
        "data": cfg.name,
    }
