"""Command-line mistakes (issue 14), through Hydra's compose API: one line each. The real
processes and signals: tests/e2e/test_faults_process.py."""

from __future__ import annotations

import pytest
from hydra.errors import HydraException

from tests.conftest import composed
from train import app
from train.config.groups import ConfigError


def test_an_unknown_key_added_with_plus_is_one_config_error() -> None:
    with pytest.raises(ConfigError) as refused:
        app._typed(composed("+trainer.foo=1"))
    assert str(refused.value) == ("trainer.foo: Key 'foo' not in 'TrainerConfig'. "
                                  "`python -m train --help` lists every setting.")


@pytest.mark.parametrize(("override", "expected"), [
    ("trainer.nope=1", "Could not override 'trainer.nope': Key 'nope' not in 'TrainerConfig'."),
    ("model=nosuch", "In 'train': Could not find 'model/nosuch' Available options in 'model': "
                     "cnn, custom, gpt, mlp, resnet18, torchvision."),
])
def test_a_composition_error_is_one_line(override: str, expected: str) -> None:
    with pytest.raises(HydraException) as failed:
        composed(override)
    assert app.one_line(failed.value) == expected + " `python -m train --help` lists every setting."


@pytest.mark.parametrize(("overrides", "expected"), [
    (("trainer.epoch=1",), "Could not override 'trainer.epoch': Key 'epoch' not in "
                           "'TrainerConfig'; did you mean trainer.epochs?"),
    (("optim.lr0=0.1",), "did you mean optim.lr?"),
    (("model=custom", "model._target_=userpkg.models.TinyConvNet", "model.hidden=32"),
     "Could not override 'model.hidden': Key 'hidden' is not in struct; a key of your own "
     "needs a +: +model.hidden=32."),
    (("data=custom", "data.train._target_=userpkg.data.Lines", "data.train.length=48"),
     "a key of your own needs a +: +data.train.length=48."),
])
def test_an_unknown_key_gets_the_near_key_or_the_plus(overrides: tuple[str, ...],
                                                       expected: str) -> None:
    with pytest.raises(HydraException) as failed:
        composed(*overrides)
    line = app.one_line(failed.value)
    assert expected in line and line.endswith("`python -m train --help` lists every setting.")
    assert "\n" not in line


def test_a_misspelt_key_added_with_plus_gets_the_near_key() -> None:
    with pytest.raises(ConfigError) as refused:
        app._typed(composed("+trainer.epoch=1"))
    assert str(refused.value) == ("trainer.epoch: Key 'epoch' not in 'TrainerConfig'; did you "
                                  "mean trainer.epochs? `python -m train --help` lists every "
                                  "setting.")


def test_every_group_has_help_with_a_doc_for_every_key() -> None:
    from train.config import keys

    for group in keys.groups():
        shown = keys.group_help(group)
        for key, _, doc in keys.fields(group):
            assert doc and f"\n{key}=" in shown, key
    assert app._help_group(["--help", "trainer"]) == "trainer"
    assert app._help_group(["--help"]) is None and app._help_group(["trainer.epochs=1"]) is None
