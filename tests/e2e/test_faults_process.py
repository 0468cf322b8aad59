"""Process and signal faults, tried as a user would (issue 14): a killed or signalled launcher,
a signalled process group with DataLoader workers, a killed rank, a closed terminal, a second
job in a directory in use, command-line mistakes, and a dry run's leftovers.

Real 2-rank jobs get real signals and are read back from the real MLflow store; the job lock's
holders and the DataLoader worker are real processes that import no torch. Command-line
mistakes composed in process: tests/unit/test_faults_process.py.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from tests.conftest import (
    LAUNCHER_VARS,
    REPO,
    assert_refused,
    history,
    process_ended,
    rank_processes,
    run_train,
    runs_in,
    wait_until,
)
from train.launch import joblock

# -- the job lock (its holder is a real process that imports no torch) ------------------------

HOLDER = """
import subprocess, sys
from pathlib import Path
from train.launch import joblock
joblock.take(Path(sys.argv[1]))
if len(sys.argv) > 2:  # as the local launcher: its ranks hold the directory with it
    rank = subprocess.Popen(["sleep", "60"])
    joblock.add_ranks(Path(sys.argv[1]), [rank.pid])
    print(rank.pid, flush=True)
print("held", flush=True)
sys.stdin.read()
"""


@pytest.fixture
def holder(tmp_path: Path) -> Iterator[Callable[..., subprocess.Popen[str]]]:
    """Start a process that holds a directory's lock until its stdin closes."""
    started: list[subprocess.Popen[str]] = []

    def start(directory: Path, *with_rank: str, **env: str) -> subprocess.Popen[str]:
        proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(directory), *with_rank],
                                text=True, env={**os.environ, "PYTHONPATH": str(REPO), **env},
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        started.append(proc)
        assert proc.stdout is not None
        if with_rank:
            proc.rank_pid = int(proc.stdout.readline())  # type: ignore[attr-defined]
        assert proc.stdout.readline() == "held\n"
        return proc

    yield start
    for proc in started:
        proc.kill()
        proc.wait()


def test_a_directory_held_by_a_live_job_is_refused_in_one_line(
        tmp_path: Path, holder: Callable[..., subprocess.Popen[str]]) -> None:
    other = holder(tmp_path)
    with pytest.raises(joblock.JobLockedError) as refused:
        joblock.take(tmp_path)
    message = str(refused.value)
    assert "\n" not in message
    assert f"in use by another job: pid {other.pid} on " in message
    assert f"kill {other.pid}" in message and str(tmp_path / joblock.LOCK_FILE) in message
    assert json.loads((tmp_path / joblock.LOCK_FILE).read_text())["pid"] == other.pid


def test_a_dead_holders_lock_is_taken_over_and_released(
        tmp_path: Path, holder: Callable[..., subprocess.Popen[str]]) -> None:
    other = holder(tmp_path)
    other.kill()  # as `kill -9`: the lock file stays behind
    other.wait()
    assert (tmp_path / joblock.LOCK_FILE).exists()
    with joblock.held(tmp_path):
        assert json.loads((tmp_path / joblock.LOCK_FILE).read_text())["pid"] == os.getpid()
    assert not (tmp_path / joblock.LOCK_FILE).exists()
    assert [p.name for p in tmp_path.iterdir()] == []  # no draft left either


def test_ranks_that_outlive_their_killed_launcher_still_hold_the_directory(
        tmp_path: Path, holder: Callable[..., subprocess.Popen[str]]) -> None:
    """`kill -9 <launcher>`: its ranks write their stop checkpoint before they end."""
    launcher = holder(tmp_path, "with a rank")
    rank = psutil.Process(launcher.rank_pid)  # type: ignore[attr-defined]
    launcher.kill()
    launcher.wait()
    with pytest.raises(joblock.JobLockedError, match=f"pid {launcher.pid} on "):
        joblock.take(tmp_path)
    rank.kill()
    wait_until(lambda: process_ended(rank), 10, "the rank's end")
    with joblock.held(tmp_path):
        pass


def test_a_requeued_slurm_job_takes_its_directory_back(
        tmp_path: Path, holder: Callable[..., subprocess.Popen[str]],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Slurm requeues keep the job id; another job id is refused while its holder lives."""
    holder(tmp_path, SLURM_JOB_ID="4242")
    monkeypatch.setenv("SLURM_JOB_ID", "4243")
    with pytest.raises(joblock.JobLockedError, match=r"\(Slurm job 4242\)"):
        joblock.take(tmp_path)
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    with joblock.held(tmp_path):
        assert json.loads((tmp_path / joblock.LOCK_FILE).read_text())["pid"] == os.getpid()


def test_ranks_after_the_first_do_not_take_the_lock(
        tmp_path: Path, holder: Callable[..., subprocess.Popen[str]]) -> None:
    other = holder(tmp_path)
    lock = tmp_path / joblock.LOCK_FILE
    before = lock.read_bytes()
    ran = False
    with joblock.held(tmp_path, holds=False):  # rank 1 of a job whose rank 0 holds it
        ran = True
        assert lock.read_bytes() == before  # not taken over: still the holder's
    assert ran
    # Nor released at its end: the lock is still the holder's, the directory still refused.
    assert lock.read_bytes() == before and json.loads(before)["pid"] == other.pid
    assert sorted(p.name for p in tmp_path.iterdir()) == [joblock.LOCK_FILE]  # no draft
    with pytest.raises(joblock.JobLockedError, match=f"pid {other.pid} on "):
        joblock.take(tmp_path)


def test_a_two_rank_job_starts_though_the_port_found_free_was_taken_meanwhile(
        tmp_path: Path, store: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    """The local launcher found a port free, then another process took it before rank 0's
    store bound it (three jobs started together: EADDRINUSE, the job failed). Rank 0 binds a
    port the OS gives it and tells the other rank; the launcher leaves no file behind."""
    import socket

    from tests.conftest import composed
    from tests.unit.test_job import SMALL
    from train.app import run
    from train.distributed import env as distenv

    for key in LAUNCHER_VARS:
        monkeypatch.delenv(key, raising=False)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        monkeypatch.setattr(distenv, "free_port", lambda: taken.getsockname()[1])
        run(composed(*SMALL, "trainer.epochs=1", "distributed.nproc_per_node=2",
                     f"tracking.uri={store['MLFLOW_TRACKING_URI']}"), str(tmp_path / "job"),
            "python -m train (test)")
    [mlflow_run] = runs_in(store["MLFLOW_TRACKING_URI"])
    assert mlflow_run.info.status == "FINISHED" and mlflow_run.data.tags["world_size"] == "2"
    assert not list((tmp_path / "job").glob(".store-port*"))


def test_jobs_started_together_from_one_directory_each_get_their_own(
        tmp_path: Path, store: dict[str, str]) -> None:
    """A shell loop's `python -m train optim.lr=$lr &`: Hydra's outputs/<date>/<time> is one
    directory for the jobs of one second, where the second job would be refused after its
    .hydra/ overwrote the first's. Each job: its own directory, record and MLflow run."""
    env = {k: v for k, v in os.environ.items()
           if k not in LAUNCHER_VARS and not k.startswith("SLURM_")}
    lrs = ["0.01", "0.02", "0.03"]
    jobs = [subprocess.Popen([sys.executable, "-m", "train", f"optim.lr={lr}", "trainer.epochs=1",
                              "trainer.max_steps=2"], cwd=tmp_path, env={**env, **store},
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
            for lr in lrs]
    for job in jobs:
        assert job.wait(timeout=300) == 0, job.stderr.read() if job.stderr else ""
    dirs = sorted((tmp_path / "outputs").glob("*/*"))
    recorded = [(d / ".hydra" / "overrides.yaml").read_text() for d in dirs]
    assert sorted(r.split("\n")[0] for r in recorded) == [f"- optim.lr={lr}" for lr in lrs]
    runs = runs_in(store["MLFLOW_TRACKING_URI"])
    assert sorted(r.data.params["optim.lr"] for r in runs) == lrs
    assert {r.info.status for r in runs} == {"FINISHED"}
    assert {json.loads((d / "mlflow_run.json").read_text())["run_id"] for d in dirs} == \
        {r.info.run_id for r in runs}


# -- DataLoader workers (one forked worker) --------------------------------------------------

def test_a_temporary_directory_too_long_for_the_workers_sockets_is_refused(
        store: dict[str, str], tmp_path: Path) -> None:
    """A TMPDIR of 85 characters hung the default job (a DataLoader worker's batch lost for
    want of a socket): refused before any rank starts, with what to do."""
    long_tmp = tmp_path.joinpath(*["t" * 20] * 4)
    long_tmp.mkdir(parents=True)
    result = run_train("trainer.epochs=1", f"hydra.run.dir={tmp_path}/job",
                       env={**store, "TMPDIR": str(long_tmp)}, timeout=120)
    assert_refused(result, f"the temporary directory {long_tmp} ({len(str(long_tmp))} "
                           "characters, from TMPDIR) is too long", store)
    assert "TMPDIR=/tmp, or use data.num_workers=0" in result.stderr
    assert not (tmp_path / "job" / "checkpoints").exists()


def test_a_rank_started_elsewhere_refuses_a_too_long_temporary_directory(
        store: dict[str, str], tmp_path: Path) -> None:
    """No pre-flight sees the TMPDIR of a rank that torchrun or Slurm started on its node: the
    rank refuses it as it makes its DataLoader workers (it hung there), and its run says why."""
    long_tmp = tmp_path.joinpath(*["t" * 20] * 4)
    long_tmp.mkdir(parents=True)
    result = run_train("--nproc_per_node=1", "-m", "train", "trainer.epochs=1",
                       f"hydra.run.dir={tmp_path}/job", env={**store, "TMPDIR": str(long_tmp)},
                       module=("-m", "torch.distributed.run"), timeout=120)
    assert result.returncode != 0
    assert f"error: the temporary directory {long_tmp} ({len(str(long_tmp))} characters" \
        in result.stderr
    [failed] = runs_in(store["MLFLOW_TRACKING_URI"])
    assert failed.info.status == "FAILED"
    assert "TMPDIR=/tmp, or use data.num_workers=0" in failed.data.tags["error"]


def test_a_worker_outlives_the_groups_signals_but_not_its_ranks_terminate() -> None:
    """TERM or HUP from elsewhere (Slurm, a shell's `kill -- -<pgid>`) leaves the worker to its
    rank; the rank's own terminate() (DataLoader shutdown, exit) still ends it."""
    import torch

    from train.data.batches import WorkersBornDeaf
    from train.distributed.stopping import ignore_in_worker

    # As a rank does at its start (train/engine/job.py): after set_num_threads a forked worker
    # starts a thread of its own before worker_init_fn runs, through which a TERM could kill it.
    torch.set_num_threads(torch.get_num_threads())
    loader = WorkersBornDeaf(list(range(1000)), batch_size=4, num_workers=1,
                             worker_init_fn=ignore_in_worker, persistent_workers=True,
                             multiprocessing_context="fork")
    batches = iter(loader)
    assert next(batches).tolist() == [0, 1, 2, 3]
    [worker] = batches._workers  # type: ignore[attr-defined]
    for name in ("TERM", "HUP", "INT", "USR2"):
        subprocess.run(["kill", f"-{name}", str(worker.pid)], check=True)
    # More batches than were prefetched: the worker made them after the signals.
    assert [next(batches)[0].item() for _ in range(20)] == list(range(4, 84, 4))
    assert worker.is_alive()
    worker.terminate()
    worker.join(10)
    assert worker.exitcode == 0
    del batches


# -- real jobs, real signals ------------------------------------------------------------------

class Job:
    """A 2-rank `python -m train` in its own process group (as a terminal or Slurm starts it),
    with its launcher, ranks and DataLoader workers as psutil processes."""

    def __init__(self, out_dir: Path, store: dict[str, str], *overrides: str) -> None:
        self.out_dir, self.uri = out_dir, store["MLFLOW_TRACKING_URI"]
        env = {k: v for k, v in os.environ.items()
               if k not in LAUNCHER_VARS and not k.startswith("SLURM_")}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "train", "distributed.nproc_per_node=2", "trainer.epochs=200",
             f"hydra.run.dir={out_dir}", *overrides], cwd=REPO, env={**env, **store},
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
        self.launcher = psutil.Process(self.proc.pid)
        self.ranks = sorted(wait_until(self._ranks, 60, "2 ranks"), key=lambda p: p.pid)
        # Training is under way once the run exists: rank 0 creates it at the first step.
        wait_until(lambda: (out_dir / "mlflow_run.json").exists(), 120, "the run")
        self.family = [self.launcher, *self.launcher.children(recursive=True)]

    def _ranks(self) -> list[psutil.Process] | None:
        ranks = rank_processes(self.launcher)
        return ranks if len(ranks) == 2 else None

    def checkpoints(self) -> list[str]:
        return sorted(p.name for p in (self.out_dir / "checkpoints").glob("step-*.pt"))

    def end(self, timeout: float = 90) -> str:
        """Wait for the launcher; every process of the job must be gone. Its stderr."""
        try:
            _, stderr = self.proc.communicate(timeout=timeout)
            wait_until(lambda: all(process_ended(p) for p in self.family), 30,
                       "every process's end")
        finally:
            for p in self.family:  # this test's own processes, should they have outlived it
                if not process_ended(p):
                    p.kill()
        return stderr

    def run(self) -> Any:
        [run] = runs_in(self.uri)
        assert run.info.run_id == json.loads((self.out_dir / "mlflow_run.json").read_text())[
            "run_id"]
        return run

    def assert_steps_once(self, run_id: str) -> list[int]:
        """Every metric's steps, each once; returns train/step_loss's."""
        for key in ("train/loss", "lr", "train/step_loss"):
            steps = [s for s, _ in history(self.uri, run_id, key)]
            assert steps == sorted(set(steps)), key
        return [s for s, _ in history(self.uri, run_id, "train/step_loss")]


@pytest.fixture(scope="module")
def migrated_db(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An empty SQLite store with MLflow's schema in place, made once: migrating a new file
    takes rank 0 many seconds, which each job here would wait for before its first step."""
    from mlflow import MlflowClient

    db = tmp_path_factory.mktemp("store") / "mlflow.db"
    MlflowClient(tracking_uri=f"sqlite:///{db}").search_experiments(max_results=1)
    return db


@pytest.fixture
def fresh_store(migrated_db: Path, tmp_path: Path) -> dict[str, str]:
    """A store of this test's own (a copy of the migrated empty one)."""
    db = tmp_path / "mlflow.db"
    shutil.copyfile(migrated_db, db)
    return {"MLFLOW_TRACKING_URI": f"sqlite:///{db}"}


def _stopped_cleanly(job: Job, before: list[str], signal_name: str, code: int) -> None:
    stderr = job.end()
    assert job.proc.returncode == code, stderr
    last = [line for line in stderr.splitlines() if line.strip()][-1]
    assert last == (f"stopped by {signal_name} after saving a checkpoint in {job.out_dir}/"
                    f"checkpoints; the same command with hydra.run.dir={job.out_dir} resumes it")
    run = job.run()
    assert run.info.status == "KILLED"
    assert run.data.tags["stopped_by"] == signal_name
    assert "error" not in run.data.tags
    [*_, stop_checkpoint] = job.checkpoints()
    assert stop_checkpoint not in before  # written after the signal
    logged = job.assert_steps_once(run.info.run_id)
    assert logged and int(stop_checkpoint[5:-3]) >= logged[-1]  # nothing trained after it


def test_a_second_job_is_refused_and_hup_to_the_launcher_stops_its_ranks(
        fresh_store: dict[str, str], tmp_path: Path) -> None:
    """The same command in a directory in use is refused before it starts anything; a HUP
    (a closed terminal) or TERM (`kill`) that only the launcher gets reaches its ranks as their
    coordinated stop. (HUP to the whole group: the ranks also get it directly.)"""
    job = Job(tmp_path / "job", fresh_store)
    second = run_train("distributed.nproc_per_node=2", f"hydra.run.dir={job.out_dir}",
                       env=fresh_store, timeout=60)
    assert second.returncode == 2
    assert second.stderr.strip().splitlines()[-1].startswith(
        f"error: {job.out_dir} is in use by another job: pid {job.proc.pid} on ")
    before = job.checkpoints()
    job.launcher.send_signal(signal.SIGHUP)
    _stopped_cleanly(job, before, "SIGHUP", 128 + signal.SIGHUP)
    assert not (job.out_dir / joblock.LOCK_FILE).exists()


def test_ctrl_c_stops_the_job_after_a_checkpoint(fresh_store: dict[str, str],
                                                 tmp_path: Path) -> None:
    """Ctrl-C once: INT to the terminal's whole process group (the ranks get it directly too);
    the same coordinated stop as TERM, exit code 130."""
    job = Job(tmp_path / "job", fresh_store)
    before = job.checkpoints()
    os.killpg(job.proc.pid, signal.SIGINT)
    _stopped_cleanly(job, before, "SIGINT", 128 + signal.SIGINT)


def test_term_to_the_group_with_dataloader_workers_writes_the_stop_checkpoint(
        fresh_store: dict[str, str], tmp_path: Path) -> None:
    """As Slurm signals a job: every process of the group at once, workers included."""
    job = Job(tmp_path / "job", fresh_store, "data.num_workers=1")
    workers = [c for rank in job.ranks for c in rank.children()]
    assert len(workers) >= 2, "each rank has its DataLoader worker"
    before = job.checkpoints()
    os.killpg(job.proc.pid, signal.SIGTERM)
    _stopped_cleanly(job, before, "SIGTERM", 128 + signal.SIGTERM)


def test_a_killed_rank_0_fails_the_run_with_its_death(fresh_store: dict[str, str],
                                                      tmp_path: Path) -> None:
    """Rank 0 alone talks to MLflow; SIGKILLed, it cannot end its run: the launcher does."""
    job = Job(tmp_path / "job", fresh_store)
    job.ranks[0].send_signal(signal.SIGKILL)
    stderr = job.end()
    assert job.proc.returncode == 1
    assert "the training job failed; rank 0 was killed by SIGKILL" in stderr
    run = job.run()
    assert run.info.status == "FAILED"
    assert run.data.tags["error"] == f"rank 0 (pid {job.ranks[0].pid}) killed by SIGKILL"
    job.assert_steps_once(run.info.run_id)
    assert not (job.out_dir / joblock.LOCK_FILE).exists()


def test_command_line_mistakes_and_dry_runs_leave_nothing(tmp_path: Path) -> None:
    """One line and exit code 2 for what the user typed wrong, and no directory left: neither
    outputs/<date>/<time>/ nor one named by hydra.run.dir; a dry run leaves no empty
    multirun/<date>/<time>/ in the directory it was started from."""
    for overrides, start in ((["+trainer.foo=1"], "error: trainer.foo: Key 'foo' not in"),
                             (["trainer.nope=1"], "error: Could not override 'trainer.nope'"),
                             (["distributed.nproc_per_node=1000", "data.batch_size=1000"],
                              "error: distributed.nproc_per_node=1000 local ranks, but "),
                             (["trainer.epochs=-1"], "error: Refusing to start: trainer.epochs")):
        for placed in ([f"hydra.run.dir={tmp_path}/job"], []):
            result = run_train(*overrides, *placed, cwd=tmp_path, timeout=60)
            lines = result.stderr.strip().splitlines()
            assert result.returncode == 2 and lines[-1].startswith(start), result.stderr
            assert "Traceback" not in result.stderr
            assert sorted(p.name for p in tmp_path.iterdir()) == [], overrides
    # A sweep whose second job does not compose: no multirun/<date>/<time>/multirun.yaml left.
    result = run_train("-m", "optim.lr=0.1,abc", cwd=tmp_path, timeout=60)
    assert result.returncode == 2 and "optim.lr=abc" in result.stderr, result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == []
    # A directory that holds a job already keeps all of it, and its parent.
    (tmp_path / "job").mkdir()
    (tmp_path / "job" / "summary.json").write_text("{}")
    result = run_train("trainer.epochs=-1", f"hydra.run.dir={tmp_path}/job", cwd=tmp_path,
                       timeout=60)
    assert result.returncode == 2 and (tmp_path / "job" / "summary.json").is_file()
    (tmp_path / "job" / "summary.json").unlink()
    shutil.rmtree(tmp_path / "job")
    # A laptop without Slurm: a dry run prints the script and calls nothing; a submission is
    # refused in one line; neither leaves multirun/<date>/<time>/multirun.yaml behind.
    no_slurm = {"PATH": str(tmp_path / "bin")}
    (tmp_path / "bin").mkdir()
    for sweep in ((), ("-m", "optim.lr=0.1,0.2")):
        flags = [o for o in sweep if o == "-m"]
        result = run_train(*flags, "+cluster=slurm", "cluster.dry_run=true",
                           *[o for o in sweep if o != "-m"], cwd=tmp_path, timeout=60,
                           env=no_slurm)
        assert result.returncode == 0 and "#SBATCH" in result.stdout, result.stderr
        assert ("#SBATCH --array=0-1" in result.stdout) == bool(flags), result.stdout
        assert not (tmp_path / "multirun").exists()
    result = run_train("+cluster=slurm", cwd=tmp_path, timeout=60, env=no_slurm)
    assert result.returncode == 2 and result.stderr.strip().splitlines()[-1].startswith(
        "error: sbatch is not on PATH"), result.stderr
    assert not (tmp_path / "multirun").exists()


def test_ctrl_c_twice_stops_at_once_without_the_stop_checkpoint(
        fresh_store: dict[str, str], tmp_path: Path) -> None:
    """Ctrl-C (INT to the terminal's whole process group) twice, the second before the stop
    checkpoint: a KeyboardInterrupt, ended by SIGINT as Python ends on one (a shell's 130), the
    run FAILED; the last regular checkpoint is what is kept. (A CNN epoch on CPU, with no
    logging step in it where the first Ctrl-C would be acted on, leaves time for the second.)"""
    out_dir, log = tmp_path / "job", tmp_path / "stderr"
    env = {k: v for k, v in os.environ.items()
           if k not in LAUNCHER_VARS and not k.startswith("SLURM_")}
    with open(log, "w") as stderr:
        proc = subprocess.Popen(
            [sys.executable, "-m", "train", "data=synthetic", "data.num_samples=1024",
             "model=cnn", "trainer.epochs=200", "trainer.log_every_n_steps=100000",
             "tracking.log_model=false", f"hydra.run.dir={out_dir}"],
            cwd=REPO, env={**env, **fresh_store}, stdout=subprocess.DEVNULL, stderr=stderr,
            start_new_session=True)
    try:
        [regular] = wait_until(lambda: list((out_dir / "checkpoints").glob("step-*.pt")), 240,
                               "the first epoch's checkpoint", every=0.05, job=proc)
        os.killpg(proc.pid, signal.SIGINT)
        wait_until(lambda: "received SIGINT" in log.read_text(), 30, "the first Ctrl-C noted",
                   every=0.05, job=proc)
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(timeout=90)
    finally:
        if proc.poll() is None:  # this test's own job, should it have outlived it
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    stderr_text = log.read_text()
    assert proc.returncode == -signal.SIGINT, stderr_text
    assert stderr_text.rstrip().endswith("KeyboardInterrupt"), stderr_text
    assert "stopped by SIGINT after saving a checkpoint" not in stderr_text
    assert sorted((out_dir / "checkpoints").glob("step-*.pt")) == [regular]
    [run] = runs_in(fresh_store["MLFLOW_TRACKING_URI"])
    assert run.info.status == "FAILED"
    assert run.data.tags["error"].startswith("rank 0 on ") and "KeyboardInterrupt" in \
        run.data.tags["error"]
