"""Reads of tensor values on the host, counted by optimiser step: on a GPU each is a host sync
(tests/unit/test_host_reads.py in process, tests/e2e/test_host_reads.py in each rank).

Counted: `.item()`, `bool()`, `float()` and `int()` of a tensor (all `_local_scalar_dense`),
the ops that size their output by the data (`nonzero`, a boolean mask's index...), and
`.tolist()`, `.numpy()` and `.cpu()` (no op of their own on a CPU tensor; on a GPU the last is
a copy to the host, which waits). Not counted: reads of the samples in the DataLoader's fetch,
which are on the host anyway, and `.to(device)` (on this CPU the job's device is the host: a
copy to the host cannot be told from the batch's move to the device).
"""

from __future__ import annotations

import json
import os
import traceback
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

READING_OPS = {"aten._local_scalar_dense.default", "aten.nonzero.default",
               "aten.masked_select.default", "aten._unique2.default", "aten.unique_dim.default",
               "aten.equal.default", "aten.repeat_interleave.Tensor"}
READING_METHODS = ("tolist", "numpy", "cpu")
HOST_DATA = "/torch/utils/data/"
FOLDER_VAR = "HOST_READS_DIR"
"""Where each rank of a counted job writes rank-<N>.json (CountedCrossEntropy)."""


class HostReads(TorchDispatchMode):
    """Every read of a tensor's value on the host: (optimiser steps done, what, where)."""

    def __init__(self) -> None:
        super().__init__()
        self.steps = 0
        self.seen: Counter[tuple[int, str, str]] = Counter()

    def note(self, what: str) -> None:
        stack = traceback.extract_stack()[:-2]
        if any(HOST_DATA in f.filename for f in stack):
            return
        ours = [f for f in stack if "/train/" in f.filename and "-packages/" not in f.filename]
        where = f"{Path(ours[-1].filename).name}:{ours[-1].lineno} {ours[-1].name}" if ours \
            else "outside the project"
        self.seen[(self.steps, what, where)] += 1

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        name = str(func)
        if name in READING_OPS or (name == "aten.index.Tensor" and any(
                i is not None and i.dtype == torch.bool for i in args[1])):
            self.note(name)
        return func(*args, **(kwargs or {}))

    def counting_methods(self) -> dict[str, Callable[..., Any]]:
        """READING_METHODS, each noting its call: to put on torch.Tensor."""
        def counting(name: str) -> Callable[..., Any]:
            real = getattr(torch.Tensor, name)

            def read(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
                self.note(f"Tensor.{name}")
                return real(tensor, *args, **kwargs)
            return read
        return {name: counting(name) for name in READING_METHODS}

    def stepped(self, *_: Any) -> None:
        """An optimiser step's post-hook."""
        self.steps += 1

    def rows(self) -> list[list[Any]]:
        """[steps done, what, where, how many], in order: what a rank writes (JSON)."""
        return [[*key, n] for key, n in sorted(self.seen.items())]


def outside_logging(rows: list[list[Any]], last: int, log_every: int) -> list[list[Any]]:
    """Reads in steps that do not log: after the first step started and before step `last`
    ended, in no logging step's tail (its own logging, the next step's data and forward)."""
    return [row for row in rows if 0 < row[0] < last and row[0] % log_every]


def fused_as_on_gpu() -> Callable[..., bool | None]:
    """train/engine/optim.py's `fused_kernels` answering as on a GPU: the fused optimiser
    kernels (the CPU's unfused Adam reads each parameter's step count at every step)."""
    from train.engine import optim

    fused = optim.fused_kernels
    return lambda name, params, on_gpu: fused(name, params, True)


class CountedCrossEntropy(nn.CrossEntropyLoss):
    """trainer.loss for a counted job: built in each rank before its first step, it starts the
    count there, and writes it to $HOST_READS_DIR/rank-<RANK>.json after every optimiser step."""

    reads: HostReads | None = None
    """This process's count, started by the first loss built in it."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # Once per process. The launcher's pre-flight builds one too: its count writes nothing,
        # as no optimiser steps there.
        if CountedCrossEntropy.reads is None:
            CountedCrossEntropy.reads = _count_this_rank()


def _count_this_rank() -> HostReads:
    from torch.optim.optimizer import register_optimizer_step_post_hook

    from train.engine import optim

    reads = HostReads()
    optim.fused_kernels = fused_as_on_gpu()
    for name, method in reads.counting_methods().items():
        setattr(torch.Tensor, name, method)
    out = Path(os.environ[FOLDER_VAR]) / f"rank-{os.environ.get('RANK', '0')}.json"

    def stepped(*args: Any) -> None:
        reads.stepped(*args)
        out.write_text(json.dumps(reads.rows()))

    register_optimizer_step_post_hook(stepped)
    reads.__enter__()  # for the rest of this rank's life, on its main thread
    return reads
