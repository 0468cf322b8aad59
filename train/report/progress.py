"""The progress bar of an epoch: on rank 0's terminal only, counted in samples (so the rate it
shows is samples/s). Output to a file or a Slurm log gets one line per epoch instead."""

from __future__ import annotations

import sys
from collections.abc import Iterable, Iterator
from typing import Any, TypeVar

T = TypeVar("T")


class Progress:
    def __init__(self, enabled: bool, epochs: int, global_batch: int) -> None:
        self.enabled, self.epochs, self.global_batch = enabled, epochs, global_batch
        self._bar: Any = None

    def over(self, batches: Iterable[T], epoch: int, total: int) -> Iterator[T]:
        """`batches`, drawing the bar while they are consumed."""
        if not self.enabled:
            yield from batches
            return
        from tqdm import tqdm

        with tqdm(batches, total=total, desc=f"epoch {epoch + 1}/{self.epochs}", leave=False,
                  unit="sample", unit_scale=self.global_batch, dynamic_ncols=True,
                  file=sys.stderr) as bar:
            self._bar = bar
            yield from bar
        self._bar = None

    def show(self, **values: float) -> None:
        """Values beside the bar (the latest step loss)."""
        if self._bar is not None:
            self._bar.set_postfix({k: f"{v:.4g}" for k, v in values.items()}, refresh=False)
