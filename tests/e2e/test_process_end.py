"""A process that submitit started ends without the interpreter's teardown once a rank
returned (train/distributed/process_end.py), and loses nothing of it: the result submitit
pickles after the return reaches the submitter, every exit handler still runs, and a task that
fails after all keeps the interpreter's own ending - its error and a non-zero exit. Real
submitit tasks (its local executor: `python -m submitit.core._submit`, as on a Slurm node)."""

from __future__ import annotations

import atexit
import os
import pickle
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from tests.conftest import REPO


def _returns(marker: str) -> dict[str, float]:
    from train.distributed import process_end

    atexit.register(Path(marker).write_text, "exit handler ran")
    before = atexit._ncallbacks()
    process_end.end_quickly_under_submitit()
    return {"val/loss": 0.25, "quick_end_armed": atexit._ncallbacks() - before}


def _fails_after_its_rank_returned(marker: str) -> None:
    _returns(marker)
    raise RuntimeError("failed after the rank's return")


def _task(function: Callable[[str], object], tmp_path: Path) -> tuple[int, str, Path]:
    """`function` run as the one task of a job, by the command srun runs on a Slurm node
    (`python -m submitit.core._submit FOLDER`, submitit's local job variables standing in for
    Slurm's): the task's exit code, its output, and its result pickle."""
    from submitit.core import utils

    folder, marker = tmp_path / "submitit", tmp_path / "marker"
    paths = utils.JobPaths(folder, job_id="7", task_id=0)
    paths.folder.mkdir(parents=True)
    utils.DelayedSubmission(function, str(marker)).dump(paths.submitted_pickle)
    env = {**os.environ, "PYTHONPATH": str(REPO), "SUBMITIT_EXECUTOR": "local",
           "SUBMITIT_LOCAL_JOB_ID": "7",
           "SUBMITIT_LOCAL_NTASKS": "1", "SUBMITIT_LOCAL_JOB_NUM_NODES": "1",
           "SUBMITIT_LOCAL_NODEID": "0", "SUBMITIT_LOCAL_GLOBALID": "0",
           "SUBMITIT_LOCAL_LOCALID": "0"}
    done = subprocess.run([sys.executable, "-m", "submitit.core._submit", str(folder)],
                          env=env, capture_output=True, text=True, timeout=120)
    return done.returncode, done.stdout + done.stderr, paths.result_pickle


def test_a_task_that_returned_hands_over_its_result_and_runs_its_exit_handlers(
        tmp_path: Path) -> None:
    code, output, result = _task(_returns, tmp_path)
    assert code == 0, output
    with result.open("rb") as f:  # submitit's pickle of this test's own function
        assert pickle.load(f) == ("success", {"val/loss": 0.25, "quick_end_armed": 1})
    assert (tmp_path / "marker").read_text() == "exit handler ran"
    assert "Exiting after successful completion" in output


def test_a_task_failing_after_the_return_ends_as_the_interpreter_ends_it(
        tmp_path: Path) -> None:
    code, output, result = _task(_fails_after_its_rank_returned, tmp_path)
    assert code == 1, output
    assert "RuntimeError: failed after the rank's return" in output
    with result.open("rb") as f:
        outcome, error = pickle.load(f)
    assert outcome == "error" and "failed after the rank's return" in error
    assert (tmp_path / "marker").read_text() == "exit handler ran"
