"""The real CLI's config handling: `--help` and `--cfg job` (the groups, nothing heavy imported),
and bad input refused before anything starts (exit 2, one line, no run). In process, through
Hydra's compose API: tests/unit/test_config.py."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.conftest import REPO, assert_refused, run_train, runs_in
from tests.unit.test_config import GROUPS


def test_help_lists_groups_without_importing_heavy_modules() -> None:
    out = subprocess.run([sys.executable, "-X", "importtime", "-m", "train", "--help"],
                         cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    for line in ("== Config groups ==", "model: cnn, custom, gpt, hf, mlp, resnet18, torchvision",
                 "data: arrow, cifar10, custom, digits, fashion_mnist, imagefolder, mnist, "
                 "synthetic, tokens",
                 "optim: adamw, sgd"):
        assert line in out.stdout
    imported = {row.rsplit("|", 1)[-1].strip() for row in out.stderr.splitlines()
                if row.startswith("import time:")}
    # The import times were read (else the check below passes on nothing): what --help needs.
    assert {"train", "hydra", "omegaconf"} <= imported, out.stderr[-2000:]
    assert not {"torch", "torchvision", "mlflow"} & imported


def test_one_command_line_lists_its_commands_and_runs_each_under_both_names() -> None:
    """`python -m train --help` (and the `train` console script) names every command in one
    line each, before Hydra's help; each command answers --help under the new form and the
    old `python -m train.<module>` form; a typo gets a did-you-mean and exit 2."""
    from train.__main__ import COMMANDS

    script = str(Path(sys.executable).parent / "train")
    for argv in ([sys.executable, "-m", "train", "--help"], [script, "--help"]):
        shown = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=60)
        assert shown.returncode == 0, shown.stderr
        listed = shown.stdout.index("commands (")
        assert listed < shown.stdout.index("== Config groups ==")
        for name, command in COMMANDS.items():
            assert f"  {name}  " in shown.stdout or f"  {name} " in shown.stdout, name
            assert command.summary in shown.stdout
    for name, command in COMMANDS.items():
        new = run_train(name, "--help", timeout=60)
        assert new.returncode == 0 and new.stdout.strip(), (name, new.stderr[-500:])
        # rerun, diff, eval and predict were never root modules: no older form to keep
        if not command.module.startswith("train.launch."):
            old = run_train("--help", module=("-m", command.module), timeout=60)
            assert old.returncode == 0 and old.stdout == new.stdout, (name, old.stderr[-500:])
    typo = run_train("stauts", "outputs/x", timeout=60)
    assert typo.returncode == 2 and typo.stdout == ""
    assert typo.stderr.strip() == (
        "error: 'stauts' is no command of python -m train and no override (key=value); did you "
        "mean `python -m train status`? `python -m train --help` lists the commands.")


def test_help_of_a_group_shows_its_keys_defaults_and_docs() -> None:
    out = subprocess.run([sys.executable, "-X", "importtime", "-m", "train", "--help",
                          "trainer"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "trainer.epochs=10\n    Passes over the training set.\n" in out.stdout
    assert "trainer.max_steps=null\n" in out.stdout and "optim.lr" not in out.stdout
    imported = {row.rsplit("|", 1)[-1].strip() for row in out.stderr.splitlines()
                if row.startswith("import time:")}
    assert "train" in imported and not {"torch", "mlflow"} & imported
    # The general --help says how to get there (and no longer that README documents it all).
    general = run_train("--help", timeout=60).stdout
    assert "python -m train --help GROUP" in general and "README.md" not in general


def test_cfg_job_prints_the_composed_config() -> None:
    out = run_train("--cfg", "job", "model=mlp", "optim.lr=0.2", timeout=60)
    assert out.returncode == 0, out.stderr
    printed = yaml.safe_load(out.stdout)
    assert printed["model"]["name"] == "mlp"
    assert printed["optim"]["lr"] == 0.2
    assert set(GROUPS) <= set(printed)


@pytest.mark.parametrize(("overrides", "expected"), [
    (("optim.lr=-0.1",), "optim.lr must be positive"),
    (("data.batch_size=63", "distributed.nproc_per_node=2"), "must split evenly over the 2 ranks"),
    (("model.name=vgg",), "choose one of"),
    # These two import torch or torchvision before refusing (seconds each).
    (("distributed.backend=nccl", "distributed.nproc_per_node=2"), "need as many GPUs"),
    (("model=torchvision", "model.name=not_a_net"), "not a torchvision classification model"),
    (("trainer.memory_snapshot=true",), "trainer.memory_snapshot=true records the CUDA "
                                        "allocator's history, but this machine has no GPU"),
    (("model.activation_checkpointing=sometimes",), "choose none, blocks or a number N"),
    (("model=mlp", "model.activation_checkpointing=blocks"),
     "model.activation_checkpointing=blocks: the model has no blocks"),
])
def test_cli_refuses_bad_input_before_anything_starts(store: dict[str, str],
                                                      overrides: tuple[str, ...],
                                                      expected: str) -> None:
    assert_refused(run_train(*overrides, "trainer.epochs=1", env=store, timeout=120),
                   expected, store)


def test_cli_names_the_download_command_for_a_missing_data_set(store: dict[str, str],
                                                               tmp_path: Path) -> None:
    out = run_train("data=mnist", f"data.root={tmp_path / 'nothing'}", env=store, timeout=120)
    assert out.returncode == 2
    assert "MNIST(" in out.stderr and "download=True" in out.stderr
    assert "data.download=true" in out.stderr
    assert runs_in(store["MLFLOW_TRACKING_URI"]) == []


def test_cli_refuses_an_unreachable_tracking_server() -> None:
    from train.distributed.env import free_port

    out = run_train("trainer.epochs=1",
                    env={"MLFLOW_TRACKING_URI": f"http://127.0.0.1:{free_port()}"}, timeout=120)
    assert out.returncode == 2
    assert "cannot be reached" in out.stderr and "make mlflow-server" in out.stderr


def test_unknown_group_option_lists_the_choices() -> None:
    out = run_train("model=vgg", timeout=60)
    assert out.returncode == 2, out.stderr  # what the user typed wrong: exit 2, one line
    [line] = [x for x in out.stderr.splitlines() if x.startswith("error:")]
    assert "Could not find 'model/vgg'" in line and "cnn" in line and "resnet18" in line
    assert "Traceback" not in out.stderr
