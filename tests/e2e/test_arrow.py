"""data=arrow through the real CLI: `python -m train prepare-data` writes shards from a folder
of real JPEGs with 2 worker processes, and a 2-rank job trains on them from a read-only
directory into a FINISHED run whose validation counted every sample once; a changed shard is
named at pre-flight, before any rank starts, with no run left behind. In process:
tests/unit/test_arrow.py."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

from tests.conftest import run_train, runs_in
from tests.images import write_image_folder


def _read_only(root: Path) -> None:
    for path in [root, *root.rglob("*")]:
        mode = stat.S_IMODE(path.stat().st_mode)
        path.chmod(mode & ~(stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH))


def test_prepared_shards_train_from_a_read_only_directory_and_bad_ones_are_named(
        tmp_path: Path, store: dict[str, str]) -> None:
    source = write_image_folder(tmp_path / "images", train_per_class=16, val_per_class=5)
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
