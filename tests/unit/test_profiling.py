"""trainer.profile (train/engine/profiling.py): a job trained in-process on one gloo rank with
the profiler's window open for two steps; its trace, summary, tag and artifacts read back."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest
from mlflow import MlflowClient

from tests.conftest import composed, new_store, runs_in, typed
from train.app import run
from train.config.validation import validate
from train.errors import ConfigError

JOB = ("data=synthetic", "data.num_samples=96", "data.val_fraction=0.25", "data.image_size=8",
       "data.batch_size=8", "model=mlp", "model.width=16", "data.num_workers=0",
       "trainer.epochs=1", "tracking.batch_interval_s=0", "tracking.log_model=false")


def test_a_profiled_window_leaves_a_trace_a_summary_a_tag_and_artifacts(
        tmp_path: Path, store_template: Path, no_launcher_env: None) -> None:
    uri = new_store(tmp_path / "mlflow.db", store_template)
    out = tmp_path / "job"
    run(composed(*JOB, f"tracking.uri={uri}", "trainer.profile.enabled=true",
                 "trainer.profile.wait=2", "trainer.profile.warmup=1",
                 "trainer.profile.active=2"), str(out), "test")
    [mlflow_run] = runs_in(uri)
    # 9 steps; 2 waited, 1 warm-up: optimiser steps 4 and 5 recorded.
    assert mlflow_run.data.tags["profile.steps"] == "4-5"
    with gzip.open(out / "profile" / "rank-0.json.gz", "rt") as f:
        events = json.load(f)["traceEvents"]
    names = {e.get("name", "") for e in events}
    assert {"ProfilerStep#3", "ProfilerStep#4"} <= names, sorted(n for n in names if "Step" in n)
    assert not {"ProfilerStep#2", "ProfilerStep#5"} & names  # warm-up and after: not kept
    assert "aten::addmm" in names  # the MLP's forward
    assert any(n.startswith("autograd::engine::evaluate_function: AddmmBackward") for n in names)
    summary = (out / "profile" / "rank-0.txt").read_text()
    assert summary.startswith("rank 0, optimiser step(s) 4-5, by self_cpu_time_total\n")
    assert "Self CPU" in summary and "aten::addmm" in summary
    artifacts = MlflowClient(uri).list_artifacts(mlflow_run.info.run_id, "profile")
    assert sorted(a.path for a in artifacts) == ["profile/rank-0.json.gz", "profile/rank-0.txt"]


def test_a_window_without_a_recorded_step_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"trainer\.profile: wait=5 and warmup=1 must be 0 or "
                                          r"more and active=0 positive"):
        validate(typed("trainer.profile.enabled=true", "trainer.profile.active=0"), 1)
