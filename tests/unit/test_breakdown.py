"""Where the step time goes (train/report/breakdown.py): jobs trained in-process on one gloo
rank, their time/* metrics and `bottleneck` tag read back from a real MLflow store; the table
arithmetic and `train status`'s line from written heartbeats."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from statistics import median

import pytest

from tests.conftest import composed, history, new_store, runs_in
from train.app import run
from train.launch import inspect
from train.report.breakdown import PHASES, Breakdown

JOB = ("model=mlp", "model.width=16", "data.batch_size=8", "data.num_workers=0",
       "trainer.epochs=1", "trainer.log_every_n_steps=2", "tracking.batch_interval_s=0",
       "tracking.log_model=false")
SLEEPING = ("data=custom", "data.train._target_=userpkg.data.SlowOnRank",
            "+data.train.length=64", "+data.train.rank=0", "+data.train.delay=0.02",
            "data.val._target_=userpkg.data.Lines", "+data.val.length=16")
IN_MEMORY = ("data=synthetic", "data.num_samples=80", "data.val_fraction=0.2",
             "data.image_size=8")


def _trained(tmp_path: Path, store_template: Path, *overrides: str) -> tuple[str, object]:
    uri = new_store(tmp_path / "mlflow.db", store_template)
    run(composed(*JOB, *overrides, f"tracking.uri={uri}"), str(tmp_path / "job"), "test")
    [mlflow_run] = runs_in(uri)
    return uri, mlflow_run


def _per_step(uri: str, run_id: str, key: str) -> dict[int, float]:
    return dict(history(uri, run_id, key))


def test_a_data_set_that_sleeps_makes_the_run_input_bound(
        tmp_path: Path, store_template: Path, no_launcher_env: None, user_path: None) -> None:
    """Each sample takes 20 ms to read, with no DataLoader worker: over half of every logged
    interval is the wait for data, the run is tagged `bottleneck=input` with the advice, and
    the phases add up to the step time the loop measured with its own clock."""
    uri, mlflow_run = _trained(tmp_path, store_template, *SLEEPING)
    run_id = mlflow_run.info.run_id
    shares = _per_step(uri, run_id, "time/data_share")
    assert sorted(shares) == [2, 4, 6, 8] and all(s > 0.5 for s in shares.values()), shares
    assert mlflow_run.data.tags["bottleneck"] == "input"
    assert mlflow_run.data.tags["bottleneck_hint"].startswith(
        "rank 0 waited for data ") and "data.num_workers=0 and" in \
        mlflow_run.data.tags["bottleneck_hint"]
    step = _per_step(uri, run_id, "time/step")
    per_phase = [_per_step(uri, run_id, f"time/{phase}") for phase in PHASES]
    for at, seconds in step.items():
        assert sum(p[at] for p in per_phase) == pytest.approx(seconds, rel=0.05), at
    # A one-rank job is its own slowest rank.
    assert set(_per_step(uri, run_id, "time/slowest_rank").values()) == {0.0}
    assert _per_step(uri, run_id, "time/slowest/data_share") == shares


def test_the_same_job_on_in_memory_data_is_not_input_bound(
        tmp_path: Path, store_template: Path, no_launcher_env: None) -> None:
    """(The first interval also holds the first batch's fetch: the data moved to the device.)"""
    uri, mlflow_run = _trained(tmp_path, store_template, *IN_MEMORY)
    shares = _per_step(uri, mlflow_run.info.run_id, "time/data_share")
    assert len(shares) == 4 and median(shares.values()) < 0.5, shares
    assert mlflow_run.data.tags["bottleneck"] in ("compute", "communication")
    assert mlflow_run.data.tags["bottleneck_hint"].startswith("rank 0 ")


def test_the_slowest_rank_is_the_one_with_the_most_own_work_and_it_sets_the_verdict() -> None:
    """Rank 1 reads slowly; rank 0 waits for it inside backward (DDP's all-reduce): rank 1 is
    the slowest, and the run is input-bound, not compute-bound."""
    breakdown = Breakdown()
    #        data forward backward optimizer collective other
    rank0 = [0.1, 0.2, 2.0, 0.1, 0.05, 0.0]
    rank1 = [1.9, 0.2, 0.2, 0.1, 0.05, 0.0]
    values = breakdown.interval([rank0, rank1], steps=10)
    assert values["time/slowest_rank"] == 1.0
    assert values["time/data"] == pytest.approx(0.01)  # rank 0's, per step
    assert values["time/slowest/data_share"] == pytest.approx(1.9 / 2.45)
    assert sum(values[f"time/{p}_share"] for p in PHASES) == pytest.approx(1.0)
    verdict = breakdown.verdict(num_workers=2, ranks_here=2)
    assert verdict is not None and verdict.bottleneck == "input"
    assert verdict.line.startswith("rank 1 waited for data 78% of its step time with "
                                   "data.num_workers=2 and ")
    assert Breakdown().verdict(num_workers=0, ranks_here=1) is None  # no logging step yet
    computing = Breakdown()
    computing.interval([[0.0, 1.0, 1.0, 0.1, 0.0, 0.0]], steps=1)
    lines = [computing.verdict(0, 1, precision, compiled).line  # type: ignore[union-attr]
             for precision, compiled in (("fp32", False), ("bf16-mixed", False),
                                         ("bf16-mixed", True))]
    assert lines[0].endswith("try trainer.precision=bf16-mixed or trainer.compile=true")
    assert lines[1].endswith("try trainer.compile=true")  # not what the run already does
    assert lines[2].endswith(": a smaller model, or more GPUs")
    # What the compute phases hold besides the rank's own compute: nothing on one rank, the
    # strategy's collectives on more.
    assert "of its step time (forward, backward, the optimiser step)" in lines[0]
    two = Breakdown()
    two.interval([[0.0, 1.0, 1.0, 0.1, 0.0, 0.0]] * 2, steps=1)
    assert "(forward, backward with DDP's gradient all-reduce, the optimiser step)" in \
        two.verdict(0, 2).line  # type: ignore[union-attr]
    assert ("(forward and backward with FSDP's parameter gathers and gradient reduce-scatters, "
            "the optimiser step)") in two.verdict(0, 2, strategy="fsdp").line  # type: ignore[union-attr]


def test_the_input_advice_fits_the_ranks_cpus_and_its_data(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """More workers only while a rank has idle CPUs; a sharded data set only for data that is
    not one already."""
    monkeypatch.setattr(os, "sched_getaffinity", lambda _: set(range(8)))
    starving = Breakdown()
    starving.interval([[1.9, 0.2, 0.2, 0.1, 0.0, 0.0]], steps=10)
    few = starving.verdict(num_workers=1, ranks_here=2).line  # type: ignore[union-attr]
    assert "4 CPUs per rank: raise data.num_workers (up to 4)" in few
    assert few.endswith("or use a sharded data set (data=arrow, written by "
                        "`train prepare-data`)")
    busy = starving.verdict(num_workers=4, ranks_here=2,  # type: ignore[union-attr]
                            sharded=True).line
    assert "raise data.num_workers" not in busy and "sharded" not in busy
    assert busy.endswith("give each rank more CPUs (cluster.cpus_per_task, or fewer ranks per "
                         "node), or lighter per-sample work (data transforms, decoding)")


def test_status_shows_each_ranks_wait_for_data(tmp_path: Path) -> None:
    ranks = tmp_path / "ranks"
    ranks.mkdir()
    now = time.time()
    for rank, share in ((0, 0.46), (1, None)):
        (ranks / f"rank-{rank}.json").write_text(json.dumps(
            {"rank": rank, "host": "node1", "pid": 100 + rank, "step": 7, "phase": "forward",
             "since": now - 1, "data_share": share, "written": now}))
    lines = inspect.status(tmp_path).splitlines()
    assert ", waited for data 46% of the last logging interval, heartbeat written" in lines[0]
    assert "waited for data" not in lines[1]  # before its first logging step


def test_status_of_a_job_that_finished_says_so_unless_it_was_resumed_since(
        tmp_path: Path) -> None:
    ranks = tmp_path / "ranks"
    ranks.mkdir()
    now = time.time()
    (ranks / "rank-0.json").write_text(json.dumps(
        {"rank": 0, "host": "node1", "pid": 100, "step": 46, "phase": "collective",
         "since": now - 370, "written": now - 369}))
    (tmp_path / "summary.json").write_text("{}")
    lines = inspect.status(tmp_path).splitlines()
    assert lines == [f"the job finished training ({tmp_path / 'summary.json'}); where its ranks "
                     "last were:", "rank 0 on node1 (pid 100): step 46, collective"]
    # Resumed with more epochs: the earlier start's summary.json is older than its phases.
    os.utime(tmp_path / "summary.json", (now - 400, now - 400))
    assert inspect.status(tmp_path).startswith("rank 0 on node1 (pid 100): step 46, collective")
