"""Sharded checkpoint directories (train/engine/sharded.py) among single files: found newest
first, a directory that is not whole (a crash before rank 0 completed it) skipped for the
newest whole checkpoint, and removed like a file when it is no longer kept."""

from __future__ import annotations

from pathlib import Path

import torch

from train.engine import checkpoint_folder, sharded


def _dcp(folder: Path, step: int, whole: bool) -> Path:
    path = sharded.path_for(folder, step)
    path.mkdir(parents=True)
    (path / "__0_0.distcp").write_bytes(b"shard")
    if whole:
        (path / ".metadata").write_bytes(b"metadata")
        torch.save({"step": step, "epoch": 0, "batch_in_epoch": 3}, path / sharded.META)
    return path


def test_the_newest_whole_checkpoint_is_resumed_whatever_its_kind(tmp_path: Path) -> None:
    folder = tmp_path / "checkpoints"
    folder.mkdir()
    torch.save({"model": {}, "step": 1}, folder / "step-000000001.pt")
    whole = _dcp(folder, 2, whole=True)
    broken = _dcp(folder, 3, whole=False)
    (folder / "step-000000004.dcp.tmp").mkdir()  # a crash mid-save: never a candidate
    assert checkpoint_folder.candidates(folder) == [broken, whole, folder / "step-000000001.pt"]
    found = checkpoint_folder.load_newest(checkpoint_folder.candidates(folder))
    assert found is not None and found.path == whole and found.state["step"] == 2
    assert checkpoint_folder.find(str(whole), tmp_path).path == whole  # trainer.resume=<the dir>
    for old in checkpoint_folder.candidates(folder)[1:]:
        sharded.remove(old)
    assert checkpoint_folder.candidates(folder) == [broken]
