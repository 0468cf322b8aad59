"""The `optim` config group: the optimiser (a preset or any class by `_target_`) and its learning-
rate schedule. A dataclass with a docstring per field, like train/config/groups.py's (whose
TrainConfig holds it); built by train/engine/optim.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class OptimConfig:
    name: str = "sgd"
    """sgd or adamw: the preset optimiser, unless `_target_` names another."""
    _target_: str | None = None
    """Any optimiser by dotted path: a torch.optim class (torch.optim.Adadelta) or your own
    (a torch.optim.Optimizer subclass, or a function returning one). Built, as Hydra's
    `_partial_: true` does, as target(<the parameter groups>, lr=optim.lr,
    weight_decay=optim.weight_decay, **optim.args), lr and weight_decay where it takes them;
    the groups carry optim.lr x lr_scale and weight_decay (optim.param_groups). null = the
    preset `name`; momentum, nesterov and betas are the presets' only."""
    args: dict[str, Any] = field(default_factory=dict)
    """`_target_`'s own arguments, e.g. +optim.args.rho=0.95 (not lr, weight_decay or params:
    optim.lr and optim.weight_decay are passed, and the model's groups)."""
    lr: float = 0.05
    """Peak learning rate."""
    momentum: float = 0.9
    """sgd: momentum."""
    nesterov: bool = True
    """sgd: Nesterov momentum."""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    """adamw: betas."""
    weight_decay: float = 5e-4
    """Decoupled (adamw) or L2 (sgd) weight decay."""
    schedule: str = "cosine"
    """The built-in schedule, stepped per optimiser step: cosine (with linear warm-up) or
    constant. Unused when `scheduler._target_` is set (so are warmup_epochs, min_lr_ratio)."""
    warmup_epochs: float = 0.0
    """Linear warm-up length in epochs (fractions allowed)."""
    min_lr_ratio: float = 0.0
    """cosine: final lr as a fraction of the peak."""
    scheduler: dict[str, Any] = field(default_factory=lambda: {"_target_": None})
    """Any LR scheduler by dotted path and its arguments, e.g. optim.scheduler._target_=
    torch.optim.lr_scheduler.StepLR +optim.scheduler.step_size=30: built as target(<the
    optimiser>, **args) (a `_partial_` key is ignored: the call always is). Filled where it
    takes them and they are not set: max_lr (OneCycleLR, CyclicLR) = each group's lr;
    total_steps (when neither it nor epochs / steps_per_epoch is set) = the job's optimiser
    steps, or epochs with scheduler_interval=epoch; ReduceLROnPlateau's mode = trainer.monitor's
    direction (it is stepped with trainer.monitor's value after each validation). null
    `_target_` = the built-in `schedule`."""
    scheduler_interval: str = "epoch"
    """When `scheduler` steps: epoch (once, at each epoch's end; Lightning's default) or step
    (after every optimiser step). ReduceLROnPlateau: epoch only. The built-in schedule always
    steps per optimiser step."""
    grad_clip: float | None = None
    """Clip the global gradient norm to this value (the norm before clipping is logged as
    train/grad_norm at each logging step); null = no clipping."""
    param_groups: list[dict[str, Any]] = field(default_factory=list)
    """Parameters trained with their own settings, e.g. [{prefix: layer4, lr_scale: 0.1}]: per
    group a module-name `prefix`, `lr_scale` (times optim.lr; the schedule scales every group
    alike) and optionally `weight_decay`. The rest keep optim.lr and optim.weight_decay.
    Prefixes must match trainable parameters and not overlap."""
