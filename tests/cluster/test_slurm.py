"""`python -m train +cluster=slurm` against the real local Slurm cluster (slurm/); first, fast
tests of train/distributed/slurm.py (in a job) and train/launch/submit.py's request checks, which need no cluster."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest

from tests.conftest import REPO, history, run_train, runs_in, skip_or_fail, wait_until
from train.config.cluster import ClusterConfig
from train.config.groups import ConfigError, DistributedConfig, TrainConfig
from train.distributed import slurm as in_job
from train.launch import submit as slurm

T = TypeVar("T")


def on_slurm(test: T) -> T:
    """The marks of a test that runs `python -m train +cluster=slurm` or Slurm's commands."""
    return pytest.mark.slow(pytest.mark.slurm(test))


# -- no cluster needed -------------------------------------------------------------------------

@pytest.fixture
def fake_scontrol(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """`scontrol` on PATH that writes its arguments to a file; a Slurm job's environment."""
    calls = tmp_path / "scontrol.calls"
    script = tmp_path / "bin" / "scontrol"
    script.parent.mkdir()
    script.write_text(f"#!/bin/sh\necho \"$@\" >> {calls}\n")
    script.chmod(0o755)
    monkeypatch.setenv("PATH", f"{script.parent}{os.pathsep}{os.environ['PATH']}")
    for key in [k for k in os.environ if k.startswith("SLURM_")]:
        monkeypatch.delenv(key)
    monkeypatch.setenv("SLURM_JOB_ID", "41")
    return calls


def test_a_time_limit_requeues_until_the_budget_is_spent(fake_scontrol: Path) -> None:
    assert in_job.requeue_after_stop("SIGUSR2", 0, 3) == 1
    assert in_job.requeue_after_stop("SIGUSR2", 2, 3) == 3
    assert in_job.requeue_after_stop("SIGUSR2", 3, 3) is None  # spent: not requeued
    assert fake_scontrol.read_text().splitlines() == ["requeue 41", "requeue 41"]


def test_requeue_targets_the_array_task_and_only_after_usr2(
        fake_scontrol: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert in_job.requeue_after_stop("SIGTERM", 0, 3) is None  # Slurm requeues it itself
    assert not fake_scontrol.exists()
    monkeypatch.setenv("SLURM_ARRAY_JOB_ID", "40")
    monkeypatch.setenv("SLURM_ARRAY_TASK_ID", "1")
    assert in_job.requeue_target() == "40_1"
    assert in_job.requeue_after_stop("SIGUSR2", 0, 1) == 1
    assert fake_scontrol.read_text().splitlines() == ["requeue 40_1"]


def test_outside_slurm_nothing_is_requeued_or_tagged(fake_scontrol: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SLURM_JOB_ID")
    assert in_job.requeue_after_stop("SIGUSR2", 0, 3) is None
    assert in_job.slurm_tags(["node1"]) == {}
    assert not fake_scontrol.exists()


def test_slurm_tags_name_the_job_and_its_nodes(fake_scontrol: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLURM_JOB_PARTITION", "debug")
    assert in_job.slurm_tags(["node2", "node1", "node2"]) == {
        "slurm.job_id": "41", "slurm.nodes": "node1,node2", "slurm.partition": "debug"}
    monkeypatch.setenv("SLURM_ARRAY_JOB_ID", "40")
    monkeypatch.setenv("SLURM_ARRAY_TASK_ID", "0")
    tags = in_job.slurm_tags(["node1"])
    assert tags["slurm.job_id"] == "40" and tags["slurm.array_task_id"] == "0"


def test_the_request_is_checked_with_the_shared_ranks_per_node() -> None:
    cfg = TrainConfig(cluster=ClusterConfig(nodes=2, gpus_per_node=4))
    assert slurm.check_request(cfg) == 8
    cfg.cluster = ClusterConfig(gpus_per_node=2, tasks_per_node=1, time_min=0)
    with pytest.raises(ConfigError, match="a GPU job runs one rank per GPU.*time_min"):
        slurm.check_request(cfg)


def test_cuda_only_options_on_nodes_without_gpus_are_refused_before_submitting() -> None:
    """Issue 17: a job asked for no GPU cannot serve nccl, device=cuda or SyncBatchNorm; the
    request is refused on the login node instead of failing in the job after hours queued."""
    cfg = TrainConfig(cluster=ClusterConfig(gpus_per_node=0),
                      distributed=DistributedConfig(sync_batchnorm=True, backend="nccl"))
    with pytest.raises(ConfigError, match=r"distributed.backend=nccl "
                       r"distributed.sync_batchnorm=true needs GPUs, but cluster.gpus_per_node=0"):
        slurm.check_request(cfg)
    cfg.cluster = ClusterConfig(gpus_per_node=1, tasks_per_node=1)
    assert slurm.check_request(cfg) == 1


# -- the local cluster ---------------------------------------------------------------------------

ROOT_SKIP = 3  # cluster-up.sh's exit code when it cannot run here (not root)


def _cluster_answers() -> bool:
    """The cluster is up: its controller answers and lists nodes, in any state. (Not "some
    node idle": on a shared cluster whose nodes are all busy, that made the fixture start the
    cluster again and then take it down under everyone else's jobs.)"""
    if shutil.which("sinfo") is None:
        return False
    out = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True, timeout=20)
    return out.returncode == 0 and bool(out.stdout.split())


@pytest.fixture(scope="module")
def cluster() -> Iterator[None]:
    """The local 2-node cluster: started for these tests, stopped after (unless already up)."""
    already_up = _cluster_answers()
    if not already_up:
        up = subprocess.run(["bash", str(REPO / "slurm" / "cluster-up.sh")], capture_output=True,
                            text=True, timeout=600)
        if up.returncode == ROOT_SKIP:
            skip_or_fail(f"the local Slurm cluster needs root: {up.stdout}{up.stderr}")
        assert up.returncode == 0, f"cluster-up failed:\n{up.stdout}\n{up.stderr}"
    yield
    # A job whose follower just saw it end may still be completing (state CG) for a moment: the
    # queue must empty within 30 s, or the job was left behind.
    deadline = time.monotonic() + 30
    while (leftover := subprocess.run(["squeue", "-h", "-o", "%i"], capture_output=True,
                                      text=True)).stdout.strip() and time.monotonic() < deadline:
        time.sleep(0.5)
    if not already_up:
        down = subprocess.run(["bash", str(REPO / "slurm" / "cluster-down.sh")],
                              capture_output=True, text=True, timeout=120)
        assert down.returncode == 0, down.stdout + down.stderr
        assert not _cluster_processes(), f"left behind by cluster-down: {_cluster_processes()}"
    assert leftover.stdout.strip() == "", f"jobs left behind: {leftover.stdout}"


def _cluster_processes() -> list[str]:
    """Live daemons and job steps of the local cluster (zombies are gone in all that matters)."""
    import psutil

    daemons = {"munged", "mariadbd", "slurmdbd", "slurmctld", "slurmd", "slurmstepd"}
    found = []
    for p in psutil.process_iter(["name", "cmdline", "status"]):
        if p.info["status"] != psutil.STATUS_ZOMBIE and (
                p.info["name"] in daemons or "train-slurm" in " ".join(p.info["cmdline"] or [])):
            found.append(f"{p.pid} {p.info['name']}")
    return found


def slurm_job(tmp_path: Path, *overrides: str, env: dict[str, str] | None = None,
              timeout: float = 420) -> subprocess.CompletedProcess[str]:
    flags = [o for o in overrides if o == "-m"]  # argparse wants flags before the overrides
    overrides = tuple(o for o in overrides if o != "-m")
    return run_train(*flags, "+cluster=slurm", "cluster.partition=debug", "cluster.time_min=10",
                     f"hydra.sweep.dir={tmp_path}/sweep", *overrides, env=env, timeout=timeout)


@on_slurm
def test_two_nodes_four_ranks_make_one_run(cluster: None, store: dict[str, str],
                                           tmp_path: Path) -> None:
    result = slurm_job(tmp_path, "cluster.nodes=2", "cluster.tasks_per_node=2",
                       "trainer.epochs=2", "data.batch_size=64", env=store)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Submitted Slurm job" in result.stdout and "rank 0 logs:" in result.stdout
    assert ": RUNNING" in result.stdout and ": COMPLETED" in result.stdout
    assert "shared filesystem" in result.stderr  # the SQLite-path warning
    uri = store["MLFLOW_TRACKING_URI"]
    [run] = runs_in(uri)
    tags = run.data.tags
    assert run.info.status == "FINISHED"
    assert tags["world_size"] == "4" and tags["launcher"] == "submitit"
    assert tags["hostnames"] == "node1,node2" and tags["slurm.nodes"] == "node1,node2"
    assert tags["slurm.partition"] == "debug" and tags["slurm.job_id"].isdigit()
    assert "slurm.array_task_id" not in tags or tags["slurm.array_task_id"] == "0"
    assert history(uri, run.info.run_id, "val/samples") == [(0, 359.0), (1, 359.0)]
    assert history(uri, run.info.run_id, "train/samples") == [(0, 1440.0), (1, 1440.0)]


@on_slurm
def test_the_plain_sbatch_template_runs_the_same_code(cluster: None, store: dict[str, str],
                                                      tmp_path: Path) -> None:
    """slurm/train.sbatch: srun starts the ranks, which read SLURM_* themselves."""
    out = tmp_path / "job"
    env = {**os.environ, **store, "TRAIN_REPO": str(REPO), "TRAIN_OUTPUT_DIR": str(out)}
    submitted = subprocess.run(
        ["sbatch", "--parsable", "--nodes=2", "--ntasks-per-node=2", "--cpus-per-task=1",
         "--partition=debug", str(REPO / "slurm" / "train.sbatch"), "trainer.epochs=1",
         "tracking.log_model=false"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert submitted.returncode == 0, submitted.stderr
    state = _wait_for_job(submitted.stdout.strip().split(";")[0], timeout=300)
    logs = "".join(p.read_text() for p in sorted(out.glob("rank-*.log")))
    assert state == "COMPLETED", logs
    assert sorted(p.name for p in out.glob("rank-*.log")) == [f"rank-{i}.log" for i in range(4)]
    uri = store["MLFLOW_TRACKING_URI"]
    [run] = runs_in(uri)
    assert run.info.status == "FINISHED"
    tags = run.data.tags
    assert tags["world_size"] == "4" and tags["launcher"] == "slurm"
    assert tags["hostnames"] == "node1,node2" and tags["slurm.job_id"].isdigit()
    assert history(uri, run.info.run_id, "val/samples") == [(0, 359.0)]


def _wait_for_job(job_id: str, timeout: float) -> str:
    """The job's final state, polled twice a second (`sbatch --wait` polls every 10 s)."""
    def final_state() -> str | None:
        out = subprocess.run(["sacct", "-n", "-X", "-P", "-o", "State", "-j", job_id],
                             capture_output=True, text=True).stdout.split()
        ended = out and out[0] in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL")
        return out[0] if ended else None

    return wait_until(final_state, timeout, f"job {job_id} ending")


def _listed_by_squeue(job_id: str) -> bool:
    return bool(subprocess.run(["squeue", "-h", "-j", job_id], capture_output=True,
                               text=True).stdout.strip())


@on_slurm
def test_the_tracking_server_runs_as_a_slurm_job(cluster: None, tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """slurm/mlflow-server.sbatch on a node; a job elsewhere logs to it by the node's name."""
    from train.distributed.env import free_port

    env_file, artifacts = tmp_path / "server.env", tmp_path / "artifacts"
    env = {**os.environ, "TRAIN_REPO": str(REPO), "MLFLOW_PORT": str(free_port()),
           "MLFLOW_BACKEND_STORE_URI": f"sqlite:///{tmp_path / 'server.db'}",
           "MLFLOW_ARTIFACTS": str(artifacts), "MLFLOW_SERVER_ENV_FILE": str(env_file)}
    submitted = subprocess.run(
        ["sbatch", "--parsable", "--partition=debug", "--time=10",
         str(REPO / "slurm" / "mlflow-server.sbatch")],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert submitted.returncode == 0, submitted.stderr
    job_id = submitted.stdout.strip().split(";")[0]
    def server_url() -> str | None:  # the env file is written atomically, login included
        from train.security.server_auth import read_env_file

        values = read_env_file(env_file) if env_file.exists() else {}
        for name in ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD"):
            if name in values:  # runs_in below and the job log in as a user would
                monkeypatch.setenv(name, values[name])
        return values.get("MLFLOW_TRACKING_URI")

    try:
        log = tmp_path / f"mlflow-server-{job_id}.out"
        url = wait_until(server_url, 120, f"the server's address (see {log})")
        wait_until(lambda: _answers(url), 120, f"the server answering (see {log})")
        assert url.split(":")[1].lstrip("/") in ("node1", "node2")  # the node's name
        result = run_train("trainer.epochs=1", "tracking.log_model=false",
                           f"hydra.run.dir={tmp_path}/job", env={"MLFLOW_TRACKING_URI": url})
        assert result.returncode == 0, result.stderr[-3000:]
        [run] = runs_in(url)
        assert run.info.status == "FINISHED"
        assert list(artifacts.rglob("config.yaml"))  # uploaded through the server
    finally:
        subprocess.run(["scancel", job_id], check=False)
        _wait_for_job(job_id, timeout=60)
        # sacct says CANCELLED while squeue still lists it (the fixture checks none is left)
        with contextlib.suppress(AssertionError):
            wait_until(lambda: not _listed_by_squeue(job_id), 60, f"job {job_id} leaving squeue")


def _answers(url: str) -> bool:
    import urllib.request

    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


@on_slurm
def test_dry_run_prints_the_script_and_submits_nothing(cluster: None, tmp_path: Path) -> None:
    before = subprocess.run(["sacct", "-n", "-X", "-o", "JobID"], capture_output=True,
                            text=True).stdout
    result = slurm_job(tmp_path, "cluster.dry_run=true", "cluster.nodes=2",
                       "cluster.tasks_per_node=2", "cluster.time_min=7")
    assert result.returncode == 0, result.stderr
    script = result.stdout
    for line in ("#SBATCH --nodes=2", "#SBATCH --ntasks-per-node=2", "#SBATCH --time=7",
                 "#SBATCH --partition=debug", "#SBATCH --job-name=train",
                 "--kill-on-bad-exit=1"):
        assert line in script
    assert "Submitted" not in script
    after = subprocess.run(["sacct", "-n", "-X", "-o", "JobID"], capture_output=True,
                           text=True).stdout
    assert after == before


@on_slurm
@pytest.mark.parametrize(("overrides", "expected"), [
    (("cluster.gpus_per_node=2", "cluster.tasks_per_node=1"), "a GPU job runs one rank per GPU"),
    (("cluster.nodes=2", "cluster.tasks_per_node=2", "data.batch_size=30"),
     "must split evenly over the 4 ranks"),
    (("cluster.partition=nowhere",), "cluster.partition='nowhere' does not exist"),
    (("data=cifar10", "data.root=/nonexistent"), "CIFAR10("),
    (("-m", "optim.lr=0.1,0.02", "cluster.partition=nowhere"), "does not exist"),  # no parent
])
def test_preflight_refuses_before_submitting(cluster: None, store: dict[str, str],
                                             tmp_path: Path, overrides: tuple[str, ...],
                                             expected: str) -> None:
    result = slurm_job(tmp_path, *overrides, env=store, timeout=120)
    assert result.returncode == 2, result.stdout + result.stderr
    assert expected in result.stderr
    assert "Submitted" not in result.stdout
    assert runs_in(store["MLFLOW_TRACKING_URI"]) == []


@on_slurm
def test_preflight_refuses_an_unreachable_tracking_server(cluster: None, tmp_path: Path) -> None:
    from train.distributed.env import free_port

    uri = f"http://127.0.0.1:{free_port()}"
    result = slurm_job(tmp_path, env={"MLFLOW_TRACKING_URI": uri}, timeout=120)
    assert result.returncode == 2
    assert "cannot be reached" in result.stderr and "Submitted" not in result.stdout


@on_slurm
def test_preflight_without_slurm_commands(tmp_path: Path) -> None:
    """A login node without Slurm on PATH (no cluster needed for this one)."""
    bare_path = os.pathsep.join(p for p in os.environ["PATH"].split(os.pathsep)
                                if not (Path(p) / "sbatch").exists())
    result = slurm_job(tmp_path, env={"PATH": bare_path}, timeout=120)
    assert result.returncode == 2
    assert "sbatch is not on PATH" in result.stderr


@on_slurm
def test_an_optuna_search_cannot_leave_its_trials_unwaited(tmp_path: Path) -> None:
    result = slurm_job(tmp_path, "-m", "+hparams_search=optuna_digits", "cluster.wait=false",
                       timeout=120)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "cluster.wait=false cannot serve OptunaSweeper" in result.stderr
    assert "Submitted" not in result.stdout


@on_slurm
def test_a_failing_rank_ends_the_job_promptly(cluster: None, store: dict[str, str],
                                              tmp_path: Path) -> None:
    result = slurm_job(tmp_path, "cluster.nodes=2", "cluster.tasks_per_node=2",
                       "trainer.epochs=50", "trainer.fail_on_rank=3", "trainer.fail_at_step=2",
                       env=store, timeout=300)  # well under the job's 10-minute limit
    assert result.returncode == 1, result.stdout + result.stderr
    assert ": FAILED" in result.stdout
    assert "FailureDrill" in result.stderr  # the failing rank's log tail
    [run] = runs_in(store["MLFLOW_TRACKING_URI"])
    assert run.info.status == "FAILED"
    assert run.data.tags["error"].startswith("rank 3 on node2")


@on_slurm
def test_a_sweep_is_one_job_array_under_a_parent_run(cluster: None, store: dict[str, str],
                                                     tmp_path: Path) -> None:
    result = slurm_job(tmp_path, "-m", "optim.lr=0.1,0.02", "cluster.tasks_per_node=2",
                       "trainer.epochs=1", env=store)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "_[0-1]: 2 job(s), each 2 rank(s)" in result.stdout  # one Slurm array
    uri = store["MLFLOW_TRACKING_URI"]
    runs = runs_in(uri)
    [parent] = [r for r in runs if r.data.tags.get("sweep") == "true"]
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id]
    assert len(runs) == 3 and len(children) == 2
    assert parent.info.status == "FINISHED" and parent.data.metrics["sweep/children"] == 2
    assert {c.data.tags["slurm.array_task_id"] for c in children} == {"0", "1"}
    assert len({c.data.tags["slurm.job_id"] for c in children}) == 1
    assert {c.data.params["optim.lr"] for c in children} == {"0.1", "0.02"}
    for child in children:
        assert child.info.status == "FINISHED" and child.data.tags["world_size"] == "2"
        assert history(uri, child.info.run_id, "val/samples") == [(0, 359.0)]


def _parent_once_ended(uri: str) -> Any:
    """The sweep's parent run, once the last of its unwaited jobs has ended it."""

    def ended_parent() -> object:
        [parent] = [r for r in runs_in(uri) if r.data.tags.get("sweep") == "true"]
        return parent if parent.info.status != "RUNNING" else None

    return wait_until(ended_parent, 240, "the last job ending the parent run")


@on_slurm
def test_an_unwaited_sweep_is_ended_by_its_last_job(cluster: None, store: dict[str, str],
                                                   tmp_path: Path) -> None:
    """cluster.wait=false: the command returns at once; the parent run stays RUNNING until the
    last of its jobs has ended, and that job summarises and ends it."""
    result = slurm_job(tmp_path, "-m", "optim.lr=0.1,0.02", "cluster.wait=false",
                       "trainer.epochs=1", "tracking.log_model=false", env=store, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "stays RUNNING" in result.stdout and "COMPLETED" not in result.stdout
    uri = store["MLFLOW_TRACKING_URI"]
    parent = _parent_once_ended(uri)
    children = [r for r in runs_in(uri)
                if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id]
    assert parent.info.status == "FINISHED", parent.data.tags
    assert parent.data.tags["sweep.jobs"] == "2" and len(children) == 2
    assert parent.data.metrics["sweep/children"] == 2
    assert parent.data.tags["best_run_id"] in {c.info.run_id for c in children}
    assert all(c.info.status == "FINISHED" for c in children)


@on_slurm
def test_an_unwaited_sweep_whose_jobs_fail_ends_its_parent_failed(
        cluster: None, store: dict[str, str], tmp_path: Path) -> None:
    """One job fails at start-up, before its run exists; the other fails while training. The
    last of them to end still ends the parent, FAILED, counting both."""
    result = slurm_job(tmp_path, "-m", "trainer.fail_on_rank=0", "trainer.fail_at_step=0,3",
                       "cluster.wait=false", "trainer.epochs=1", "tracking.log_model=false",
                       env=store, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    uri = store["MLFLOW_TRACKING_URI"]
    parent = _parent_once_ended(uri)
    [child] = [r for r in runs_in(uri)
               if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id]
    assert child.info.status == "FAILED" and "failing on purpose at step 3" in \
        child.data.tags["error"]
    [no_run] = [v for k, v in parent.data.tags.items() if k.startswith("sweep.no_run.")]
    assert "failing on purpose at step 0" in no_run and str(tmp_path / "sweep") in no_run
    assert parent.info.status == "FAILED", parent.data.tags
    assert parent.data.metrics["sweep/failed_children"] == 2
    assert parent.data.metrics["sweep/children"] == 1


def _attempts(tmp_path: Path) -> str:
    logs = sorted((tmp_path / "sweep" / ".submitit").glob("*/*_0_log.err"))
    return "\n".join(p.read_text(errors="replace") for p in logs)


@on_slurm
def test_a_time_limit_requeues_and_resumes_into_the_same_run(cluster: None,
                                                             store: dict[str, str],
                                                             tmp_path: Path) -> None:
    """USR2 60 s before a 2-minute limit: checkpoint, requeue (same job id), resume, finish."""
    # Slurm sends USR2 at the limit minus the delay, or up to ~16 s earlier (seen: 44-51 s
    # after the start): 170 epochs (~65 s of training here) outlast the first attempt and fit
    # in the second.
    epochs = 170
    result = slurm_job(tmp_path, "cluster.tasks_per_node=2", "cluster.time_min=2",
                       "cluster.signal_delay_s=60", f"trainer.epochs={epochs}",
                       "trainer.log_every_n_steps=5", "trainer.checkpoint_every=0",
                       env=store, timeout=900)
    assert result.returncode == 0, result.stdout + result.stderr
    uri = store["MLFLOW_TRACKING_URI"]
    [run] = runs_in(uri)
    assert run.info.status == "FINISHED"
    assert int(run.data.tags["restarts"]) >= 1 and run.data.tags["stopped_by"] == "SIGUSR2"
    for key in ("train/loss", "val/accuracy", "val/samples"):
        assert [s for s, _ in history(uri, run.info.run_id, key)] == list(range(epochs)), key
    steps = [s for s, _ in history(uri, run.info.run_id, "train/step_loss")]
    total_steps = epochs * 23  # ceil(719 / 32) steps per epoch and rank
    assert steps == list(range(5, total_steps + 1, 5))
    assert "resumed from" in _attempts(tmp_path)


@on_slurm
def test_scontrol_requeue_resumes_from_the_checkpoint(cluster: None, store: dict[str, str],
                                                      tmp_path: Path) -> None:
    proc = subprocess.Popen(
        [*_train_argv(tmp_path), "cluster.tasks_per_node=2", "trainer.epochs=20",
         "trainer.log_every_n_steps=5"], cwd=REPO, env={**os.environ, **store},
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    checkpoints = tmp_path / "sweep" / "0" / "checkpoints"
    first = wait_until(lambda: _newest_step(checkpoints), 180, "the first checkpoint")
    job_id = subprocess.run(["squeue", "-h", "-o", "%i"], capture_output=True,
                            text=True).stdout.split()[0]
    # Two epochs further (23 steps each with 2 ranks): the requeue lands mid-training.
    wait_until(lambda: (_newest_step(checkpoints) or 0) >= first + 2 * 23, 120,
               "two more epochs")
    subprocess.run(["scontrol", "requeue", job_id], check=True)
    stdout, stderr = proc.communicate(timeout=420)
    assert proc.returncode == 0, stdout + stderr
    uri = store["MLFLOW_TRACKING_URI"]
    [run] = runs_in(uri)
    assert run.info.status == "FINISHED"
    assert run.data.tags["restarts"] == "1" and run.data.tags["stopped_by"] == "SIGTERM"
    assert [s for s, _ in history(uri, run.info.run_id, "train/loss")] == list(range(20))
    steps = [s for s, _ in history(uri, run.info.run_id, "train/step_loss")]
    assert steps == sorted(set(steps))
    assert "resumed from" in _attempts(tmp_path)


def _newest_step(checkpoints: Path) -> int | None:
    """The global step of the newest checkpoint written (files are renamed into place)."""
    return max((int(p.stem.split("-")[1]) for p in checkpoints.glob("step-*.pt")), default=None)


def _train_argv(tmp_path: Path) -> list[str]:
    import sys

    return [sys.executable, "-m", "train", "+cluster=slurm", "cluster.partition=debug",
            "cluster.time_min=10", f"hydra.sweep.dir={tmp_path}/sweep"]
