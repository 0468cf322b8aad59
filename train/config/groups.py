"""Typed configuration: one dataclass per config group, with a docstring per field.

train/config/schema.py registers them as Hydra's schema, so every YAML file of a group is merged
onto these dataclasses: a misspelt key or a value of the wrong type is refused by OmegaConf
while composing; train/launch/preflight.py's `validate()` then checks what types cannot express
(ranges, names, divisibility) before any process starts.

The defaults live here and only here: a group's YAML file sets just what differs for its option
(tests/unit/test_config.py checks that none restates a default). The cluster, optim, task and
tracking groups' dataclasses (and the data and distributed groups') are in their own modules
beside this one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from train.config.cluster import ClusterConfig
from train.config.data import DataConfig as DataConfig  # re-exported
from train.config.data import reads_files as reads_files  # re-exported
from train.config.distributed import DistributedConfig as DistributedConfig  # re-exported
from train.config.distributed import FsdpConfig as FsdpConfig  # re-exported
from train.config.ema import EmaConfig
from train.config.evaluate import EvalConfig, PredictConfig
from train.config.optim import OptimConfig as OptimConfig  # re-exported: its group's home
from train.config.task import TaskConfig
from train.config.tracking import TrackingConfig as TrackingConfig  # re-exported
from train.errors import ConfigError as ConfigError  # re-exported


@dataclass
class ModelConfig:
    name: str = "cnn"
    """The model: cnn, mlp or resnet18; with `model=torchvision`, any torchvision.models
    classification builder (resnet50, efficientnet_b0, vit_b_16, ...)."""
    source: str = "builtin"
    """Where `name` is looked up: builtin (train/models/build.py) or torchvision (set by the
    group)."""
    width: int = 32
    """cnn: channels of the first conv layer; mlp: hidden units."""
    depth: int = 2
    """mlp: hidden layers."""
    dropout: float = 0.0
    """Dropout before the classifier."""
    weights: str | None = None
    """Start from these weights (fine-tuning): a local state dict file (a previous run's
    model.pt, a checkpoint step-<N>.pt, any torch.save'd state dict), read with
    torch.load(weights_only=True); with model=torchvision also DEFAULT or a weights name
    (IMAGENET1K_V1, ResNet18_Weights.IMAGENET1K_V1) from the local torch hub cache (never
    downloaded). null = random weights. A resumed job takes its checkpoint's weights instead."""
    weights_strict: bool = True
    """Refuse weights whose keys or shapes differ from the model's; false = load what matches
    and report the rest (e.g. a classifier head of another class count is left new)."""
    freeze: list[str] = field(default_factory=list)
    """Module-name prefixes (layer1, features.0, fc.weight) whose parameters are not trained:
    requires_grad=False and left out of the optimiser."""
    activation_checkpointing: str = "none"
    """Recompute blocks' activations in backward instead of keeping them (memory for time):
    none, blocks (every block), or a number N (every N-th block). The blocks are those FSDP
    shards one by one (distributed.fsdp.shard_modules; by default the modules held in the
    model's ModuleLists: model=gpt's transformer blocks). torch's composable checkpoint, so
    parameter names, checkpoints and the logged model stay as without."""


@dataclass
class CustomModelConfig:
    """`model=custom`: the user's own nn.Module, built with hydra.utils.instantiate. Its keys are
    its constructor's, so it has no schema of its own: `to_typed` makes it from the model dict."""

    target: str
    """Dotted path of the class (or of a function returning the model): `model._target_`."""
    kwargs: dict[str, Any] = field(default_factory=dict)
    """The other model.* keys (`+model.depth=4`): constructor arguments. num_classes,
    in_channels / channels and image_size are filled from the data where the constructor takes
    them and they are not set here."""
    weights: str | None = None
    """As ModelConfig.weights (`+model.weights=...`; a key reserved, not a constructor
    argument)."""
    weights_strict: bool = True
    """As ModelConfig.weights_strict (reserved)."""
    freeze: list[str] = field(default_factory=list)
    """As ModelConfig.freeze (reserved)."""
    activation_checkpointing: str = "none"
    """As ModelConfig.activation_checkpointing (reserved)."""


@dataclass
class ProfileConfig:
    """trainer.profile's keys: torch.profiler over a window of training steps on every rank
    (train/engine/profiling.py)."""

    enabled: bool = False
    """Profile this start of the job: after `wait` optimiser steps, `warmup` steps with the
    profiler on but nothing kept, then `active` steps recorded."""
    wait: int = 5
    """Optimiser steps from this start's first before the profiler warms up (the DataLoader's
    workers, caches and compile settle)."""
    warmup: int = 1
    """Steps after `wait` with the profiler on and nothing kept: its own start-up cost."""
    active: int = 3
    """Steps recorded: each rank's trace (profile/rank-<N>.json.gz, for Perfetto or
    chrome://tracing) and its top operators by self time (profile/rank-<N>.txt), as run
    artifacts; the steps are the run's `profile.steps` tag, and their throughput is left out of
    train/samples_per_sec."""
    record_shapes: bool = True
    """The operators' input shapes, in the trace and the summary."""
    profile_memory: bool = True
    """Tensor allocations and frees, in the trace."""
    with_stack: bool = False
    """Python and C++ stacks for each operator (a larger trace, slower steps)."""
    top: int = 25
    """Operators in each rank's text summary."""


@dataclass
class TrainerConfig:
    epochs: int = 10
    """Passes over the training set."""
    max_steps: int | None = None
    """Stop after this many optimiser steps in all, mid-epoch if need be, when that comes before
    trainer.epochs end (validation, checkpoint and test then as after a last epoch); the LR
    schedule ends there. null = trainer.epochs alone."""
    accumulate_grad_batches: int = 1
    """Micro-batches whose gradients are summed before each optimiser step. data.batch_size
    stays the global batch of one optimiser step: each rank's micro-batch is
    batch_size / (world size x this), and the intermediate micro-steps skip DDP's all-reduce."""
    seed: int = 0
    """Seed for weights and shuffling (each rank adds its rank)."""
    precision: str = "fp32"
    """fp32, bf16-mixed or fp16-mixed (fp16 uses a GradScaler)."""
    loss: dict[str, Any] = field(
        default_factory=lambda: {"_target_": "torch.nn.CrossEntropyLoss"})
    """The loss, built with hydra.utils.instantiate and called as loss(outputs, targets) in
    training and evaluation (there on fp32 outputs), asked for reduction="sum" (the task divides
    by the item count over every rank); add its arguments with `+`, e.g.
    +trainer.loss.label_smoothing=0.1. Each task option sets its own (regression: MSELoss)."""
    eval_every: int = 1
    """Validate every N epochs (and always after the last)."""
    monitor: str = "val/accuracy"
    """The validation metric that picks the best checkpoint and drives early stopping: one the
    task logs (classification: val/accuracy, val/loss, val/accuracy_top5 with more than 5
    classes; each task option sets its own default)."""
    monitor_mode: str = "auto"
    """max or min: which way `monitor` improves; auto = min if its name contains "loss",
    else max."""
    save_best: bool = False
    """Keep the best evaluation's weights in <output dir>/checkpoints/best.pt (never pruned)."""
    ema: EmaConfig = field(default_factory=EmaConfig)
    """An exponential moving average of the weights, evaluated and saved instead of them:
    trainer.ema.enabled=true (train/config/ema.py)."""
    early_stopping_patience: int | None = None
    """Stop once `monitor` has not improved for this many evaluations; null = never."""
    test_on: str = "last"
    """After training, evaluate once on the data set's test split (where it has one) with the
    last weights, the best (needs save_best=true; they then become the final model), or none."""
    log_every_n_steps: int = 10
    """Log train/step_loss every N optimiser steps; the only steps that sync with the host."""
    straggler_share: float = 0.5
    """A rank whose time waiting for data (before any collective) is more than this share over
    the median rank's for straggler_intervals logging intervals in a row is named in a warning
    and the run's `straggler` tag (train/engine/stragglers.py)."""
    straggler_intervals: int = 3
    """How many logging intervals in a row a straggler must be slow before it is named; 0 =
    never (the ranks' times are shared at logging steps all the same, for the time/* metrics)."""
    profile: ProfileConfig = field(default_factory=ProfileConfig)
    """torch.profiler over a window of steps: trainer.profile.enabled=true."""
    memory_snapshot: bool = False
    """GPU only: record the CUDA allocator's history (torch.cuda.memory) and, when a rank runs
    out of GPU memory, write its snapshot (memory/rank-<N>.pickle, for pytorch.org/memory_viz)
    beside the failure and as a run artifact. Refused at pre-flight without CUDA."""
    channels_last: bool = False
    """Use channels_last memory format (faster convolutions on recent GPUs)."""
    compile: bool = False
    """torch.compile the model."""
    checkpoint_every: int = 1
    """Checkpoint every N epochs (0 = only on the time interval and on stop signals)."""
    checkpoint_interval_min: float | None = 30.0
    """Also checkpoint when this many minutes passed since the last one (at a logging step;
    0 = at every logging step, null = never on time)."""
    keep_checkpoints: int = 2
    """Newest checkpoints kept in <output dir>/checkpoints."""
    resume: str = "auto"
    """auto (continue this output directory's job if it has a checkpoint or run), never, or a
    checkpoint file or directory."""
    peak_tflops: float | None = None
    """Peak TFLOP/s of ONE device for train/mfu; null = known GPUs' data-sheet figure (H100,
    A100, ...) for the precision in use, and no train/mfu elsewhere (e.g. on CPUs)."""
    objective: str = "val/accuracy"
    """Metric the job returns to Hydra sweepers: train/, val/ or test/ of a metric the task
    logs (each task option sets its own default)."""
    objective_direction: str = "maximize"
    """maximize or minimize (for sweepers)."""
    trial: int | None = None
    """Handed by the Optuna sweeper (an override): this job's trial number in `study`."""
    study: str | None = None
    """Handed by the Optuna sweeper: `<storage>::<study name>` (train/engine/trial.py); rank 0
    reports the objective there at each evaluation, and the study's pruner may stop the job."""


@dataclass
class TrainConfig:
    model: Any = field(default_factory=ModelConfig)
    """ModelConfig (the built-in options) or CustomModelConfig (`model=custom`): untyped in the
    schema, so that a custom model's own keys compose; each built-in option brings ModelConfig
    in its defaults list (`/model_schema@_here_`), and `to_typed` types both kinds."""
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    cluster: ClusterConfig | None = None
    eval: EvalConfig = field(default_factory=EvalConfig)
    """`python -m train eval <run_id>`: which weights, split and name (train/config/evaluate.py)."""
    predict: PredictConfig = field(default_factory=PredictConfig)
    """`python -m train predict <run_id>`: where the outputs go, which weights and split."""


HANDED_KEYS = ("tracking.experiment_id", "tracking.parent_run_id")
"""Keys the launchers append to each job's overrides; no user types them."""


def handed_overrides(experiment_id: str, parent_run_id: str | None) -> list[str]:
    """What a launcher appends to each job's overrides: the experiment (created once, by the
    launching process) and, for a sweep, the parent run. Quoted: an id made of digits and one
    `e` would otherwise be read as a number."""
    ids = (experiment_id, parent_run_id)
    return [f"{key}='{value}'" for key, value in zip(HANDED_KEYS, ids, strict=True)
            if value is not None]


def typed_by_user(overrides: Sequence[str]) -> list[str]:
    """A job's overrides without those a launcher appended (for the command a run records)."""
    return [o for o in overrides if o.split("=", 1)[0] not in HANDED_KEYS]
