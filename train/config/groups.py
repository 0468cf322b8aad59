"""Typed configuration: one dataclass per config group, with a docstring per field.

train/config/schema.py registers them as Hydra's schema, so every YAML file of a group is merged
onto these dataclasses: a misspelt key or a value of the wrong type is refused by OmegaConf
while composing; train/launch/preflight.py's `validate()` then checks what types cannot express
(ranges, names, divisibility) before any process starts.

The defaults live here and only here: a group's YAML file sets just what differs for its option
(tests/unit/test_config.py checks that none restates a default). The cluster, optim, task and
tracking groups' dataclasses are in their own modules beside this one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from train.config.cluster import ClusterConfig
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
class DataConfig:
    name: str = "digits"
    """The data set: digits, synthetic, mnist, fashion_mnist, cifar10 (held in memory); or
    imagefolder, arrow, custom, tokens (streamed from disk by DataLoader workers). Set by the
    group option."""
    batch_size: int = 64
    """GLOBAL batch size, split evenly over all ranks."""
    val_fraction: float = 0.2
    """Share of the training split held out for validation (fixed split seed)."""
    split_seed: int = 0
    """Seed of the train/val split; the same for every rank and every restart."""
    root: str = "${oc.env:TRAIN_DATA_ROOT,data}"
    """Where torchvision data sets live (env TRAIN_DATA_ROOT overrides); imagefolder: the folder
    of class folders, or of train/ and val/ holding them; arrow: the directory prepare-data or
    datasets' save_to_disk wrote, or a Hub data set's name (owner/name[:config]) found in the
    local datasets cache ($HF_DATASETS_CACHE; never downloaded)."""
    download: bool = False
    """Download missing torchvision data sets (compute nodes are often offline)."""
    num_workers: int | None = None
    """DataLoader workers per rank; null = what the CPUs available to each rank allow (one CPU
    per rank left to training; in-memory sets up to 4, streamed ones 1 to 8)."""
    on_device: bool = True
    """Keep the in-memory data set on the GPU (shuffle, augment and batch there)."""
    augment: bool = False
    """Augment training batches: in-memory sets a random crop (pad 4) and horizontal flip on the
    device; imagefolder the default train_transforms (else training uses the eval ones)."""
    num_samples: int = 4096
    """synthetic: number of samples."""
    seq_len: int = 256
    """tokens: tokens per window (a sample): the model's context must hold it (model=gpt's
    block_size defaults to it)."""
    channels: int = 3
    """synthetic: image channels."""
    image_size: int = 32
    """synthetic: image height and width; imagefolder: the side of the default transforms'
    square crop."""
    num_classes: int = 10
    """synthetic: number of classes."""
    mean: list[float] = field(default_factory=lambda: [0.485, 0.456, 0.406])
    """imagefolder: per-channel mean of Normalize (ImageNet's), applied on the device."""
    std: list[float] = field(default_factory=lambda: [0.229, 0.224, 0.225])
    """imagefolder: per-channel standard deviation of Normalize (ImageNet's)."""
    train_transforms: list[Any] | None = None
    """imagefolder: transforms.v2 steps for training images, each {_target_:
    torchvision.transforms.v2.<Name>, <its arguments>}, on the decoded uint8 image (the device
    then converts and normalises); null = RandomResizedCrop(image_size) + RandomHorizontalFlip
    (with augment=false: the eval steps)."""
    eval_transforms: list[Any] | None = None
    """imagefolder: the same for validation; null = Resize(image_size / 0.875) +
    CenterCrop(image_size)."""
    train: Any = None
    """custom: the training Dataset, {_target_: <dotted path>, <its own arguments>}, built with
    hydra.utils.instantiate; sample i is (input tensor, integer label)."""
    val: Any = None
    """custom: the validation Dataset, as `train`; no _target_ = split off `train` by
    val_fraction."""
    test: Any = None
    """custom: the test Dataset, as `train`, evaluated once after training
    (trainer.test_on); no _target_ = no test phase."""
    input_column: str = "auto"
    """arrow: the column the model reads; auto = the manifest's (prepare-data), else the first
    image column, else image / input / pixel_values / x / text / sentence / tokens."""
    target_column: str = "auto"
    """arrow: the target's column; auto = the manifest's, else label / labels / target(s) /
    ner_tags / tags. A list per row (a tag per word of a column of words): one target per
    token, for task=token_classification."""
    tokenizer: str | None = None
    """arrow with a text input column: the tokenizer (a `tokenizers` JSON file, or a directory
    holding tokenizer.json as save_pretrained writes it) that turns each text into token ids in
    the DataLoader's workers, padded (its [PAD] or <pad> token) and truncated to max_length."""
    max_length: int = 128
    """arrow with a text input column: token ids per sample."""
    tokenize: str = "workers"
    """arrow with a text input column: workers = each batch's texts tokenized in the
    DataLoader's workers as they are read (nothing written); map = the whole set tokenized
    once per node before training (datasets' map) and cached in tokenized_to, reused while the
    data, tokenizer and max_length stay the same."""
    tokenized_to: str | None = None
    """tokenize=map: where the tokenized set is kept (a directory every node sees; '$VARS'
    expanded on the node); null = <root>/.tokenized."""
    shuffle: str = "shards"
    """arrow: the training order. shards: the shards in a random order, then the samples of
    each window of shuffle_window shards (reads stay in a few files); global: one permutation
    of all samples (reads all over the set)."""
    shuffle_window: int = 4
    """arrow, shuffle=shards: shards whose samples are mixed together."""
    stage_to: str | None = None
    """arrow: node-local storage to copy the data set to before training, once per node
    (e.g. '$TMPDIR', quoted: expanded on the node); null = read it where it is."""


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
class FsdpConfig:
    """distributed.strategy=fsdp's keys (train/engine/fsdp.py)."""

    shard_modules: list[str] = field(default_factory=list)
    """Class names of the blocks sharded one by one (fully_shard each, then the root); empty =
    the classes of the modules held in the model's ModuleLists (model=gpt: `Block`)."""
    reshard_after_forward: bool = True
    """Free each block's gathered parameters after its forward (gathered again for backward):
    less memory, one more all-gather per block."""
    cpu_offload: bool = False
    """Keep the parameter shards, gradients and optimiser state in host memory (CPUOffloadPolicy):
    a GPU holds only what a block computes with, at the price of copies each step."""
    init_on: str = "auto"
    """auto: cpu where the whole model fits in host memory on every rank (half of what is
    available, for all of a node's ranks), else meta. cpu: build the whole model on every rank
    first, as DDP does - the same seed gives the same initial weights under either strategy;
    model.weights needs it. meta: build it without memory, shard it, then allocate and
    initialise each rank's shards (reset_parameters, or the model's init_weights) - for a
    model larger than host memory; its initial weights differ from DDP's. The run's tag
    fsdp.init_on says which was used."""
    async_checkpoint: bool = False
    """Write the sharded checkpoints taken while training goes on in the background
    (dcp.async_save): training waits only for the copy into host memory; each is completed
    before the next one, and a stop's and the last are written before the job ends."""


@dataclass
class DistributedConfig:
    strategy: str = "ddp"
    """ddp (every rank holds the whole model, gradients all-reduced) or fsdp (FSDP2: parameters,
    gradients and optimiser state sharded; models larger than a device; distributed.fsdp.*)."""
    fsdp: FsdpConfig = field(default_factory=FsdpConfig)
    """distributed.strategy=fsdp's keys."""
    backend: str = "auto"
    """auto (nccl with CUDA, else gloo), gloo or nccl."""
    nproc_per_node: int = 1
    """Ranks `python -m train` starts on this machine (ignored under torchrun/Slurm)."""
    timeout_s: int = 120
    """Collective timeout: a rank stuck longer than this ends the job."""
    device: str = "auto"
    """auto (cuda when available), cuda or cpu."""
    find_unused_parameters: bool = False
    """DDP: tolerate parameters that get no gradient."""
    gradient_as_bucket_view: bool = True
    """DDP: gradients alias the all-reduce buckets (saves memory and a copy)."""
    static_graph: bool = False
    """DDP: the graph is the same every step."""
    bucket_cap_mb: float = 25.0
    """DDP: all-reduce bucket size."""
    sync_batchnorm: bool = False
    """Convert BatchNorm layers to SyncBatchNorm."""
    keep_host_memory: bool = True
    """Ranks keep freed host memory for their next steps (glibc malloc; docs/training.md,
    Speed): CPU steps of a small conv net 1.6x faster, +5 % peak RSS; room at the heap's top
    for 32 MiB activations (eval's forwards 1.3x faster). false: glibc's defaults."""


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


DATASETS_WITHOUT_FILES = frozenset({"digits", "synthetic"})
"""Data sets that need nothing on disk: bundled with scikit-learn, or generated."""


def reads_files(data: DataConfig) -> bool:
    """Whether the data set must already be on disk (pre-flight checks it is)."""
    return data.name not in DATASETS_WITHOUT_FILES and not data.download


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
