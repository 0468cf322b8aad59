"""Driving an Optuna sweep without batches: up to n_jobs trials in flight, the next one asked
and started as soon as one ends (finished, pruned or failed).

Each trial is one job, started by a `Start` (locally: `python -m train` in its own process, run
mode, its output directory <sweep dir>/<trial number>; a process per trial is what lets trials
overlap, as Hydra's in-process launcher cannot). The job itself tells the study how it ended
(train/engine/trial.py); the driver only settles what a job left RUNNING (a crash: from its
summary.json if it got that far, else FAIL).

A trial RUNNING that no process of this driver runs belongs to an earlier driver (a resumed
sweep): it holds a slot while its heartbeat is fresh, and is failed - and its parameters asked
again - once the heartbeat is older than 3 heartbeat intervals (its job died with the driver).
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from train.engine import trial as trial_lib
from train.errors import TrainError
from train.launch.study import FINISHED, StudySettings

log = logging.getLogger("train.sweep")

POLL_S = 0.5
"""How often the driver looks at its jobs (a process poll each: cheap)."""


class Handle(Protocol):
    def poll(self) -> int | None: ...


Prepare = Callable[[int, dict[str, Any]], list[str]]
"""(trial number, params) -> the job's overrides; raises TrainError when pre-flight refuses."""
Start = Callable[[int, list[str]], Handle]


def local_start(sweep_dir: str) -> Start:
    """Each trial as `python -m train <overrides>` in its own process (run mode)."""

    def start(number: int, overrides: list[str]) -> Handle:
        job_dir = Path(sweep_dir) / str(number)
        job_dir.mkdir(parents=True, exist_ok=True)
        with open(job_dir / "job.out", "ab") as out:  # the child keeps its own descriptor
            return subprocess.Popen([sys.executable, "-m", "train", *overrides,
                                     f"hydra.run.dir={job_dir}"], stdout=out,
                                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)

    return start


def run_trials(study: Any, s: StudySettings, sweep_dir: str, prepare: Prepare,
               start: Start) -> None:
    """Until n_trials trials have ended (those of earlier drivers count)."""
    from train.launch.study import distributions

    space = distributions(s.params)
    in_flight: dict[int, Handle] = {}
    while True:
        trials = study.get_trials(deepcopy=False)
        fail_stale(study, trials, set(in_flight), s.heartbeat_s)
        trials = study.get_trials(deepcopy=False)
        # A trial failed for lack of heartbeat is asked again: its retry counts, not it.
        retried = {t.user_attrs.get("retry_of") for t in trials}
        ended = sum(t.state.name in FINISHED and t.number not in retried for t in trials)
        foreign = [t.number for t in trials
                   if t.state.name == "RUNNING" and t.number not in in_flight]
        busy = len(in_flight) + len(foreign)
        while busy < s.n_jobs and ended + busy < s.n_trials:
            trial = study.ask(space)
            try:
                overrides = prepare(trial.number, trial.params)
            except TrainError as e:
                print(f"trial {trial.number} refused: {e}", file=sys.stderr, flush=True)
                study.tell(trial, state=_state("FAIL"))
                ended += 1
                continue
            in_flight[trial.number] = start(trial.number, overrides)
            log.info("trial %d started: %s", trial.number, trial.params)
            busy += 1
        if busy == 0:
            return
        _wait_for_one(in_flight, foreign_waiting=bool(foreign))
        for number in [n for n, h in in_flight.items() if h.poll() is not None]:
            handle = in_flight.pop(number)
            settle(study, number, Path(sweep_dir) / str(number), s.objectives, handle.poll())


def _wait_for_one(in_flight: dict[int, Handle], foreign_waiting: bool) -> None:
    """Until a job of this driver ends; at most 5 s while an earlier driver's trial runs (its
    end shows only in the study)."""
    deadline = time.monotonic() + (5.0 if foreign_waiting else float("inf"))
    while time.monotonic() < deadline:
        if any(h.poll() is not None for h in in_flight.values()):
            return
        time.sleep(POLL_S)


def settle(study: Any, number: int, job_dir: Path, objectives: list[str],
           returncode: int | None) -> str:
    """After a trial's job ended: the trial's state, told here if the job did not tell it."""
    trial = study.get_trials(deepcopy=False)[number]
    if trial.state.name == "RUNNING":
        values = _summary_values(job_dir, objectives)
        if "pruned_at" in trial.user_attrs:
            study.tell(number, state=_state("PRUNED"))
        elif values is not None and returncode == 0:
            study.tell(number, values if len(values) > 1 else values[0])
        else:
            study.tell(number, state=_state("FAIL"))
        trial = study.get_trials(deepcopy=False)[number]
    state = trial.state.name
    value = trial.values if trial.values else ""
    print(f"trial {number}: {state} {value} {trial.params}"
          + (f" (job exit {returncode}; see {job_dir}/job.out)" if returncode else ""),
          flush=True)
    return state


def _summary_values(job_dir: Path, objectives: list[str]) -> list[float] | None:
    try:
        metrics = json.loads((job_dir / "summary.json").read_text())["metrics"]
        return [float(metrics[o]) for o in objectives]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def fail_stale(study: Any, trials: list[Any], own: set[int], heartbeat_s: float) -> list[int]:
    """RUNNING trials of no live job (heartbeat older than 3 intervals, or none for as long):
    FAIL, and their parameters asked again (a WAITING trial the next `ask` takes)."""
    now, failed = time.time(), []
    for t in trials:
        if t.state.name != "RUNNING" or t.number in own:
            continue
        started = t.datetime_start.timestamp() if t.datetime_start else now
        beat = float(t.user_attrs.get(trial_lib.HEARTBEAT_ATTR, started))
        if now - beat > 3 * heartbeat_s:
            study.tell(t.number, state=_state("FAIL"))
            study.enqueue_trial(t.params, user_attrs={"retry_of": t.number})
            log.warning("trial %d: no heartbeat for %.0f s: failed, its parameters asked again",
                        t.number, now - beat)
            failed.append(t.number)
    return failed


def _state(name: str) -> Any:
    from optuna.trial import TrialState

    return TrialState[name]
