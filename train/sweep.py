"""`python -m train sweep status|resume <sweep dir>`: a sweep's jobs or trials, and a sweep
continued where it stopped.

Both read <sweep dir>/sweep.json, written once the sweep's jobs passed their pre-flight
(train/tracking/sweep.py; an Optuna search's also names its study, train/launch/study.py): the
command that started the sweep and its parent run. `resume` runs that command again with the
same hydra.sweep.dir, under the same parent MLflow run:
- a grid sweep (a=1,2 b=x,y): each finished job stays as it is (the launchers do not start it
  again), each failed, stopped or never-started job resumes from its checkpoints into its own
  run - after a failure, a node lost, a sweep stopped with Ctrl-C;
- an Optuna search: the sweeper loads the study (finished trials stay finished and count),
  waits for trials an earlier driver left running while their heartbeat is fresh, fails those
  whose job is gone and asks their parameters again, and goes on until n_trials have ended.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from train.errors import FailureRecord


def __getattr__(name: str) -> object:
    """`train.sweep` was the sweep's parent-run module (now train/tracking/sweep.py): its names
    still answer here, for configs (`_target_: train.sweep.ParentRunCallback`) and pickles."""
    if name.startswith("__"):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from train.tracking import sweep as moved

    return getattr(moved, name)


def _record(sweep_dir: Path) -> dict[str, Any]:
    path = sweep_dir / "sweep.json"
    if not path.is_file():  # a usage error: exit 2, as every other command's
        print(f"error: {path} does not exist: not the directory of a sweep of this project "
              "that started its jobs with tracking on (hydra.sweep.dir)", file=sys.stderr)
        raise SystemExit(2)
    return json.loads(path.read_text())


def status(sweep_dir: Path) -> int:
    record = _record(sweep_dir)
    if "storage" not in record:
        return _grid_status(sweep_dir, record)
    from train.engine.trial import load_study

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


def _grid_status(sweep_dir: Path, record: dict[str, Any]) -> int:
    """Each job directory's state as its files tell it (no store needed): FINISHED (its
    summary.json, newer than any failure.json), FAILED (failure.json), else not finished."""
    print(f"sweep {sweep_dir}: parent MLflow run {record.get('parent_run_id')}")
    states: list[str] = []
    jobs = [p for p in sweep_dir.iterdir() if p.is_dir() and (
        p.name.isdigit() or (p / "mlflow_run.json").exists() or (p / "train.log").exists())]
    for job in sorted(jobs, key=lambda p: (not p.name.isdigit(), int(p.name) if
                                           p.name.isdigit() else 0, p.name)):
        state, note = _job_state(job)
        states.append(state)
        run = _json(job / "mlflow_run.json").get("run_id", "-")
        print(f"{job.name:>5}  {state:<12}  run {run}{note}")
    print("  ".join(f"{s}: {states.count(s)}" for s in sorted(set(states))))
    if any(s != "FINISHED" for s in states):
        print(f"resume the others: python -m train sweep resume {sweep_dir}")
    return 0


def _job_state(job: Path) -> tuple[str, str]:
    summary, failure = job / "summary.json", FailureRecord.read(job)
    if summary.exists() and (failure is None or summary.stat().st_mtime >= failure.at):
        return "FINISHED", ""
    if failure is not None:
        return "FAILED", f"  {failure.cause}"
    if not any((job / name).exists() for name in ("ranks", "mlflow_run.json", "checkpoints")):
        return "not started", ""  # no rank got as far as its heartbeat (Hydra's files only)
    return "not finished", "  (running, stopped or killed)"


def _json(path: Path) -> dict[str, Any]:
    try:
        found = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return found if isinstance(found, dict) else {}


def resume(sweep_dir: Path) -> int:
    record = _record(sweep_dir)
    # Followed to its end even if first submitted unwaited: the last job to end would end the
    # parent, and the jobs still to run again are FAILED runs that look ended already.
    argv = [("cluster.wait=true" if a.lower() == "cluster.wait=false" else a)
            for a in record["argv"]]
    argv.append(f"hydra.sweep.dir={sweep_dir.resolve()}")
    print("resuming:", " ".join(argv[1:]), flush=True)
    return subprocess.call(argv, cwd=record.get("cwd") or os.getcwd())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m train sweep", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=("status", "resume"))
    parser.add_argument("sweep_dir", type=Path)
    args = parser.parse_args(argv)
    return status(args.sweep_dir) if args.command == "status" else resume(args.sweep_dir)


if __name__ == "__main__":
    sys.exit(main())
