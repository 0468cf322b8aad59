"""The test split and the best-checkpoint monitor in process: an image folder's and MNIST's
test files sharded exactly over the ranks, and the monitor minimising a loss and carrying its
state over a checkpoint. The whole jobs: tests/e2e/test_bestcheck.py."""

from __future__ import annotations

from pathlib import Path

import torch


def test_an_image_folders_test_folder_is_sharded_exactly_over_the_ranks(tmp_path: Path) -> None:
    from tests.images import class_names, write_class_folder, write_image_folder
    from train.config.groups import DataConfig
    from train.data import build as data
    from train.distributed.env import DistEnv

    root = write_image_folder(tmp_path / "set", 3, 4, 2, size=16)
    write_class_folder(root / "test", class_names(3), 3, size=16, seed=5)  # 9 images
    cfg = DataConfig(name="imagefolder", root=str(root), image_size=16, batch_size=4,
                     num_workers=0)
    cpu = torch.device("cpu")
    bundles = [data.build(cfg, DistEnv.on_one_node(rank, 2), cpu, seed=0) for rank in range(2)]
    assert [b.num_test for b in bundles] == [9, 9]
    labels = [int(y) for b in bundles for _, batch in b.test for y in batch]
    assert sorted(labels) == [0, 0, 0, 1, 1, 1, 2, 2, 2]  # 5 + 4: none twice, none left out
    digits = data.build(DataConfig(batch_size=4), DistEnv.on_one_node(0, 1), cpu, seed=0)
    assert digits.test is None


def test_the_monitor_minimises_a_loss_and_carries_its_state_over() -> None:
    from train.config.groups import TrainerConfig
    from train.engine.monitor import Monitor
    from train.report.metrics import Reduced

    cfg = TrainerConfig(monitor="val/loss", early_stopping_patience=2)
    bests: list[float] = []
    first = Monitor(cfg, on_best=lambda best: bests.append(best.value))
    for epoch, loss in enumerate([1.0, 0.5, 0.7]):
        first.observe(epoch, epoch * 10, Reduced({"loss": loss, "accuracy": 0.1}, samples=4))
    assert (first.mode, bests, first.best_epoch, first.bad_evaluations) == ("min", [1.0, 0.5], 1, 1)
    resumed = Monitor(cfg)
    resumed.load_state_dict(first.state_dict())
    assert (resumed.best, resumed.best_epoch, resumed.bad_evaluations) == (0.5, 1, 1)
    other = Monitor(TrainerConfig())  # val/accuracy: another metric's best is not its best
    other.load_state_dict(first.state_dict())
    assert other.best is None


def test_mnists_test_files_are_its_test_split_sharded_exactly(tmp_path: Path) -> None:
    import numpy as np

    from tests.unit.test_data_models import write_idx
    from train.config.groups import DataConfig
    from train.data import build as data
    from train.distributed.env import DistEnv

    rng = np.random.default_rng(0)
    raw = tmp_path / "MNIST" / "raw"
    write_idx(raw / "train-images-idx3-ubyte", rng.integers(0, 256, (40, 28, 28)))
    write_idx(raw / "train-labels-idx1-ubyte", rng.integers(0, 10, 40))
    test_labels = rng.integers(0, 10, 11)
    write_idx(raw / "t10k-images-idx3-ubyte", rng.integers(0, 256, (11, 28, 28)))
    write_idx(raw / "t10k-labels-idx1-ubyte", test_labels)
    cfg = DataConfig(name="mnist", root=str(tmp_path), batch_size=4, num_workers=0)
    cpu = torch.device("cpu")
    bundles = [data.build(cfg, DistEnv.on_one_node(rank, 2), cpu, seed=0, resident=True)
               for rank in range(2)]
    assert [b.num_test for b in bundles] == [11, 11]
    labels = [int(y) for b in bundles for _, batch in b.test for y in batch]
    assert sorted(labels) == sorted(test_labels.tolist())  # 6 + 5: each test sample once
