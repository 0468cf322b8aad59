"""A rank failing on purpose, for the tests of how a job ends when one rank fails (and as a
drill on a new cluster): the environment variable TRAIN_FAIL_DRILL, never the user's config.

TRAIN_FAIL_DRILL="R:S" makes rank R raise FailureDrill at optimiser step S (S=0: at start-up,
before the job's MLflow run exists). Several entries are separated by commas; "J/R:S" applies
only to the sweep job whose output directory is named J (hydra.sweep.subdir: the job's number),
so that one sweep can hold a job failing at start-up, one failing in training and one that
finishes. The variable reaches local ranks and Slurm jobs as any environment variable does.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

ENV = "TRAIN_FAIL_DRILL"
_ENTRY = re.compile(r"(?:(?P<job>[^/,]+)/)?(?P<rank>\d+):(?P<step>\d+)")


class FailureDrill(RuntimeError):
    """The failure asked for with TRAIN_FAIL_DRILL."""


def fail_at(rank: int, output_dir: str | Path) -> int | None:
    """The step at which this rank of the job in `output_dir` is to fail; None = never."""
    raw = os.environ.get(ENV, "").strip()
    if not raw:
        return None
    job = Path(output_dir).name
    for entry in raw.split(","):
        found = _ENTRY.fullmatch(entry.strip())
        if found is None:
            raise ValueError(f"{ENV}={raw!r}: each entry is RANK:STEP or JOB/RANK:STEP")
        if int(found["rank"]) == rank and found["job"] in (None, job):
            return int(found["step"])
    return None


def check(at: int | None, step: int, rank: int) -> None:
    """Raise FailureDrill when this rank's drill is due at `step`."""
    if at is not None and step == at:
        raise FailureDrill(f"{ENV}: rank {rank} failing on purpose at step {step}")
