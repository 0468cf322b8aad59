"""Your own model and loss from config: `model=custom model._target_=...` and `trainer.loss`.

The model classes live in tests/userpkg/models.py, a package that is not part of train/ and is
found only through PYTHONPATH (tests/ on it), as a user's project would be. Fast tests compose,
build and check in process; the slow ones train through the real CLI, locally, under torchrun
and on the local Slurm cluster, and read the real MLflow store back.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from hydra import compose, initialize_config_dir

from tests.conftest import REPO, history, kill_job_after_checkpoints, run_train, runs_in
from tests.test_slurm import cluster, on_slurm, slurm_job  # noqa: F401 - the fixture
from train.config.groups import ConfigError, CustomModelConfig
from train.config.schema import register_schema, to_container, to_typed
from train.engine import loop
from train.launch import preflight
from train.models import build as models

USER_PATH = str(REPO / "tests")
"""What a user puts on PYTHONPATH: the directory that holds their package (userpkg)."""
NET = "userpkg.models.TinyConvNet"
CUSTOM = ("model=custom", f"model._target_={NET}", "+model.depth=3")


def composed(*overrides: str):
    register_schema()
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        return compose(config_name="train", overrides=list(overrides))


def typed(*overrides: str):
    return to_typed(to_container(composed(*overrides)))


@pytest.fixture
def user_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """This process sees the user's package, as `PYTHONPATH=tests` gives the CLI."""
    monkeypatch.syspath_prepend(USER_PATH)


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


@pytest.mark.slow  # reads the store back (imports mlflow)
@pytest.mark.parametrize("flags", [(), ("-m",)], ids=["run", "sweep"])
def test_cli_refuses_a_custom_model_without_target(flags: tuple[str, ...],
                                                   store: dict[str, str]) -> None:
    out = run_train(*flags, "model=custom", "trainer.epochs=1", env=store, timeout=60)
    assert out.returncode == 2, out.stderr
    assert "error: model._target_ must be set" in out.stderr and "Traceback" not in out.stderr
    assert runs_in(store["MLFLOW_TRACKING_URI"]) == []


def test_cfg_job_shows_the_custom_model_and_the_loss() -> None:
    out = run_train("--cfg", "job", *CUSTOM, "+trainer.loss.label_smoothing=0.1", timeout=60)
    assert out.returncode == 0, out.stderr
    printed = yaml.safe_load(out.stdout)
    assert printed["model"] == {"_target_": NET, "depth": 3}
    assert printed["trainer"]["loss"] == {"_target_": "torch.nn.CrossEntropyLoss",
                                          "label_smoothing": 0.1}


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
    criterion = loop.Criterion(torch.nn.CrossEntropyLoss(), 10, "model=custom x.Y")
    assert criterion.top_k == 5
    with pytest.raises(loop.ModelOutputError,
                       match=r"returns shape \(4, 3\) for inputs of shape \(4, 1, 8, 8\); "
                             r"training needs \(batch, num_classes\) = \(4, 10\)"):
        criterion(torch.zeros(4, 3), torch.zeros(4, dtype=torch.long), torch.zeros(4, 1, 8, 8))
    assert loop.Criterion(torch.nn.CrossEntropyLoss(), 5, "m").top_k is None


# -- bad input: refused by pre-flight, one line --------------------------------------------------

BAD_INPUTS = [
    (("model=custom", "model._target_=nopkg.models.Net"),
     ["no module named 'nopkg' is found", "PYTHONPATH=", "sys.path=["]),
    (("model=custom", "model._target_=userpkg.models.NotAModel"),
     ["is the class userpkg.models.NotAModel (bases: object), not a torch.nn.Module"]),
    (("model=custom", "model._target_=userpkg.models.ThreeScores"),
     ["returns shape (2, 3) for inputs of shape (2, 1, 8, 8)", "(batch, num_classes) = (2, 10)"]),
    ((*CUSTOM, "+model.dept=4"), ["got an unexpected keyword argument 'dept'"]),
    (("trainer.loss._target_=torch.nn.CrossEntropyLos",),
     ["trainer.loss._target_='torch.nn.CrossEntropyLos'", "has no 'CrossEntropyLos'"]),
    (("trainer.loss._target_=math.pi",), ["is a float (3.14", "not a loss class or function"]),
    (("+trainer.loss.reduction=none",), ["gives (2,) for a batch, not one value"]),
]


@pytest.mark.parametrize(("overrides", "expected"), BAD_INPUTS)
def test_preflight_refuses_bad_models_and_losses(user_path: None, overrides: tuple[str, ...],
                                                 expected: list[str]) -> None:
    with pytest.raises(ConfigError) as info:
        preflight.check_model(typed(*overrides))
    message = str(info.value)
    assert "\n" not in message
    for part in expected:
        assert part in message


@pytest.mark.slow  # each imports torch in a new process
@pytest.mark.parametrize(("overrides", "expected"), [BAD_INPUTS[0], BAD_INPUTS[2], BAD_INPUTS[5]])
def test_cli_refuses_bad_input_before_any_rank_starts(store: dict[str, str],
                                                      overrides: tuple[str, ...],
                                                      expected: list[str]) -> None:
    out = run_train(*overrides, "distributed.nproc_per_node=2", "trainer.epochs=1",
                    env={**store, "PYTHONPATH": USER_PATH}, timeout=120)
    assert out.returncode == 2, out.stderr
    assert all(part in out.stderr for part in expected), out.stderr
    assert "Traceback" not in out.stderr and "[rank" not in out.stderr
    assert runs_in(store["MLFLOW_TRACKING_URI"]) == []


# -- end to end ----------------------------------------------------------------------------------

def _assert_custom_run(uri: str, run, epochs: int, world_size: int) -> None:
    assert run.info.status == "FINISHED"
    assert run.data.tags["world_size"] == str(world_size)
    params = run.data.params
    assert params["model._target_"] == NET and params["model.depth"] == "3"
    assert params["trainer.loss._target_"] == "torch.nn.CrossEntropyLoss"
    for key in ("train/loss", "val/accuracy", "val/accuracy_top5", "train/accuracy_top5"):
        assert [s for s, _ in history(uri, run.info.run_id, key)] == list(range(epochs)), key
    assert {v for _, v in history(uri, run.info.run_id, "val/samples")} == {359.0}
    for (_, top1), (_, top5) in zip(history(uri, run.info.run_id, "val/accuracy"),
                                    history(uri, run.info.run_id, "val/accuracy_top5"),
                                    strict=True):
        assert 0 <= top1 <= top5 <= 1


@pytest.mark.slow
def test_user_model_trains_resumes_and_loads_back(store: dict[str, str], tmp_path: Path,
                                                  user_path: None) -> None:
    """Two local ranks: killed after two checkpoints, run again, one run with every epoch once;
    the logged model loads where the user's package is importable, and only there."""
    env = {**store, "PYTHONPATH": USER_PATH}
    out_dir = tmp_path / "job"
    kill_job_after_checkpoints(out_dir, env, 2, "distributed.nproc_per_node=2", *CUSTOM,
                               "trainer.epochs=4")
    result = run_train("distributed.nproc_per_node=2", *CUSTOM, "trainer.epochs=4",
                       f"hydra.run.dir={out_dir}", env=env)
    assert result.returncode == 0, result.stderr
    assert "resumed from" in result.stderr and "continuing MLflow run" in result.stderr
    uri = store["MLFLOW_TRACKING_URI"]
    [run] = runs_in(uri)
    assert run.data.tags["restarts"] == "1"
    _assert_custom_run(uri, run, epochs=4, world_size=2)

    import mlflow.pytorch

    mlflow.set_tracking_uri(uri)
    model = mlflow.pytorch.load_model(f"runs:/{run.info.run_id}/model")
    assert type(model).__module__ == "userpkg.models"
    assert model(torch.randn(3, 1, 8, 8)).shape == (3, 10)
    without = subprocess.run(
        [sys.executable, "-c", "import mlflow.pytorch, sys; "
         f"mlflow.set_tracking_uri({uri!r}); mlflow.pytorch.load_model(sys.argv[1])",
         f"runs:/{run.info.run_id}/model"], cwd=tmp_path, capture_output=True, text=True,
        timeout=120)
    assert without.returncode != 0 and "No module named 'userpkg'" in without.stderr


@pytest.mark.slow
def test_user_model_under_torchrun(store: dict[str, str], tmp_path: Path) -> None:
    result = run_train("--nproc_per_node=2", "-m", "train", *CUSTOM, "trainer.epochs=1",
                       f"hydra.run.dir={tmp_path}/job", env={**store, "PYTHONPATH": USER_PATH},
                       module=("-m", "torch.distributed.run"))
    assert result.returncode == 0, result.stderr
    uri = store["MLFLOW_TRACKING_URI"]
    [run] = runs_in(uri)
    assert run.data.tags["launcher"] == "torchrun"
    _assert_custom_run(uri, run, epochs=1, world_size=2)


@pytest.mark.slow
def test_label_smoothing_changes_the_training_loss(store: dict[str, str],
                                                   tmp_path: Path) -> None:
    """The same seed, data and model: only the loss differs."""
    uri = store["MLFLOW_TRACKING_URI"]
    losses = {}
    for name, extra in (("plain", ()), ("smooth", ("+trainer.loss.label_smoothing=0.1",))):
        result = run_train("trainer.epochs=1", "model=mlp", "tracking.log_model=false",
                           f"tracking.run_name={name}", f"hydra.run.dir={tmp_path}/{name}",
                           *extra, env=store)
        assert result.returncode == 0, result.stderr
    for run in runs_in(uri):
        losses[run.info.run_name] = (history(uri, run.info.run_id, "train/loss")[0][1],
                                     history(uri, run.info.run_id, "val/loss")[0][1])
        if run.info.run_name == "smooth":
            assert run.data.params["trainer.loss.label_smoothing"] == "0.1"
    assert losses["smooth"][0] != pytest.approx(losses["plain"][0], rel=1e-3)
    assert losses["smooth"][1] != pytest.approx(losses["plain"][1], rel=1e-3)


@on_slurm
def test_user_model_on_slurm(cluster: None, store: dict[str, str],  # noqa: F811
                             tmp_path: Path) -> None:
    """PYTHONPATH exported in the submitting shell reaches every rank: sbatch passes the
    environment on (--export=ALL, Slurm's default)."""
    result = slurm_job(tmp_path, *CUSTOM, "cluster.tasks_per_node=2", "trainer.epochs=1",
                       "tracking.log_model=false", env={**store, "PYTHONPATH": USER_PATH})
    assert result.returncode == 0, result.stdout + result.stderr
    uri = store["MLFLOW_TRACKING_URI"]
    [run] = runs_in(uri)
    assert run.data.tags["launcher"] == "submitit"
    _assert_custom_run(uri, run, epochs=1, world_size=2)
