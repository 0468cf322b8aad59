"""data=arrow through the real CLI: `python -m train prepare-data` writes shards from a folder
of real JPEGs with 2 worker processes, and a 2-rank job trains on them from a read-only
directory into a FINISHED run whose validation counted every sample once; a changed shard is
named at pre-flight, before any rank starts, with no run left behind; a shard truncated while a
job reads it ends the job and its run FAILED with a line naming it, whether a DataLoader worker
or the rank itself read it; a job on shards `datasets` wrote, killed mid-epoch at world 4 and
again at epoch 1's end at world 3, finishes at world 1 with the losses of a job never killed;
the ranks' data path with 0, 2 and 5 DataLoader worker processes at worlds 1-4 reads every
sample once an epoch. In process: tests/unit/test_arrow.py."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import (
    REPO,
    history,
    kill_job_after_checkpoints,
    run_train,
    runs_in,
    wait_until,
)
from tests.images import write_image_folder
from train.data import shard_plan, shards


def _read_only(root: Path) -> None:
    for path in [root, *root.rglob("*")]:
        mode = stat.S_IMODE(path.stat().st_mode)
        path.chmod(mode & ~(stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH))


def test_prepared_shards_train_from_a_read_only_directory_and_bad_ones_are_named(
        tmp_path: Path, store: dict[str, str]) -> None:
    source = write_image_folder(tmp_path / "images", train_per_class=16, val_per_class=5)
    # Shards inside the source would break it (its next scan finds a class folder train/), and
    # a folder of the user's would be mixed with them: refused, nothing written.
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "readme.txt").write_text("mine\n")
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    for out, said in ((source / "train", "is inside the source"),
                      (tmp_path / "notes", "is not empty and holds no interrupted preparation")):
        refused = run_train("prepare-data", str(source), str(out), timeout=120)
        assert refused.returncode == 2 and said in refused.stderr, refused.stderr
        assert "Traceback" not in refused.stderr
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before
    out = tmp_path / "shards"
    prepared = run_train("prepare-data", str(source), str(out), "--workers", "2",
                         "--shard-mb", "0.02", timeout=120)
    assert prepared.returncode == 0, prepared.stderr[-2000:]
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["splits"]["train"]["samples"] == 48
    assert len(manifest["splits"]["train"]["shards"]) >= 2
    assert f"train on it: python -m train data=arrow data.root={out}" in prepared.stdout
    _read_only(out)
    home = tmp_path / "home"  # nothing may land in ~/.cache
    home.mkdir()
    done = run_train("data=arrow", f"data.root={out}", "data.image_size=32", "data.batch_size=16",
                     "trainer.epochs=2", "distributed.nproc_per_node=2", "data.num_workers=2",
                     f"hydra.run.dir={tmp_path / 'job'}", env={**store, "HOME": str(home)},
                     timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    [run] = runs_in(store["MLFLOW_TRACKING_URI"])
    assert run.info.status == "FINISHED"
    assert run.data.metrics["val/samples"] == 15  # every validation sample once over 2 ranks
    assert not list(home.rglob("*")), list(home.rglob("*"))
    # A shard changed after it was prepared (same size): refused before any rank starts.
    shard = out / manifest["splits"]["validation"]["shards"][0]["file"]
    shard.chmod(0o600)
    data = bytearray(shard.read_bytes())
    data[-64] ^= 0xFF
    shard.write_bytes(bytes(data))
    again = run_train("data=arrow", f"data.root={out}", "data.image_size=32",
                      f"hydra.run.dir={tmp_path / 'job2'}", env={**store, "HOME": str(home)},
                      timeout=120)
    assert again.returncode == 2
    [line] = [x for x in again.stderr.splitlines() if x.startswith("error:")]
    assert f"{shard} changed since it was prepared" in line
    assert len(runs_in(store["MLFLOW_TRACKING_URI"])) == 1
    assert os.access(out, os.R_OK)


@pytest.mark.parametrize(("ranks", "workers"), [(2, 2), (1, 0)])
def test_a_shard_truncated_mid_run_fails_the_run_naming_it(
        tmp_path: Path, store: dict[str, str], ranks: int, workers: int) -> None:
    """Memory-mapped shards: the process that touches a truncated one dies of SIGBUS (a worker:
    "Bus error ... out of shared memory", the rank itself: no word). The line names the file."""
    source = write_image_folder(tmp_path / "images", train_per_class=16, val_per_class=4)
    out = tmp_path / "shards"
    manifest = shards.prepare(shard_plan.plan_image_folder(source, limit=4000), out, workers=1,
                              command="test")
    shard = out / manifest["splits"]["train"]["shards"][1]["file"]
    job = tmp_path / "job"
    log = (tmp_path / "job.log").open("w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "train", "data=arrow", f"data.root={out}", "data.image_size=16",
         "data.batch_size=8", "model.width=8", "trainer.epochs=1000",
         f"distributed.nproc_per_node={ranks}", f"data.num_workers={workers}",
         f"hydra.run.dir={job}"], cwd=REPO, env={**os.environ, **store}, stdout=log,
        stderr=subprocess.STDOUT, text=True)
    # Once epoch 1's checkpoint is written, every rank has read every shard: truncated now,
    # the next epoch reads past its end.
    wait_until(lambda: list((job / "checkpoints").glob("step-*.pt")), 180,
               "the first checkpoint", job=proc)
    os.truncate(shard, shard.stat().st_size // 2)
    assert proc.wait(timeout=180) != 0
    output = (tmp_path / "job.log").read_text()
    assert f"{shard} changed while the job read it" in output, output[-3000:]
    [run] = runs_in(store["MLFLOW_TRACKING_URI"])
    assert run.info.status == "FAILED"
    assert f"{shard} changed while the job read it" in run.data.tags["error"]


def _table(root: Path) -> Path:
    """A DatasetDict `datasets` itself wrote in 4 + 2 shards: 8 numbers and one of 3 classes
    per sample; 204 training samples, 17 batches of 12 at world 1, 3 and 4 alike. (At a size
    a world size does not divide, its ranks' shares are padded as DistributedSampler pads them,
    so an epoch's last batch differs from world to world: that coverage is
    tests/unit/test_arrow.py's.) 61 validation samples: validation is exact at any world size."""
    import datasets

    rng = np.random.default_rng(0)

    def split(n: int) -> datasets.Dataset:
        x = rng.normal(size=(n, 8)).astype(np.float32)
        return datasets.Dataset.from_dict({"x": x.tolist(), "label": x[:, :3].argmax(1).tolist()})

    datasets.DatasetDict({"train": split(204), "validation": split(61)}).save_to_disk(
        str(root), num_shards={"train": 4, "validation": 2})
    return root


def test_a_job_killed_at_world_4_and_3_finishes_at_world_1_as_if_never_killed(
        tmp_path: Path, store_template: Path) -> None:
    """17 steps an epoch (batches of 12 over 204 samples, dealt to the ranks), 2 epochs, a
    checkpoint at every step: killed after its 5th checkpoint at world 4 (mid-epoch 1),
    resumed at world 3 and killed again after epoch 1's end (its 17th), finished at world 1
    from there - one run, each step's loss that of the job run through at world 1 (float sums
    in another order: 1e-5), every training and validation sample counted once per epoch."""
    from tests.conftest import new_store

    args = ("data=arrow", f"data.root={_table(tmp_path / 'table')}", "data.input_column=x",
            "data.target_column=label", "model=mlp", "model.width=16", "model.dropout=0",
            "data.batch_size=12", "trainer.epochs=2", "trainer.log_every_n_steps=1",
            "data.num_workers=1", "trainer.checkpoint_interval_min=0",
            "trainer.keep_checkpoints=40", "tracking.log_model=false",
            # Killed right after epoch 1's checkpoint: its metrics must be in the store by
            # then however loaded this machine is (a checkpoint waits 5 s for them by default).
            "tracking.checkpoint_flush_s=120")
    reference = {"MLFLOW_TRACKING_URI": new_store(tmp_path / "ref.db", store_template)}
    through = run_train(*args, f"hydra.run.dir={tmp_path / 'ref'}", env=reference)
    assert through.returncode == 0, through.stderr[-3000:]
    [ref] = runs_in(reference["MLFLOW_TRACKING_URI"])
    expected = dict(history(reference["MLFLOW_TRACKING_URI"], ref.info.run_id,
                            "train/step_loss"))
    assert sorted(expected) == list(range(1, 35))
    store = {"MLFLOW_TRACKING_URI": new_store(tmp_path / "mlflow.db", store_template)}
    out = tmp_path / "job"
    kill_job_after_checkpoints(out, store, 5, *args, "distributed.nproc_per_node=4")
    kill_job_after_checkpoints(out, store, 17, *args, "distributed.nproc_per_node=3")
    # As if killed right after epoch 1's own checkpoint (step 17, the epoch's last): the
    # world-1 job resumes exactly at an epoch end.
    later = sorted(out.glob("checkpoints/step-*.pt"))[17:]
    for path in later:
        path.unlink()
    assert sorted(out.glob("checkpoints/step-*.pt"))[-1].name == "step-000000017.pt"
    finished = run_train(*args, "distributed.nproc_per_node=1", f"hydra.run.dir={out}",
                         env=store, timeout=240)
    assert finished.returncode == 0, finished.stderr[-3000:]
    uri = store["MLFLOW_TRACKING_URI"]
    [run] = runs_in(uri)
    assert run.info.status == "FINISHED" and run.data.tags["restarts"] == "2"
    steps = history(uri, run.info.run_id, "train/step_loss")
    assert sorted({s for s, _ in steps}) == list(range(1, 35))
    for step, value in steps:  # a step logged twice (after a checkpoint, before the kill)
        assert value == pytest.approx(expected[step], abs=1e-5), step
    assert [v for _, v in history(uri, run.info.run_id, "train/samples")] == [204.0, 204.0]
    assert [v for _, v in history(uri, run.info.run_id, "val/samples")] == [61.0, 61.0]
    assert run.data.metrics["val/loss"] == pytest.approx(ref.data.metrics["val/loss"],
                                                         abs=1e-5)


def _keyed(root: Path) -> Path:
    """A DatasetDict of 103 training and 37 validation samples (sizes no world size above 1
    divides) in 4 + 3 shards, each sample's input holding its key."""
    import datasets

    def split(n: int, first: int) -> datasets.Dataset:
        keys = np.arange(first, first + n, dtype=np.float32)
        return datasets.Dataset.from_dict({"x": np.stack([keys, -keys], 1).tolist(),
                                           "label": (np.arange(n) % 3).tolist()})

    datasets.DatasetDict({"train": split(103, 0), "validation": split(37, 1000)}).save_to_disk(
        str(root), num_shards={"train": 4, "validation": 3})
    return root


@pytest.fixture(scope="module")
def keyed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _keyed(tmp_path_factory.mktemp("keyed") / "set")


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("workers", [0, 2, 5])
def test_every_rank_together_reads_every_sample_once_at_any_world_size_and_workers(
        keyed: Path, world: int, workers: int) -> None:
    """The ranks' own data path (ArrowSamples, the shard-window sampler, the DataLoader and its
    worker processes), rank by rank: over one epoch their training batches hold every sample,
    and only the padding DistributedSampler adds twice (-103 % world samples: the ranks take
    as many steps); their validation batches every sample exactly once. Resumed mid-epoch
    (from batch 2), the same epoch's remaining samples."""
    import torch

    from tests.conftest import typed
    from train.data import sources
    from train.distributed.env import DistEnv

    cfg = typed("data=arrow", f"data.root={keyed}", "data.input_column=x",
                "data.target_column=label", f"data.num_workers={workers}",
                "data.shuffle_window=2")
    train, val, resumed = [], [], []
    for rank in range(world):
        env = DistEnv(rank=rank, local_rank=rank, world_size=world, local_world_size=world,
                      master_addr="127.0.0.1", master_port=0, launcher="local")
        bundle = sources.build(cfg.data, env, torch.device("cpu"), seed=7, per_rank=4)
        bundle.train.set_epoch(1)
        ours = [int(k) for x, _ in bundle.train for k in x[:, 0]]
        train += ours
        val += [int(k) for x, _ in bundle.val for k in x[:, 0]]
        bundle.train.set_epoch(1, start_batch=2)
        assert [int(k) for x, _ in bundle.train for k in x[:, 0]] == ours[8:]
        resumed.append(len(ours))
    assert sorted(set(train)) == list(range(103))
    assert len(train) == 103 + (-103 % world) and len(set(resumed)) == 1
    assert sorted(val) == list(range(1000, 1037))  # exactly once, no padding
