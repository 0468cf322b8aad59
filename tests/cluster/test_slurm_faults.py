"""Slurm faults, tried for real on the local 2-node cluster (issue 18): a dead node, a failing
set-up line, Ctrl-C while following, a time limit without requeue, scancel with DataLoader
workers, a tracking outage. What the login node says at submission:
tests/unit/test_slurm_faults.py."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

from tests.cluster.conftest import job_id, listed_by_squeue, slurm_job
from tests.conftest import REPO, USER_PATH, command_line, history, runs_in, wait_until

TWO_NODES = ("cluster.nodes=2", "cluster.tasks_per_node=1", "cluster.cpus_per_task=1",
             "data.batch_size=64")


def _processes_of(job: str, node: str) -> list[psutil.Process]:
    """A job's processes on one node: its ranks (by their Slurm environment), their children
    (DataLoader workers) and the slurmstepd above them."""
    found: dict[int, psutil.Process] = {}
    for p in psutil.process_iter():
        try:
            env = p.environ()
        except (psutil.Error, OSError):
            continue
        if env.get("SLURM_JOB_ID") == job and env.get("SLURMD_NODENAME") == node \
                and "submitit" in command_line(p):
            found.update({q.pid: q for q in [p, *p.children(recursive=True)]})
            if (parent := p.parent()) is not None and "slurmstepd" in parent.name():
                found[parent.pid] = parent
    return list(found.values())


def _train(tmp_path: Path, store: dict[str, str], *overrides: str) -> subprocess.Popen[str]:
    flags = [o for o in overrides if o == "-m"]  # argparse wants flags before the overrides
    return subprocess.Popen(
        [sys.executable, "-m", "train", *flags, "+cluster=slurm", "cluster.partition=debug",
         "cluster.time_min=10", f"hydra.sweep.dir={tmp_path}/sweep",
         *(o for o in overrides if o != "-m")],
        cwd=REPO, env={**os.environ, **store}, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, preexec_fn=_as_a_terminal_starts_it)


def _as_a_terminal_starts_it() -> None:
    """Ctrl-C reaches a terminal's foreground command: SIGINT at its default, also when these
    tests run in the background of a non-interactive shell (which starts them ignoring it)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _read_until(proc: subprocess.Popen[str], text: str, timeout: float) -> str:
    """stdout up to the first line holding `text` (fails after `timeout`)."""
    seen, deadline = [], time.monotonic() + timeout
    assert proc.stdout is not None
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        seen.append(line)
        if text in line or (not line and proc.poll() is not None):
            break
    out = "".join(seen)
    assert text in out, f"{text!r} not within {timeout} s:\n{out}"
    return out


def test_a_dead_node_ends_the_job_in_seconds_and_a_resume_finishes_clean(
        cluster: None, store: dict[str, str], tmp_path: Path) -> None:
    """Every process of the job on node2 killed: the run names rank 1 on node2, the job ends
    (cancelled, not requeued) within seconds; the same command then resumes and finishes the
    run, whose `error` is history (`attempts`), and ends like a local job."""
    overrides = (*TWO_NODES, "trainer.epochs=4", "tracking.log_model=false")
    proc = _train(tmp_path, store, *overrides)
    head = _read_until(proc, ": RUNNING", 180)
    assert "UNKNOWN" not in head  # the first state shown is a real one
    job = job_id(head)
    checkpoints = tmp_path / "sweep" / "0" / "checkpoints"
    wait_until(lambda: list(checkpoints.glob("step-*.pt")), 180, "the first checkpoint")
    victims = wait_until(lambda: _processes_of(job, "node2"), 30, "node2's processes")
    for p in victims:
        p.send_signal(signal.SIGKILL)
    killed_at = time.monotonic()
    stdout, stderr = proc.communicate(timeout=240)
    assert time.monotonic() - killed_at < 180, "the job outlived its dead node by 3 minutes"
    assert proc.returncode == 1, head + stdout + stderr
    assert "rank 1 on node2 stopped answering" in stderr
    uri = store["MLFLOW_TRACKING_URI"]
    [run] = runs_in(uri)
    assert run.info.status == "FAILED"
    assert run.data.tags["error"].startswith("rank 1 on node2 stopped answering")
    state = subprocess.run(["sacct", "-n", "-X", "-P", "-o", "State", "-j", job],
                           capture_output=True, text=True).stdout.split()
    assert state and state[0].startswith("CANCELLED")  # not left for Slurm to requeue

    resumed = slurm_job(tmp_path, *overrides, env=store, timeout=300)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    [run] = runs_in(uri)
    assert run.info.status == "FINISHED" and "error" not in run.data.tags
    assert run.data.tags["attempts"].startswith("attempt 1: FAILED: rank 1 on node2")
    assert [s for s, _ in history(uri, run.info.run_id, "val/loss")] == list(range(1, 5))
    assert f"MLflow run {run.info.run_id} FINISHED" in resumed.stdout
    assert "val/accuracy=" in resumed.stdout and "view it:" in resumed.stdout
    assert "Job completed successfully" not in "".join(
        p.read_text() for p in (tmp_path / "sweep" / ".submitit").glob(f"{job}/*_log.err"))


def test_a_failing_setup_line_fails_the_job_before_any_rank(
        cluster: None, store: dict[str, str], tmp_path: Path) -> None:
    result = slurm_job(tmp_path, 'cluster.setup=["cd /tmp","source /nowhere/venv/bin/activate"]',
                       "trainer.epochs=1", env=store, timeout=180)
    assert result.returncode == 1, result.stdout + result.stderr
    assert ": FAILED" in result.stdout
    assert ("error: cluster.setup line failed (exit 1): source /nowhere/venv/bin/activate"
            in result.stderr)
    assert "/nowhere/venv/bin/activate: No such file or directory" in result.stderr
    assert runs_in(store["MLFLOW_TRACKING_URI"]) == []  # no rank started


def test_ctrl_c_while_following_leaves_the_jobs_to_finish_the_sweep(
        cluster: None, store: dict[str, str], tmp_path: Path) -> None:
    proc = _train(tmp_path, store, "-m", "optim.lr=0.1,0.02", "trainer.epochs=2",
                  "tracking.log_model=false")
    head = _read_until(proc, ": RUNNING", 180)
    job = job_id(head)
    proc.send_signal(signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 130, head + stdout + stderr
    assert f"job {job} still runs: `scancel {job}` to stop it, `squeue -j {job}` to watch" \
        in stderr
    assert "Traceback" not in stderr and "KeyboardInterrupt" not in stderr
    uri = store["MLFLOW_TRACKING_URI"]

    def ended_parent() -> object:
        parents = [r for r in runs_in(uri) if r.data.tags.get("sweep") == "true"]
        return parents[0] if parents and parents[0].info.status != "RUNNING" else None

    parent = wait_until(ended_parent, 240, "the sweep's last job ending the parent run")
    assert parent.info.status == "FINISHED" and parent.data.metrics["sweep/children"] == 2
    wait_until(lambda: not listed_by_squeue(job), 60, f"job {job} leaving squeue")


def test_a_time_limit_without_requeue_says_how_to_resume(
        cluster: None, store: dict[str, str], tmp_path: Path) -> None:
    """USR2 60 s before a 2-minute limit, cluster.max_requeues=0: KILLED, and both the terminal
    and the run say where the checkpoint is and which command resumes from it."""
    result = slurm_job(tmp_path, "cluster.time_min=2", "cluster.signal_delay_s=60",
                       "cluster.max_requeues=0", "trainer.epochs=1000",
                       "trainer.log_every_n_steps=5", "tracking.log_model=false", env=store,
                       timeout=300)
    assert result.returncode == 1, result.stdout + result.stderr
    [run] = runs_in(store["MLFLOW_TRACKING_URI"])
    assert run.info.status == "KILLED" and run.data.tags["stopped_by"] == "SIGUSR2"
    note = run.data.tags["stop_reason"]
    checkpoint = note.split("checkpoint ")[1].split(" saved")[0]
    assert note.startswith("time limit reached, checkpoint ") and Path(checkpoint).is_file()
    assert note.endswith(f"trainer.resume={checkpoint}") and "+cluster=slurm" in note
    assert note in result.stdout
    assert "FAILED" not in result.stdout


def running_an_epoch(tmp_path: Path, store: dict[str, str],
                     *overrides: str) -> tuple[subprocess.Popen[str], str]:
    """A 200-epoch job (no epoch-end checkpoints, a step logged at every step) submitted and
    followed until its first epoch ended, for a test to signal; (the following process, the
    Slurm job id)."""
    proc = _train(tmp_path, store, *overrides, "trainer.epochs=200", "trainer.checkpoint_every=0",
                  "trainer.log_every_n_steps=1", "tracking.log_model=false")
    job = job_id(_read_until(proc, ": RUNNING", 180))
    log = tmp_path / "sweep" / "0" / "train.log"
    wait_until(lambda: log.exists() and "epoch 1/200" in log.read_text(), 240, "an epoch")
    return proc, job


def test_scancel_with_dataloader_workers_stops_with_a_checkpoint(
        cluster: None, store: dict[str, str], tmp_path: Path) -> None:
    """TERM reaches the ranks and their DataLoader workers alike: the workers must not die
    first, so the ranks agree on the stop, save a checkpoint and mark the run KILLED. Slurm
    names the job CANCELLED at once, while its ranks are still stopping (COMPLETING): the
    following command returns only once they have ended, and the run says KILLED then."""
    proc, job = running_an_epoch(tmp_path, store, *TWO_NODES, "data.num_workers=2")
    subprocess.run(["scancel", job], check=True)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 1 and f"job {job}: CANCELLED" in stdout, stdout + stderr
    assert not listed_by_squeue(job)
    [run] = runs_in(store["MLFLOW_TRACKING_URI"])
    assert run.info.status == "KILLED", run.data.tags.get("error")
    assert run.data.tags["stopped_by"] == "SIGTERM" and "error" not in run.data.tags
    assert list((tmp_path / "sweep" / "0" / "checkpoints").glob("step-*.pt"))


COLLECTIVE_TIMEOUT_S, OUTAGE_S = 30, 35


def test_a_tracking_outage_on_slurm_loses_no_epoch(
        cluster: None, tmp_path: Path) -> None:
    """The tracking server away for longer than the job's collective timeout (35 s, with
    distributed.timeout_s=30) mid-job: training goes on - a rank that waited on MLflow that
    long would end the job at its peers' next collective -, and the run FINISHES with every
    epoch once.

    The test sets the pace: each sample takes 0.02 s until the server is back (an epoch of
    240 samples a rank >= 4.8 s, so the 20 epochs cannot end within the outage), then the job
    runs at full speed."""
    from tests.servers import ServerProcess

    server = ServerProcess(tmp_path / "server")
    server.start()
    epochs, release = 20, tmp_path / "release"
    proc = _train(tmp_path, {"MLFLOW_TRACKING_URI": server.url, "PYTHONPATH": USER_PATH},
                  *TWO_NODES, f"trainer.epochs={epochs}", "tracking.log_model=false",
                  f"distributed.timeout_s={COLLECTIVE_TIMEOUT_S}",
                  "data=custom", "data.num_workers=0", "data.train._target_=userpkg.data.HeldLines",
                  "+data.train.length=480", f"+data.train.release={release}",
                  "+data.train.delay=0.02")
    log = tmp_path / "sweep" / "0" / "train.log"

    def epochs_ended() -> int:
        return log.read_text().count(f"/{epochs}  train/loss") if log.exists() else 0

    try:
        wait_until(lambda: epochs_ended() >= 2, 300, "two epochs", job=proc)
        server.stop()
        down_at, before = time.monotonic(), epochs_ended()
        wait_until(lambda: time.monotonic() - down_at >= OUTAGE_S or proc.poll() is not None,
                   OUTAGE_S + 30, "the outage")
        if proc.poll() is not None:
            out, err = proc.communicate()
            raise AssertionError(f"the command ended during the outage:\n{out}\n{err[-3000:]}")
        assert epochs_ended() > before  # trained on meanwhile
        server.start()
        release.write_text("")
        stdout, stderr = proc.communicate(timeout=400)
        assert proc.returncode == 0, stdout + stderr[-3000:]
        [run] = runs_in(server.url)
        assert run.info.status == "FINISHED"
        for key in ("train/loss", "val/accuracy", "epoch_time_s"):
            assert [s for s, _ in history(server.url, run.info.run_id, key)] == \
                list(range(1, epochs + 1)), key
    finally:
        release.write_text("")
        proc.kill()
        proc.wait()
        server.stop()
