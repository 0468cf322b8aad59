"""A user's own optimiser and scheduler, as a research project would write them: NOT part of
train/, reached only through PYTHONPATH (tests/ on it: `optim._target_=userpkg.optim.HalfSGD`)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch


class HalfSGD(torch.optim.SGD):
    """Plain SGD that applies `share` of each step (default half): w - share x lr x grad."""

    def __init__(self, params: Iterable[Any], lr: float = 0.1, share: float = 0.5,
                 weight_decay: float = 0.0) -> None:
        super().__init__(params, lr=lr, weight_decay=weight_decay)
        self.share = share

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        lrs = [group["lr"] for group in self.param_groups]
        for group in self.param_groups:
            group["lr"] = group["lr"] * self.share
        try:
            return super().step(closure)
        finally:
            for group, lr in zip(self.param_groups, lrs, strict=True):
                group["lr"] = lr


def plain_sgd(params: Iterable[Any], lr: float) -> torch.optim.Optimizer:
    """A function returning an optimiser (no weight_decay argument: none is passed)."""
    return torch.optim.SGD(params, lr=lr)


def not_an_optimiser(params: Iterable[Any], lr: float) -> dict[str, float]:
    """Returns something else: refused in one line."""
    return {"lr": lr}
