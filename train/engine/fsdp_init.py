"""distributed.strategy=fsdp: where the model is built before train/engine/fsdp.py shards it -
whole on every rank (init_on=cpu, and auto where it fits: the same initial weights as DDP's
from the same seed) or on the meta device, each rank then initialising its own shards
(init_on=meta) - and the one-line refusal of a model that cannot be initialised that way."""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from train.config.groups import TrainConfig
from train.engine.fsdp import meta_copy

log = logging.getLogger("train")


HOST_SHARE = 0.5
"""init_on=auto builds the whole model on every rank while this node's ranks' copies take at
most this share of the host's available memory."""


def init_place(cfg: TrainConfig, spec: Any, device: torch.device) -> str:
    """Collective: where this job's sharded model is built - `cpu`, whole on every rank first,
    as DDP builds it, so that the same seed gives the same initial weights; or `meta`, without
    memory, each rank initialising its own shards (other values from the same seed).
    distributed.fsdp.init_on=auto takes cpu where this node's ranks' whole copies fit in
    HOST_SHARE of the host's available memory, on every rank (they agree: one all-reduce),
    and model.weights always takes cpu."""
    import os

    import psutil
    import torch.distributed as dist

    chosen = cfg.distributed.fsdp.init_on
    if chosen != "auto":
        return chosen
    if cfg.model.weights:
        return "cpu"
    model = meta_copy(cfg, spec)  # shapes only: no memory, no random numbers drawn
    whole = sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))
    copies = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))  # set by every launcher
    fits = torch.tensor([int(whole * copies <= HOST_SHARE * psutil.virtual_memory().available)],
                        device=device)
    if dist.is_initialized():
        dist.all_reduce(fits, op=dist.ReduceOp.MIN)
    if bool(fits.item()):
        return "cpu"
    log.warning("distributed.fsdp.init_on=auto: the whole model (%.1f GB, %d on this node) does "
                "not fit in %d%% of host memory, so each rank initialises its own shards "
                "(init_on=meta): its initial weights differ from a DDP job's with the same seed "
                "(tag fsdp.init_on=meta)", whole / 1e9, copies, int(HOST_SHARE * 100))
    return "meta"


def not_initialisable(module: nn.Module) -> str | None:
    """Why a model built on the meta device cannot be initialised shard by shard: a module
    holding parameters or buffers of its own and no reset_parameters() (unless the model has
    init_weights(), which then initialises everything). None when it can."""
    if callable(getattr(module, "init_weights", None)):
        return None
    for name, sub in module.named_modules():
        own = [*sub.parameters(recurse=False), *sub.buffers(recurse=False)]
        if own and not callable(getattr(sub, "reset_parameters", None)):
            return (f"its module {name or '(root)'} ({type(sub).__name__}) holds parameters or "
                    "buffers and has no reset_parameters()")
    return None


def meta_refusal(cfg: TrainConfig, module: nn.Module) -> str | None:
    """The one line refusing distributed.fsdp.init_on=meta for a model it cannot initialise
    (pre-flight, where the model can be built on the meta device, and every rank)."""
    if cfg.distributed.strategy != "fsdp" or cfg.distributed.fsdp.init_on != "meta":
        return None
    if (problem := not_initialisable(module)) is None:
        return None
    return (f"distributed.fsdp.init_on=meta cannot initialise model {type(module).__name__}: "
            f"{problem}. Give it reset_parameters() or an init_weights() method, or set "
            "distributed.fsdp.init_on=cpu.")


def meta_refusal_of_auto(cfg: TrainConfig, module: nn.Module) -> str | None:
    """init_on=auto's refusal where it had to build on meta (the model does not fit in host
    memory on every rank) a model that cannot be initialised shard by shard."""
    if (problem := not_initialisable(module)) is None:
        return None
    return (f"distributed.fsdp.init_on=auto: model {type(module).__name__} does not fit in host "
            f"memory whole on every rank, and cannot be initialised shard by shard: {problem}. "
            "Give it reset_parameters() or an init_weights() method, or run fewer ranks per "
            "node with distributed.fsdp.init_on=cpu.")


def materialise(module: nn.Module, device: torch.device, offload: bool = False) -> None:
    """A sharded meta-device model's shards allocated on `device` and initialised: the
    model's init_weights() if it has one, else every module's reset_parameters(). With
    `offload` (distributed.fsdp.cpu_offload) the shards live in host memory - FSDP2 refuses
    offloaded parameters on the GPU at the first forward - and only the buffers (BatchNorm's
    statistics), which FSDP does not move, go to `device`, where the forward uses them."""
    module.to_empty(device=torch.device("cpu") if offload else device)
    init = getattr(module, "init_weights", None)
    with torch.no_grad():
        if callable(init):
            init()
        else:
            for sub in module.modules():
                if callable(reset := getattr(sub, "reset_parameters", None)):
                    reset()
    if offload:
        for sub in module.modules():
            for name, buffer in sub.named_buffers(recurse=False):
                sub._buffers[name] = buffer.to(device)
