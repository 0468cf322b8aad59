"""Submitting to Slurm from the login node: pre-flight, dry run, and following the jobs.

Used by the Hydra launcher in hydra_plugins/train_launcher (what `+cluster=slurm` selects).
Everything here runs in the submitting process, before or after the jobs; what runs inside a
job is the ordinary training code (train/launch.py -> train/job.py), which reads its place in
the job from SLURM_* through train/distenv.py.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from train import config as config_lib
from train.config import ConfigError, TrainConfig
from train.config import _ranks_per_node as ranks_per_node

TERMINAL_STATES = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY",
                   "PREEMPTED", "BOOT_FAIL", "DEADLINE")
POLL_S = 2.0


class SubmitError(RuntimeError):
    """The job cannot be submitted as asked; nothing was submitted."""


def check_slurm(partition: str | None) -> None:
    """sbatch is here, the controller answers, and the partition exists."""
    if shutil.which("sbatch") is None:
        raise SubmitError("sbatch is not on PATH: run this on a Slurm login node (or `make "
                          "cluster-up` for the local test cluster).")
    try:
        out = subprocess.run(["sinfo", "-h", "-o", "%P"], capture_output=True, text=True,
                             timeout=20)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise SubmitError(f"Slurm does not answer (sinfo: {e}).") from None
    if out.returncode != 0:
        raise SubmitError("No usable Slurm configuration or controller: sinfo says "
                          f"{out.stderr.strip() or out.stdout.strip()!r}. Check SLURM_CONF.")
    partitions = [p.rstrip("*") for p in out.stdout.split()]
    if partition is not None and partition not in partitions:
        raise SubmitError(f"cluster.partition={partition!r} does not exist; partitions: "
                          f"{', '.join(partitions)}.")


def check_request(cfg: TrainConfig) -> int:
    """Refuse an inconsistent request; returns the job's world size."""
    assert cfg.cluster is not None
    c = cfg.cluster
    problems = []
    if c.nodes < 1:
        problems.append("cluster.nodes must be at least 1.")
    if c.gpus_per_node < 0:
        problems.append("cluster.gpus_per_node cannot be negative.")
    per_node = ranks_per_node(c.tasks_per_node, c.gpus_per_node)
    if c.gpus_per_node > 0 and per_node != c.gpus_per_node:
        problems.append(f"cluster.tasks_per_node={per_node} but cluster.gpus_per_node="
                        f"{c.gpus_per_node}: a GPU job runs one rank per GPU.")
    if c.time_min < 1:
        problems.append("cluster.time_min must be at least 1.")
    if problems:
        raise ConfigError("Refusing to submit: " + " ".join(problems))
    world_size = c.nodes * per_node
    config_lib.validate(cfg, world_size)
    return world_size


def check_tracking(cfg: TrainConfig) -> str | None:
    """The store is usable from here; returns the experiment id to hand to every job."""
    if not cfg.tracking.enabled:
        return None
    from train import store, tracking

    uri = store.resolve_uri(cfg.tracking)
    store.check_reachable(uri)
    if store.is_local_path_uri(uri):
        print(f"warning: tracking store {uri} is a local path: the compute nodes must see it on "
              "a shared filesystem (and SQLite on NFS can lock badly). With many jobs or nodes, "
              "run an MLflow server (`make mlflow-server` or slurm/mlflow-server.sbatch) and set "
              "MLFLOW_TRACKING_URI=http://<host>:<port>.", file=sys.stderr, flush=True)
    # Created (and an SQLite store migrated) here, once: parallel jobs racing to do either put
    # runs into the Default experiment or corrupt the database.
    return tracking.prepare(cfg.tracking)


def preflight(job_configs: Sequence[TrainConfig]) -> str | None:
    """All checks before anything is submitted; returns the experiment id for the jobs."""
    first = job_configs[0]
    assert first.cluster is not None
    check_slurm(first.cluster.partition)
    for cfg in job_configs:
        check_request(cfg)
        if cfg.data.name not in ("digits", "synthetic") and not cfg.data.download:
            from train import datasets

            datasets.check_available(cfg.data)
    return check_tracking(first)


def show_script(executor: Any, num_jobs: int) -> str:
    """The sbatch script submitit would submit (with the array line for a sweep)."""
    slurm = executor._executor
    parameters = dict(slurm.parameters)
    if num_jobs > 1:
        parameters["map_count"] = num_jobs
    from submitit.slurm.slurm import _make_sbatch_string

    return _make_sbatch_string(command=slurm._submitit_command_str, folder=slurm.folder,
                               **parameters)


def _log_paths(job: Any) -> tuple[Path, Path]:
    task0 = job.task(0)
    return task0.paths.stdout, task0.paths.stderr


def announce(jobs: Sequence[Any], world_size: int, nodes: int) -> None:
    first = jobs[0]
    ids = first.job_id.split("_")[0] + (f"_[0-{len(jobs) - 1}]" if len(jobs) > 1 else "")
    print(f"Submitted Slurm job {ids}: {len(jobs)} job(s), each {world_size} rank(s) on "
          f"{nodes} node(s).", flush=True)
    stdout, stderr = _log_paths(first)
    print(f"  rank 0 logs: {stdout}\n               {stderr}", flush=True)
    print(f"  all ranks:   {stdout.parent}/  (one .out/.err per rank)", flush=True)
    print(f"  follow with: squeue -j {ids.split('_')[0]}; sacct -j {ids.split('_')[0]}",
          flush=True)


def follow(jobs: Sequence[Any]) -> list[str]:
    """Print each job's state changes until every job has ended; returns the final states."""
    last: dict[str, str] = {}
    while True:
        for job in jobs:
            state = job.get_info(mode="force").get("State", "UNKNOWN").split()[0]
            if state != last.get(job.job_id):
                print(f"[{time.strftime('%H:%M:%S')}] job {job.job_id}: {state}", flush=True)
                last[job.job_id] = state
        if all(state in TERMINAL_STATES for state in last.values()):
            return [last[job.job_id] for job in jobs]
        time.sleep(POLL_S)


def failing_log_tail(job: Any, lines: int = 40) -> str:
    """The end of the first rank's log that shows an error (ranks in order)."""
    fallback = ""
    for rank in range(job.num_tasks):
        path = job.task(rank).paths.stderr
        if not path.exists():
            continue
        text = path.read_text(errors="replace").splitlines()
        tail = f"--- {path} (last {lines} lines) ---\n" + "\n".join(text[-lines:])
        if any("Error" in line or "Traceback" in line for line in text):
            return tail
        fallback = fallback or tail
    return fallback or "(no rank log found)"


def collect(jobs: Sequence[Any], states: Sequence[str]) -> tuple[list[Any], list[Any]]:
    """Rank 0's return of every job that succeeded, and the jobs that failed.

    A job fails when Slurm says so, or when one of its ranks raised: Hydra (inside each task)
    turns the error into a FAILED JobReturn and the task ends normally, so Slurm can report
    COMPLETED for a job whose ranks failed.
    """
    from hydra.core.utils import JobStatus

    returns, failed = [], []
    for job, state in zip(jobs, states, strict=True):
        try:
            if state != "COMPLETED":
                raise RuntimeError(state)
            ranks = job.results()
            if any(r.status == JobStatus.FAILED for r in ranks):
                raise RuntimeError("a rank failed")
            returns.append(ranks[0])
        except Exception:  # noqa: BLE001 - also submitit's FailedJobError and friends
            failed.append(job)
            if state == "COMPLETED":
                print(f"[{time.strftime('%H:%M:%S')}] job {job.job_id}: FAILED (a rank raised; "
                      "Slurm reports COMPLETED)", flush=True)
    return returns, failed


def report_failures(jobs: Sequence[Any], failed: Sequence[Any]) -> None:
    for job in failed:
        print(f"\njob {job.job_id} failed.\n{failing_log_tail(job)}", file=sys.stderr)
    if failed:
        print(f"\nerror: {len(failed)} of {len(jobs)} Slurm job(s) failed.", file=sys.stderr)
