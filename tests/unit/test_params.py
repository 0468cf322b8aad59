"""The run's params: only what applies to the options chosen, the values the job resolved (input
shape, the normalisation applied), a name for a model of the user's own, no test-only knobs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import composed, new_store, runs_in, typed
from train.app import run
from train.config.naming import default_run_name
from train.config.schema import to_container
from train.report.params import applicable

FAST = ("data.batch_size=32", "trainer.epochs=1", "data.num_workers=0", "tracking.log_model=false",
        "tracking.batch_interval_s=0")


def test_a_digits_run_with_a_custom_model_logs_what_shaped_it(
        tmp_path: Path, store_template: Path, no_launcher_env: None, user_path: None) -> None:
    uri = new_store(tmp_path / "mlflow.db", store_template)
    cfg = composed(*FAST, "model=custom", "model._target_=userpkg.models.TinyConvNet",
                   "+model.depth=1", f"tracking.uri={uri}")
    run(cfg, str(tmp_path / "job"), "python -m train (test)")
    [mlflow_run] = runs_in(uri)
    assert mlflow_run.info.run_name == "TinyConvNet-digits"  # no tracking.run_name given
    params = mlflow_run.data.params
    assert params["model.name"] == "TinyConvNet" and params["model.depth"] == "1"
    assert params["data.name"] == "digits" and params["data.input_shape"] == "1x8x8"
    # Neither the synthetic set's keys nor an image folder's ImageNet statistics: the
    # normalisation digits got, one channel, as the model card says.
    for key in ("data.num_samples", "data.channels", "data.image_size", "data.num_classes",
                "data.train_transforms", "data.train", "data.download", "data.root"):
        assert key not in params, key
    assert params["data.mean"] != "[0.485, 0.456, 0.406]"
    assert len(json.loads(params["data.mean"])) == len(json.loads(params["data.std"])) == 1
    assert not [k for k in params if k.startswith("task.") and k != "task.name"]
    assert not [k for k in params if "fail" in k or k.startswith("cluster")]


@pytest.mark.parametrize(("overrides", "present", "absent"), [
    (("data=synthetic",), ["data.num_samples", "data.channels", "data.image_size"],
     ["data.root", "data.mean"]),
    (("optim=adamw",), ["optim.betas"], ["optim.momentum", "optim.nesterov"]),
    (("optim.scheduler._target_=torch.optim.lr_scheduler.StepLR",),
     ["optim.scheduler._target_", "optim.scheduler_interval"], ["optim.schedule",
                                                                "optim.warmup_epochs"]),
    ((), ["optim.schedule", "optim.momentum", "model.width"],
     ["optim.scheduler._target_", "model.depth", "optim.betas"]),
    (("task=segmentation",), ["task.ignore_index", "task.samples_shown"], ["task._target_"]),
])
def test_only_the_keys_the_chosen_options_read(overrides: tuple[str, ...], present: list[str],
                                               absent: list[str]) -> None:
    from train.report.runlog import flatten

    params = flatten(applicable(to_container(composed(*overrides))))
    for key in present:
        assert key in params, key
    for key in absent:
        assert key not in params, key


@pytest.mark.parametrize(("overrides", "output_dir", "name"), [
    ((), "outputs/2026-11-25/20-06-19", "cnn-digits"),
    (("model=resnet18", "data=cifar10"), None, "resnet18-cifar10"),
    (("task=regression", "data=synthetic"), None, "cnn-synthetic-regression"),
    (("data=custom", "data.train._target_=userpkg.data.Lines"), None, "cnn-Lines"),
    (("tracking.parent_run_id=abc",), "multirun/2026-11-25/20-06-19/3", "cnn-digits-3"),
    (("tracking.run_name=mine",), None, "mine"),
])
def test_a_run_is_named_after_what_it_trains(overrides: tuple[str, ...], output_dir: str | None,
                                             name: str) -> None:
    cfg = typed(*overrides)
    assert (cfg.tracking.run_name or default_run_name(cfg, output_dir)) == name
