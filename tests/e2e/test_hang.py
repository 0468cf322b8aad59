"""A rank that hangs: named with the user's line it is stuck on, in the terminal and in the run;
every rank's stacks kept in the output directory and as the run's artifacts (issue 29).

Real parts: two local ranks, a user Dataset (tests/userpkg/data.py StuckOnRank) whose reads
block in time.sleep on rank 1, gloo's real timeout, the MLflow store read back."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from statistics import median
from typing import Any

import pytest
from mlflow import MlflowClient

from tests.conftest import REPO, USER_PATH, history, run_train, runs_in, skip_or_fail, wait_until
from train.tracking.store import how_to_view

TIMEOUT_S = 10
ENDS_WITHIN_S = TIMEOUT_S + 30
"""From the hang to the job's exit: the collective's timeout, the waiting ranks' check that all
answer (up to 3 s), the ranks' stacks (up to 5 s) and rank 0 ending its run (seconds on a busy
2-core machine); the stuck rank is then stopped at once."""
STUCK = ("data=custom", "data.train._target_=userpkg.data.StuckOnRank", "+data.train.length=48",
         "data.val._target_=userpkg.data.Lines", "+data.val.length=16", "model.width=8",
         "tracking.log_model=false", "distributed.nproc_per_node=2", "data.batch_size=8",
         "data.num_workers=0", f"distributed.timeout_s={TIMEOUT_S}")
USERPKG = {"PYTHONPATH": os.pathsep.join([USER_PATH, str(REPO)])}


def _sleep_line() -> int:
    return _line_of("data.py", "time.sleep(3600)")


@pytest.mark.parametrize(("after", "caller"), [
    (0, "called from train/data/userdata.py"),  # the first read, before training
    (20, "called from DataLoader"),  # mid-epoch: 20 samples read, the third step
], ids=["before-training", "mid-epoch"])
def test_a_stuck_rank_is_named_with_the_line_it_is_stuck_on(
        store: dict[str, str], tmp_path: Path, after: int, caller: str) -> None:
    out = tmp_path / "job"
    result = run_train(*STUCK, f"+data.train.after={after}", f"hydra.run.dir={out}",
                       env={**store, **USERPKG}, timeout=ENDS_WITHIN_S + 60)
    ended = time.time()
    assert result.returncode == 1, result.stderr
    stuck = (f"rank 1 on {socket.gethostname()} stuck ", f" s in userpkg/data.py:{_sleep_line()} "
             f"__getitem__ (time.sleep), {caller}")
    [line] = [x for x in result.stderr.splitlines() if x.startswith("error:")]
    assert line.startswith(f"error: the training job failed; {stuck[0]}"), result.stderr
    assert stuck[1] in line and "; rank 0 waited in " in line, line
    assert "Traceback" not in result.stderr  # the tracebacks are in train.log
    assert "Traceback" in (out / "train.log").read_text()
    hung_at = json.loads((out / "stacks" / "rank-1.txt").read_text().split("\n")[0][2:])
    took = ended - hung_at["since"]  # since rank 1 began the read it is stuck in
    assert took < ENDS_WITHIN_S, f"the job ended {took:.0f} s after rank 1 got stuck"
    [run] = runs_in(store["MLFLOW_TRACKING_URI"])
    assert run.info.status == "FAILED"
    assert run.data.tags["error"].startswith(stuck[0]) and stuck[1] in run.data.tags["error"]
    artifacts = MlflowClient(store["MLFLOW_TRACKING_URI"]).list_artifacts(run.info.run_id,
                                                                         "stacks")
    assert sorted(a.path for a in artifacts) == ["stacks/rank-0.txt", "stacks/rank-1.txt"]
    stacks = (out / "stacks" / "rank-1.txt").read_text()
    assert "in __getitem__" in stacks and "train-watchdog" not in stacks.split("\n", 1)[0]
    assert "Waited in a collective" in (out / "stacks" / "rank-0.txt").read_text()


@pytest.mark.parametrize(("overrides", "place"), [
    (("data.num_workers=1", "+data.train.after=20"),
     r"its DataLoader worker 0, at userpkg/data\.py:{sleep} __getitem__ \(time\.sleep\)"),
    (("model=custom", "model._target_=userpkg.models.SpinsOnRank", "data.num_workers=0",
      "+data.train.after=1000"),  # the loop's two lines: either is where it was caught
     r"userpkg/models\.py:({spin}|{loop}) forward( \(int\))?, called from "
     r"train/engine/loop\.py:\d+ _micro_step"),
], ids=["dataloader-worker", "endless-loop-in-forward"])
def test_a_stuck_worker_or_an_endless_loop_is_named(store: dict[str, str], tmp_path: Path,
                                                    overrides: tuple[str, ...],
                                                    place: str) -> None:
    common = [o for o in STUCK if not (o.startswith("model.") and "model=custom" in overrides)]
    result = run_train(*common, *overrides, f"hydra.run.dir={tmp_path / 'job'}",
                       env={**store, **USERPKG}, timeout=ENDS_WITHIN_S + 60)
    spin = _line_of("models.py", "spins += 1")
    stuck = f"rank 1 on {socket.gethostname()} stuck "
    assert result.returncode == 1, result.stderr
    [run] = runs_in(store["MLFLOW_TRACKING_URI"])
    error = run.data.tags["error"]
    assert error.startswith(stuck), error
    assert re.search(place.format(sleep=_sleep_line(), spin=spin, loop=spin - 1), error), error
    assert f"error: the training job failed; {error}" in result.stderr


def _line_of(module: str, text: str) -> int:
    lines = (REPO / "tests" / "userpkg" / module).read_text().splitlines()
    return next(i for i, line in enumerate(lines, 1) if text in line)


def _start(out: Path, store: dict[str, str], *overrides: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "train", *overrides, f"hydra.run.dir={out}"],
                            cwd=REPO, env={**os.environ, **store, **USERPKG}, text=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            start_new_session=True)


def _inspect(command: str, out: Path) -> str:
    """`train status|stacks <dir>` through the `train` console script the install put beside
    the interpreter (python -m train COMMAND runs the same code)."""
    script = Path(sys.executable).parent / "train"
    done = subprocess.run([str(script), command, str(out)], cwd=REPO,
                          env={**os.environ, **USERPKG}, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_status_and_stacks_of_a_running_job(store: dict[str, str], tmp_path: Path) -> None:
    """A job whose rank 1 is stuck mid-epoch (the collective's timeout far off): train.status
    shows it in "data" while rank 0 is in its forward; train.stacks names both frames, and the
    job goes on."""
    out = tmp_path / "job"
    job = _start(out, store, *STUCK[:-1], "distributed.timeout_s=120", "+data.train.after=20",
                 "trainer.log_every_n_steps=1")
    try:
        beat = out / "ranks" / "rank-1.json"
        wait_until(lambda: _beat(beat).get("phase") == "data" and _beat(beat)["step"] > 0
                   and time.time() - _beat(beat)["since"] > 2, 90, "rank 1 stuck", job=job)
        step = _beat(beat)["step"]
        status = _inspect("status", out)
        assert re.search(rf"^rank 1 on \S+ \(pid \d+\): step {step}, data for [\d.]+ s",
                         status, re.M), status
        assert re.search(rf"^rank 0 on \S+ \(pid \d+\): step {step}, forward for [\d.]+ s, "
                         r"waited for data \d+% of the last logging interval", status,
                         re.M), status
        stacks = _inspect("stacks", out)
        assert (f"rank 1: userpkg/data.py:{_sleep_line()} __getitem__ (time.sleep), called "
                "from DataLoader") in stacks, stacks
        assert "rank 0: " in stacks and "_sync_buffers" in stacks
        assert job.poll() is None  # a stack request stops no rank
    finally:
        os.killpg(job.pid, signal.SIGKILL)
        job.wait()


def _beat(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def test_a_frozen_rank_is_named_as_not_answering(store: dict[str, str], tmp_path: Path) -> None:
    """SIGSTOP on rank 1 mid-training: it cannot dump its stacks; the error says so, with its
    process state, and the job still ends."""
    out = tmp_path / "job"
    job = _start(out, store, *STUCK, "data.train._target_=userpkg.data.Lines",
                 "trainer.epochs=100")
    try:
        beat = out / "ranks" / "rank-1.json"
        wait_until(lambda: _beat(beat).get("step", 0) >= 3, 90, "rank 1 at step 3", job=job)
        pid = _beat(beat)["pid"]
        os.kill(pid, signal.SIGSTOP)
        stopped = time.monotonic()
        _, stderr = job.communicate(timeout=ENDS_WITHIN_S + 30)
        took = time.monotonic() - stopped
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(job.pid, signal.SIGKILL)
    assert job.returncode == 1
    line = (f"rank 1 on {socket.gethostname()} stopped answering (its process or node died, or "
            f"it is frozen): it did not answer the stack request; its process {pid} is stopped "
            "(SIGSTOP)")
    assert f"error: the training job failed; {line}" in stderr, stderr
    [run] = runs_in(store["MLFLOW_TRACKING_URI"])
    assert run.info.status == "FAILED" and run.data.tags["error"].startswith(line)
    # The timeout, the check of who answers (3 s), the unanswered stack request (5 s), rank 0
    # ending its run, then rank 1 killed at once.
    assert took < TIMEOUT_S + 30, f"the job ended {took:.0f} s after rank 1 froze"
    # Seen from outside once it ended: how it ended, and where its ranks last were - not two
    # ranks whose watchdogs fell silent - and no stack request sent to processes long gone.
    status = _inspect("status", out).splitlines()
    assert status[0].startswith(f"the job failed: {line}") and status[0].endswith(
        f"({out / 'failure.json'}); where its ranks last were:"), status
    assert [x.split(" (pid")[0] for x in status[1:]] == [f"rank {r} on {socket.gethostname()}"
                                                         for r in (0, 1)], status
    assert "silent" not in "\n".join(status)
    stacks = run_train("stacks", str(out), env=store)
    assert stacks.returncode == 2 and "no rank is left to ask" in stacks.stderr, stacks.stderr


def test_a_full_disk_at_a_checkpoint_is_one_line_in_the_terminal(
        store: dict[str, str], tmp_path: Path, request: pytest.FixtureRequest) -> None:
    """2 ranks, 1 MiB of output disk: the second checkpoint does not fit. The terminal shows
    the cause in one line, not rank 1's c10d warnings nor rank 0's traceback (train.log has
    them); the run is FAILED with it and the first checkpoint is kept."""
    if os.geteuid() != 0:
        skip_or_fail("mounting a small tmpfs needs root")
    out = tmp_path / "out"
    out.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(out)], check=True)
    request.addfinalizer(lambda: subprocess.run(["umount", "-l", str(out)], check=False))
    overrides = ("trainer.epochs=3", "tracking.log_model=false", "distributed.nproc_per_node=2")
    result = run_train(*overrides, f"hydra.run.dir={out}", env=store)
    assert result.returncode == 1
    block = _failure_block(result.stderr)
    assert re.fullmatch(r"error: the training job failed; rank 0 on \S+: DiskFull: No space "
                        r"left on device: the checkpoint .* needs \d+ bytes and .* has \d+ "
                        r"free", block[0]), block
    [run] = runs_in(store["MLFLOW_TRACKING_URI"])
    assert block[1:] == [
        f"  kept: {out}/checkpoints/step-000000023.pt (step 23), the newest checkpoint",
        f"  resume: python -m train {' '.join(overrides)} hydra.run.dir={out}",
        f"  run: MLflow run {run.info.run_id}; view it: {_view(store, run)}",
        f"  tracebacks: {out}/train.log"]
    assert not re.search(r"Traceback|c10d|Broken pipe|frame #", result.stderr), result.stderr
    assert result.stderr.count("No space left on device") == 1  # the block's, not rank 0's too
    assert "Traceback" in (out / "train.log").read_text()
    assert run.info.status == "FAILED" and "DiskFull" in run.data.tags["error"]
    assert [p.name for p in (out / "checkpoints").iterdir()] == ["step-000000023.pt"]


def test_a_straggler_is_named_in_a_warning_and_a_tag(store: dict[str, str],
                                                     tmp_path: Path) -> None:
    """Rank 1 reads every sample 50 ms slower: after 2 logging intervals it is named.

    50 ms, not 10: rank 1's compute share holds its waits for rank 0 inside DDP's collectives,
    and on a slow, loaded machine 40 ms of data a step (4 samples) lost to them in the run's
    sums (`compute`, with the intervals' median still `input`); 200 ms a step leaves the
    verdict to the data, whatever the machine's speed."""
    result = run_train(*STUCK, "data.train._target_=userpkg.data.SlowOnRank",
                       "++data.train.length=96", "+data.train.delay=0.05",
                       "trainer.log_every_n_steps=1",
                       "trainer.straggler_intervals=2", "trainer.epochs=2",
                       f"hydra.run.dir={tmp_path / 'job'}",
                       env={**store, **USERPKG}, timeout=ENDS_WITHIN_S + 60)
    assert result.returncode == 0, "the job failed:\n" + result.stderr
    named = re.search(r"rank 1 on \S+ is a straggler: [\d.]+ s waiting for data \(\d+% over "
                      r"the median rank's [\d.]+ s\) and [\d.]+ s computing in the logging "
                      r"interval up to step \d+; 2 intervals in a row", result.stderr)
    assert named, "no straggler named:\n" + result.stderr
    [run] = runs_in(store["MLFLOW_TRACKING_URI"])
    assert run.data.tags["straggler"] == named.group(0)
    assert result.stderr.count("is a straggler") == 1  # named once, by rank 0
    # The step-time breakdown names it too: the slowest rank, whose input holds the run back.
    uri, run_id = store["MLFLOW_TRACKING_URI"], run.info.run_id
    slowest = dict(history(uri, run_id, "time/slowest_rank"))  # 96 / 8 steps, twice
    assert len(slowest) == 24 and list(slowest.values()).count(1.0) >= 20, slowest
    ours, theirs = (dict(history(uri, run_id, f"time/{who}data_share"))
                    for who in ("", "slowest/"))
    # Most intervals (the first ones also hold the run's creation, which both ranks wait for).
    assert median(theirs.values()) > 0.5 > median(ours.values()), (ours, theirs)
    assert run.data.tags["bottleneck"] == "input"
    assert run.data.tags["bottleneck_hint"].startswith("rank 1 waited for data ")
    assert "bottleneck: input - rank 1 waited for data" in result.stderr
    # The run's picture of it: rank 1's bar mostly waiting for data, rank 0's not.
    figure = (tmp_path / "job" / "step_time.svg").read_text()
    waited = {int(rank): int(share) for rank, share in
              re.findall(r"<title>rank (\d) data: [\d.]+ s \((\d+)%\)</title>", figure)}
    assert waited[1] > 50 > waited[0], waited


def _view(store: dict[str, str], run: Any) -> str:
    return how_to_view(store["MLFLOW_TRACKING_URI"], run.info.experiment_id, run.info.run_id)


def _failure_block(stderr: str) -> list[str]:
    """The terminal's block for a failed job: its error line and the indented lines under it;
    nothing of it may come twice."""
    lines = stderr.splitlines()
    [start] = [i for i, line in enumerate(lines) if line.startswith("error:")]
    end = next((i for i in range(start + 1, len(lines)) if not lines[i].startswith("  ")),
               len(lines))
    return lines[start:end]


def test_a_user_exception_shows_its_own_frames_and_the_printed_command_resumes(
        store: dict[str, str], tmp_path: Path) -> None:
    """Rank 1's Dataset raises in the second epoch (a corrupt sample, once: a later read of it
    works): the terminal's block has the user's frames and the DataLoader's frame that called
    them, no frame of the service, the first epoch's checkpoint, and a command that, run as
    printed, continues the same MLflow run to FINISHED."""
    out = tmp_path / "job"
    overrides = [*STUCK, "data.train._target_=userpkg.data.BrokenSampleOnRank",
                 "+data.train.after=30", "trainer.epochs=2"]  # 24 reads per rank and epoch
    result = run_train(*overrides, f"hydra.run.dir={out}", env={**store, **USERPKG},
                       timeout=ENDS_WITHIN_S + 60)
    assert result.returncode == 1, result.stderr
    block = _failure_block(result.stderr)
    assert re.fullmatch(r"error: the training job failed; rank 1 on \S+: ValueError: sample \d+: "
                        r"corrupt header", block[0]), block
    decode, raised = _line_of("data.py", "return _decode(index)"), _line_of("data.py", "raise V")
    frames = [line.strip() for line in block if line.startswith("    File")]
    assert frames[0].startswith('File "') and "torch/utils/data/_utils/fetch.py" in frames[0]
    assert frames[1:] == [f'File "{REPO}/tests/userpkg/data.py", line {decode}, in __getitem__',
                          f'File "{REPO}/tests/userpkg/data.py", line {raised}, in _decode']
    assert block[-5].startswith("  ValueError: sample ") and "Traceback" not in block[0]
    assert block[-4] == (f"  kept: {out}/checkpoints/step-000000006.pt (step 6), the newest "
                         "checkpoint")
    [failed] = runs_in(store["MLFLOW_TRACKING_URI"])
    assert block[-2] == (f"  run: MLflow run {failed.info.run_id}; view it: "
                         f"{_view(store, failed)}")
    assert block[-1] == f"  tracebacks: {out}/train.log"
    log = (out / "train.log").read_text()
    whole = log.split("[rank 1] traceback of its error:\n")[1].split("\n[")[0]
    assert "in run_rank" in whole and "in _decode" in whole  # the whole traceback
    logged = MlflowClient(store["MLFLOW_TRACKING_URI"]).download_artifacts(
        failed.info.run_id, "train.log", str(tmp_path))
    assert whole in Path(logged).read_text()  # and in the run
    assert failed.info.status == "FAILED" and failed.data.tags["error"] == block[0].split("; ")[1]
    command = shlex.split(block[-3].removeprefix("  resume: "))
    assert command[:3] == ["python", "-m", "train"]
    assert json.loads((out / "failure.json").read_text())["cause"] == block[0].split("; ")[1]
    resumed = run_train(*command[3:], env={**store, **USERPKG}, timeout=ENDS_WITHIN_S + 60)
    assert resumed.returncode == 0, resumed.stderr
    assert not (out / "failure.json").exists()  # the finished job's cause is no stale one
    [run] = runs_in(store["MLFLOW_TRACKING_URI"])
    assert run.info.run_id == failed.info.run_id and run.info.status == "FINISHED"
    assert run.data.tags["restarts"] == "1"
    assert [step for step, _ in history(store["MLFLOW_TRACKING_URI"], run.info.run_id,
                                        "val/accuracy")] == [1, 2]
