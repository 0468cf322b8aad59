"""Prediction files in process, on real Parquet and PNG files: each task's rows, the ranks'
parts merged into the data set's order (also in merge steps smaller than a part, and with a
rank that got no sample), whole or absent, and the predict command's refusals of its out."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from PIL import Image

from train.engine import prediction_files as files
from train.errors import ConfigError
from train.launch.predict import checked_out


def _parts(tmp_path: Path, samples: int, world: int, batch: int) -> list[Path]:
    """Each rank's strided shard of `samples` classification outputs, written `batch` at a
    time as a predicting rank writes them; the logits encode the global index."""
    paths = []
    for rank in range(world):
        part = files.Part(tmp_path / "parts" / f"rank-{rank:05d}.parquet")
        shard = list(range(rank, samples, world))
        for start in range(0, len(shard), batch):
            index = np.array(shard[start:start + batch])
            logits = torch.stack([torch.tensor([float(i), 0.0, -1.0]) for i in index])
            part.add(files.rows("classification", logits, torch.tensor(index % 3), index,
                                ["a", "b", "c"], tmp_path / "out.parquet"))
        part.close()
        paths.append(part.path)
    return paths


@pytest.mark.parametrize(("samples", "world", "batch", "merge_rows"),
                         [(23, 3, 4, 4096), (23, 3, 4, 2), (2, 3, 1, 4096), (100, 1, 7, 5)])
def test_parts_merge_into_the_data_sets_order(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                              samples: int, world: int, batch: int,
                                              merge_rows: int) -> None:
    monkeypatch.setattr(files, "MERGE_ROWS", merge_rows)
    out = tmp_path / "out.parquet"
    written = files.merge(_parts(tmp_path, samples, world, batch), out, {"run_id": "r1"})
    table = pq.read_table(out)
    assert written == table.num_rows == samples
    assert table.column("index").to_pylist() == list(range(samples))
    assert table.column("target").to_pylist() == [i % 3 for i in range(samples)]
    probabilities = np.array(table.column("probabilities").to_pylist())
    assert np.allclose(probabilities.sum(1), 1) and probabilities.shape == (samples, 3)
    assert json.loads(table.schema.metadata[b"train.run_id"]) == "r1"
    assert json.loads((tmp_path / "out.parquet.json").read_text())["rows"] == samples
    assert not (tmp_path / "out.parquet.tmp").exists()


def test_each_tasks_rows(tmp_path: Path) -> None:
    index = np.array([4, 7])
    out = tmp_path / "p.parquet"
    regression = files.rows("regression", torch.tensor([[1.5], [2.5]]), torch.tensor([1., 2.]),
                            index, [], out)
    assert regression.column("prediction").to_pylist() == [1.5, 2.5]
    assert regression.column("target").to_pylist() == [1.0, 2.0]
    several = files.rows("regression", torch.ones(2, 3), None, index, [], out)
    assert several.column("prediction").to_pylist() == [[1.0] * 3] * 2
    masks = torch.zeros(2, 3, 4, 5)
    masks[0, 2], masks[1, 1] = 1.0, 1.0  # sample 4: class 2 everywhere; sample 7: class 1
    segmentation = files.rows("segmentation", {"out": masks}, None, index, [], out)
    assert segmentation.column("mask").to_pylist() == ["p_masks/00000004.png",
                                                      "p_masks/00000007.png"]
    written = tmp_path / "p_masks.tmp"  # until finish() renames it
    assert np.asarray(Image.open(written / "00000004.png")).tolist() == [[2] * 5] * 4
    assert np.asarray(Image.open(written / "00000007.png")).tolist() == [[1] * 5] * 4
    own = files.rows("custom", torch.arange(12.).reshape(2, 2, 3), None, index, [], out)
    assert own.column("shape").to_pylist() == ["2x3", "2x3"]
    assert own.column("output").to_pylist()[1] == [6.0, 7.0, 8.0, 9.0, 10.0, 11.0]


def test_an_interrupted_prediction_leaves_nothing_that_looks_finished(tmp_path: Path) -> None:
    out = tmp_path / "p.parquet"
    files.rows("segmentation", torch.zeros(1, 2, 2, 2), None, np.array([0]), [], out)
    (tmp_path / "p.parquet.tmp").write_bytes(b"half")
    assert not out.exists() and not files.masks_dir(out).exists()
    files.clear_leftovers(out, tmp_path / "parts")
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_the_predict_command_makes_out_absolute_and_refuses_an_existing_one(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert checked_out(["predict.out=p.parquet", "data=digits"]) == [
        "data=digits", f"predict.out='{tmp_path / 'p.parquet'}'"]
    (tmp_path / "p.parquet").write_bytes(b"x")
    with pytest.raises(ConfigError, match="exists: give another path"):
        checked_out(["predict.out=p.parquet"])
    assert checked_out(["predict.out=p.parquet", "predict.overwrite=true"])[-1].endswith(
        "p.parquet'")
    with pytest.raises(ConfigError, match="is a directory"):
        checked_out([f"predict.out={tmp_path}", "predict.overwrite=true"])
    with pytest.raises(ConfigError, match="predict.split=train must be one of"):
        checked_out(["predict.split=train"])
    with pytest.raises(ConfigError, match=r"predict.out=p.csv: the predictions are written as "
                                          r"Parquet; name the file so, e.g. predict.out=p.parquet"):
        checked_out(["predict.out=p.csv"])
    with pytest.raises(ConfigError, match=r"continuations are written as JSON lines; .* "
                                          r"predict.out=c.jsonl"):
        checked_out(["predict.out=c.parquet", "predict.prompts=['a']"])
    assert checked_out(["predict.out=c.jsonl", "predict.prompts=['a']"])[-1].endswith("c.jsonl'")
