"""Config composition, typing and validation, in process through Hydra's compose API. The real
CLI: tests/e2e/test_config.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf
from omegaconf.errors import ValidationError

from tests.conftest import REPO, composed
from train.config.cluster import ClusterConfig, ranks_per_node
from train.config.groups import (
    ConfigError,
    DataConfig,
    DistributedConfig,
    ModelConfig,
    OptimConfig,
    TrackingConfig,
    TrainerConfig,
    handed_overrides,
    typed_by_user,
)
from train.config.schema import to_container, to_typed
from train.config.task import TaskConfig
from train.launch.preflight import validate

GROUPS = ("model", "data", "optim", "trainer", "distributed", "tracking", "task")


def test_defaults_compose_every_group_and_no_cluster() -> None:
    cfg = composed()
    for group in GROUPS:
        assert group in cfg
    assert cfg.cluster is None
    typed = to_typed(to_container(cfg))
    assert (typed.model.name, typed.data.name, typed.optim.name) == ("cnn", "digits", "sgd")
    assert typed.distributed.nproc_per_node == 1
    validate(typed, world_size=1)


def test_group_options_and_values_override() -> None:
    cfg = composed("model=resnet18", "optim=adamw", "optim.lr=0.003", "data=synthetic",
                   "data.num_samples=100", "trainer.precision=bf16-mixed")
    typed = to_typed(to_container(cfg))
    assert typed.model.name == "resnet18"
    assert typed.optim.name == "adamw" and typed.optim.lr == pytest.approx(0.003)
    assert typed.data.num_samples == 100
    assert typed.trainer.precision == "bf16-mixed"


def test_a_torchvision_model_is_picked_by_name() -> None:
    typed = to_typed(to_container(composed("model=torchvision", "model.name=efficientnet_b0")))
    assert (typed.model.source, typed.model.name) == ("torchvision", "efficientnet_b0")
    validate(typed, world_size=1)  # the builder itself is checked by the CLI's pre-flight


def test_wrong_type_is_refused_while_composing() -> None:
    with pytest.raises((ConfigCompositionException, ValidationError)):
        composed("data.batch_size=abc")


def test_misspelt_key_is_refused() -> None:
    with pytest.raises(ConfigCompositionException):
        composed("optim.lrr=0.1")


@pytest.mark.parametrize(("overrides", "world_size", "expected"), [
    (("model.name=vgg11",), 1,
     "choose one of ['cnn', 'mlp', 'resnet18', 'torchvision'] (for a torchvision.models builder: "
     "model=torchvision model.name=vgg11)"),
    (("data.name=imagenet",), 1, "choose one of ['digits', 'synthetic'"),
    (("optim.lr=0",), 1, "optim.lr must be positive"),
    (("trainer.epochs=-1",), 1, "trainer.epochs must be positive"),
    (("trainer.max_steps=0",), 1,
     "trainer.max_steps must be a positive number of optimiser steps, or null (got 0)"),
    (("data.batch_size=0",), 1, "data.batch_size must be positive"),
    (("trainer.straggler_intervals=-1",), 2,
     "trainer.straggler_intervals cannot be negative (0 turns the check off)"),
    (("data.batch_size=64",), 3, "must split evenly over the 3 ranks"),
    (("trainer.precision=fp8",), 1, "trainer.precision='fp8'"),
])
def test_validation_refuses_with_a_clear_message(overrides: tuple[str, ...], world_size: int,
                                                 expected: str) -> None:
    typed = to_typed(to_container(composed(*overrides)))
    with pytest.raises(ConfigError) as info:
        validate(typed, world_size)
    assert expected in str(info.value)


def test_validation_lists_every_problem_at_once() -> None:
    typed = to_typed(to_container(composed("optim.lr=-1", "trainer.epochs=0")))
    with pytest.raises(ConfigError) as info:
        validate(typed, 1)
    assert "optim.lr" in str(info.value) and "trainer.epochs" in str(info.value)


def test_tracking_uri_follows_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://tracking.example:5000")
    cfg = composed()
    assert OmegaConf.to_container(cfg.tracking, resolve=True)["uri"] == \
        "http://tracking.example:5000"
    monkeypatch.delenv("MLFLOW_TRACKING_URI")
    assert composed().tracking.uri is None


# -- one source of defaults: the dataclasses ---------------------------------------------------

SCHEMA = {"model": ModelConfig, "data": DataConfig, "optim": OptimConfig,
          "trainer": TrainerConfig, "distributed": DistributedConfig,
          "tracking": TrackingConfig, "task": TaskConfig, "cluster": ClusterConfig}
OPTION_FILES = sorted((REPO / "conf").glob("*/*.yaml"))
REQUIRED = {"model/custom": ("model._target_=torch.nn.Identity",),
            "data/custom": ("data.train._target_=torchvision.datasets.FakeData",),
            "task/custom": ("task._target_=train.tasks.regression.Regression",
                            "trainer.monitor=val/loss"),
            "data/tokens": ("data.root=/tokens", "task=language_model"),
            "task/language_model": ("data=tokens", "data.root=/tokens")}
"""What an option leaves for the command line (`???`)."""


def restated_defaults(path: Path) -> list[str]:
    """Keys a group option's YAML sets to the value its dataclass already has."""
    text = path.read_text()
    body = yaml.safe_load(text) or {}
    body.pop("defaults", None)
    groups = body if "@package _global_" in text else {path.parent.name: body}
    restated = []
    for group, values in groups.items():
        if group not in SCHEMA or not values or "_target_" in values:
            continue  # hydra.* (the launcher mapping, a sweeper); a model's own constructor keys
        defaults = OmegaConf.to_container(OmegaConf.structured(SCHEMA[group]))
        restated += [f"{group}.{key}={value!r}" for key, value in values.items()
                     if key in defaults and defaults[key] == value]
    return restated


@pytest.mark.parametrize("path", OPTION_FILES, ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_yaml_sets_only_what_differs_from_the_dataclass(path: Path) -> None:
    assert restated_defaults(path) == [], f"{path}: these equal train/config/groups.py's defaults"


@pytest.mark.parametrize("path", OPTION_FILES, ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_every_group_option_composes_complete_and_valid(path: Path) -> None:
    group, option = path.parent.name, path.stem
    prefix = "" if group in GROUPS else "+"  # cluster and hparams_search are added, not chosen
    cfg = composed(f"{prefix}{group}={option}", *REQUIRED.get(f"{group}/{option}", ()))
    typed = to_typed(to_container(cfg))
    for name, schema in SCHEMA.items():
        if name == "model" and "_target_" in cfg.model:
            continue  # model=custom: the user's own keys, no schema
        if name in cfg and cfg[name] is not None:  # every key of the dataclass is there
            assert set(cfg[name]) == set(OmegaConf.structured(schema)), name
    world = 1 if typed.cluster is None else ranks_per_node(typed.cluster) * typed.cluster.nodes
    validate(typed, world)


def test_cluster_keys_come_from_the_dataclass() -> None:
    cfg = composed("+cluster=slurm", "cluster.nodes=2")
    expected = OmegaConf.to_container(OmegaConf.structured(ClusterConfig))
    assert OmegaConf.to_container(cfg.cluster) == {**expected, "nodes": 2}


@pytest.mark.parametrize(("tasks", "gpus", "expected"), [
    (None, 0, 1), (None, 4, 4), (2, 0, 2), (3, 3, 3)])
def test_ranks_per_node(tasks: int | None, gpus: int, expected: int) -> None:
    cluster = ClusterConfig(tasks_per_node=tasks, gpus_per_node=gpus)
    assert ranks_per_node(cluster) == expected
    # The launcher's tasks_per_node is the same function, through the YAML's resolver.
    overrides = ["+cluster=slurm", f"cluster.gpus_per_node={gpus}"]
    if tasks is not None:
        overrides.append(f"cluster.tasks_per_node={tasks}")
    cfg = composed(*overrides, return_hydra_config=True)
    assert cfg.hydra.launcher.tasks_per_node == expected


def test_launcher_ids_are_quoted_overrides_left_out_of_the_command() -> None:
    handed = handed_overrides("123e45", "abc")
    assert handed == ["tracking.experiment_id='123e45'", "tracking.parent_run_id='abc'"]
    assert handed_overrides("1", None) == ["tracking.experiment_id='1'"]
    typed = to_typed(to_container(composed(*handed)))
    assert (typed.tracking.experiment_id, typed.tracking.parent_run_id) == ("123e45", "abc")
    assert typed_by_user(["optim.lr=0.1", *handed]) == ["optim.lr=0.1"]


def test_background_checkpoints_are_refused_without_fsdp() -> None:
    """distributed.fsdp.async_checkpoint writes sharded checkpoints: a DDP job has none."""
    ddp = to_typed(to_container(composed("distributed.fsdp.async_checkpoint=true")))
    with pytest.raises(ConfigError, match=r"distributed.fsdp.async_checkpoint=true needs "
                                          r"distributed.strategy=fsdp"):
        validate(ddp, world_size=2)
    validate(to_typed(to_container(composed("distributed.strategy=fsdp",
                                            "distributed.fsdp.async_checkpoint=true"))), 2)
