"""trainer.ema: an exponential moving average of the weights, kept beside them on every rank.

The average is one tensor per entry of the model's state dict (parameters and buffers, so
BatchNorm's running statistics are averaged too; integer buffers are copied), updated in place
after every `every`-th optimiser step with torch.optim.swa_utils' EMA rule (one foreach lerp
per device and dtype; no host sync). Under FSDP each tensor is a DTensor like the parameter it
follows: each rank averages its own shards, and a sharded checkpoint holds the average as
resharded as the model (train/engine/sharded.py). torch's AveragedModel is not used as a whole:
it deep-copies the module, which under FSDP would copy its sharding hooks too.

`applied()` puts the average into the model for validation (the training loop) and gives the
trained weights back after; `apply()` puts it in for good (the test split and the final
weights, train/engine/job.py). What a checkpoint holds: `state_dict()` (train/engine/
checkpoint.py).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.optim.swa_utils import get_ema_multi_avg_fn

from train.config.ema import EmaConfig
from train.engine import fsdp

log = logging.getLogger("train")
RAW_WEIGHTS = "model_raw.pt"
"""The trained weights' file beside model.pt (the average's) where trainer.ema is on."""

Group = tuple[list[torch.Tensor], list[torch.Tensor]]
"""The average's and the model's local tensors of one device and dtype, in the same order."""


class Ema:
    def __init__(self, cfg: EmaConfig, module: nn.Module) -> None:
        """The average of `module`'s weights, starting as a copy of them. `module` is the bare
        (or FSDP-sharded) model, whose tensors are held here: call it once the model is built
        and sharded, before any forward."""
        self.cfg, self.module = cfg, module
        self.average_step = get_ema_multi_avg_fn(cfg.decay)
        _reshard(module)
        self.live = dict(module.state_dict(keep_vars=True))
        self.shadow = {name: t.detach().clone() for name, t in self.live.items()}
        self.floats, self.others = self._groups()

    def _groups(self) -> tuple[list[Group], list[Group]]:
        """The floating-point tensors grouped for foreach kernels, and the others (counters)."""
        floats: dict[tuple[torch.device, torch.dtype], Group] = {}
        others: Group = ([], [])
        for name, tensor in self.live.items():
            mine, theirs = fsdp.local(self.shadow[name]), fsdp.local(tensor.detach())
            if tensor.is_floating_point():
                group = floats.setdefault((mine.device, mine.dtype), ([], []))
                group[0].append(mine)
                group[1].append(theirs)
            else:
                others[0].append(mine)
                others[1].append(theirs)
        return list(floats.values()), [others] if others[0] else []

    @torch.no_grad()
    def update(self, step: int) -> None:
        """After optimiser step `step`: a copy of the weights up to trainer.ema.start_step,
        then one averaging step, every trainer.ema.every steps."""
        if step % self.cfg.every:
            return
        for average, weights in self.floats:
            if step <= self.cfg.start_step:
                torch._foreach_copy_(average, weights)
            else:
                self.average_step(average, weights, step)
        for average, weights in self.others:
            torch._foreach_copy_(average, weights)

    @torch.no_grad()
    def _swap_in(self) -> list[torch.Tensor]:
        """The average into the model's tensors; returns copies of what they held."""
        _reshard(self.module)  # FSDP: the shards, not a gathered copy, are the weights
        held = []
        for average, weights in [*self.floats, *self.others]:
            held += [w.clone() for w in weights]
            torch._foreach_copy_(weights, average)
        return held

    @contextmanager
    def applied(self) -> Iterator[None]:
        """The model holds the average inside, its trained weights again after (every rank:
        under FSDP the swap is of each rank's shards)."""
        held = self._swap_in()
        try:
            yield
        finally:
            _reshard(self.module)  # the evaluation's gathered copy of the average goes
            weights = [w for _, group in [*self.floats, *self.others] for w in group]
            with torch.no_grad():
                torch._foreach_copy_(weights, held)

    def apply(self) -> None:
        """The average into the model for good: after training, for the test and model.pt."""
        self._swap_in()

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The average in the model's state-dict layout (DTensors under FSDP)."""
        return dict(self.shadow)

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Any]) -> None:
        """A checkpoint's average: whole tensors (a single-file checkpoint, whichever strategy
        wrote it), each rank keeping its shard of each under FSDP."""
        from torch.distributed.tensor import DTensor, distribute_tensor

        missing = sorted(set(self.shadow) - set(state))
        if missing:
            raise KeyError(f"the checkpoint's EMA lacks {missing[:3]}")
        for name, average in self.shadow.items():
            whole = state[name]
            if isinstance(average, DTensor):
                whole = distribute_tensor(whole.to(average.device_mesh.device_type),
                                          average.device_mesh, average.placements,
                                          src_data_rank=None).to_local()
            fsdp.local(average).copy_(whole)

    @torch.no_grad()
    def reset(self) -> None:
        """The average restarts from the weights (a checkpoint written without trainer.ema)."""
        for average, weights in [*self.floats, *self.others]:
            torch._foreach_copy_(average, weights)
        log.info("trainer.ema: the checkpoint holds no average; it starts from its weights")


def _reshard(module: nn.Module) -> None:
    """FSDP: every sharded module's gathered parameters freed and its shards registered again
    (the root keeps what it gathered for an evaluation's forwards; DDP: nothing to do)."""
    from torch.distributed.fsdp import FSDPModule

    for part in module.modules():
        if isinstance(part, FSDPModule):
            part.reshard()


def applied(average: Ema | None) -> contextlib.AbstractContextManager:
    """`average.applied()`, or nothing to apply where trainer.ema is off."""
    return contextlib.nullcontext() if average is None else average.applied()
