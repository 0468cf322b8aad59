"""From composed config to typed config: the dataclasses of train/config/groups.py registered as
Hydra's
schema, and the composed config turned into TrainConfig objects (a `???` left unset, or a key
no model takes, is one clear ConfigError).

`conf/train.yaml` lists `train_schema` first in its defaults. The model group is left untyped
there: a built-in model option brings ModelConfig through its own defaults list, while
model=custom is a plain dict of the user's constructor arguments.
"""

from __future__ import annotations

import functools
from dataclasses import fields
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import MissingMandatoryValue

from train.config.cluster import (
    ranks_per_node,
    slurm_cpus_per_task,
    slurm_sbatch_extra,
    slurm_srun_args,
    slurm_tasks_per_node,
)
from train.config.groups import CustomModelConfig, ModelConfig, TrainConfig
from train.errors import ConfigError


def register_schema() -> None:
    """The schema and the resolvers the YAML files use (idempotent)."""
    store = ConfigStore.instance()
    store.store(name="train_schema", node=_schema())
    # Not in the model group, so that `--help` does not offer it as a model: each built-in
    # option's defaults list merges it in (`/model_schema@_here_`), and with it the keys, the
    # defaults and the types of ModelConfig.
    store.store(name="model_schema", node=ModelConfig)
    # ${ranks_per_node:${cluster}} in conf/cluster/slurm.yaml: the same rule as everywhere.
    OmegaConf.register_new_resolver("ranks_per_node", ranks_per_node, replace=True)
    # What Slurm is asked for per node and task (one task per rank, or per node).
    OmegaConf.register_new_resolver("slurm_tasks_per_node", slurm_tasks_per_node, replace=True)
    OmegaConf.register_new_resolver("slurm_cpus_per_task", slurm_cpus_per_task, replace=True)
    # cluster.sbatch_extra and cluster.srun_args, with an elastic job's node range
    # (cluster.min_nodes).
    OmegaConf.register_new_resolver("slurm_sbatch_extra", slurm_sbatch_extra, replace=True)
    OmegaConf.register_new_resolver("slurm_srun_args", slurm_srun_args, replace=True)
    # ${first_set:a,b}: a unless it is null.
    OmegaConf.register_new_resolver("first_set", lambda a, b: b if a is None else a,
                                    replace=True)


def to_container(cfg: DictConfig) -> dict[str, Any]:
    """Plain, resolved dict of the composed config: picklable and safe to send to ranks."""
    try:
        return OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)  # type: ignore[return-value]
    except MissingMandatoryValue as e:
        raise _unset(e) from None


def _unset(e: MissingMandatoryValue) -> ConfigError:
    """A `???` left unset, e.g. model=custom's model._target_."""
    hint = {"model._target_": "model=custom takes model._target_=<package>.<module>.<class>",
            "data.train._target_": "data=custom takes data.train._target_=<package>.<module>."
                                   "<Dataset class>"}.get(str(e.full_key))
    return ConfigError(f"{e.full_key} must be set: add {e.full_key}=<value> to the command"
                       + (f" ({hint})." if hint else "."))


def _schema() -> DictConfig:
    """TrainConfig as Hydra's schema, with `model` left untyped: the model group's option types
    it (a built-in one brings ModelConfig; model=custom is a plain dict of its own keys)."""
    schema = OmegaConf.structured(TrainConfig)
    schema.model = {}
    return schema


@functools.cache
def _merge_schema() -> DictConfig:
    """_schema() built once per process for to_typed: building it from the dataclasses was
    about half of a to_typed call (78 -> 41 ms), and OmegaConf.merge copies its first config,
    never changing it."""
    return _schema()


def to_typed(cfg: DictConfig | dict[str, Any]) -> TrainConfig:
    """The composed config as TrainConfig objects (attribute access, types checked)."""
    merged = OmegaConf.merge(_merge_schema(), cfg)
    try:
        typed: TrainConfig = OmegaConf.to_object(merged)  # type: ignore[assignment]
    except MissingMandatoryValue as e:  # a container made without throw_on_missing
        raise _unset(e) from None
    typed.model = typed_model(typed.model)
    return typed


def typed_model(model: Any) -> ModelConfig | CustomModelConfig:
    """The model dict as ModelConfig (a built-in option) or CustomModelConfig (`_target_`)."""
    if isinstance(model, ModelConfig | CustomModelConfig):
        return model
    model = dict(model)
    builtin_keys = {f.name for f in fields(ModelConfig)}
    if "_target_" not in model:
        if unknown := sorted(set(model) - builtin_keys):
            raise ConfigError(
                f"model.{unknown[0]} is not a key of the built-in models "
                f"({sorted(builtin_keys)}); a model of your own takes its own keys: "
                f"model=custom model._target_=<dotted path> +model.{unknown[0]}=...")
        return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ModelConfig), model))  # type: ignore[return-value]
    target = model.pop("_target_")
    if builtin_keys <= set(model):  # a built-in option's keys, plus +model._target_
        raise ConfigError("model._target_ needs model=custom: python -m train model=custom "
                          "model._target_=<dotted path> [+model.<argument>=<value> ...]")
    if not isinstance(target, str) or not target.strip():
        raise ConfigError(f"model._target_={target!r} must be the dotted path of your model "
                          "class, e.g. model._target_=mypkg.models.Net.")
    return CustomModelConfig(target=target, **_reserved(model), kwargs=model)


RESERVED = {"weights": "a file path, a weights name or null", "weights_strict": "true or false",
            "freeze": "a list of module-name prefixes",
            "activation_checkpointing": "none, blocks or a number N (every N-th block)"}
"""model=custom keys the service takes (pretrained weights, freezing, activation
checkpointing), not the constructor."""


def _reserved(model: dict[str, Any]) -> dict[str, Any]:
    """Pop RESERVED from a custom model's keys, their types checked (no schema does it)."""
    taken = {key: model.pop(key) for key in RESERVED if key in model}
    ok = {"weights": lambda v: v is None or isinstance(v, str),
          "weights_strict": lambda v: isinstance(v, bool),
          "freeze": lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v),
          "activation_checkpointing": lambda v: isinstance(v, str | int)}
    for key, value in taken.items():
        if not ok[key](value):
            raise ConfigError(f"model.{key}={value!r} must be {RESERVED[key]} (a key the "
                              "service takes, not your model's constructor).")
    if "activation_checkpointing" in taken:  # a number from the command line: its text
        taken["activation_checkpointing"] = str(taken["activation_checkpointing"])
    return taken
