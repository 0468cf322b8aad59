"""The distributed group's keys: how ranks share the model (DDP or FSDP2), their backend and
device, with a docstring per field like train/config/groups.py's (which re-exports them)."""

from __future__ import annotations

from dataclasses import dataclass, field


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
    a GPU holds only what a block computes with, at the price of copies each step. With nccl,
    the process group gets gloo beside it for the host tensors (`cuda:nccl,cpu:gloo`)."""
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
