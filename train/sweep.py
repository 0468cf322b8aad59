"""`python -m train.sweep status|resume <sweep dir>`: an Optuna sweep's trials from its study,
and a sweep whose driver died continued.

Both read <sweep dir>/sweep.json, which the sweeper wrote when it began (train/launch/study.py):
the study's storage and name, and the command that started the sweep. `resume` runs that
command again with the same hydra.sweep.dir: the sweeper loads the study (finished trials stay
finished and count), waits for trials an earlier driver left running while their heartbeat is
fresh, fails those whose job is gone and asks their parameters again, and goes on until
n_trials trials have ended, under the same parent MLflow run.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any


def __getattr__(name: str) -> object:
    """`train.sweep` was the sweep's parent-run module (now train/tracking/sweep.py): its names
    still answer here, for configs (`_target_: train.sweep.ParentRunCallback`) and pickles."""
    if name.startswith("__"):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from train.tracking import sweep as moved

    return getattr(moved, name)


def _record(sweep_dir: Path) -> dict[str, Any]:
    path = sweep_dir / "sweep.json"
    if not path.is_file():
        raise SystemExit(f"error: {path} does not exist: not the directory of an Optuna sweep "
                         f"of this project (hydra.sweep.dir)")
    return json.loads(path.read_text())


def status(sweep_dir: Path) -> int:
    from train.engine.trial import load_study

    record = _record(sweep_dir)
    study = load_study(f"{record['storage']}::{record['study_name']}")
    trials = study.get_trials(deepcopy=False)
    print(f"study {record['study_name']!r} in {record['storage']}: {len(trials)} of "
          f"{record['n_trials']} trials asked")
    print(f"{'trial':>5}  {'state':<8}  {'value':<22}  {'steps':>5}  params")
    for t in trials:
        value = "" if t.values is None else ", ".join(f"{v:.6g}" for v in t.values)
        note = f"  pruned_at={t.user_attrs['pruned_at']}" if "pruned_at" in t.user_attrs else ""
        print(f"{t.number:>5}  {t.state.name:<8}  {value:<22}  "
              f"{len(t.intermediate_values):>5}  {t.params}{note}")
    states = [t.state.name for t in trials]
    print("  ".join(f"{s}: {states.count(s)}" for s in sorted(set(states))))
    if len(study.directions) == 1 and "COMPLETE" in states:
        best = study.best_trial
        print(f"best so far: trial {best.number}, {best.value:.6g}, {best.params}")
    return 0


def resume(sweep_dir: Path) -> int:
    record = _record(sweep_dir)
    argv = [*record["argv"], f"hydra.sweep.dir={sweep_dir.resolve()}"]
    print("resuming:", " ".join(argv[1:]), flush=True)
    return subprocess.call(argv, cwd=record.get("cwd") or os.getcwd())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m train.sweep", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=("status", "resume"))
    parser.add_argument("sweep_dir", type=Path)
    args = parser.parse_args(argv)
    return status(args.sweep_dir) if args.command == "status" else resume(args.sweep_dir)


if __name__ == "__main__":
    sys.exit(main())
