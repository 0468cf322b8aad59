"""distributed.strategy=fsdp: the model sharded with FSDP2 (`torch.distributed.fsdp.fully_shard`)
and what rank 0 alone would otherwise do on a whole model.

Every parameter becomes a DTensor holding this rank's rows (Shard(0)); a block's forward and
backward all-gather its parameters, and its gradients are reduce-scattered (averaged, as DDP
does, so the loop's loss scaling is the same under both strategies). Hence:
- every rank must run the same forwards, in the same order (evaluation pads with filler
  forwards: train/engine/loop.py `evaluate`);
- `state_dict()` is this rank's shards: checkpoints, best.pt and model.pt take the consolidated
  state dict (`full_state_dict`, a collective; rank 0 receives it in host memory one
  parameter at a time, so no rank holds two whole copies);
- what rank 0 does with a whole model (the MLflow model, a task's sampled text) it does on a
  plain copy built from that state dict (`plain_copy`), and FLOPs are counted from shapes
  (`meta_copy`).
Where the model is built before it is sharded (whole, or on the meta device) and how its
shards are then initialised: train/engine/fsdp_init.py.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from train.config.groups import TrainConfig
from train.errors import ConfigError

log = logging.getLogger("train")


def is_sharded(module: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(module, FSDPModule)


def offloads(cfg: TrainConfig) -> bool:
    """Whether the job keeps FSDP's shards in host memory (distributed.fsdp.cpu_offload): its
    collectives then reduce host tensors too (train/distributed/process_group.py `init`)."""
    return cfg.distributed.strategy == "fsdp" and cfg.distributed.fsdp.cpu_offload


def blocks(module: nn.Module, names: list[str]) -> list[nn.Module]:
    """The submodules sharded one by one: those of the classes `names`, or (none named) the
    modules held in ModuleLists (model=gpt's `Block`s: a transformer's repeated layers)."""
    if not names:
        names = sorted({type(child).__name__ for list_ in module.modules()
                        if isinstance(list_, nn.ModuleList) for child in list_})
    found = [m for m in module.modules() if type(m).__name__ in names and m is not module]
    missing = sorted(set(names) - {type(m).__name__ for m in found})
    if missing and not found:
        raise ConfigError(f"distributed.fsdp.shard_modules={names}: the model has no module of "
                          f"class {missing[0]}; name classes of its blocks (or [] for the "
                          "default), e.g. distributed.fsdp.shard_modules=[Block].")
    return found


def shard(module: nn.Module, cfg: TrainConfig, device: torch.device) -> nn.Module:
    """fully_shard each block, then the root (bottom-up, as FSDP2 asks), over all ranks of the
    job, with trainer.precision's MixedPrecisionPolicy and distributed.fsdp's keys."""
    from torch.distributed import get_world_size
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import (
        CPUOffloadPolicy,
        MixedPrecisionPolicy,
        OffloadPolicy,
        fully_shard,
    )

    # An explicit mesh: FSDP2's default picks the accelerator whatever the job's device.
    mesh = init_device_mesh(device.type, (get_world_size(),))
    policy = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
              if cfg.trainer.precision == "bf16-mixed" else MixedPrecisionPolicy())
    # Pinned host shards let their copies to the GPU overlap; pinning needs CUDA (a CPU job
    # with cpu_offload failed at its first forward).
    offload = (CPUOffloadPolicy(pin_memory=device.type == "cuda")
               if cfg.distributed.fsdp.cpu_offload else OffloadPolicy())
    reshard = cfg.distributed.fsdp.reshard_after_forward
    parts = blocks(module, list(cfg.distributed.fsdp.shard_modules))
    kinds = "/".join(sorted({type(p).__name__ for p in parts})) or "no"  # before FSDP renames
    # BatchNorm keeps fp32 parameters (FSDP1's MixedPrecision does the same by default): its
    # running statistics are fp32 buffers, and batch_norm refuses bf16 weights beside them
    # ("expected scalar type BFloat16 but found Float"); it takes the bf16 input as it is.
    if cfg.trainer.precision == "bf16-mixed":
        for norm in [m for m in module.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)
                     and m is not module]:
            fully_shard(norm, mesh=mesh, reshard_after_forward=reshard,
                        mp_policy=MixedPrecisionPolicy(), offload_policy=offload)
    for part in parts:
        fully_shard(part, mesh=mesh, reshard_after_forward=reshard, mp_policy=policy,
                    offload_policy=offload)
    # The root's parameters (embeddings, final norm) stay gathered after forward: backward
    # needs them first (FSDP2's default for the root).
    fully_shard(module, mesh=mesh, reshard_after_forward=False, mp_policy=policy,
                offload_policy=offload)
    log.info("FSDP2: %d %s blocks sharded over %d ranks, then the root (precision %s)",
             len(parts), kinds, get_world_size(), cfg.trainer.precision)
    return module


def compile_sharded(module: nn.Module, cfg: TrainConfig) -> str:
    """trainer.compile under FSDP2, as torchtitan compiles it: each sharded block's forward in
    place (`compile_each`), so FSDP's hooks (a block's all-gather before its forward, its
    reduce-scatter after its backward) stay outside the graphs and overlap them as without
    compile; a model without blocks, the root's forward. What was compiled, for the log."""
    parts = blocks(module, list(cfg.distributed.fsdp.shard_modules))
    compile_each(parts or [module])
    return f"{len(parts)} blocks' forwards" if parts else "the root's forward (no blocks)"


def compile_each(modules: list[nn.Module]) -> None:
    """torch.compile each module's forward in place: its hooks (FSDP's, the recompute's) stay
    outside the graph, and parameter names, state dicts and checkpoints stay as without."""
    for module in modules:
        module.forward = torch.compile(module.forward)


@contextlib.contextmanager
def gradient_sync(model: nn.Module, sync: bool) -> Iterator[None]:
    """DDP's no_sync under either strategy: `sync=False` accumulates this micro-batch's
    gradient on the rank only; the step's last micro-batch reduces the sum. A one-rank job's
    bare model (train/engine/state.py) has nothing to reduce."""
    if sync or not (is_sharded(model) or hasattr(model, "no_sync")):
        yield
    elif is_sharded(model):
        model.set_requires_gradient_sync(False)  # type: ignore[operator]
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)  # type: ignore[operator]
    else:
        with model.no_sync():  # type: ignore[operator]
            yield


def local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of a (DTensor) gradient: scaled in place, no collective."""
    to_local = getattr(tensor, "to_local", None)
    return to_local() if callable(to_local) else tensor


def whole(tensor: torch.Tensor) -> torch.Tensor:
    """A value FSDP holds as a DTensor (clip_grad_norm_'s norm), whole on every rank: a
    collective then, so every rank calls it at the same point; a plain tensor as it is."""
    full_tensor = getattr(tensor, "full_tensor", None)
    return full_tensor() if callable(full_tensor) else tensor


def share_rank0_buffers(module: nn.Module) -> None:
    """Collective: every rank takes rank 0's buffers (BatchNorm's running statistics). Each
    rank's statistics follow its own batches - under FSDP, which shards parameters, not
    buffers, always; under DDP since its last forward (DDP broadcasts rank 0's buffers before
    each) - so without this the ranks would validate, test and checkpoint different models.
    Taken before each evaluation and sharded checkpoint, they are the model rank 0's weights
    files hold (BatchNorm in training mode uses each batch's own statistics, not these)."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    for buffer in module.buffers():
        dist.broadcast(buffer, src=0)


def full_state_dict(module: nn.Module, optimizer: torch.optim.Optimizer | None = None
                    ) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """Collective (every rank, same point): the consolidated model state dict, and the
    optimiser's in torch.optim's own layout (parameters by index, as a DDP job saves it), on
    rank 0 in host memory; empty dicts on the other ranks."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    weights = get_model_state_dict(module, options=options)
    if optimizer is None:
        return weights, None
    by_name = get_optimizer_state_dict(module, optimizer, options=options)
    if not by_name:
        return weights, {}
    index = {fqn: i for i, fqn in enumerate(_names_in_order(module, optimizer))}
    state = {index[fqn]: value for fqn, value in by_name["state"].items()}
    groups = [{**g, "params": [index[fqn] for fqn in g["params"]]} for g in by_name["param_groups"]]
    return weights, {"state": state, "param_groups": groups}


def load_full(module: nn.Module, optimizer: torch.optim.Optimizer | None,
              weights: dict[str, Any], optim_state: dict[str, Any] | None = None) -> None:
    """Collective: a consolidated state dict (a DDP or an FSDP job's: the same layout) into
    the sharded model (and optimiser); every rank passes the whole dicts."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    options = StateDictOptions(full_state_dict=True)
    with _buffers_beside_parameters(module):
        set_model_state_dict(module, weights, options=options)
    if optimizer is None or optim_state is None:
        return
    names = _names_in_order(module, optimizer)
    by_name = {"state": {names[i]: value for i, value in optim_state["state"].items()},
               "param_groups": [{**g, "params": [names[i] for i in g["params"]]}
                                for g in optim_state["param_groups"]]}
    set_optimizer_state_dict(module, optimizer, by_name, options=options)


@contextlib.contextmanager
def _buffers_beside_parameters(module: nn.Module) -> Iterator[None]:
    """The buffers on the parameters' device for as long as the block runs. Offloaded shards
    live in host memory and the buffers (BatchNorm's statistics) on the GPU, and torch loads a
    full state dict only into a model on one device ("Multiple devices found")."""
    devices = {p.device for p in module.parameters()}
    moved: list[tuple[nn.Module, str, torch.device]] = []
    if len(devices) == 1:
        [device] = devices
        for owner in module.modules():
            for name, buffer in owner._buffers.items():
                if buffer is not None and buffer.device != device:
                    moved.append((owner, name, buffer.device))
                    owner._buffers[name] = buffer.to(device)
    try:
        yield
    finally:
        for owner, name, device in moved:
            owner._buffers[name] = owner._buffers[name].to(device)


def _names_in_order(module: nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
    """Each optimiser parameter's name, in torch.optim's index order (groups in turn)."""
    name_of = {id(p): name for name, p in module.named_parameters()}
    return [name_of[id(p)] for group in optimizer.param_groups for p in group["params"]]


def meta_copy(cfg: TrainConfig, spec: Any) -> nn.Module:
    """The model as built, on the meta device: its shapes (parameter count, FLOPs) without
    memory and without the sharded module."""
    from train.models import build as models

    with torch.device("meta"):
        return models.build(cfg.model, spec)


def plain_copy(cfg: TrainConfig, spec: Any, weights: dict[str, Any]) -> nn.Module:
    """Rank 0: a plain module holding the consolidated `weights` (their tensors, not a copy of
    them: assign=True) for what rank 0 does alone with the final model."""
    module = meta_copy(cfg, spec)
    module.load_state_dict(weights, assign=True)
    return module.eval()
