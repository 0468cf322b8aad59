"""Sharded Arrow data sets in process: `prepare-data`'s shards from an image folder, tars and a
user's Dataset read back byte for byte, an interrupted preparation finished without rewriting
what it had written, data=arrow's samples from a directory `datasets` itself wrote, the
shard-local training order covering every sample once at any world size, and the bad-data
cases named at pre-flight (train/data/shards.py, train/data/arrow.py)."""

from __future__ import annotations

import io
import json
import os
import pickle
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
import torch

from tests.conftest import typed
from tests.images import write_image_folder
from train.data import arrow, arrow_split, imagefolder, shard_plan, shards
from train.data.arrow_samples import ArrowSamples
from train.data.shard_order import ShardWindowSampler


def _stored(out: Path, split: str) -> list[tuple[bytes, int]]:

    data = arrow.open_split(out / split)
    return [(row["image"]["bytes"], row["label"]) for row in data]


def _prepare(plan: shard_plan.Plan, out: Path) -> dict:
    return shards.prepare(plan, out, workers=1, command="test")


def test_an_image_folder_becomes_shards_holding_each_files_bytes_and_imagefolders_classes(
        tmp_path: Path) -> None:
    import datasets

    root = write_image_folder(tmp_path / "images", train_per_class=12, val_per_class=4)
    layout = imagefolder.find(str(root))
    manifest = _prepare(shard_plan.plan_image_folder(root, limit=4000), tmp_path / "out")
    assert manifest["classes"] == layout.train.classes
    assert {s: i["samples"] for s, i in manifest["splits"].items()} == {"train": 36,
                                                                       "validation": 12}
    assert len(manifest["splits"]["train"]["shards"]) > 3  # ~4 KB a shard: several
    train, val = ([((f.path / name).read_bytes(), label)
                   for name, label in zip(f.files, f.labels, strict=True)]
                  for f in (layout.train, layout.val))
    stored = _stored(tmp_path / "out", "train")
    # Each file's bytes as they are (no re-encoding), with its class; the training split in
    # a mixed order - the folder's is class by class, and shards of one class each would make
    # data.shuffle=shards' batches of one class - and validation in the folder's.
    assert sorted(stored) == sorted(train) and stored != train
    assert _stored(tmp_path / "out", "validation") == val
    first = arrow.open_split(tmp_path / "out" / "train")["label"][:12]
    assert len(set(first)) == 3, first  # the first shards hold every class
    assert manifest["train_order"] == "mixed, seed 0"
    loaded = datasets.load_from_disk(str(tmp_path / "out"))  # as any datasets user reads it
    assert loaded["train"].features["label"].names == layout.train.classes
    assert (tmp_path / "out" / "train" / "state.json").is_file()
    # The same seed writes the same order; --source-order (seed None) the folder's.
    _prepare(shard_plan.plan_image_folder(root, limit=4000, seed=0), tmp_path / "again")
    assert _stored(tmp_path / "again", "train") == stored
    _prepare(shard_plan.plan_image_folder(root, limit=4000, seed=None), tmp_path / "source")
    assert _stored(tmp_path / "source", "train") == train


def test_an_interrupted_preparation_finishes_without_rewriting_finished_shards(
        tmp_path: Path) -> None:
    root = write_image_folder(tmp_path / "images", train_per_class=10)
    plan = shard_plan.plan_image_folder(root, limit=4000)
    out = tmp_path / "out"
    first = _prepare(plan, out)
    files = sorted((out / "train").glob("data-*.arrow"))
    # As a kill leaves it: one shard never renamed into place, its temporary file left, and
    # no manifest (written last).
    (out / "manifest.json").unlink()
    lost = files[2]
    lost.rename(lost.with_name(f".{lost.name}.dead.tmp"))
    before = {f: f.stat().st_mtime_ns for f in files if f != lost}
    again = _prepare(shard_plan.plan_image_folder(root, limit=4000), out)
    assert again["kept_shards"] == len(files) - 1
    assert {f: f.stat().st_mtime_ns for f in before} == before  # not written again
    assert lost.is_file() and not list(out.glob("*/.*.tmp"))
    assert again["splits"] == first["splits"]  # the same rows, bytes and checksums
    with pytest.raises(shards.PrepareError, match="holds a prepared data set already"):
        _prepare(plan, out)
    (out / "manifest.json").unlink()
    other = write_image_folder(tmp_path / "other", num_classes=2, train_per_class=3)
    with pytest.raises(shards.PrepareError, match="unfinished preparation of other data"):
        _prepare(shard_plan.plan_image_folder(other, limit=4000), out)


def _tar(path: Path, samples: list[tuple[str, bytes, int | str]]) -> None:
    with tarfile.open(path, "w") as tar:
        for key, image, label in samples:
            for name, data in ((f"{key}.jpg", image), (f"{key}.cls", str(label).encode())):
                info = tarfile.TarInfo(name)
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))


def test_webdataset_tars_become_shards_with_their_bytes_and_labels(tmp_path: Path) -> None:
    images = sorted((write_image_folder(tmp_path / "images", num_classes=3,
                                        train_per_class=4)).rglob("*.jpg"))
    samples = [(f"s{i:03d}", p.read_bytes(), i % 3) for i, p in enumerate(images)]
    (tmp_path / "tars" / "train").mkdir(parents=True)
    _tar(tmp_path / "tars" / "train" / "shard-000.tar", samples[:7])
    _tar(tmp_path / "tars" / "train" / "shard-001.tar", samples[7:])
    manifest = _prepare(shard_plan.plan_tars(tmp_path / "tars", limit=10_000), tmp_path / "out")
    assert manifest["classes"] == ["0", "1", "2"]
    stored = _stored(tmp_path / "out", "train")
    assert sorted(stored) == sorted((b, label) for _, b, label in samples)  # mixed order
    _prepare(shard_plan.plan_tars(tmp_path / "tars", limit=10_000, seed=None), tmp_path / "source")
    assert _stored(tmp_path / "source", "train") == [(b, label) for _, b, label in samples]
    _tar(tmp_path / "tars" / "train" / "shard-002.tar", [("s999", samples[0][1], "cat")])
    with pytest.raises(shards.PrepareError, match=r"shard-002.tar: s999.cls holds b'cat', not"):
        shard_plan.plan_tars(tmp_path / "tars", limit=10_000)
    (tmp_path / "tars" / "train" / "shard-002.tar").write_bytes(b"not a tar" * 100)
    with pytest.raises(shards.PrepareError, match=r"shard-002.tar is no readable tar \("):
        shard_plan.plan_tars(tmp_path / "tars", limit=10_000)  # named: not tarfile's ReadError


def test_a_users_dataset_becomes_shards_read_back_as_its_tensors(
        tmp_path: Path, user_path: None) -> None:
    from userpkg.data import Lines

    spec = {"_target_": "userpkg.data.Lines", "length": 30, "size": 8}
    plan = shard_plan.plan_dataset(spec, limit=2000)
    manifest = _prepare(plan, tmp_path / "out")
    assert manifest["classes"] == Lines.classes and manifest["splits"]["train"]["samples"] == 30
    samples = ArrowSamples(tmp_path / "out" / "train", "input", "target")
    original, order = Lines(30, 8), plan.order(30)
    assert sorted(order) == list(range(30)) and order != list(range(30))
    for i in range(30):  # row i is the Dataset's sample order[i], its tensors as they were
        x, y = samples[i]
        assert torch.equal(x, original[order[i]][0]) and y == original[order[i]][1]
    # Arrow record batches of ~8 MB, not of a fixed count of rows: 600 small samples are one
    # (a process that opens a split reads every batch's header, and the pages around it).
    _prepare(shard_plan.plan_dataset({**spec, "length": 600}, limit=10**6), tmp_path / "600")
    with pa.memory_map(str(tmp_path / "600" / "train" / "data-00000-of-00001.arrow")) as source:
        assert [b.num_rows for b in pa.ipc.open_stream(source)] == [600]


def test_a_directory_written_by_datasets_itself_is_read_with_its_columns(
        tmp_path: Path) -> None:
    """An image column and a label (found by themselves), and a regression table whose
    columns are named; a column it lacks is named with those it has."""
    import datasets

    from train.data.arrow_source import arrow_source

    jpegs = sorted(write_image_folder(tmp_path / "images", train_per_class=5).rglob("*.jpg"))
    datasets.Dataset.from_dict(
        {"picture": [str(p) for p in jpegs], "label": [i % 3 for i in range(len(jpegs))]},
        features=datasets.Features({"picture": datasets.Image(), "label": datasets.Value(
            "int64")})).save_to_disk(str(tmp_path / "pictures"))
    cfg = typed("data=arrow", f"data.root={tmp_path / 'pictures'}", "data.image_size=16")
    source = arrow_source(cfg.data)
    assert source.class_names == ["0", "1", "2"] and source.input_shape == (3, 16, 16)
    assert len(source.train) + len(source.val) == len(jpegs)
    rng = np.random.default_rng(0)
    features = rng.normal(size=(40, 5)).astype(np.float32)
    table_set = datasets.Dataset.from_dict({"x": features.tolist(),
                                            "y": features.sum(1).tolist()})
    table_set.save_to_disk(str(tmp_path / "table"))
    table = typed("data=arrow", f"data.root={tmp_path / 'table'}", "data.input_column=x",
                  "data.target_column=y", "task=regression")
    source = arrow_source(table.data, classes=False)
    x, y = source.train[0]
    assert x.shape == (5,) and x.dtype == torch.float32 and isinstance(y, float)
    assert source.input_shape == (5,) and source.target_shape == ()
    wrong = typed("data=arrow", f"data.root={tmp_path / 'table'}", "data.input_column=z")
    with pytest.raises(arrow.ArrowDataError, match=r"data.input_column='z' is not a column .*"
                                                   r"\(its columns: x, y\)"):
        arrow_source(wrong.data, classes=False)


def test_a_split_reads_the_rows_datasets_reads_without_importing_it(tmp_path: Path) -> None:
    """The job's reader (train/data/arrow_split.py) against `datasets`' own, on every kind of
    column a user's set may hold, rows gathered across shards in any order and repeated; its
    process imports neither `datasets` nor pandas (the 0.4 s each rank paid at its start)."""
    import datasets

    n, kinds = 300, datasets.Features({
        "image": datasets.Image(), "label": datasets.ClassLabel(names=["a", "b", "c"]),
        "x": datasets.Sequence(datasets.Value("float32")), "t": datasets.Value("string"),
        "words": datasets.List(datasets.Value("string")), "y": datasets.Value("float64"),
        "grid": datasets.Array2D((2, 3), "float32"), "n": datasets.Value("int32"),
        "tags": datasets.List(datasets.ClassLabel(names=["o", "b"]))})
    jpegs = sorted(write_image_folder(tmp_path / "images", train_per_class=4).rglob("*.jpg"))
    datasets.Dataset.from_dict({
        "image": [str(jpegs[i % len(jpegs)]) for i in range(n)], "label": [i % 3 for i in
                                                                          range(n)],
        "x": [[i, 0.5] for i in range(n)], "t": [f"text {i}" for i in range(n)],
        "words": [["a", str(i)] for i in range(n)], "y": [i / 7 for i in range(n)],
        "grid": [np.full((2, 3), i, np.float32) for i in range(n)], "n": [3 * i for i in
                                                                        range(n)],
        "tags": [[i % 2, 1] for i in range(n)]}, features=kinds,
    ).save_to_disk(str(tmp_path / "set"), max_shard_size="16KB")
    picked = [5, n - 1, 0, n // 2, n // 2 + 1, 3, 3]
    expected = datasets.load_from_disk(str(tmp_path / "set")).cast_column(
        "image", datasets.Image(decode=False))[picked]
    assert len(arrow.shard_files(tmp_path / "set")) > 5  # rows gathered across shards
    reader = f"""
import pickle, sys
from pathlib import Path
from train.data import arrow_split
split = arrow_split.read_split(Path({str(tmp_path / "set")!r}))
rows = split.rows({picked}, {list(kinds)})
names = [arrow_split.class_names(split, c) for c in ("label", "tags", "n", "y")]
kinds = {{c: arrow_split.kind(f) for c, f in split.features.items()}}
words = arrow_split.is_words(split.features["words"]), arrow_split.is_text(split.features["t"])
pickle.dump((len(split), rows, names, kinds, words, "datasets" in sys.modules,
             "pandas" in sys.modules), sys.stdout.buffer)
"""
    done = subprocess.run([sys.executable, "-c", reader], capture_output=True, check=True)
    length, rows, names, found, words, with_datasets, with_pandas = pickle.loads(done.stdout)
    assert length == n and rows == {c: expected[c] for c in kinds}
    assert names == [["a", "b", "c"], ["o", "b"], [str(k) for k in range(3 * n - 2)], None]
    assert found == {c: type(f).__name__ for c, f in kinds.items()} and words == (True, True)
    assert not with_datasets and not with_pandas
    with pytest.raises(IndexError):  # not a short batch: a row past the end is an error
        arrow_split.read_split(tmp_path / "set").rows([0, n], ["label"])


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_the_shard_local_order_covers_every_sample_once_at_any_world_size(world: int) -> None:
    sizes = [30, 30, 30, 13]  # 103 samples: no world size above 1 divides them
    data = list(range(sum(sizes)))

    def sampler(rank: int, world: int) -> ShardWindowSampler:
        s = ShardWindowSampler(data, world, rank, seed=5, shard_sizes=sizes, window=2)
        s.set_epoch(3)
        return s

    order = sampler(0, 1).global_order().tolist()
    assert sorted(order) == data  # one permutation of the set
    # Reads stay local: the shards in a random order, each window of 2 read to its end before
    # the next window's first sample.
    shard_of = (np.searchsorted(np.cumsum([0, *sizes]), order, side="right") - 1).tolist()
    shards = list(dict.fromkeys(shard_of))
    assert shards != [0, 1, 2, 3] or shard_of != sorted(shard_of)
    for w in range(0, len(shards) - 2, 2):
        last_of_window = max(i for i, s in enumerate(shard_of) if s in shards[w:w + 2])
        assert last_of_window < min(i for i, s in enumerate(shard_of) if s in shards[w + 2:])
    seen = [i for rank in range(world) for i in sampler(rank, world)]
    padding = -len(data) % world
    assert sorted(set(seen)) == data and len(seen) == len(data) + padding
    # Every rank takes its turns of the same global order, whatever the world size.
    assert list(sampler(0, world))[:5] == order[:5 * world:world]


def test_bad_shards_are_named_before_any_rank_starts(tmp_path: Path) -> None:
    root = write_image_folder(tmp_path / "images", train_per_class=6, val_per_class=2)
    out = tmp_path / "out"
    _prepare(shard_plan.plan_image_folder(root, limit=3000), out)
    layout = arrow.check(out)
    digest = arrow.digest(layout)
    shutil.copytree(out, tmp_path / "copy")
    files = sorted((out / "train").glob("data-*.arrow"))
    # One byte changed in place (same size): the checksum names it.
    data = bytearray(files[0].read_bytes())
    data[-100] ^= 0xFF
    files[0].write_bytes(bytes(data))
    with pytest.raises(arrow.ArrowDataError, match=f"{files[0]} changed since it was prepared"):
        arrow.check(out)
    # Truncated, as an interrupted copy leaves it: named, with what to do.
    files[-1].write_bytes(files[-1].read_bytes()[:200])
    with pytest.raises(arrow.ArrowDataError, match=f"{files[-1]} is truncated or damaged"):
        arrow.check(out)
    files[-1].unlink()
    with pytest.raises(arrow.ArrowDataError, match=f"{files[-1]} is missing"):
        arrow.check(out)
    (tmp_path / "copy" / "validation" / "state.json").unlink()
    with pytest.raises(arrow.ArrowDataError, match=f"{tmp_path / 'copy' / 'validation'}: no "
                                                   "state.json"):
        arrow.check(tmp_path / "copy")
    state = json.loads((tmp_path / "copy" / "train" / "state.json").read_text())
    (tmp_path / "copy" / "train" / "state.json").write_text(json.dumps({**state,
                                                                        "_data_files": []}))
    with pytest.raises(arrow.ArrowDataError, match=f"{tmp_path / 'copy' / 'train'}: the split "
                                                   "lists no shards"):
        arrow.check(tmp_path / "copy")
    assert len(digest) == 8


def _stage(args: tuple[str, str]) -> str:
    from train.data.staging import staged

    return str(staged(*args))


def test_staging_copies_the_set_once_per_node_whatever_its_ranks(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch
                                                                ) -> None:
    """Three processes of one node stage at once: one copy, complete, under a name holding the
    set's digest, read as the original; `$TMPDIR` is the node's."""
    import multiprocessing

    root = write_image_folder(tmp_path / "images", train_per_class=4)
    out = tmp_path / "shards"
    _prepare(shard_plan.plan_image_folder(root, limit=3000), out)
    monkeypatch.setenv("TMPDIR", str(tmp_path / "node-local"))
    with multiprocessing.get_context("fork").Pool(3) as pool:
        copies = set(pool.map(_stage, [(str(out), "$TMPDIR/stage")] * 3))
    [copy] = copies
    assert Path(copy).parent == tmp_path / "node-local" / "stage"
    assert [p.name for p in (tmp_path / "node-local" / "stage").iterdir()
            if not p.name.endswith(".lock")] == [Path(copy).name]
    assert arrow.digest(arrow.check(copy)) == arrow.digest(arrow.find(out))
    assert _stored(Path(copy), "train") == _stored(out, "train")


def test_a_job_trains_on_shards_and_refuses_to_resume_on_other_ones(
        tmp_path: Path, store_template: Path, no_launcher_env: None) -> None:
    """One rank in process: a FINISHED run on prepared shards whose validation counted each
    sample once; the shards prepared again from other images under the same directory, the
    same job (more epochs) refuses to continue its checkpoint, naming both digests, before
    its run is touched."""
    from tests.conftest import composed, history, new_store, runs_in
    from train.app import run
    from train.errors import TrainError

    uri = new_store(tmp_path / "mlflow.db", store_template)
    out = tmp_path / "shards"
    _prepare(shard_plan.plan_image_folder(write_image_folder(tmp_path / "a", train_per_class=8,
                                                         val_per_class=3), 4000), out)
    args = ("data=arrow", f"data.root={out}", "data.image_size=16", "data.batch_size=8",
            "data.num_workers=1", "model.width=8", "tracking.log_model=false",
            f"tracking.uri={uri}", "tracking.batch_interval_s=0")
    run(composed(*args, "trainer.epochs=1"), str(tmp_path / "job"), "python -m train (test)")
    [first] = runs_in(uri)
    assert first.info.status == "FINISHED"
    assert history(uri, first.info.run_id, "val/samples") == [(1, 9.0)]
    shutil.rmtree(out)
    _prepare(shard_plan.plan_image_folder(write_image_folder(tmp_path / "b", train_per_class=8,
                                                         val_per_class=3, seed=9), 4000), out)
    with pytest.raises(TrainError, match="written on data=arrow shards of digest .* now holds"):
        run(composed(*args, "trainer.epochs=2"), str(tmp_path / "job"), "python -m train (test)")
    [after] = runs_in(uri)
    assert after.info.status == "FINISHED" and after.info.end_time == first.info.end_time


def test_a_hub_name_not_in_the_cache_is_named_with_where_it_was_looked_for(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import datasets
    import huggingface_hub.constants

    # What HF_DATASETS_CACHE and HF_HUB_OFFLINE=1 set when these modules are imported.
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(arrow.ArrowDataError) as refused:
        arrow.find("nobody/nothing")
    out = str(refused.value)
    assert out.startswith(f"data=arrow data.root=nobody/nothing: neither a directory nor a "
                          f"data set in the local datasets cache ({tmp_path})"), out
    assert "load it once where the Hub can be reached" in out


def test_a_readers_death_anywhere_in_the_rank_is_named_after_the_shard_that_changed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """torch's SIGCHLD handler raises a DataLoader worker's death wherever its rank is (a
    backward pass too), so the rank's failure handler asks shard_guard as well as the wait for
    a batch does: a RuntimeError becomes the line naming the truncated shard, its cause kept."""
    from train.data import shard_guard
    from train.errors import TrainError

    monkeypatch.setattr(shard_guard, "_opened", {})
    shard = tmp_path / "data-00000-of-00001.arrow"
    shard.write_bytes(b"x" * 100)
    worker_died = RuntimeError("DataLoader worker (pid 1) is killed by signal: Bus error.")
    shard_guard.opened([shard])
    assert shard_guard.named(worker_died) is worker_died  # nothing changed: as it was
    os.truncate(shard, 50)
    named = shard_guard.named(worker_died)
    assert isinstance(named, shard_guard.ShardChangedError) and named.__cause__ is worker_died
    assert f"{shard} changed while the job read it (100 bytes when the job opened it, 50 " \
           "bytes now)" in str(named)
    stopped = TrainError("the job's own error")
    assert shard_guard.named(stopped) is stopped and shard_guard.named(KeyboardInterrupt()) \
        .__class__ is KeyboardInterrupt
