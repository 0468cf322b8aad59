"""Stragglers: a rank that is slower than the others, named before it slows the job for long.

Each rank adds up its time waiting for data and computing (forward, backward) between logging
steps (train/distributed/phase.py: no sync of its own). At a logging step the ranks
share these sums, two numbers each in the logging step's own all_gather (train/report/
metrics.py sync_step: no collective of its own); a rank whose wait for data is more than
trainer.straggler_share over the median rank's for trainer.straggler_intervals logging
intervals in a row is named: a warning and the run's `straggler` tag.

Only the wait for data is judged: it ends before any collective. Under DDP the computing time
holds the gradients' all-reduce (in backward) and the buffers' broadcast (in forward), where a
fast rank waits for a slow one, so every rank's computing time grows alike; it is reported,
not judged.
"""

from __future__ import annotations

import logging
import statistics
from collections.abc import Callable, Mapping, Sequence

from train.distributed import phase
from train.report.breakdown import PHASES, phase_seconds

log = logging.getLogger("train")
OWN_WORK = ("data", "forward", "backward")
"""The phases a rank spends on its own, before it waits for the others."""


class Stragglers:
    def __init__(self, share: float, intervals: int, node_of: Callable[[int], str],
                 tag: Callable[[Mapping[str, str]], None], speaks: bool) -> None:
        """`speaks`: this rank warns (rank 0; every rank judges alike)."""
        self.share, self.intervals, self.node_of, self.tag = share, intervals, node_of, tag
        self.speaks = speaks
        self.streaks: dict[int, int] = {}
        self.named: set[int] = set()

    @staticmethod
    def own_work(phases: Sequence[float]) -> list[float]:
        """Waiting for data, and computing, from a rank's breakdown.phase_seconds."""
        return [phases[PHASES.index("data")], sum(phases[PHASES.index(p)] for p in OWN_WORK[1:])]

    @staticmethod
    def mine() -> list[float]:
        """This rank's sums since the last logging step: waiting for data, and computing."""
        return Stragglers.own_work(phase_seconds(phase.take_spent()))

    def judge(self, ranks: list[list[float]], step: int) -> None:
        totals = [data for data, _ in ranks]
        median = statistics.median(totals)
        for rank, total in enumerate(totals):
            slow = median > 0 and total > median * (1 + self.share)
            self.streaks[rank] = self.streaks.get(rank, 0) + 1 if slow else 0
            if self.streaks[rank] >= self.intervals and rank not in self.named and self.speaks:
                self.named.add(rank)
                data, compute = ranks[rank]
                text = (f"rank {rank} on {self.node_of(rank)} is a straggler: {data:.2f} s "
                        f"waiting for data ({total / median - 1:.0%} over the median rank's "
                        f"{median:.2f} s) and {compute:.2f} s computing in the logging "
                        f"interval up to step {step}; {self.streaks[rank]} intervals in a row")
                log.warning("%s", text)
                self.tag({"straggler": text})
