"""Your own model and loss from config: `model=custom model._target_=...` and `trainer.loss`.

The model classes live in tests/userpkg/models.py, a package that is not part of train/ and is
found only through PYTHONPATH (tests/ on it), as a user's project would be. Composed, built and
checked here in process; trained through the real CLI in tests/e2e/test_custom_model.py (locally
and under torchrun) and tests/cluster/test_custom_model.py (on the local Slurm cluster).
"""

from __future__ import annotations

import pytest
import torch

from tests.conftest import typed
from train.config.groups import ConfigError, CustomModelConfig
from train.engine import evaluation
from train.launch import model_checks, preflight
from train.models import build as models
from train.tasks.base import summed
from train.tasks.classification import Classification

NET = "userpkg.models.TinyConvNet"
CUSTOM = ("model=custom", f"model._target_={NET}", "+model.depth=3")


# -- config ------------------------------------------------------------------------------------

def test_custom_model_composes_with_its_own_keys() -> None:
    cfg = typed(*CUSTOM, "+model.width=8")
    assert cfg.model == CustomModelConfig(target=NET, kwargs={"depth": 3, "width": 8})
    preflight.validate(cfg, world_size=1)
    assert typed("model=mlp").model.width == 256  # the built-ins stay typed


@pytest.mark.parametrize(("overrides", "expected"), [
    (("model=custom",), "model._target_ must be set"),
    ((f"+model._target_={NET}",), "model._target_ needs model=custom"),
    (("model=cnn", "+model.blocks=4"), "model.blocks is not a key of the built-in models"),
])
def test_model_config_mistakes_are_one_clear_line(overrides: tuple[str, ...],
                                                  expected: str) -> None:
    with pytest.raises(ConfigError, match=expected):
        typed(*overrides)


# -- building ------------------------------------------------------------------------------------

def test_constructor_arguments_are_filled_from_the_data(user_path: None) -> None:
    spec = models.InputSpec.of((3, 16, 16), 12)
    net = models.build(CustomModelConfig(NET, {"depth": 4}), spec)
    assert (net.num_classes, net.in_channels, net.depth) == (12, 3, 4)
    assert net(torch.zeros(2, 3, 16, 16)).shape == (2, 12)
    flat = models.build(CustomModelConfig("userpkg.models.FlatNet"), spec)
    assert (flat.channels, flat.image_size, flat.num_classes) == (3, 16, 12)
    # What the user set wins over what the data says.
    mine = models.build(CustomModelConfig(NET, {"num_classes": 5}), spec)
    assert mine.num_classes == 5
    own = models.build(CustomModelConfig("userpkg.models.NamedItsOwnWay", {"n_classes": 4}), spec)
    assert own(torch.zeros(2, 3, 16, 16)).shape == (2, 4)  # set with +model.n_classes=4
    factory = models.build(CustomModelConfig("userpkg.models.tiny_conv_net"), spec)
    assert factory.depth == 1 and factory.num_classes == 12


def test_output_check_runs_on_meta_or_else_on_one_cpu_sample(user_path: None) -> None:
    spec = models.InputSpec.of((1, 8, 8), 10)
    models.check_output(CustomModelConfig(NET, {"depth": 2}), spec)  # meta device
    models.check_output(CustomModelConfig("userpkg.models.ChecksOnTheHost"), spec)  # CPU


def test_label_smoothing_changes_the_loss() -> None:
    logits = torch.tensor([[2.0, 0.5, -1.0], [0.1, 0.2, 3.0]])
    labels = torch.tensor([0, 2])
    plain = models.build_loss({"_target_": "torch.nn.CrossEntropyLoss"})
    smooth = models.build_loss({"_target_": "torch.nn.CrossEntropyLoss", "label_smoothing": 0.1})
    expected = torch.nn.functional.cross_entropy(logits, labels, label_smoothing=0.1)
    assert smooth(logits, labels).item() == pytest.approx(expected.item())
    assert smooth(logits, labels).item() > plain(logits, labels).item()


def test_the_first_batch_checks_the_models_output() -> None:
    task = Classification()
    task.setup(summed(torch.nn.CrossEntropyLoss()), 10, [str(i) for i in range(10)])
    assert task.top_k == 5
    with pytest.raises(evaluation.ModelOutputError,
                       match=r"the model returns shape \(4, 3\) for inputs of shape "
                             r"\(4, 1, 8, 8\); task=classification needs \(batch, num_classes\)"
                             r" = \(4, 10\)"):
        evaluation.check_output(task, torch.zeros(4, 3), torch.zeros(4, dtype=torch.long),
                           torch.zeros(4, 1, 8, 8))
    task.setup(summed(torch.nn.CrossEntropyLoss()), 5, [str(i) for i in range(5)])
    assert task.top_k is None


# -- bad input: refused by pre-flight, one line --------------------------------------------------

BAD_INPUTS = [
    (("model=custom", "model._target_=nopkg.models.Net"),
     ["no module named 'nopkg' is found", "PYTHONPATH=", "sys.path=["]),
    (("model=custom", "model._target_=userpkg.models.NotAModel"),
     ["is the class userpkg.models.NotAModel (bases: object), not a torch.nn.Module"]),
    (("model=custom", "model._target_=userpkg.models.ThreeScores"),
     ["returns shape (2, 3) for inputs of shape (2, 1, 8, 8)", "(batch, num_classes) = (2, 10)"]),
    ((*CUSTOM, "+model.dept=4"), ["got an unexpected keyword argument 'dept'"]),
    (("model=custom", "model._target_=userpkg.models.NamedItsOwnWay"),
     ["its constructor needs n_classes, which nothing sets", "The data fills only num_classes, "
      "in_channels, channels, image_size", "+model.n_classes=<value>"]),
    (("trainer.loss._target_=torch.nn.CrossEntropyLos",),
     ["trainer.loss._target_='torch.nn.CrossEntropyLos'", "has no 'CrossEntropyLos'"]),
    (("trainer.loss._target_=math.pi",), ["is a float (3.14", "not a loss class or function"]),
    (("+trainer.loss.reduction=none",), ["gives (2,) for a batch, not one value"]),
]


@pytest.mark.parametrize(("overrides", "expected"), BAD_INPUTS)
def test_preflight_refuses_bad_models_and_losses(user_path: None, overrides: tuple[str, ...],
                                                 expected: list[str]) -> None:
    with pytest.raises(ConfigError) as info:
        model_checks.check_model(typed(*overrides))
    message = str(info.value)
    assert "\n" not in message
    for part in expected:
        assert part in message
