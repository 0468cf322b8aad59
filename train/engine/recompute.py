"""model.activation_checkpointing: blocks whose activations are recomputed in backward instead
of kept from forward - the first thing to try when a model almost fits.

torch's composable `checkpoint` (torch.distributed._composable), as torchtitan's per-block
choice: hooks on each chosen block, non-reentrant, so parameter names, state dicts,
checkpoints and optimiser groups are those of the model without it, and it composes with
FSDP2's fully_shard (applied first, on the same blocks FSDP shards). With trainer.compile each
block's forward is compiled instead of the whole model (`compile_blocks`, as torchtitan
compiles per block): the recompute in backward then runs the same compiled forward as the
forward did - a whole-model compile breaks its graph at the hooks, and the recomputed block
saved other tensors than the compiled one (torch.utils.checkpoint's CheckpointError, seen). The
hooks do not pickle, so the model logged at the end is a plain copy of the weights
(train/engine/outputs.py).
"""

from __future__ import annotations

from torch import nn
from torch.distributed._composable import checkpoint

from train.engine import fsdp
from train.errors import ConfigError

APPLIED = "_train_activation_checkpointing"
"""Set on a model whose blocks recompute, to what does (train/engine/outputs.py then logs a
plain copy)."""
BLOCKS = "_train_blocks"
"""Set on such a model to all its blocks (`compile_blocks`)."""


def every(mode: str) -> int | None:
    """Every how many blocks recompute: None for none; 1 for blocks; N for "N"."""
    if mode == "none":
        return None
    if mode == "blocks":
        return 1
    if mode.isdigit() and int(mode) > 0:
        return int(mode)
    raise ConfigError(f"model.activation_checkpointing={mode!r}: choose none, blocks or a "
                      "number N (every N-th block).")


def chosen_blocks(module: nn.Module, mode: str, shard_modules: list[str]) -> list[nn.Module]:
    """The blocks that will recompute; a model without blocks is refused in one line."""
    step = every(mode)
    return [] if step is None else _all_blocks(module, mode, shard_modules)[::step]


def _all_blocks(module: nn.Module, mode: str, shard_modules: list[str]) -> list[nn.Module]:
    try:
        found = fsdp.blocks(module, shard_modules)
    except ConfigError:
        found = []
    if not found:
        raise ConfigError(
            f"model.activation_checkpointing={mode}: the model has no blocks - the modules "
            "held in its ModuleLists, or the classes distributed.fsdp.shard_modules names "
            "(e.g. distributed.fsdp.shard_modules=[BasicBlock] for a torchvision ResNet).")
    return found


def apply(module: nn.Module, mode: str, shard_modules: list[str]) -> None:
    """Make the chosen blocks of `module` recompute in backward."""
    if (step := every(mode)) is None:
        return
    found = _all_blocks(module, mode, shard_modules)
    for block in found[::step]:
        checkpoint(block)
    setattr(module, APPLIED,
            f"{len(found[::step])} of {len(found)} {type(found[0]).__name__} blocks")
    module.__dict__[BLOCKS] = found  # a plain attribute: not submodules a second time


def compile_blocks(module: nn.Module) -> None:
    """trainer.compile for a model whose blocks recompute: each block's forward compiled in
    place (the hooks stay outside it, so the forward and its recompute run one graph)."""
    fsdp.compile_each(module.__dict__[BLOCKS])


def applied(module: nn.Module) -> str | None:
    """What recomputes in `module` ("2 of 4 Block blocks", the run's tag); None: nothing."""
    return getattr(module, APPLIED, None)
