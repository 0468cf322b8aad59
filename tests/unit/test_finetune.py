"""Fine-tuning: `model.weights` (a local state dict file, a run's model.pt or checkpoint, or
torchvision weights from the local hub cache), `model.freeze` and `optim.param_groups`.

Real files written by the tests (state dicts, checkpoints, torchvision's cache file saved from a
randomly initialised resnet18 under a temporary TORCH_HOME: no network), read, checked and
refused in process. A run's model fine-tuned by another run, and the CLI's refusals:
tests/e2e/test_finetune.py.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from torch import nn

from tests.conftest import USER_PATH, typed
from tests.unit.test_custom_model import NET
from train.config.groups import ConfigError, ModelConfig, OptimConfig
from train.engine import optim
from train.engine.state import GradScaler, TrainState
from train.launch import model_checks, preflight
from train.models import build as models
from train.models import finetune, pretrained

RESNET18_FILE = "resnet18-f37072fd.pth"
"""The file name torchvision's ResNet18_Weights.IMAGENET1K_V1 (= DEFAULT) is cached under."""


@pytest.fixture
def torch_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty torch cache (TORCH_HOME), as on a compute node nothing was fetched for."""
    home = tmp_path / "torch_home"
    monkeypatch.setenv("TORCH_HOME", str(home))
    return home


def cache_resnet18(home: Path) -> dict[str, torch.Tensor]:
    """What `get_weight('ResNet18_Weights.IMAGENET1K_V1').get_state_dict()` leaves in the cache:
    here a random resnet18's state dict (1000 classes) at the file name torchvision expects."""
    import torchvision

    torch.manual_seed(1)
    state = torchvision.models.resnet18().state_dict()
    folder = home / "hub" / "checkpoints"
    folder.mkdir(parents=True)
    torch.save(state, folder / RESNET18_FILE)
    return state


def mlp(classes: int = 10, width: int = 16) -> nn.Module:
    cfg = ModelConfig(name="mlp", width=width)
    return models.build(cfg, models.InputSpec(3, 8, classes))


# -- reading a weights file ----------------------------------------------------------------------

def test_a_state_dict_a_checkpoint_and_wrapped_keys_read_the_same(tmp_path: Path) -> None:
    state = mlp().state_dict()
    files = {"plain.pt": state, "checkpoint.pt": {"model": state, "optimizer": {}, "step": 3},
             "ddp.pt": {f"module.{k}": v for k, v in state.items()},
             "compiled_ddp.pt": {f"_orig_mod.module.{k}": v for k, v in state.items()}}
    for name, content in files.items():
        torch.save(content, tmp_path / name)
        read = pretrained.read(tmp_path / name, name)
        assert list(read) == list(state), name
        assert all(torch.equal(read[k], state[k]) for k in state), name


class NotWeights:
    pass


@pytest.mark.parametrize(("content", "expected"), [
    ([1, 2, 3], "holds list, not a state dict"),
    (NotWeights(), "cannot be read as a state dict of tensors (UnpicklingError"),
])
def test_a_file_that_is_no_state_dict_is_refused(tmp_path: Path, content: object,
                                                 expected: str) -> None:
    torch.save(content, tmp_path / "w.pt")
    with pytest.raises(pretrained.WeightsError, match="model.weights=") as info:
        pretrained.read(tmp_path / "w.pt", str(tmp_path / "w.pt"))
    assert expected in str(info.value) and "\n" not in str(info.value)


def test_a_missing_file_or_a_directory_is_refused(tmp_path: Path) -> None:
    with pytest.raises(pretrained.WeightsError, match="no such file"):
        pretrained.resolve(ModelConfig(weights=str(tmp_path / "nope.pt")))
    with pytest.raises(pretrained.WeightsError, match="is a directory; name the file in it"):
        pretrained.resolve(ModelConfig(weights=str(tmp_path)))


# -- fitting the model ---------------------------------------------------------------------------

def test_strict_refuses_another_architecture_naming_keys(tmp_path: Path) -> None:
    torch.save(mlp().state_dict(), tmp_path / "mlp.pt")
    cnn = models.build(ModelConfig(name="cnn", weights=str(tmp_path / "mlp.pt")),
                       models.InputSpec(3, 8, 10))
    with pytest.raises(pretrained.WeightsError) as info:
        pretrained.load(cnn, ModelConfig(name="cnn", weights=str(tmp_path / "mlp.pt")), 10)
    message = str(info.value)
    assert "does not fit the model" in message and "model.weights_strict=false" in message
    assert "19 missing (0.weight, 0.bias, 1.running_mean, ...); 2 unexpected (6.weight, " \
           "6.bias); 4 of another shape (1.weight: (16, 192) in the file, (32,) here" in message


def test_not_strict_loads_what_matches_and_reports_the_head(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Weights of 5 classes into a model of 10: everything but the classifier is loaded."""
    five = mlp(classes=5).state_dict()
    torch.save(five, tmp_path / "five.pt")
    cfg = ModelConfig(name="mlp", width=16, weights=str(tmp_path / "five.pt"))
    with pytest.raises(pretrained.WeightsError, match=r"of another shape \(6.weight: \(5, 16\) "
                                                      r"in the file, \(10, 16\) here"):
        pretrained.load(mlp(), cfg, 10)
    cfg.weights_strict = False
    model = mlp()
    with caplog.at_level(logging.INFO, logger="train"):
        pretrained.load(model, cfg, 10)
    for key, value in model.state_dict().items():
        assert torch.equal(value, five[key]) == (key not in ("6.weight", "6.bias")), key
    assert "4 of 6 tensors loaded" in caplog.text
    assert "not loaded from" in caplog.text and "2 of another shape (6.weight" in caplog.text


# -- torchvision weights from the local cache ----------------------------------------------------

TORCHVISION = ModelConfig(name="resnet18", source="torchvision", weights="DEFAULT")


def test_torchvision_default_loads_from_the_cache_with_a_new_head(
        torch_home: Path, caplog: pytest.LogCaptureFixture) -> None:
    cached = cache_resnet18(torch_home)
    source = pretrained.resolve(TORCHVISION)
    assert source is not None and source.label == "torchvision:ResNet18_Weights.IMAGENET1K_V1"
    assert source.path == torch_home / "hub" / "checkpoints" / RESNET18_FILE
    assert pretrained.label(TORCHVISION) == source.label
    for name in ("IMAGENET1K_V1", "ResNet18_Weights.IMAGENET1K_V1"):
        assert pretrained.resolve(ModelConfig(name="resnet18", source="torchvision",
                                              weights=name)) == source
    model = models.build(TORCHVISION, models.InputSpec(3, 32, 10))
    with caplog.at_level(logging.INFO, logger="train"):
        pretrained.load(model, TORCHVISION, 10)
    assert model.fc.weight.shape == (10, 512)
    for key, value in model.state_dict().items():
        assert torch.equal(value, cached[key]) == (key not in ("fc.weight", "fc.bias")), key
    assert "classifier head ['fc.weight', 'fc.bias'] newly initialised: the weights have 1000 " \
           "classes, the data 10" in caplog.text


def test_torchvision_weights_on_grey_images_sum_the_first_filters(torch_home: Path) -> None:
    cached = cache_resnet18(torch_home)
    model = models.build(TORCHVISION, models.InputSpec(1, 28, 10))
    pretrained.load(model, TORCHVISION, 10)
    assert torch.allclose(model.conv1.weight, cached["conv1.weight"].sum(1, keepdim=True))
    assert torch.equal(model.layer4[1].conv2.weight, cached["layer4.1.conv2.weight"])


def test_torchvision_weights_not_cached_are_refused_with_the_download_command(
        torch_home: Path) -> None:
    with pytest.raises(pretrained.WeightsError) as info:
        pretrained.resolve(TORCHVISION)
    message = str(info.value)
    assert f"({torch_home / 'hub' / 'checkpoints' / RESNET18_FILE} is missing)" in message
    assert "jobs never download" in message and "\n" not in message
    assert ("python -c \"import torchvision; torchvision.models.get_weight("
            "'ResNet18_Weights.IMAGENET1K_V1').get_state_dict(progress=True)\"") in message
    with pytest.raises(pretrained.WeightsError, match="are not weights of resnet18; choose "
                                                      "DEFAULT or one of"):
        pretrained.resolve(ModelConfig(name="resnet18", source="torchvision",
                                       weights="ResNet50_Weights.IMAGENET1K_V2"))


# -- freezing and parameter groups ---------------------------------------------------------------

def test_param_groups_get_their_lr_and_weight_decay_and_the_schedule_scales_all() -> None:
    model = mlp()  # Flatten, Linear (1), ReLU, Linear (3), ReLU, Dropout, Linear (6)
    finetune.freeze(model, ["1"])
    cfg = OptimConfig(lr=0.1, weight_decay=1e-4, warmup_epochs=1, schedule="constant",
                      param_groups=[{"prefix": 6, "lr_scale": 0.5, "weight_decay": 0.0}])
    optimizer = optim.build_optimizer(cfg, model)
    rest, head = optimizer.param_groups
    assert [p.shape for p in rest["params"]] == [(16, 16), (16,)]  # layer 3; layer 1 frozen
    assert [p.shape for p in head["params"]] == [(10, 16), (10,)]
    assert (head["weight_decay"], rest["weight_decay"]) == (0.0, 1e-4)
    scheduler = optim.build_scheduler(cfg, optimizer, steps_per_epoch=4, epochs=2)
    seen = []
    for _ in range(5):
        seen.append([round(g["lr"], 6) for g in optimizer.param_groups])
        optimizer.step()
        scheduler.step()
    assert seen == [[0.025, 0.0125], [0.05, 0.025], [0.075, 0.0375], [0.1, 0.05], [0.1, 0.05]]
    assert finetune.counts(model) == {"model.params_trainable": 16 * 16 + 16 + 16 * 10 + 10,
                                      "model.params_frozen": 192 * 16 + 16}


def test_each_group_logs_its_lr_and_lr_stays_optim_lr_when_every_parameter_is_in_a_group() -> None:
    """`lr` is optim.lr as scheduled, also when no parameter is left for the default group
    (the optimiser's first group is then a named one: its lr was logged as `lr` before)."""
    model = mlp()
    finetune.freeze(model, ["1"])
    cfg = OptimConfig(lr=0.1, warmup_epochs=1, schedule="constant", param_groups=[
        {"prefix": 3, "lr_scale": 2.0}, {"prefix": 6, "lr_scale": 0.5}])
    optimizer = optim.build_optimizer(cfg, model)
    assert [g["prefix"] for g in optimizer.param_groups] == ["3", "6"]  # no default group
    state = TrainState(model, model, optimizer, optim.build_scheduler(cfg, optimizer, 4, 2),
                       GradScaler(torch.device("cpu"), enabled=False))
    assert state.learning_rates(cfg.lr) == pytest.approx({"lr": 0.025, "lr/3": 0.05,
                                                          "lr/6": 0.0125})  # warm-up: 1/4


@pytest.mark.parametrize(("overrides", "expected"), [
    (("model.freeze=[layer9]",), "model.freeze=['layer9']: 'layer9' matches no parameter of the "
                                 "model; its top-level modules are ['0', '1', '2', '3', '4', '5', "
                                 "'6']"),
    (("model.freeze=[1]", "optim.param_groups=[{prefix:1.weight,lr_scale:0.1}]"),
     "optim.param_groups[0]: '1.weight' matches no trainable parameter"),
    (("optim.param_groups=[{prefix:3,lr_scale:0.1},{prefix:3.bias}]",),
     "optim.param_groups[1].prefix='3.bias' overlaps the group of prefix '3'"),
    (("optim.param_groups=[{prefix:3,lr:0.1}]",),
     "optim.param_groups[0] has ['lr']; a group takes ['prefix', 'lr_scale', 'weight_decay']"),
    (("optim.param_groups=[{prefix:3,lr_scale:0}]",),
     "optim.param_groups[0].lr_scale=0 must be a positive number"),
])
def test_bad_prefixes_and_groups_are_refused_by_preflight(overrides: tuple[str, ...],
                                                          expected: str) -> None:
    cfg = typed("model=mlp", "data=synthetic", "data.image_size=8", *overrides)
    with pytest.raises(ConfigError) as info:
        preflight.validate(cfg, 1)
        model_checks.check_finetuning(cfg, False, model_checks.input_before_reading(cfg.data))
    assert expected in str(info.value) and "\n" not in str(info.value)


def test_a_custom_models_reserved_keys_are_not_its_constructors(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(USER_PATH)
    cfg = typed("model=custom", f"model._target_={NET}", "+model.freeze=[features]",
                "+model.weights_strict=false", f"+model.weights={tmp_path / 'w.pt'}")
    assert cfg.model.kwargs == {} and cfg.model.freeze == ["features"]
    spec = models.InputSpec(1, 8, 10)
    torch.save(models.build(cfg.model, spec).state_dict(), tmp_path / "w.pt")
    # digits: (1, 8, 8), 10 classes
    model_checks.check_finetuning(cfg, False, model_checks.input_before_reading(cfg.data))
    with pytest.raises(ConfigError, match="must be a list of module-name prefixes"):
        typed("model=custom", f"model._target_={NET}", "+model.freeze=features")
