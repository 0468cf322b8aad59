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


def test_a_single_file_save_clears_a_sharded_saves_leftover(tmp_path: Path) -> None:
    """An FSDP job killed mid-save leaves step-<N>.dcp.tmp, a directory; resumed as DDP, its
    first single-file checkpoint clears it (it failed with IsADirectoryError before)."""
    folder = tmp_path / "checkpoints"
    whole = _dcp(folder, 3, whole=True)
    leftover = sharded.path_for(folder, 4).with_name("step-000000004.dcp.tmp")
    leftover.mkdir()
    (leftover / "__1_0.distcp").write_bytes(b"half a shard")
    (folder / "step-000000004.tmp").write_bytes(b"half a file")
    path = checkpoint_folder.save(folder, {"model": {}, "step": 4}, keep=5)
    assert path == folder / "step-000000004.pt" and torch.load(path)["step"] == 4
    assert sorted(p.name for p in folder.iterdir()) == [whole.name, path.name]
