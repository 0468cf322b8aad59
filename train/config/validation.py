"""The configuration's own values checked, before anything else (no torch, no mlflow): names
that must be one of a registry's, numbers that must be positive, the global batch that must
split over the ranks. Every problem goes into one message. Called by the pre-flight, and by
every rank of an externally launched job (torchrun, srun), which has no pre-flight."""

from __future__ import annotations

from train.config.groups import CustomModelConfig, OptimConfig, TrainConfig
from train.config.task import TOP_K as TOP_K  # accuracy_top5: with more classes than this
from train.errors import ConfigError

# The registries in train/models/build.py and train/data/build.py are keyed by exactly these names;
# they are repeated here so that validation (and --help) need not import torch.
MODEL_NAMES = ("cnn", "mlp", "resnet18")
MODEL_SOURCES = ("builtin", "torchvision")
DATASET_NAMES = ("digits", "synthetic", "mnist", "fashion_mnist", "cifar10")
STREAMED_DATASET_NAMES = ("imagefolder", "arrow", "custom", "tokens")
"""train/data/build.py's STREAMED: read from disk batch by batch (train/data/streaming.py)."""
PRECISIONS = ("fp32", "bf16-mixed", "fp16-mixed")
OPTIMIZERS = ("sgd", "adamw")
SCHEDULES = ("cosine", "constant")
INTERVALS = ("epoch", "step")
"""optim.scheduler_interval: when a scheduler of the user's steps."""
EXAMPLES = {"optim._target_": "torch.optim.Adadelta",
            "optim.scheduler._target_": "torch.optim.lr_scheduler.StepLR"}
BACKENDS = ("auto", "gloo", "nccl")
DIRECTIONS = ("maximize", "minimize")


def _require(ok: bool, message: str, problems: list[str]) -> None:
    if not ok:
        problems.append(message)


def validate(cfg: TrainConfig, world_size: int) -> None:
    """Refuse what the types allow but training cannot use; every problem in one message."""
    p: list[str] = []
    _model_and_data(cfg, p)
    _training(cfg, p)
    _ranges_and_batch_split(cfg, world_size, p)
    p += cfg.tracking.problems()
    for problem in (cfg.eval.problem(), cfg.predict.problem(), cfg.trainer.ema.problem()):
        if problem:
            p.append(problem)
    from train.config.safe_text import control_character_problems  # reaches a job script

    p += control_character_problems(cfg)
    if p:
        raise ConfigError("Refusing to start: " + " ".join(p))


def _model_and_data(cfg: TrainConfig, p: list[str]) -> None:
    if not isinstance(cfg.model, CustomModelConfig):  # model=custom: checked by check_model
        _require(cfg.model.source in MODEL_SOURCES,
                 f"model.source={cfg.model.source!r}; choose one of {list(MODEL_SOURCES)}.", p)
        _require(cfg.model.source != "builtin" or cfg.model.name in MODEL_NAMES,
                 f"model.name={cfg.model.name!r} is not a model; choose one of "
                 f"{[*MODEL_NAMES, 'torchvision']} (for a torchvision.models builder: "
                 f"model=torchvision model.name={cfg.model.name}).", p)
    from train.config.prefixes import group_problems

    p += group_problems(cfg.optim.param_groups, cfg.model.freeze)
    mode = cfg.model.activation_checkpointing
    _require(mode in ("none", "blocks") or (mode.isdigit() and int(mode) > 0),
             f"model.activation_checkpointing={mode!r}: choose none, blocks or a number N "
             "(every N-th block).", p)
    # Reproduced on torch 2.14 (CPU, sdpa and eager attention): inductor's stride checks fail
    # in the recompute of a compiled GPT2Block, whole model or block by block.
    _require(getattr(cfg.model, "target", None) != "train.models.hf.build" or mode == "none"
             or not cfg.trainer.compile,
             "model=hf with model.activation_checkpointing and trainer.compile=true: "
             "torch.compile fails on the recompute of transformers' blocks; choose one of "
             "the two.", p)
    datasets = [*DATASET_NAMES, *STREAMED_DATASET_NAMES]
    _require(cfg.data.name in datasets,
             f"data={cfg.data.name!r} is not a data set; choose one of {datasets}.", p)
    _require(cfg.data.name != "imagefolder" or len(cfg.data.mean) == len(cfg.data.std) == 3,
             "data.mean and data.std need 3 values (one per RGB channel).", p)
    _require(cfg.data.seq_len > 0, f"data.seq_len must be positive (got {cfg.data.seq_len}).", p)
    _require(cfg.data.shuffle in ("shards", "global"),
             f"data.shuffle={cfg.data.shuffle!r}; choose shards or global.", p)
    _require(cfg.data.tokenize in ("workers", "map"),
             f"data.tokenize={cfg.data.tokenize!r}; choose workers or map.", p)
    _require(cfg.task.name != "token_classification" or cfg.task.ignore_index == -100,
             f"task=token_classification marks padding and a word's later pieces -100 (as "
             f"transformers does), not task.ignore_index={cfg.task.ignore_index}: leave it.", p)
    _require(cfg.data.shuffle_window >= 1,
             f"data.shuffle_window must be at least 1 (got {cfg.data.shuffle_window}).", p)
    _require(cfg.task.name != "language_model" or cfg.data.name in ("tokens", "custom"),
             f"task=language_model reads windows of token ids, not data={cfg.data.name}: use "
             "data=tokens (files from `python -m train prepare-text`) or data=custom.", p)
    _require(cfg.data.name != "tokens" or cfg.task.name in ("language_model", "custom"),
             f"data=tokens holds token windows for task=language_model (or task=custom), not "
             f"task={cfg.task.name}: add task=language_model.", p)


def _optimiser(o: OptimConfig, p: list[str]) -> None:
    """The presets' names, and `_target_`, `args` and `scheduler` as written (whether the
    classes import and build on the model's parameters: pre-flight, train/engine/optim.py)."""
    _require(o.name in OPTIMIZERS, f"optim.name={o.name!r}; choose one of {list(OPTIMIZERS)}.",
             p)
    _require(o.schedule in SCHEDULES,
             f"optim.schedule={o.schedule!r}; choose one of {list(SCHEDULES)}.", p)
    _require(o.scheduler_interval in INTERVALS, f"optim.scheduler_interval="
             f"{o.scheduler_interval!r}; choose one of {list(INTERVALS)}.", p)
    for key, target in (("optim._target_", o._target_),
                        ("optim.scheduler._target_", o.scheduler.get("_target_"))):
        _require(target is None or (isinstance(target, str) and bool(target.strip())),
                 f"{key}={target!r} must be a dotted path, e.g. {EXAMPLES[key]}.", p)
    _require(o._target_ is not None or not o.args,
             f"optim.args ({sorted(o.args)}) are the arguments of optim._target_'s class, which "
             "is not set: add optim._target_=<dotted path> (the presets take optim.momentum, "
             "optim.nesterov, optim.betas).", p)
    if taken := sorted(set(o.args) & {"params", "lr", "weight_decay"}):
        p.append(f"optim.args.{taken[0]} is the service's: set optim.lr / optim.weight_decay "
                 "(and optim.param_groups for groups) instead.")
    extra = sorted(set(o.scheduler) - {"_target_", "_partial_"})
    _require(o.scheduler.get("_target_") is not None or not extra,
             f"optim.scheduler.{extra[0] if extra else ''} is set but optim.scheduler._target_ "
             "is not: add optim.scheduler._target_=<dotted path>, e.g. "
             f"{EXAMPLES['optim.scheduler._target_']}.", p)
    _require("optimizer" not in o.scheduler,
             "optim.scheduler.optimizer: the service passes the optimiser; remove the key.", p)


def _training(cfg: TrainConfig, p: list[str]) -> None:
    _optimiser(cfg.optim, p)
    _require(cfg.trainer.precision in PRECISIONS,
             f"trainer.precision={cfg.trainer.precision!r}; choose one of {list(PRECISIONS)}.", p)
    _require(cfg.distributed.backend in BACKENDS,
             f"distributed.backend={cfg.distributed.backend!r}; choose one of {list(BACKENDS)}.",
             p)
    _require(cfg.distributed.device in ("auto", "cuda", "cpu"),
             f"distributed.device={cfg.distributed.device!r}; choose auto, cuda or cpu.", p)
    _require(cfg.trainer.objective_direction in DIRECTIONS,
             f"trainer.objective_direction must be one of {list(DIRECTIONS)}.", p)
    _require(cfg.optim.lr > 0, f"optim.lr must be positive (got {cfg.optim.lr}).", p)
    _require(cfg.trainer.epochs > 0, f"trainer.epochs must be positive (got {cfg.trainer.epochs}).",
             p)
    _require(cfg.trainer.eval_every > 0, "trainer.eval_every must be positive.", p)
    _require(cfg.trainer.max_steps is None or cfg.trainer.max_steps > 0,
             f"trainer.max_steps must be a positive number of optimiser steps, or null (got "
             f"{cfg.trainer.max_steps}).", p)
    _best_and_test(cfg, p)
    _fsdp(cfg, p)
    _require(cfg.trainer.log_every_n_steps > 0, "trainer.log_every_n_steps must be positive.", p)
    _require(cfg.trainer.keep_checkpoints > 0, "trainer.keep_checkpoints must be positive.", p)
    _require(cfg.trainer.checkpoint_every >= 0, "trainer.checkpoint_every cannot be negative.",
             p)
    _require(cfg.trainer.straggler_intervals >= 0,
             "trainer.straggler_intervals cannot be negative (0 turns the check off).", p)
    prof = cfg.trainer.profile
    _require(not prof.enabled or (prof.wait >= 0 and prof.warmup >= 0 and prof.active > 0),
             f"trainer.profile: wait={prof.wait} and warmup={prof.warmup} must be 0 or more "
             f"and active={prof.active} positive (the steps recorded).", p)
    _require(cfg.data.batch_size > 0,
             f"data.batch_size must be positive (got {cfg.data.batch_size}).", p)
    _require(cfg.data.num_workers is None or cfg.data.num_workers >= 0,
             f"data.num_workers must be 0 or more, or null (got {cfg.data.num_workers}).", p)
    if cfg.data.name == "synthetic":
        for key in ("num_samples", "channels", "image_size", "num_classes"):
            _require(getattr(cfg.data, key) > 0,
                     f"data.{key} must be positive (got {getattr(cfg.data, key)}).", p)


def _fsdp(cfg: TrainConfig, p: list[str]) -> None:
    """distributed.strategy and, with fsdp, what FSDP2 is not combined with here (untested or
    refused by torch): one line each, before any rank starts."""
    d = cfg.distributed
    _require(d.strategy in ("ddp", "fsdp"),
             f"distributed.strategy={d.strategy!r}; choose ddp or fsdp.", p)
    _require(not (d.fsdp.async_checkpoint and d.strategy != "fsdp"),
             "distributed.fsdp.async_checkpoint=true needs distributed.strategy=fsdp (a DDP "
             "job's checkpoint is one file rank 0 writes); drop it or use fsdp.", p)
    if d.strategy != "fsdp":
        return
    _require(d.fsdp.init_on in ("auto", "cpu", "meta"),
             f"distributed.fsdp.init_on={d.fsdp.init_on!r}; choose auto, cpu or meta.", p)
    why = {"trainer.precision=fp16-mixed": cfg.trainer.precision == "fp16-mixed",
           "distributed.sync_batchnorm=true": d.sync_batchnorm,
           "distributed.static_graph=true": d.static_graph,
           "distributed.find_unused_parameters=true": d.find_unused_parameters,
           "model.freeze": bool(cfg.model.freeze)}
    hint = {"trainer.precision=fp16-mixed": "use bf16-mixed (FSDP's MixedPrecisionPolicy: bf16 "
            "parameters, fp32 gradient reduction) or fp32"}
    for key in (k for k, on in why.items() if on):
        p.append(f"distributed.strategy=fsdp cannot be combined with {key} (not supported by this "
                 f"service's FSDP path); {hint.get(key, 'remove it')}, or use "
                 "distributed.strategy=ddp.")
    _require(not (cfg.model.weights and d.fsdp.init_on == "meta"),
             "model.weights with distributed.strategy=fsdp needs distributed.fsdp.init_on=auto "
             "or cpu (the weights are loaded into the whole model before it is sharded).", p)


def _task_metrics(cfg: TrainConfig, p: list[str]) -> None:
    """task.name is known, and trainer.monitor / trainer.objective are metrics it logs (a
    custom task's are checked once its class is imported: train/launch/preflight.py)."""
    from train.config.task import METRICS, TASK_NAMES, metric_problem

    task, t = cfg.task, cfg.trainer
    if task.name not in TASK_NAMES:
        p.append(f"task={task.name!r} is not a task; choose one of {list(TASK_NAMES)}.")
        return
    if task.name == "custom":
        return
    p.extend(problem for problem in (
        metric_problem(t.monitor, task.name, METRICS[task.name], "trainer.monitor"),
        objective_problem(t.objective, task.name, METRICS[task.name])) if problem)


def objective_problem(objective: str, task: str, metrics: tuple[str, ...]) -> str | None:
    """trainer.objective is one of the task's metrics on the train, val or test split."""
    split, _, metric = objective.partition("/")
    if split in ("train", "val", "test") and metric in metrics:
        return None
    return (f"trainer.objective={objective!r} is not a metric task={task} logs; choose one of "
            + ", ".join(f"val/{m}" for m in metrics) + " (or its train/ or test/ value).")


def _best_and_test(cfg: TrainConfig, p: list[str]) -> None:
    t = cfg.trainer
    _task_metrics(cfg, p)
    _require(t.monitor_mode in ("auto", "max", "min"),
             f"trainer.monitor_mode={t.monitor_mode!r}; choose auto, max or min.", p)
    _require(t.early_stopping_patience is None or t.early_stopping_patience > 0,
             "trainer.early_stopping_patience must be positive or null.", p)
    _require(t.test_on in ("last", "best", "none"),
             f"trainer.test_on={t.test_on!r}; choose last, best or none.", p)
    _require(t.test_on != "best" or t.save_best,
             "trainer.test_on=best needs trainer.save_best=true (the best weights are kept "
             "only then); add it, or use trainer.test_on=last.", p)


def monitor_problem(monitor: str, num_classes: int) -> str | None:
    """Why trainer.monitor is never logged with this many classes (top-5 needs more than
    TOP_K), or None. Checked by the pre-flight where the classes are known without the data, and
    by every rank once the data is built."""
    if monitor != "val/accuracy_top5" or num_classes > TOP_K:
        return None
    return (f"trainer.monitor=val/accuracy_top5 needs more than {TOP_K} classes; this data has "
            f"{num_classes}, so the job never logs it: monitor val/accuracy or val/loss instead.")


def _ranges_and_batch_split(cfg: TrainConfig, world_size: int, p: list[str]) -> None:
    _require(0 < cfg.data.val_fraction < 1,
             f"data.val_fraction must be between 0 and 1 (got {cfg.data.val_fraction}).", p)
    _require(cfg.distributed.nproc_per_node > 0, "distributed.nproc_per_node must be positive "
             f"(got {cfg.distributed.nproc_per_node}).", p)
    _require(cfg.distributed.timeout_s > 0,
             f"distributed.timeout_s must be positive (got {cfg.distributed.timeout_s}).", p)
    _require(cfg.trainer.peak_tflops is None or cfg.trainer.peak_tflops > 0,
             "trainer.peak_tflops must be positive or null.", p)
    _require(cfg.optim.grad_clip is None or cfg.optim.grad_clip > 0,
             "optim.grad_clip must be positive or null.", p)
    _batch_split(cfg, world_size, p)


def _batch_split(cfg: TrainConfig, world_size: int, p: list[str]) -> None:
    """The global batch must split into whole micro-batches: world size x accumulation."""
    k = cfg.trainer.accumulate_grad_batches
    _require(k >= 1, f"trainer.accumulate_grad_batches must be 1 or more (got {k}).", p)
    # DDP's no_sync (the accumulation's skipped all-reduces) fails inside the reducer with a
    # static graph (torch 2.14: "expect_autograd_hooks_ INTERNAL ASSERT FAILED").
    _require(k <= 1 or not cfg.distributed.static_graph,
             "trainer.accumulate_grad_batches>1 cannot be combined with "
             "distributed.static_graph=true (DDP's no_sync fails on a static graph); set "
             "distributed.static_graph=false.", p)
    if cfg.data.batch_size <= 0 or world_size <= 0 or k < 1:
        return
    if cfg.eval.run_id is not None:  # evaluating: each rank's batch only chunks its shard
        _require(cfg.data.batch_size >= world_size, f"data.batch_size={cfg.data.batch_size} "
                 f"gives {world_size} ranks no sample each: use at least {world_size}.", p)
        return
    unit = world_size * k
    if cfg.data.batch_size % unit == 0:
        return
    suggestion = max(unit, round(cfg.data.batch_size / unit) * unit)
    over = f"the {world_size} ranks" if k == 1 else (
        f"{world_size} rank{'s' * (world_size > 1)} x {k} micro-batches "
        f"(trainer.accumulate_grad_batches={k})")
    p.append(f"data.batch_size={cfg.data.batch_size} is the GLOBAL batch and must split evenly "
             f"over {over}; use a multiple of {unit}, e.g. data.batch_size={suggestion}.")
