"""Data sets (on real file formats the tests write), the split, the shards, and the models."""

from __future__ import annotations

import pickle
import struct
from pathlib import Path

import numpy as np
import pytest
import torch

from train.config.groups import DataConfig, ModelConfig
from train.data import batches, datasets
from train.data import build as data
from train.distributed.env import DistEnv
from train.errors import ConfigError
from train.launch import preflight
from train.models import build as models


def write_idx(path: Path, array: np.ndarray) -> None:
    """The IDX format MNIST ships in: magic (type 0x08 = uint8, dims), big-endian sizes, data."""
    path.parent.mkdir(parents=True, exist_ok=True)
    header = struct.pack(">HBB", 0, 0x08, array.ndim) + struct.pack(f">{array.ndim}I",
                                                                     *array.shape)
    path.write_bytes(header + array.astype(np.uint8).tobytes())


@pytest.fixture
def mnist_root(tmp_path: Path) -> tuple[Path, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, (50, 28, 28), dtype=np.uint8)
    labels = rng.integers(0, 10, 50, dtype=np.uint8)
    raw = tmp_path / "MNIST" / "raw"
    write_idx(raw / "train-images-idx3-ubyte", images)
    write_idx(raw / "train-labels-idx1-ubyte", labels)
    write_idx(raw / "t10k-images-idx3-ubyte", images[:10])
    write_idx(raw / "t10k-labels-idx1-ubyte", labels[:10])
    return tmp_path, images, labels


def test_mnist_loads_from_idx_files(mnist_root: tuple[Path, np.ndarray, np.ndarray]) -> None:
    root, images, labels = mnist_root
    loaded = datasets.DATASETS["mnist"](DataConfig(name="mnist", root=str(root)))
    assert loaded.images.shape == (50, 1, 28, 28) and loaded.images.dtype == torch.uint8
    assert np.array_equal(loaded.images[:, 0].numpy(), images)
    assert np.array_equal(loaded.labels.numpy(), labels)
    assert loaded.num_classes == 10 and loaded.scale == 255.0


def test_cifar10_loads_from_pickled_batches(tmp_path: Path) -> None:
    folder = tmp_path / "cifar-10-batches-py"
    folder.mkdir()
    rng = np.random.default_rng(1)
    batches = []
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        pixels = rng.integers(0, 256, (4, 3072), dtype=np.uint8)
        labels = rng.integers(0, 10, 4).tolist()
        # Python 2 pickles with str keys, as the official files are (read with latin1).
        (folder / name).write_bytes(pickle.dumps({"data": pixels, "labels": labels}, protocol=2))
        batches.append((pixels, labels))
    names = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship",
             "truck"]
    (folder / "batches.meta").write_bytes(pickle.dumps({"label_names": names}, protocol=2))
    loaded = datasets.DATASETS["cifar10"](DataConfig(name="cifar10", root=str(tmp_path)))
    assert loaded.images.shape == (20, 3, 32, 32) and loaded.images.dtype == torch.uint8
    first = batches[0][0][0].reshape(3, 32, 32)  # CIFAR rows: 1024 red, 1024 green, 1024 blue
    assert np.array_equal(loaded.images[0].numpy(), first)
    assert loaded.labels.tolist() == sum((b[1] for b in batches[:5]), [])
    assert loaded.class_names[0] == "airplane" and loaded.num_classes == 10


@pytest.mark.parametrize(("name", "cls"), [("mnist", "MNIST"), ("fashion_mnist", "FashionMNIST"),
                                           ("cifar10", "CIFAR10")])
def test_a_missing_data_set_names_the_download_command(tmp_path: Path, name: str,
                                                       cls: str) -> None:
    with pytest.raises(datasets.DataMissingError) as info:
        datasets.check_available(DataConfig(name=name, root=str(tmp_path)))
    assert f"{cls}('{tmp_path}', download=True)" in str(info.value)
    assert "data.download=true" in str(info.value)


def test_digits_are_scikit_learns() -> None:
    from sklearn.datasets import load_digits

    reference = load_digits()
    loaded = datasets.DATASETS["digits"](DataConfig())
    assert loaded.images.shape == (1797, 1, 8, 8)
    assert np.array_equal(loaded.images[:, 0].numpy(), reference.images)
    assert np.array_equal(loaded.labels.numpy(), reference.target)


def test_synthetic_follows_its_config_and_seed() -> None:
    cfg = DataConfig(name="synthetic", num_samples=40, channels=2, image_size=6, num_classes=3)
    a, b = datasets.DATASETS["synthetic"](cfg), datasets.DATASETS["synthetic"](cfg)
    assert a.images.shape == (40, 2, 6, 6) and a.num_classes == 3
    assert set(a.labels.tolist()) <= {0, 1, 2}
    assert torch.equal(a.images, b.images) and torch.equal(a.labels, b.labels)


def test_the_split_is_fixed_disjoint_and_complete() -> None:
    one, two = data.split(1797, 0.2, seed=0), data.split(1797, 0.2, seed=0)
    assert torch.equal(one.val_idx, two.val_idx)
    assert len(one.val_idx) == 359
    assert sorted(torch.cat([one.train_idx, one.val_idx]).tolist()) == list(range(1797))
    assert not torch.equal(one.val_idx, data.split(1797, 0.2, seed=1).val_idx)


@pytest.mark.parametrize(("n", "fraction", "n_val"), [(10, 0.2, 2), (103, 0.2, 21), (3, 0.1, 1),
                                                    (1000, 0.5, 500)])
def test_split_sizes_and_seeds(n: int, fraction: float, n_val: int) -> None:
    parts = data.split(n, fraction, seed=7)
    train, val = set(parts.train_idx.tolist()), set(parts.val_idx.tolist())
    assert len(val) == len(parts.val_idx) == n_val  # at least one validation sample
    assert not train & val and train | val == set(range(n))
    again = data.split(n, fraction, seed=7)
    assert torch.equal(again.train_idx, parts.train_idx) and torch.equal(again.val_idx,
                                                                          parts.val_idx)


def _rows(images: torch.Tensor) -> list[bytes]:
    """Each image as bytes: with random pixels, the sample's identity."""
    return [bytes(image.flatten().tolist()) for image in images]


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 5])
def test_synthetic_shards_cover_every_sample_at_any_world_size(world_size: int) -> None:
    """103 samples (21 validation, 82 training) over W ranks: validation shards hold every
    validation sample exactly once, whatever W; training shards take the same number of steps
    on every rank and together cover the training split (DistributedSampler pads by repeating
    a few samples)."""
    cfg = DataConfig(name="synthetic", num_samples=103, channels=1, image_size=4, num_classes=3,
                     batch_size=4 * world_size, num_workers=0)
    source = datasets.DATASETS["synthetic"](cfg)
    parts = data.split(103, cfg.val_fraction, cfg.split_seed)
    assert len(set(_rows(source.images))) == 103  # the byte rows do identify samples

    bundles = [data.build(cfg, DistEnv.on_one_node(rank, world_size), torch.device("cpu"), seed=0)
               for rank in range(world_size)]
    assert {(b.num_train, b.num_val) for b in bundles} == {(82, 21)}
    val_shards = [[row for images, _ in b.val.raw() for row in _rows(images)] for b in bundles]
    assert sorted(sum(val_shards, [])) == sorted(_rows(source.images[parts.val_idx]))
    sizes = [len(shard) for shard in val_shards]
    assert max(sizes) - min(sizes) <= 1  # strided: balanced, no padding

    for b in bundles:
        b.train.set_epoch(0)
    train_seen = [[row for images, _ in b.train.raw() for row in _rows(images)] for b in bundles]
    assert len({len(rows) for rows in train_seen}) == 1  # the same shard size everywhere
    assert len({len(b.train) for b in bundles}) == 1  # the same number of steps everywhere
    everything = [row for rows in train_seen for row in rows]
    assert len(everything) == -(-82 // world_size) * world_size
    assert set(everything) == set(_rows(source.images[parts.train_idx]))


def test_more_ranks_than_validation_samples_leaves_some_shards_empty() -> None:
    """10 samples, 2 for validation, 3 ranks: rank 2 validates nothing (and adds nothing)."""
    cfg = DataConfig(name="synthetic", num_samples=10, channels=1, image_size=4, num_classes=2,
                     batch_size=3, num_workers=0)
    bundles = [data.build(cfg, DistEnv.on_one_node(rank, 3), torch.device("cpu"), seed=0)
               for rank in range(3)]
    shards = [[row for images, _ in b.val.raw() for row in _rows(images)] for b in bundles]
    assert [len(shard) for shard in shards] == [1, 1, 0]
    assert [len(b.val) for b in bundles] == [1, 1, 0]
    source = datasets.DATASETS["synthetic"](cfg)
    assert sorted(shards[0] + shards[1]) == sorted(
        _rows(source.images[data.split(10, 0.2, 0).val_idx]))


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_shards_cover_validation_exactly_once(world_size: int) -> None:
    cpu = torch.device("cpu")
    cfg = DataConfig(batch_size=30 * world_size, num_workers=0)
    bundles = [data.build(cfg, DistEnv.on_one_node(rank, world_size), cpu, seed=0)
               for rank in range(world_size)]
    seen = torch.cat([labels for b in bundles for _, labels in b.val])
    assert len(seen) == 359  # no padding, nothing dropped
    parts = data.split(1797, 0.2, 0)
    expected = datasets.DATASETS["digits"](cfg).labels[parts.val_idx]
    assert sorted(seen.tolist()) == sorted(expected.tolist())
    assert len({len(b.train) for b in bundles}) == 1  # the same number of steps everywhere
    images, _ = next(iter(bundles[0].train))
    assert images.shape == (30, 1, 8, 8)


def test_training_order_changes_with_the_epoch() -> None:
    bundle = data.build(DataConfig(num_workers=0), DistEnv.on_one_node(0, 1), torch.device("cpu"),
                        seed=0)
    bundle.train.set_epoch(0)
    first = next(iter(bundle.train))[1]
    bundle.train.set_epoch(1)
    assert not torch.equal(first, next(iter(bundle.train))[1])
    bundle.train.set_epoch(0)
    assert torch.equal(first, next(iter(bundle.train))[1])


@pytest.mark.parametrize("world_size", [1, 3])
def test_device_resident_batches_are_the_loaders_batches(world_size: int) -> None:
    """The GPU fast path (data on the device, batched there) shards and orders exactly as the
    DataLoader path does; here on the CPU, which takes the same code."""
    cpu = torch.device("cpu")
    cfg = DataConfig(batch_size=32 * world_size, num_workers=0)
    for rank in range(world_size):
        env = DistEnv.on_one_node(rank, world_size)
        loaded = data.build(cfg, env, cpu, seed=3, resident=False)
        resident = data.build(cfg, env, cpu, seed=3, resident=True)
        assert isinstance(resident.train, data.ResidentBatches)
        for epoch in (0, 1):
            loaded.train.set_epoch(epoch)
            resident.train.set_epoch(epoch)
            assert len(resident.train) == len(loaded.train)
            for (xa, ya), (xb, yb) in zip(loaded.train, resident.train, strict=True):
                assert torch.equal(ya, yb) and torch.equal(xa, xb)
        assert [y.tolist() for _, y in resident.val] == [y.tolist() for _, y in loaded.val]


def test_crop_and_flip_only_moves_pixels() -> None:
    x = torch.arange(2 * 3 * 8 * 8, dtype=torch.float32).reshape(2, 3, 8, 8) + 1
    out = batches.crop_and_flip(x)
    assert out.shape == x.shape
    values = set(x.flatten().tolist()) | {0.0}  # zero padding may come in
    assert set(out.flatten().tolist()) <= values


def test_registries_match_the_names_config_validates() -> None:
    assert set(datasets.DATASETS) == set(preflight.DATASET_NAMES)
    assert set(models.MODELS) == set(preflight.MODEL_NAMES)


@pytest.mark.parametrize("name", ["cnn", "mlp", "resnet18"])
@pytest.mark.parametrize(("channels", "size"), [(1, 8), (3, 32)])
def test_models_classify_and_learn(name: str, channels: int, size: int) -> None:
    model = models.build(ModelConfig(name=name), models.InputSpec(channels, size, 10))
    logits = model(torch.randn(4, channels, size, size))
    assert logits.shape == (4, 10)
    logits.sum().backward()
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())


def test_any_torchvision_builder_takes_the_data_shape() -> None:
    for name in ("resnet18", "mobilenet_v3_small"):  # grey-scale input, 7 classes
        model = models.build(ModelConfig(name=name, source="torchvision"),
                             models.InputSpec(1, 28, 7))
        assert model(torch.randn(2, 1, 28, 28)).shape == (2, 7), name
    with pytest.raises(ValueError, match="choose one of"):
        models.build(ModelConfig(name="no_such_net", source="torchvision"),
                     models.InputSpec(3, 32, 10))


class _FrozenInWorker(torch.utils.data.Dataset):
    """Each sample: how many objects the worker reading it holds frozen (gc's permanent
    generation: objects its collections never walk)."""

    def __len__(self) -> int:
        return 4

    def __getitem__(self, index: int) -> int:
        import gc

        return gc.get_freeze_count()


def test_a_worker_collects_none_of_the_objects_it_inherits_and_the_rank_all_of_its_own() -> None:
    """DataLoader workers are forked with the rank's objects frozen: a worker's garbage
    collection does not walk them (copying every page it shares with the rank), and the rank,
    once the workers are forked, collects its own as before."""
    import gc

    order = batches.ShardOrder(None, 4, batch_size=2)
    loader = batches.loader(_FrozenInWorker(), order, workers=1, device=torch.device("cpu"),
                            collate=lambda samples: samples)
    frozen = [count for batch in loader for count in batch]
    assert min(frozen) > 10_000  # torch's and this process's objects, inherited
    assert gc.get_freeze_count() == 0


def test_a_val_fraction_that_leaves_no_training_sample_is_named() -> None:
    """Not the ZeroDivisionError the first epoch's end met with an empty training split."""
    cfg = DataConfig(name="synthetic", num_samples=10, channels=1, image_size=4, num_classes=3,
                     batch_size=2, num_workers=0, val_fraction=0.96)
    with pytest.raises(ConfigError, match=r"data.val_fraction=0.96 of 10 samples leaves none to "
                                          r"train on: lower it"):
        data.build(cfg, DistEnv.on_one_node(0, 1), torch.device("cpu"), seed=0)
    assert len(data.split(10, 0.9, 0).train_idx) == 1  # one sample is still a training split
