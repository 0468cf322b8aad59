"""Where the step time goes: each rank's seconds per phase of its training steps, as MLflow
metrics at every logging step and as a verdict (the run's `bottleneck` tag and one line of
advice) at the end.

The phases are those the hang watch already marks (train/distributed/phase.py: the clock read
as a rank changes phase, no sync of its own); every rank's sums travel in the logging step's one
all_gather (train/report/metrics.py sync_step), so each rank holds the whole table and nothing
is added to the other steps.

  data        waiting for the next batch (the DataLoader, or the data set's own __getitem__)
  forward     the model and the task's loss; under DDP also the buffers' broadcast
  backward    gradients; under DDP also the wait for the gradients' all-reduce, which overlaps
              backward and cannot be told apart from it by a clock; under FSDP the gathers
  optimizer   the optimiser step (and clipping, the LR schedule)
  collective  explicit collectives: the logging step's, a varying-items task's item count
  other       anything else in the interval (logging, a checkpoint, a validation)

On the CPU the host's clock. On a GPU the device's: a CUDA event at each change of phase,
read back at the logging step (train/distributed/device_clock.py), so forward and backward
hold their kernels' time rather than the time to queue them, and data the time the device sat
idle for want of a batch; the host clock would put the device's work wherever the host next
waits for it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

PHASES = ("data", "forward", "backward", "optimizer", "collective", "other")
KINDS = {"input": ("data",), "compute": ("forward", "backward", "optimizer"),
         "communication": ("collective",)}
"""The `bottleneck` tag's values and the phases each one adds up."""


def phase_seconds(spent: Mapping[str, float]) -> list[float]:
    """phase.take_spent()'s sums in PHASES order; phases outside PHASES count as "other"."""
    named = [float(spent.get(phase, 0.0)) for phase in PHASES[:-1]]
    return [*named, float(sum(s for p, s in spent.items() if p not in PHASES[:-1]))]


def share(row: Sequence[float], phase: str) -> float:
    """`phase`'s share of a rank's phase_seconds."""
    return _shares(row)[PHASES.index(phase)]


def _shares(row: Sequence[float]) -> list[float]:
    total = sum(row)
    return [s / total if total > 0 else 0.0 for s in row]


def slowest(table: Sequence[Sequence[float]]) -> int:
    """The rank the others wait for: every rank's step lasts as long as the slowest one's, the
    fast ones waiting inside forward and backward (DDP's buffers' broadcast and gradients'
    all-reduce, FSDP's gathers), where a clock cannot tell the wait from the work. So: the
    rank with the most time in the phases that hold no wait, data and optimizer."""
    own = [row[PHASES.index("data")] + row[PHASES.index("optimizer")] for row in table]
    return own.index(max(own))


@dataclass
class Verdict:
    bottleneck: str
    """input, compute or communication"""
    line: str
    """What it is and what to try, for the terminal and the run's `bottleneck_hint` tag."""


class Breakdown:
    """The step-time breakdown of one rank's training: the logging intervals' metrics, and the
    whole run's sums per rank for the verdict."""

    def __init__(self) -> None:
        self.totals: list[list[float]] = []

    def interval(self, table: Sequence[Sequence[float]], steps: int) -> dict[str, float]:
        """The metrics of one logging interval of `steps` optimiser steps; `table`: every
        rank's phase_seconds, by rank. Rank 0's seconds per step and shares, and the slowest
        rank's shares with its number."""
        if not self.totals:
            self.totals = [[0.0] * len(PHASES) for _ in table]
        for total, row in zip(self.totals, table, strict=True):
            for i, seconds in enumerate(row):
                total[i] += seconds
        values: dict[str, float] = {}
        for phase, seconds, share in zip(PHASES, table[0], _shares(table[0]), strict=True):
            values[f"time/{phase}"] = seconds / max(1, steps)
            values[f"time/{phase}_share"] = share
        worst = slowest(table)
        values["time/slowest_rank"] = float(worst)
        for phase, share in zip(PHASES, _shares(table[worst]), strict=True):
            values[f"time/slowest/{phase}_share"] = share
        return values

    def verdict(self, num_workers: int, ranks_here: int, precision: str = "fp32",
                compiled: bool = False, sharded: bool = False,
                strategy: str = "ddp") -> Verdict | None:
        """What held the run back (None before any logging step): what the slowest rank spent
        most of its step time on - the others wait for it, and their waits, inside backward
        under DDP, are its doing, not theirs. Of the compute settings, only those the run has
        not set (`precision`, `compiled`) are suggested; `sharded`: the data already comes
        from a few large files (data=arrow, tokens), so that is not suggested either.
        `strategy` (distributed.strategy) names the communication the compute phases hold."""
        untried = [o for o, on in (("trainer.precision=bf16-mixed", precision != "fp32"),
                                   ("trainer.compile=true", compiled)) if not on]
        if not self.totals or not any(sum(row) for row in self.totals):
            return None
        rank = slowest(self.totals)
        shares = dict(zip(PHASES, _shares(self.totals[rank]), strict=True))
        by_kind = {kind: sum(shares[p] for p in phases) for kind, phases in KINDS.items()}
        kind = max(by_kind, key=lambda k: by_kind[k])
        if kind == "input":
            cpus = len(os.sched_getaffinity(0)) // max(1, ranks_here)
            line = (f"rank {rank} waited for data {by_kind[kind]:.0%} of its step time with "
                    f"data.num_workers={num_workers} and {cpus} CPUs per rank: "
                    + _input_advice(num_workers, cpus, sharded))
        elif kind == "compute":
            line = (f"rank {rank} computed {by_kind[kind]:.0%} of its step time ("
                    f"{_compute_phases(strategy, len(self.totals))}, the optimiser step)" +
                    (f": on a GPU try {' or '.join(untried)}" if untried else
                     ": a smaller model, or more GPUs"))
        else:
            line = (f"rank {rank} waited in collectives {by_kind[kind]:.0%} of its step time: "
                    "log less often (trainer.log_every_n_steps) or take larger steps "
                    "(data.batch_size, trainer.accumulate_grad_batches)")
        return Verdict(kind, line)


def _compute_phases(strategy: str, ranks: int) -> str:
    """What a rank's forward and backward phases hold besides its own compute: the waits of
    the strategy's collectives, which the host clock cannot tell apart (none on one rank)."""
    if ranks < 2:
        return "forward, backward"
    if strategy == "fsdp":
        return "forward and backward with FSDP's parameter gathers and gradient reduce-scatters"
    return "forward, backward with DDP's gradient all-reduce"


def _input_advice(num_workers: int, cpus: int, sharded: bool) -> str:
    """What to try for a rank that waits for its data: more workers while it has idle CPUs
    (workers beyond its CPUs only take turns on them), else more CPUs or less work per
    sample; a sharded data set where it reads a file per sample."""
    if num_workers < cpus:
        tries = [f"raise data.num_workers (up to {cpus})"]
    else:
        tries = ["give each rank more CPUs (cluster.cpus_per_task, or fewer ranks per node)",
                 "or lighter per-sample work (data transforms, decoding)"]
    if not sharded:
        tries.append("or use a sharded data set (data=arrow, written by `train prepare-data`)")
    return ", ".join(tries)
