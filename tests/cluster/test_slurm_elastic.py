"""An elastic Slurm job (cluster.min_nodes) under FSDP on the local cluster: it starts on both
nodes, loses one (drained, then `scontrol requeue`), and resumes its sharded checkpoint on the
node it has left, into the same MLflow run, every sample of its epoch once."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

from tests.cluster.conftest import queued_jobs
from tests.conftest import REPO, history, runs_in, wait_until

TEXT = Path(dataclasses.__file__)
"""A 58 KB standard-library module: ~1,700 training windows of 32 tokens, ~108 steps of 16."""
GPT = ("data=tokens", "model=gpt", "task=language_model", "model.n_layer=2", "model.n_head=2",
       "model.n_embd=32", "data.num_workers=0", "data.seq_len=32", "data.batch_size=16",
       "optim=adamw", "task.sample_tokens=0", "trainer.epochs=1", "trainer.log_every_n_steps=1",
       "tracking.log_model=false", "distributed.strategy=fsdp")


def _node2(state: str) -> None:
    subprocess.run(["scontrol", "update", "nodename=node2", f"state={state}",
                    *(["reason=test: a lost node"] if state == "drain" else [])],
                   check=True, capture_output=True, timeout=30)


def _steps_logged(uri: str) -> int:
    runs = runs_in(uri)
    return len(history(uri, runs[0].info.run_id, "train/step_loss")) if runs else 0


def test_an_fsdp_job_that_loses_a_node_resumes_on_the_other_in_the_same_run(
        cluster: None, store: dict[str, str], tmp_path: Path) -> None:
    tokens = tmp_path / "tokens"
    prepared = subprocess.run([sys.executable, "-m", "train.prepare_text", str(TEXT), str(tokens),
                               "--val-fraction", "0.05"], cwd=REPO, capture_output=True,
                              text=True, timeout=120)
    assert prepared.returncode == 0, prepared.stderr
    uri = store["MLFLOW_TRACKING_URI"]
    job = subprocess.Popen(
        [sys.executable, "-m", "train", "+cluster=slurm", "cluster.partition=debug",
         "cluster.time_min=10", f"hydra.sweep.dir={tmp_path}/sweep", "cluster.nodes=2",
         "cluster.min_nodes=1", *GPT, f"data.root={tokens}"],
        cwd=REPO, env={**os.environ, **store}, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True)
    job_id = None
    try:
        job_id = wait_until(queued_jobs, 120, "the job in the queue", job=job).split()[0]
        wait_until(lambda: _steps_logged(uri) >= 5, 240, "five steps on two nodes", every=0.5,
                   job=job)
        _node2("drain")  # what a failing node's health check does: no new job lands on it
        subprocess.run(["scontrol", "requeue", job_id], check=True, timeout=30)
        stdout, stderr = job.communicate(timeout=300)
    finally:
        if job.poll() is None:
            job.kill()
        if job_id is not None and job.returncode != 0:
            subprocess.run(["scancel", job_id], capture_output=True, timeout=30)
        _node2("resume")
    assert job.returncode == 0, stdout + stderr
    assert "each 1-2 rank(s) on 1-2 node(s)" in stdout
    [run] = runs_in(uri)
    assert run.info.status == "FINISHED"
    assert run.data.params["distributed.strategy"] == "fsdp"
    assert run.data.tags["restarts"] == "1" and run.data.tags["stopped_by"] == "SIGTERM"
    # The first start on both nodes (the 2-node FSDP job), the second on the one left.
    attempts = {k: v for k, v in run.data.tags.items() if k.startswith("attempt.")}
    assert attempts == {"attempt.0.world_size": "2", "attempt.0.nodes": "2",
                        "attempt.1.world_size": "1", "attempt.1.nodes": "1"}
    assert run.data.tags["world_size"] == "1" and run.data.tags["hostnames"] == "node1"
    # Every optimiser step once: the checkpoint taken at the requeue's TERM is the last step
    # trained before it, and the epoch's samples are the data set's, none twice or lost.
    num_train = int(run.data.params["data.num_train"])
    steps = [s for s, _ in history(uri, run.info.run_id, "train/step_loss")]
    assert steps == list(range(1, -(-num_train // 16) + 1))
    assert history(uri, run.info.run_id, "train/samples") == [(1, float(num_train))]
    assert history(uri, run.info.run_id, "val/samples")[0][0] == 1
    attempts = "".join(p.read_text(errors="replace")
                       for p in (tmp_path / "sweep" / ".submitit").glob("*/*_0_log.err"))
    assert "resumed from" in attempts
