"""Pre-flight of the model and the task: the model builds and (where the data's shape is known
before reading it) gives the output the task needs, its pretrained weights and fine-tuning
prefixes fit, a task of the user's own imports and declares the monitored metric, and a model
to register traces with torch.export. Called by train/launch/preflight.py; light like it (no
torch at import time)."""

from __future__ import annotations

from train.config.groups import CustomModelConfig, DataConfig, TrainConfig, TrainerConfig
from train.config.task import classes_problem
from train.config.validation import monitor_problem
from train.errors import ConfigError, LaunchError


def input_before_reading(data: DataConfig) -> tuple[tuple[int, ...], int] | None:
    """(one sample's shape, number of classes) of a built-in data set or an image folder's
    class folders; None for a custom data set (known once it is built)."""
    if data.name != "imagefolder":
        return known_input(data)
    from train.data import imagefolder

    return imagefolder.known_input(data.root, data.image_size)


DEFAULT_LOSS = TrainerConfig().loss
BUILTIN_INPUTS: dict[str, tuple[tuple[int, ...], int]] = {
    "digits": ((1, 8, 8), 10), "mnist": ((1, 28, 28), 10), "fashion_mnist": ((1, 28, 28), 10),
    "cifar10": ((3, 32, 32), 10)}
"""One sample's shape and the classes of the built-in data sets (as train/data/datasets.py loads
them), known without loading them."""


def known_input(data: DataConfig) -> tuple[tuple[int, ...], int] | None:
    """(one sample's shape, number of classes) where it is known without reading the data."""
    if data.name == "synthetic":
        return (data.channels, data.image_size, data.image_size), data.num_classes
    return BUILTIN_INPUTS.get(data.name)


def check_model(cfg: TrainConfig,
                data_input: tuple[tuple[int, ...], int] | None = None) -> None:
    """The model and the loss. A custom model is built (on the meta device where it can be)
    and run on the data's input shape where that is known: `data_input` (one sample's shape,
    number of classes) as the data check found it, else the built-in sets' (`known_input`);
    where neither is known, it is only imported here, and its output is checked at the first
    training step. No torch import for a built-in model with the default loss."""
    custom = isinstance(cfg.model, CustomModelConfig)
    if not custom and cfg.model.source == "torchvision":
        from train.models.build import torchvision_builders

        if cfg.model.name not in (builders := torchvision_builders()):
            raise ConfigError(f"model=torchvision model.name={cfg.model.name!r} is not a "
                              f"torchvision classification model; choose one of {builders}.")
    checkpointing = cfg.model.activation_checkpointing != "none"
    if not custom and cfg.trainer.loss == DEFAULT_LOSS and not checkpointing:
        return
    from train.config import usercode
    from train.models import build as models

    known = data_input or known_input(cfg.data)
    if not custom and checkpointing and known is not None:  # its blocks, before any rank
        check_on_meta(cfg, models.build_on_meta(cfg.model, models.InputSpec.of(*known)))
    classifying = cfg.task.name == "classification"  # other tasks' outputs: at step 1
    try:
        if custom and known is not None and classifying:
            models.check_output(cfg.model, models.InputSpec.of(*known))
            if cfg.distributed.strategy == "fsdp" or checkpointing:
                check_on_meta(cfg, models.build_on_meta(cfg.model, models.InputSpec.of(*known)))
        elif custom:
            models.custom_target(cfg.model)
        if cfg.trainer.loss != DEFAULT_LOSS:
            models.check_loss(cfg.trainer.loss, known[1] if known and classifying else None)
    except usercode.UserCodeError as e:
        raise ConfigError(str(e)) from None


def check_finetuning(cfg: TrainConfig, resuming: bool,
                     known: tuple[tuple[int, ...], int] | None) -> None:
    """model.weights found, read (weights only) and, strict, fitting the model; model.freeze
    and optim.param_groups prefixes matching its parameters. The model is built on the meta
    device, where the data's shape is `known` without reading the data (elsewhere the job checks
    at its start). A job that continues a checkpoint takes its weights: model.weights unread."""
    m = cfg.model
    if not (m.weights or m.freeze or cfg.optim.param_groups):
        return  # no torch import
    from train.config import usercode
    from train.models import build as models
    from train.models import finetune, pretrained

    try:
        source = None if resuming else pretrained.resolve(m)
        weights = pretrained.read(source.path, source.label) if source else None
        if known is None:
            return
        spec = models.InputSpec.of(*known)
        model = models.build_on_meta(m, spec)
        if source is not None and weights is not None:
            pretrained.fit(model, source, weights, m.weights_strict, spec.num_classes)
        finetune.check(model, m.freeze, cfg.optim.param_groups)
    except (pretrained.WeightsError, finetune.FinetuneError, usercode.UserCodeError) as e:
        raise ConfigError(str(e)) from None


def check_optimiser(cfg: TrainConfig, known: tuple[tuple[int, ...], int] | None) -> None:
    """optim._target_ and optim.scheduler._target_ import, and build on the model's parameter
    groups (train/engine/optim.py `check`). No torch import for the presets."""
    if cfg.optim._target_ is None and cfg.optim.scheduler.get("_target_") is None:
        return
    from train.config import usercode
    from train.engine import optim
    from train.models import finetune

    try:
        optim.check(cfg, known)
    except (usercode.UserCodeError, finetune.FinetuneError) as e:
        raise ConfigError(str(e)) from None


def check_task(cfg: TrainConfig) -> None:
    """task=custom: the user's Task imports, is a task that holds no trainable parameters and
    declares metric names MLflow takes, among them trainer.monitor and trainer.objective (a
    built-in task's metrics are checked with the config: train/config/validation.py)."""
    if cfg.task.name != "custom":
        return
    from train.config.task import metric_problem
    from train.config.validation import objective_problem
    from train.tasks import build as tasks

    task = tasks.build(cfg.task)
    metrics = tuple(task.metrics)
    for problem in (metric_problem(cfg.trainer.monitor, "custom", metrics, "trainer.monitor"),
                    objective_problem(cfg.trainer.objective, "custom", metrics)):
        if problem:
            raise ConfigError(problem)


def check_monitor(cfg: TrainConfig, classes: int | None) -> None:
    """A top-5 monitor on a data set of TOP_K classes or fewer, or a classifier of one class,
    where the classes are known: before the data is read, or named by a custom Dataset (one
    that does not name them: on every rank once it is built)."""
    if classes is not None and (problem := monitor_problem(cfg.trainer.monitor, classes)):
        raise ConfigError(problem)
    if problem := classes_problem(cfg.task.name, classes, cfg.data.name):
        raise ConfigError(problem)


def check_registrable(cfg: TrainConfig, known: tuple[tuple[int, ...], int] | None,
                      checked: set[str]) -> None:
    """tracking.register_model: torch.export traces the model (train/models/exportable.py), where
    its
    input is `known` before the data is read; once per model and input of a sweep."""
    name = cfg.tracking.register_model
    if name and known and (key := repr((cfg.model, known))) not in checked:
        from train.models import build as models
        from train.models import exportable

        spec = models.InputSpec.of(*known)
        exportable.check_registrable(lambda: models.build(cfg.model, spec), known[0],
                                     models.describe(cfg.model), name)
        checked.add(key)


def check_token_data(cfg: TrainConfig) -> None:
    """data=tokens: the files whole (train/data/tokens.py `check`), data.seq_len within the
    model's context, and no token id outside the model's vocabulary. The model is built on the
    meta device (no memory) to read its context (`block_size`) and vocabulary (`vocab_size`,
    else its first embedding's rows)."""
    from train.data import tokens

    root, seq_len = cfg.data.root, cfg.data.seq_len
    try:
        meta = tokens.read_meta(root)
    except tokens.TokenDataError as e:
        raise LaunchError(str(e)) from None
    vocab = context = None
    if isinstance(cfg.model, CustomModelConfig):
        from train.config import usercode
        from train.models import build as models

        spec = models.InputSpec.of((seq_len,), meta.vocab_size, vocab_size=meta.vocab_size)
        try:
            model = models.build_on_meta(cfg.model, spec)
        except (usercode.UserCodeError, ValueError) as e:
            raise ConfigError(str(e)) from None
        vocab, context = _vocabulary(model), getattr(model, "block_size", None)
        check_on_meta(cfg, model)
    if isinstance(context, int) and seq_len > context:
        raise ConfigError(f"data.seq_len={seq_len} is longer than the model's context "
                          f"(block_size={context}): lower data.seq_len, or raise "
                          "model.block_size.")
    try:
        tokens.check(root, seq_len, vocab)
    except tokens.TokenDataError as e:
        raise LaunchError(str(e)) from None


def check_text_model(cfg: TrainConfig, vocab_size: int, pad_id: int, classes: int) -> None:
    """data=arrow with a text column (tokenized to data.max_length ids by a tokenizer of
    `vocab_size`): the model, built on the meta device, holds the tokenizer's vocabulary and
    data.max_length within its context."""
    if not isinstance(cfg.model, CustomModelConfig):
        return
    from train.config import usercode
    from train.models import build as models

    spec = models.InputSpec.of((cfg.data.max_length,), classes, text=(vocab_size, pad_id))
    try:
        model = models.build_on_meta(cfg.model, spec)
    except (usercode.UserCodeError, ValueError) as e:
        raise ConfigError(str(e)) from None
    context = getattr(model, "block_size", None)
    if isinstance(context, int) and cfg.data.max_length > context:
        raise ConfigError(f"data.max_length={cfg.data.max_length} is longer than the model's "
                          f"context ({context} positions): lower data.max_length.")
    check_on_meta(cfg, model)


def check_on_meta(cfg: TrainConfig, model: object) -> None:
    """The model built on the meta device: its blocks, where model.activation_checkpointing
    asks for them; and under distributed.fsdp.init_on=meta, that it can be initialised shard by
    shard, or one line saying which module cannot and what to do (auto builds such a model
    whole where it fits, on every rank: train/engine/fsdp.py init_place)."""
    if cfg.model.activation_checkpointing != "none":  # blocks to recompute, before any rank
        from train.engine import recompute

        recompute.chosen_blocks(model, cfg.model.activation_checkpointing,  # type: ignore[arg-type]
                                list(cfg.distributed.fsdp.shard_modules))
    if cfg.distributed.strategy != "fsdp":
        return
    from train.engine import fsdp_init

    if refusal := fsdp_init.meta_refusal(cfg, model):  # type: ignore[arg-type]
        raise ConfigError(refusal)


def _vocabulary(model: object) -> int | None:
    from torch import nn

    if isinstance(size := getattr(model, "vocab_size", None), int):
        return size
    if isinstance(model, nn.Module):
        for module in model.modules():
            if isinstance(module, nn.Embedding):
                return int(module.num_embeddings)
    return None
