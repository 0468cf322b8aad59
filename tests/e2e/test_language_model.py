"""Language models through the real CLI, read back from the real MLflow store: prepare_text on a
text file every Python has, 2 ranks of model=gpt learning it; validation token counts at world
sizes 1, 2 and 3; kill + resume training no window twice; a user's own language model; and the
refusals of bad token data before any rank starts."""

from __future__ import annotations

import json
import math
import pydoc_data.topics
import subprocess
import sys
import textwrap as textwrap_module
from pathlib import Path

import numpy as np
import pytest
from mlflow import MlflowClient

from tests.conftest import (
    REPO,
    USER_PATH,
    assert_refused,
    history,
    kill_job_after_checkpoints,
    run_train,
    runs_in,
)
from tests.e2e.test_sweeps import parent_and_children

LM = ("data=tokens", "model=gpt", "task=language_model", "model.n_layer=2", "model.n_head=2",
      "model.n_embd=64", "data.num_workers=0")
TOPICS = Path(pydoc_data.topics.__file__)
"""The Python documentation's topic texts (757 KB), shipped with every CPython."""
SMALL_TEXT = Path(textwrap_module.__file__)
"""A 20 KB standard-library module: a corpus small enough for whole epochs in a test."""
VAL_LOSS_CEILING = 2.6
"""val/loss (nats per byte) 2 ranks must reach in 150 steps; a uniform guess over 256 bytes
scores ln 256 = 5.55. Measured: 1.88."""


def prepare(text: Path, out: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "train", "prepare-text", str(text), str(out),
                           *args], cwd=REPO, capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def topics(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("topics") / "tokens"
    done = prepare(TOPICS, out)
    assert done.returncode == 0, done.stderr
    assert "vocabulary 256, tokenizer bytes" in done.stdout
    return out


@pytest.fixture(scope="module")
def small(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("small") / "tokens"
    assert prepare(SMALL_TEXT, out, "--val-fraction", "0.05").returncode == 0
    return out


def _val_tokens(root: Path) -> int:
    return int(np.memmap(root / "val.bin", dtype=np.uint16, mode="r").shape[0])


def test_two_ranks_learn_a_text_and_the_run_holds_tokens_samples_and_the_model(
        topics: Path, store: dict[str, str], tmp_path: Path) -> None:
    out_dir = tmp_path / "job"
    result = run_train(*LM, f"data.root={topics}", "data.seq_len=64", "data.batch_size=32",
                       "optim=adamw", "optim.lr=3e-3", "trainer.max_steps=150",
                       "trainer.epochs=1", "trainer.peak_tflops=1.0", "task.sample_tokens=40",
                       "task.samples_shown=2", "distributed.nproc_per_node=2",
                       f"hydra.run.dir={out_dir}", env=store, timeout=400)
    assert result.returncode == 0, result.stderr
    uri = store["MLFLOW_TRACKING_URI"]
    [run] = runs_in(uri)
    assert run.info.status == "FINISHED"
    m = run.data.metrics
    assert m["val/loss"] < VAL_LOSS_CEILING < math.log(256)
    assert m["val/perplexity"] == pytest.approx(math.exp(m["val/loss"]), rel=1e-6)
    assert m["val/tokens"] == _val_tokens(topics) - 1  # every token but the first, once
    assert m["train/tokens"] == 150 * 32 * 64  # 150 steps of 32 full windows of 64
    assert m["train/tokens_per_sec"] > 0 and 0 < m["train/mfu"] < 1
    assert run.data.params["data.vocab_size"] == "256"
    assert run.data.params["model.outputs"] == "256"
    artifacts = {a.path for a in MlflowClient(tracking_uri=uri).list_artifacts(run.info.run_id)}
    assert "samples.txt" in artifacts
    samples = (out_dir / "samples.txt").read_text()
    assert samples.startswith("prompt: '\\n'") and samples.count("-" * 72) == 2

    import torch

    from train.load import load_model

    model = load_model(run.info.run_id, uri)
    assert model(torch.zeros(3, 64, dtype=torch.long)).shape == (3, 64, 256)

    # Continuations of two prompts, greedy: those of the loaded model, token for token.
    predictions = tmp_path / "continued.jsonl"
    prompts = ["def ", "The "]
    predicted = run_train("predict", run.info.run_id, f"predict.out={predictions}",
                          f"predict.prompts={json.dumps(prompts)}", "predict.max_new_tokens=12",
                          f"hydra.run.dir={tmp_path}/predict", env=store)
    assert predicted.returncode == 0, predicted.stderr
    lines = [json.loads(line) for line in predictions.read_text().splitlines()]
    assert [line["prompt"] for line in lines] == prompts
    for line in lines:
        ids = torch.tensor([list(line["prompt"].encode())])
        with torch.no_grad():
            for _ in range(12):
                ids = torch.cat([ids, model(ids[:, -64:])[:, -1].argmax(-1, keepdim=True)], 1)
        assert line["continuation"] == bytes(ids[0, len(line["prompt"]):].tolist()).decode(
            "utf-8", errors="replace")


def test_validation_tokens_do_not_depend_on_the_world_size(
        small: Path, store: dict[str, str], tmp_path: Path) -> None:
    """val.bin's 25 windows of 40 tokens (the last one partial), which neither 2 nor 3 ranks
    divide: the same token count and, after the same 2 SGD steps, the same val/loss."""
    result = run_train("-m", "distributed.nproc_per_node=1,2,3", *LM, f"data.root={small}",
                       "data.seq_len=40", "data.batch_size=24", "optim=sgd", "optim.lr=0.05",
                       "trainer.max_steps=2", "trainer.epochs=1", "tracking.log_model=false",
                       "task.sample_tokens=0", f"hydra.sweep.dir={tmp_path}/sweep",
                       env=store, timeout=600)
    assert result.returncode == 0, result.stderr
    uri = store["MLFLOW_TRACKING_URI"]
    _, children = parent_and_children(uri)
    by_world = {int(c.data.tags["world_size"]): c.data.metrics for c in children}
    assert sorted(by_world) == [1, 2, 3]
    expected = _val_tokens(small) - 1
    windows = -(-expected // 40)
    assert expected % 40 and windows % 2 and windows % 3, (expected, windows)
    for world_size, metrics in by_world.items():
        assert metrics["val/tokens"] == expected, world_size
        assert metrics["val/loss"] == pytest.approx(by_world[1]["val/loss"], rel=1e-5)


def test_a_killed_job_resumes_without_training_a_window_twice(
        small: Path, store: dict[str, str], tmp_path: Path) -> None:
    """2 epochs of 11 steps, a checkpoint at every other step; killed after the third
    checkpoint (mid-epoch), resumed: the same run, the same losses as a job never killed, and
    every epoch's tokens once."""
    args = (*LM, f"data.root={small}", "data.seq_len=32", "data.batch_size=16",
            "trainer.epochs=2", "trainer.log_every_n_steps=2",
            "trainer.checkpoint_interval_min=0", "trainer.keep_checkpoints=10",
            "tracking.log_model=false", "task.sample_tokens=0", "distributed.nproc_per_node=2")
    killed_dir, whole_dir = tmp_path / "killed", tmp_path / "whole"
    kill_job_after_checkpoints(killed_dir, store, 3, *args)
    resumed = run_train(*args, f"hydra.run.dir={killed_dir}", env=store)
    assert resumed.returncode == 0, resumed.stderr
    assert "resumed from" in resumed.stderr and "continuing MLflow run" in resumed.stderr
    uri = store["MLFLOW_TRACKING_URI"]
    [run] = runs_in(uri)
    assert run.data.tags["restarts"] == "1"
    whole = run_train(*args, f"hydra.run.dir={whole_dir}",
                      env={**store, "MLFLOW_TRACKING_URI": store["MLFLOW_TRACKING_URI"]})
    assert whole.returncode == 0, whole.stderr
    other = next(r for r in runs_in(uri) if r.info.run_id != run.info.run_id)
    windows = (int(np.memmap(small / "train.bin", dtype=np.uint16, mode="r").shape[0]) - 1) // 32
    padded = -(-windows // 2) * 2  # DistributedSampler pads to a multiple of the ranks
    assert history(uri, run.info.run_id, "train/tokens") == [(1, padded * 32.0),
                                                             (2, padded * 32.0)]
    for key in ("train/loss", "val/loss"):
        mine, theirs = history(uri, run.info.run_id, key), history(uri, other.info.run_id, key)
        assert [s for s, _ in mine] == [1, 2]
        assert [v for _, v in mine] == pytest.approx([v for _, v in theirs], rel=1e-5), key


def test_a_users_own_language_model_trains_on_token_data(
        small: Path, store: dict[str, str], tmp_path: Path) -> None:
    result = run_train("data=tokens", f"data.root={small}", "task=language_model",
                       "model=custom", "model._target_=userpkg.models.BigramLM",
                       "data.seq_len=32", "data.batch_size=16", "trainer.epochs=2",
                       "optim=adamw", "optim.lr=1e-2", "data.num_workers=0",
                       "tracking.log_model=false", "task.sample_tokens=0",
                       f"hydra.run.dir={tmp_path / 'job'}",
                       env={**store, "PYTHONPATH": USER_PATH})
    assert result.returncode == 0, result.stderr
    [run] = runs_in(store["MLFLOW_TRACKING_URI"])
    losses = [v for _, v in history(store["MLFLOW_TRACKING_URI"], run.info.run_id, "val/loss")]
    assert len(losses) == 2 and losses[1] < losses[0] < math.log(256)


def _truncate(root: Path) -> None:
    with (root / "train.bin").open("r+b") as f:
        f.truncate(1000)


@pytest.mark.parametrize(("change", "overrides", "expected"), [
    (lambda root: (root / "val.bin").unlink(), (), "val.bin is missing"),
    (_truncate, (), "train.bin holds 1000 bytes, but meta.json says"),
    (lambda root: (root / "meta.json").unlink(), (), "no meta.json there; write the token"),
    (None, ("+model.vocab_size=100",), "outside the vocabulary of 100 (the model)"),
    (None, ("model.block_size=32", "data.seq_len=64"),
     "data.seq_len=64 is longer than the model's context (block_size=32)"),
], ids=["missing", "truncated", "no-meta", "vocabulary", "context"])
def test_bad_token_data_is_refused_before_any_rank_starts(
        small: Path, store: dict[str, str], tmp_path: Path, change, overrides: tuple[str, ...],
        expected: str) -> None:
    root = tmp_path / "tokens"
    root.mkdir()
    for name in ("train.bin", "val.bin", "meta.json"):
        (root / name).write_bytes((small / name).read_bytes())
    if change is not None:
        change(root)
    result = run_train(*LM, f"data.root={root}", *overrides, "distributed.nproc_per_node=2",
                       env=store)
    assert_refused(result, expected, store)
