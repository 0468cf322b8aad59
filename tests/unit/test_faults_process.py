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
