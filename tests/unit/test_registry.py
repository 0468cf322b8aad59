"""tracking.register_model in process: the model card of a registered version, and pre-flight's
export check (the meta device first, the CPU only where that cannot trace)."""

from __future__ import annotations

import json

import pytest
import torch

from tests.conftest import USER_PATH


def test_the_model_card_says_how_images_become_inputs() -> None:
    """An image folder: scale, ImageNet's normalisation and the resizing, as a caller needs
    them; the user's Dataset: its inputs as they come."""
    from types import SimpleNamespace

    from train.config.groups import DataConfig
    from train.report.modelcard import describe
    from train.tracking.registry import description, version_tags

    val = SimpleNamespace(scale=255.0, mean=torch.tensor([0.485, 0.456, 0.406]).view(1, -1, 1, 1),
                          std=torch.tensor([0.229, 0.224, 0.225]).view(1, -1, 1, 1))
    folder = DataConfig(name="imagefolder", image_size=64)
    card = describe(val, folder, (3, 64, 64), ["cat", "dog"])
    assert card["preprocessing"]["resize"] == "Resize(short side 73) + CenterCrop(64)"
    tags = version_tags(card)
    assert tags["preprocessing.mean"] == "[0.485, 0.456, 0.406]"
    assert tags["preprocessing.scale"] == "255.0" and tags["input.shape"] == "[-1, 3, 64, 64]"
    assert json.loads(tags["class_names"]) == ["cat", "dog"]
    assert "Resize(short side 73)" in description(card, "run1")

    folder.eval_transforms = [{"_target_": "torchvision.transforms.v2.Resize", "size": 64}]
    assert describe(val, folder, (3, 64, 64), ["a"])["preprocessing"]["resize"] == \
        "Resize(size=64)"
    custom = DataConfig(name="custom", train={"_target_": "mypkg.data.Spectra"})
    card = describe(SimpleNamespace(scale=None), custom, (2, 100), ["x", "y", "z"])
    assert "mypkg.data.Spectra returns them" in card["preprocessing"]["pixels"]
    assert card["input"]["layout"] == "N + sample" and card["output"]["shape"] == [-1, 3]
    assert "preprocessing.mean" not in version_tags(card)


def test_preflight_exports_a_traceable_model_on_the_meta_device_only(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A model torch.export traces is exported on the meta device alone (no memory for its
    weights at pre-flight: torchvision's resnet50 at 224 pixels here); an untraceable one is
    tried on the CPU too before it is refused."""
    from train.config.groups import ConfigError, CustomModelConfig, ModelConfig
    from train.models import build as models
    from train.models import exportable

    devices: list[str] = []
    export = exportable._export
    monkeypatch.setattr(exportable, "_export",
                        lambda model, x: (devices.append(x.device.type), export(model, x)))
    resnet50 = ModelConfig(source="torchvision", name="resnet50")
    exportable.check_registrable(
        lambda: models.build(resnet50, models.InputSpec.of((3, 224, 224), 5)), (3, 224, 224),
        "resnet50", "flowers")
    assert devices == ["meta"]

    devices.clear()
    monkeypatch.syspath_prepend(USER_PATH)
    host = CustomModelConfig("userpkg.models.ChecksOnTheHost")
    with pytest.raises(ConfigError, match="cannot trace ChecksOnTheHost .*data-dependent"):
        exportable.check_registrable(
            lambda: models.build(host, models.InputSpec.of((1, 8, 8), 10)), (1, 8, 8),
            "ChecksOnTheHost", "host-checks")
    assert devices == ["meta", "cpu"]
