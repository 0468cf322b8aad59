"""Command-line mistakes (issue 14), through Hydra's compose API: one line each. The real
processes and signals: tests/e2e/test_faults_process.py."""

from __future__ import annotations

from pathlib import Path

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
                     "cnn, custom, gpt, hf, mlp, resnet18, torchvision."),
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
    (("data.root=~/images",), "data.root=~/images ^; ~ is not expanded after '=': write "
                              "data.root=$HOME/..., or an absolute path."),
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
    assert app.help_group(["--help", "trainer"]) == "trainer"
    assert app.help_group(["--help"]) is None and app.help_group(["trainer.epochs=1"]) is None
    line = app.unknown_help_topic(["--help", "trainr"])
    assert line is not None and line.startswith("error: --help trainr: no config group trainr; "
                                                "the groups are model, data, optim, ")
    for fine in (["--help", "trainer"], ["--help"], ["-h", "--cfg", "job"],
                 ["--help", "trainer.epochs=1"]):
        assert app.unknown_help_topic(fine) is None, fine


def test_a_first_word_that_is_no_command_gets_a_did_you_mean_and_overrides_go_to_hydra(
        ) -> None:
    from train.__main__ import COMMANDS, commands_help, unknown_command

    assert "did you mean `python -m train sweep`?" in (unknown_command("sweeps") or "")
    assert "did you mean `python -m train prepare-text`?" in (
        unknown_command("prepare_text") or "")
    line = unknown_command("xyzzy") or ""
    assert line.startswith("error: 'xyzzy' is no command") and "did you mean" not in line
    for override in ("trainer.epochs=2", "+model.hidden=3", "~tracking", "-m", "--cfg"):
        assert unknown_command(override) is None, override
    shown = commands_help()
    assert all(f"  {name}" in shown and c.summary in shown for name, c in COMMANDS.items())


def test_every_command_runs_its_modules_main_and_returns_its_exit_code(
        capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    import importlib

    from train.__main__ import COMMANDS, run_command

    for command in COMMANDS.values():
        assert callable(importlib.import_module(command.module).main), command.module
    assert run_command("status", [str(tmp_path)]) == 2  # no heartbeats there: one line
    said = capsys.readouterr().err.strip()
    assert said.startswith(f"error: {tmp_path} is neither a running job's output directory"), said
    assert run_command("stacks", ["--help"]) == 0
    assert capsys.readouterr().out.startswith("usage: python -m train stacks ")
