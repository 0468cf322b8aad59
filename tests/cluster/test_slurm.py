"""`python -m train +cluster=slurm` against the real local Slurm cluster (slurm/). Without a
cluster: tests/unit/test_slurm.py."""

from __future__ import annotations

import contextlib
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
from mlflow import MlflowClient

from tests.cluster.conftest import listed_by_squeue, slurm_job, wait_for_job
from tests.conftest import (
    REPO,
    USER_PATH,
    history,
    profiled_ops,
    run_train,
    runs_in,
    wait_until,
)


def test_two_nodes_four_ranks_make_one_run(cluster: None, store: dict[str, str],
                                           tmp_path: Path) -> None:
    result = slurm_job(tmp_path, "cluster.nodes=2", "cluster.tasks_per_node=2",
                       "trainer.epochs=2", "data.batch_size=64", "trainer.profile.enabled=true",
                       "trainer.profile.wait=2", "trainer.profile.active=1", env=store)
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
    assert history(uri, run.info.run_id, "val/samples") == [(1, 359.0), (2, 359.0)]
    assert history(uri, run.info.run_id, "train/samples") == [(1, 1440.0), (2, 1440.0)]
    # trainer.profile on both nodes: every rank's trace of step 4, its forward and backward.
    assert tags["profile.steps"] == "4"
    traces = profiled_ops(uri, run.info.run_id, tmp_path / "artifacts")
    assert sorted(traces) == [0, 1, 2, 3]
    for names in traces.values():
        assert {"ProfilerStep#3", "aten::conv2d"} <= names
        assert any(n.startswith("autograd::engine::evaluate_function: ConvolutionBackward")
                   for n in names)

    # `python -m train eval` of that run on Slurm, 2 nodes: its last validation, exactly. Its
    # output directory moved out of sight first: rank 0 on node1 takes the store's copy of the
    # final weights into the evaluating job's directory, which node2's ranks read.
    trained = Path(tags["output_dir"])
    trained.rename(trained.with_name(trained.name + "-elsewhere"))
    evaluated = run_train("eval", run.info.run_id, "eval.split=val", "+cluster=slurm",
                          "cluster.partition=debug", "cluster.time_min=10", "cluster.nodes=2",
                          "cluster.tasks_per_node=2", f"hydra.sweep.dir={tmp_path}/eval",
                          env=store, timeout=420)
    assert evaluated.returncode == 0, evaluated.stdout + evaluated.stderr
    after = MlflowClient(tracking_uri=uri).get_run(run.info.run_id)
    assert after.info.status == "FINISHED"
    assert after.data.metrics["eval/digits_val/samples"] == 359
    last_val = history(uri, run.info.run_id, "val/loss")[-1]
    assert history(uri, run.info.run_id, "eval/digits_val/loss") == [
        (2, pytest.approx(last_val[1], abs=1e-6))]
    weights = f"runs:/{run.info.run_id}/weights/model.pt"
    assert after.data.tags["eval/digits_val/weights"] == f"last: {weights}"


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
    state = wait_for_job(submitted.stdout.strip().split(";")[0], timeout=300)
    logs = "".join(p.read_text() for p in sorted(out.glob("rank-*.log")))
    assert state == "COMPLETED", logs
    assert sorted(p.name for p in out.glob("rank-*.log")) == [f"rank-{i}.log" for i in range(4)]
    uri = store["MLFLOW_TRACKING_URI"]
    [run] = runs_in(uri)
    assert run.info.status == "FINISHED"
    tags = run.data.tags
    assert tags["world_size"] == "4" and tags["launcher"] == "slurm"
    assert tags["hostnames"] == "node1,node2" and tags["slurm.job_id"].isdigit()
    assert history(uri, run.info.run_id, "val/samples") == [(1, 359.0)]






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
        wait_for_job(job_id, timeout=60)
        # sacct says CANCELLED while squeue still lists it (the fixture checks none is left)
        with contextlib.suppress(AssertionError):
            wait_until(lambda: not listed_by_squeue(job_id), 60, f"job {job_id} leaving squeue")


def _answers(url: str) -> bool:
    import urllib.request

    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


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


def test_preflight_refuses_an_unreachable_tracking_server(cluster: None, tmp_path: Path) -> None:
    from train.distributed.env import free_port

    uri = f"http://127.0.0.1:{free_port()}"
    result = slurm_job(tmp_path, env={"MLFLOW_TRACKING_URI": uri}, timeout=120)
    assert result.returncode == 2
    assert "cannot be reached" in result.stderr and "Submitted" not in result.stdout


def test_preflight_without_slurm_commands(tmp_path: Path) -> None:
    """A login node without Slurm on PATH (no cluster needed for this one)."""
    bare_path = os.pathsep.join(p for p in os.environ["PATH"].split(os.pathsep)
                                if not (Path(p) / "sbatch").exists())
    result = slurm_job(tmp_path, env={"PATH": bare_path}, timeout=120)
    assert result.returncode == 2
    assert "sbatch is not on PATH" in result.stderr


def test_an_optuna_search_cannot_leave_its_trials_unwaited(tmp_path: Path) -> None:
    result = slurm_job(tmp_path, "-m", "+hparams_search=optuna_digits", "cluster.wait=false",
                       timeout=120)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "cluster.wait=false cannot serve TrainOptunaSweeper" in result.stderr
    assert "Submitted" not in result.stdout


def test_a_failing_rank_ends_the_job_promptly(cluster: None, store: dict[str, str],
                                              tmp_path: Path) -> None:
    # Rank 3 fails right after the first step, when rank 0's MLflow sender has only begun to
    # import MLflow: the run must still exist and end FAILED, although srun ends rank 0
    # KillWait (5 s here) after rank 3 leaves.
    result = slurm_job(tmp_path, "cluster.nodes=2", "cluster.tasks_per_node=2",
                       "trainer.epochs=50", env={**store, "TRAIN_FAIL_DRILL": "3:1"},
                       timeout=300)  # well under the job's 10-minute limit
    assert result.returncode == 1, result.stdout + result.stderr
    assert ": FAILED" in result.stdout
    [run] = runs_in(store["MLFLOW_TRACKING_URI"])
    assert run.info.status == "FAILED"
    error = run.data.tags["error"]
    assert error.startswith("rank 3 on node2") and "FailureDrill" in error
    # One block, as a local job's: the cause, what was kept, the command that resumes it in
    # the same directory (the same run); the tracebacks in train.log and in the run.
    out = tmp_path / "sweep" / "0"
    assert f": the training job failed; {error}" in result.stderr
    assert (f"hydra.sweep.dir={tmp_path / 'sweep'} hydra.sweep.subdir=0" in result.stderr
            and "+cluster=slurm" in result.stderr.split("  resume: ")[-1])
    assert f"  run: MLflow run {run.info.run_id}; view it: " in result.stderr
    assert "Traceback" not in result.stderr and "last 40 lines" not in result.stderr
    log = (out / "train.log").read_text()
    assert "[rank 3] traceback of its error:" in log and "FailureDrill" in log
    logged = MlflowClient(store["MLFLOW_TRACKING_URI"]).list_artifacts(run.info.run_id)
    assert "train.log" in [a.path for a in logged]


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
        assert history(uri, child.info.run_id, "val/samples") == [(1, 359.0)]


def _parent_once_ended(uri: str) -> Any:
    """The sweep's parent run, once the last of its unwaited jobs has ended it."""

    def ended_parent() -> object:
        [parent] = [r for r in runs_in(uri) if r.data.tags.get("sweep") == "true"]
        return parent if parent.info.status != "RUNNING" else None

    return wait_until(ended_parent, 240, "the last job ending the parent run")


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


def test_an_unwaited_sweep_whose_jobs_fail_ends_its_parent_failed(
        cluster: None, store: dict[str, str], tmp_path: Path) -> None:
    """One job fails at start-up, before its run exists; another fails while training; the
    third finishes. The last of them to end still ends the parent, FAILED, counting both.
    `python -m train sweep resume` then submits the two again, not the finished one."""
    result = slurm_job(tmp_path, "-m", "optim.lr=0.1,0.05,0.02", "cluster.wait=false",
                       "trainer.epochs=1", "tracking.log_model=false",
                       env={**store, "TRAIN_FAIL_DRILL": "0/0:0,1/0:3"}, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    uri = store["MLFLOW_TRACKING_URI"]
    parent = _parent_once_ended(uri)
    child, finished = sorted((r for r in runs_in(uri)
                              if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id),
                             key=lambda r: r.data.tags["output_dir"])
    assert child.info.status == "FAILED" and "failing on purpose at step 3" in \
        child.data.tags["error"]
    assert finished.info.status == "FINISHED"
    [no_run] = [v for k, v in parent.data.tags.items() if k.startswith("sweep.no_run.")]
    assert "failing on purpose at step 0" in no_run and str(tmp_path / "sweep") in no_run
    assert parent.info.status == "FAILED", parent.data.tags
    assert parent.data.metrics["sweep/failed_children"] == 2
    assert parent.data.metrics["sweep/children"] == 2

    # One command runs the two again under the same parent, and follows them to their end.
    resumed = run_train("sweep", "resume", str(tmp_path / "sweep"),
                        env=store, timeout=300)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert "cluster.wait=true" in resumed.stdout
    assert "1 of the sweep's 3 jobs finished already in their directories, not started " \
           "again: #2" in resumed.stdout
    assert "_[0-1]: 2 job(s)" in resumed.stdout  # an array of the two others
    [again] = [r for r in runs_in(uri) if r.data.tags.get("sweep") == "true"]
    assert again.info.run_id == parent.info.run_id and again.info.status == "FINISHED"
    assert again.data.metrics["sweep/failed_children"] == 0
    assert again.data.metrics["sweep/children"] == 3
    children = {r.info.run_id: r for r in runs_in(uri)
                if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id}
    assert children[child.info.run_id].info.status == "FINISHED"  # the same run, continued
    assert children[finished.info.run_id].data.tags["slurm.job_id"] == \
        finished.data.tags["slurm.job_id"]  # not run again


def _attempts(tmp_path: Path) -> str:
    logs = sorted((tmp_path / "sweep" / ".submitit").glob("*/*_0_log.err"))
    return "\n".join(p.read_text(errors="replace") for p in logs)


def test_a_time_limit_requeues_and_resumes_into_the_same_run(cluster: None,
                                                             store: dict[str, str],
                                                             tmp_path: Path) -> None:
    """USR2 60 s before a 2-minute limit: checkpoint, requeue (same job id), resume, finish.

    The test sets the job's pace, not the machine: every sample takes 0.1 s until the test
    writes `release` (a step of 32 samples a rank >= 3.2 s, so the 36 steps take >= 115 s and
    cannot end before Slurm's USR2, which comes 44-60 s after the start), and the file is
    written once the first attempt's stop checkpoint is there: the rest runs at full speed in
    the next."""
    epochs, release = 6, tmp_path / "release"
    proc = subprocess.Popen(
        [*_train_argv(tmp_path), "cluster.tasks_per_node=2", "cluster.time_min=2",
         "cluster.signal_delay_s=60", f"trainer.epochs={epochs}", "trainer.log_every_n_steps=5",
         "trainer.checkpoint_every=0", "data=custom", "data.num_workers=0",
         "data.train._target_=userpkg.data.HeldLines", "+data.train.length=480",
         f"+data.train.release={release}"],
        cwd=REPO, env={**os.environ, **store, "PYTHONPATH": USER_PATH},
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    checkpoints = tmp_path / "sweep" / "0" / "checkpoints"
    try:
        wait_until(lambda: _newest_step(checkpoints), 300, "the stop checkpoint", job=proc)
    finally:
        release.write_text("")
    stdout, stderr = proc.communicate(timeout=600)
    assert proc.returncode == 0, stdout + stderr
    uri = store["MLFLOW_TRACKING_URI"]
    [run] = runs_in(uri)
    assert run.info.status == "FINISHED"
    assert int(run.data.tags["restarts"]) >= 1 and run.data.tags["stopped_by"] == "SIGUSR2"
    for key in ("train/loss", "val/accuracy", "val/samples"):
        assert [s for s, _ in history(uri, run.info.run_id, key)] == list(range(1, epochs + 1)), key
    steps = [s for s, _ in history(uri, run.info.run_id, "train/step_loss")]
    total_steps = epochs * 6  # 384 training samples (480, 20 % held out), 64 a step
    assert steps == list(range(5, total_steps + 1, 5))
    assert "resumed from" in _attempts(tmp_path)


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
    assert [s for s, _ in history(uri, run.info.run_id, "train/loss")] == list(range(1, 21))
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
