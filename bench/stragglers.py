"""The straggler check's and the step-time breakdown's own work at a logging step, timed in
one process (docs/benchmarks.md, "The straggler check", "Where the step time goes"): a step's
phase marks with and without `Stragglers.mine` and `judge`, and with the breakdown's
(`phase_seconds` of the rank's sums, `Breakdown.interval` over `--ranks` ranks' rows). The
best of --rounds rounds: a busy machine's noise is not their cost.

    python -m bench.stragglers
"""

from __future__ import annotations

import argparse
import json
import os
import time

from train.distributed import phase
from train.engine.stragglers import Stragglers
from train.report.breakdown import Breakdown, phase_seconds


def per_step(check: Stragglers | None, ranks: int, steps: int) -> float:
    started = time.perf_counter()
    for step in range(steps):
        phase.enter("data")
        phase.enter("forward")
        phase.enter("optimizer", step)
        if check is not None:
            mine = check.mine()
            check.judge([mine] * ranks, step)
    return (time.perf_counter() - started) / steps


def per_step_breakdown(ranks: int, steps: int) -> float:
    """The loop's logging-step work for the breakdown: its row, then every rank's metrics."""
    breakdown = Breakdown()
    started = time.perf_counter()
    for step in range(steps):
        phase.enter("data")
        phase.enter("forward")
        phase.enter("optimizer", step)
        phase.enter("collective")
        row = phase_seconds(phase.take_spent())
        breakdown.interval([row] * ranks, 1)
    return (time.perf_counter() - started) / steps


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--steps", type=int, default=20_000)
    p.add_argument("--rounds", type=int, default=7)
    args = p.parse_args()
    check = Stragglers(0.5, 3, lambda rank: f"node{rank}", lambda tags: None, speaks=True)
    marks = min(per_step(None, args.ranks, args.steps) for _ in range(args.rounds))
    both = min(per_step(check, args.ranks, args.steps) for _ in range(args.rounds))
    timed = min(per_step_breakdown(args.ranks, args.steps) for _ in range(args.rounds))
    print(json.dumps({"ranks": args.ranks, "marks_us": round(marks * 1e6, 2),
                      "check_us_per_logging_step": round((both - marks) * 1e6, 2),
                      "breakdown_us_per_logging_step": round((timed - marks) * 1e6, 2),
                      "load_average_1min": os.getloadavg()[0]}))


if __name__ == "__main__":
    main()
