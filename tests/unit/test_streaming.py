"""Streamed data sets, fast: ImageFolder layouts of real JPEGs (tests/images.py), the split, exact
validation shards, transforms, unreadable files, epochs that start at a batch, a user's own
Dataset classes (tests/userpkg) and the one-line refusals of pre-flight. The whole jobs are in
tests/e2e/test_streaming_jobs.py."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import pytest
import torch

from tests.conftest import REPO
from tests.images import class_names, corrupt, write_image_folder
from train.config.groups import ConfigError, DataConfig, TrainConfig
from train.data import build as data
from train.data import imagefolder, streaming
from train.distributed.env import DistEnv
from train.launch import preflight
from train.launch.local import LaunchError

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def split_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """train/ and val/: 3 classes, 8 + 3 images each."""
    return write_image_folder(tmp_path_factory.mktemp("split"), 3, 8, 3, size=24)


@pytest.fixture(scope="module")
def flat_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One folder of 3 classes x 10 images, split by data.val_fraction."""
    return write_image_folder(tmp_path_factory.mktemp("flat"), 3, 10, size=24)


def folder_config(root: Path, **overrides: object) -> DataConfig:
    values = {"name": "imagefolder", "root": str(root), "image_size": 16, "batch_size": 4,
              "num_workers": 0, **overrides}
    return DataConfig(**values)  # type: ignore[arg-type]


def shards(cfg: DataConfig, world_size: int) -> list[data.DataBundle]:
    return [data.build(cfg, DistEnv.on_one_node(rank, world_size), CPU, seed=0)
            for rank in range(world_size)]


def rows(batches: data.Batches) -> list[bytes]:
    """Each sample of a shard as bytes (deterministic eval crops of noisy pictures: unique)."""
    return [bytes(image.flatten().tolist()) for images, _ in batches.raw() for image in images]


# -- the layout ------------------------------------------------------------------------------

def test_the_layout_is_torchvisions(split_root: Path, flat_root: Path) -> None:
    from torchvision.datasets import ImageFolder

    layout = imagefolder.find(str(split_root))
    assert layout.train.classes == class_names(3) and layout.val is not None
    assert (len(layout.train), len(layout.val)) == (24, 9)
    theirs = ImageFolder(str(split_root / "train"))
    assert [(str(layout.train.path / f), label) for f, label in
            zip(layout.train.files, layout.train.labels, strict=True)] == theirs.samples
    flat = imagefolder.find(str(flat_root))
    assert flat.val is None and len(flat.train) == 30


def test_hidden_folders_and_other_files_are_not_classes(tmp_path: Path) -> None:
    write_image_folder(tmp_path, 2, 2, size=8)
    (tmp_path / ".ipynb_checkpoints").mkdir()
    (tmp_path / "class_00" / "notes.txt").write_text("not an image")
    nested = tmp_path / "class_01" / "more"
    nested.mkdir()
    shutil.copy(tmp_path / "class_01" / "00000.jpg", nested / "extra.JPG")
    found = imagefolder.find(str(tmp_path)).train
    assert found.classes == ["class_00", "class_01"]
    assert found.files[-1] == "class_01/more/extra.JPG" and len(found) == 5


def _layouts(root: Path) -> dict[str, tuple[Path, str]]:
    """Broken layouts under `root`, each with what the refusal must say."""
    write_image_folder(root / "loose", 1, 2, size=8)
    for image in (root / "loose" / "class_00").iterdir():
        image.rename(root / "loose" / image.name)
    (root / "loose" / "class_00").rmdir()
    write_image_folder(root / "empty_class", 2, 2, size=8)
    for image in (root / "empty_class" / "class_01").iterdir():
        image.unlink()
    write_image_folder(root / "train_only", 3, 2, 2, size=8)
    shutil.rmtree(root / "train_only" / "val" / "class_02")
    write_image_folder(root / "val_only", 2, 2, 2, size=8)
    shutil.copytree(root / "val_only" / "val" / "class_01", root / "val_only" / "val" / "extra")
    (root / "nothing").mkdir()
    (root / "a_file").write_text("")
    return {
        "missing": (root / "missing", "does not exist"),
        "file": (root / "a_file", "is not a folder"),
        "nothing": (root / "nothing", "holds no class folders"),
        "loose": (root / "loose", "holds 2 image files but no class folders"),
        "empty_class": (root / "empty_class", "class_01 has no images"),
        "train_only": (root / "train_only", "class 'class_02' is in"),
        "val_only": (root / "val_only", "class 'extra' is in"),
    }


def test_preflight_refuses_what_is_no_image_folder_in_one_line(tmp_path: Path) -> None:
    for name, (root, expected) in _layouts(tmp_path).items():
        cfg = TrainConfig(data=folder_config(root))
        with pytest.raises(LaunchError) as info:
            preflight.check_data(cfg)
        message = str(info.value)
        assert expected in message and "\n" not in message, name
    message = str(pytest.raises(LaunchError, preflight.check_data, TrainConfig(
        data=folder_config(tmp_path / "train_only"))).value)
    assert message.endswith("or remove val/ to split train/ by data.val_fraction.")


# -- split, shards, transforms ----------------------------------------------------------------

@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_validation_shards_hold_every_image_once(flat_root: Path, world_size: int) -> None:
    cfg = folder_config(flat_root, batch_size=2 * world_size, val_fraction=0.3)
    bundles = shards(cfg, world_size)
    assert {(b.num_train, b.num_val) for b in bundles} == {(21, 9)}
    whole = rows(shards(cfg, 1)[0].val)
    seen = [rows(b.val) for b in bundles]
    assert sorted(sum(seen, [])) == sorted(whole) and len(set(whole)) == 9
    assert max(map(len, seen)) - min(map(len, seen)) <= 1  # strided: no padding, none dropped
    assert len({len(b.train) for b in bundles}) == 1  # the same steps on every rank
    assert {b.class_names == class_names(3) and b.input_shape == (3, 16, 16) for b in bundles} \
        == {True}


def test_the_data_set_record_names_the_file_list(flat_root: Path, tmp_path: Path) -> None:
    cfg = folder_config(flat_root)
    record = shards(cfg, 1)[0].description()
    assert record == shards(cfg, 1)[0].description()
    assert (record.num_rows, record.features_shape) == (24, [24, 3, 16, 16])
    copy = shutil.copytree(flat_root, tmp_path / "copy")
    shutil.copy(copy / "class_00" / "00000.jpg", copy / "class_00" / "extra.jpg")
    assert shards(folder_config(copy), 1)[0].description().digest != record.digest


def test_transforms_make_the_configured_crops() -> None:
    image = torch.randint(0, 256, (3, 40, 30), dtype=torch.uint8)
    cfg = DataConfig(name="imagefolder", image_size=20, augment=True)
    for train in (True, False):
        out = streaming.transforms(cfg, train)(image)
        assert (out.shape, out.dtype) == ((3, 20, 20), torch.uint8)
    steps = [{"_target_": "torchvision.transforms.v2.RandomCrop", "size": 12},
             {"_target_": "torchvision.transforms.v2.ToDtype", "dtype": torch.float32,
              "scale": True}]  # float out: back to uint8 for the device's normalisation
    out = streaming.transforms(DataConfig(train_transforms=steps), True)(image)
    assert (out.shape, out.dtype) == ((3, 12, 12), torch.uint8)
    with pytest.raises(ConfigError, match=r"data.eval_transforms\[0\].*has no 'Nope'"):
        streaming.transforms(DataConfig(eval_transforms=[
            {"_target_": "torchvision.transforms.v2.Nope"}]), False)


def test_batches_arrive_normalised_on_the_device(split_root: Path) -> None:
    bundle = shards(folder_config(split_root, batch_size=8), 1)[0]
    bundle.train.set_epoch(0)
    images, labels = next(iter(bundle.train))
    assert images.dtype == torch.float32 and images.shape == (8, 3, 16, 16)
    assert labels.dtype == torch.int64 and -3 < float(images.min()) < float(images.max()) < 3


# -- unreadable files, resuming mid-epoch -----------------------------------------------------

def test_an_unreadable_image_is_skipped_named_once_and_counted(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    root = write_image_folder(tmp_path, 2, 4, 2, size=16)
    truncated = corrupt(root / "train" / "class_01" / "00002.jpg")
    garbage = corrupt(root / "val" / "class_00" / "00001.jpg", "garbage")
    bundle = shards(folder_config(root, num_workers=1), 1)[0]  # a real worker process
    with caplog.at_level(logging.WARNING, logger="train"):
        for epoch in (0, 1):
            bundle.train.set_epoch(epoch)
            assert sum(len(labels) for _, labels in bundle.train) == 7
            assert sum(len(labels) for _, labels in bundle.val) == 3
    warned = [r.getMessage() for r in caplog.records if "unreadable" in r.getMessage()]
    assert len(warned) == 2  # each file once, not once per epoch
    assert str(truncated) in warned[0] and "OSError" in warned[0]
    assert str(garbage) in warned[1] and "cannot identify image file" in warned[1]
    assert "1 skipped on this rank" in warned[1]
    corrupt(root / "val" / "class_01" / "00000.jpg")  # now a whole batch of one: a clear stop
    lonely = shards(folder_config(root, batch_size=1), 1)[0]
    with pytest.raises(streaming.UnreadableBatchError, match="no image of a batch could be read"):
        list(lonely.val)


def test_an_epoch_starts_at_a_batch_without_reading_those_before(
        flat_root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    reads: list[str] = []
    real = streaming.decode
    monkeypatch.setattr(streaming, "decode", lambda path: reads.append(path) or real(path))
    bundle = shards(folder_config(flat_root, batch_size=6, augment=False), 2)[1]
    bundle.train.set_epoch(3)
    whole = [labels.tolist() for _, labels in bundle.train]
    reads.clear()
    bundle.train.set_epoch(3, start_batch=2)
    assert [labels.tolist() for _, labels in bundle.train] == whole[2:]
    assert len(reads) == sum(map(len, whole[2:]))  # the first two batches were never decoded
    assert len(bundle.train) == len(whole) == 4  # still the whole epoch's length


@pytest.mark.parametrize("resident", [False, True])
def test_in_memory_epochs_start_at_a_batch_too(resident: bool) -> None:
    bundle = data.build(DataConfig(batch_size=64, num_workers=0), DistEnv.on_one_node(0, 2), CPU,
                        seed=1, resident=resident)
    bundle.train.set_epoch(2)
    whole = [labels.tolist() for _, labels in bundle.train]
    bundle.train.set_epoch(2, start_batch=5)
    assert [labels.tolist() for _, labels in bundle.train] == whole[5:]


# -- a user's own Dataset ---------------------------------------------------------------------

@pytest.fixture
def userpkg_on_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(REPO / "tests"))


def custom_config(target: str, val: str | None = None, **kwargs: object) -> DataConfig:
    return DataConfig(name="custom", train={"_target_": target, "length": 30, **kwargs},
                      val={"_target_": val, "length": 12} if val else {"_target_": None},
                      batch_size=4, num_workers=0)


@pytest.mark.parametrize(("target", "names"), [
    ("userpkg.data.Lines", ["horizontal", "vertical", "diagonal"]),
    ("userpkg.data.LinesWithTargets", ["0", "1", "2"]),  # from its targets
    ("userpkg.data.UnnamedLines", ["0", "1", "2"]),  # from every label, read once
])
def test_a_custom_dataset_gives_classes_shape_and_split(userpkg_on_path: None, target: str,
                                                        names: list[str]) -> None:
    bundle = data.build(custom_config(target, size=12), DistEnv.on_one_node(0, 1), CPU, seed=0)
    assert (bundle.class_names, bundle.input_shape) == (names, (1, 12, 12))
    assert (bundle.num_train, bundle.num_val) == (24, 6)
    assert bundle.description().features_shape == [24, 1, 12, 12]
    separate = data.build(custom_config(target, val=target), DistEnv.on_one_node(0, 1), CPU, seed=0)
    assert (separate.num_train, separate.num_val) == (30, 12)
    assert sum(len(labels) for _, labels in separate.val) == 12


@pytest.mark.parametrize(("target", "expected"), [
    ("nopkg.data.Lines", "no module named 'nopkg' is found. PYTHONPATH="),
    ("userpkg.data.Nope", "has no 'Nope'"),
    ("userpkg.data.NotADataset", "not a map-style torch.utils.data.Dataset"),
    ("userpkg.data.Stream", "is an IterableDataset"),
    ("userpkg.data.DictSamples", "sample 0 is a dict, not an (input, target) pair"),
])
def test_preflight_refuses_a_custom_dataset_in_one_line(userpkg_on_path: None, target: str,
                                                        expected: str) -> None:
    with pytest.raises(ConfigError) as info:
        preflight.check_data(TrainConfig(data=custom_config(target)))
    assert expected in str(info.value) and "\n" not in str(info.value)
