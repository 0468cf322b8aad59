"""Any optimiser and LR scheduler by `_target_` (`optim._target_`, `optim.args`,
`optim.scheduler`, `optim.scheduler_interval`), in process: built from composed configs with
model.freeze and optim.param_groups, stepped as the loop steps them and compared with torch's own
schedule, restored from checkpoint files, refused by pre-flight in one line, and one job trained
in process with the lr it logs. The CLI's refusals and a killed StepLR job resumed:
tests/e2e/test_optim_target.py.
"""

from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from torch import nn
from torch.optim import lr_scheduler

from tests.conftest import LAUNCHER_VARS, composed, history, new_store, runs_in, typed
from tests.unit.test_job import SMALL
from train.app import run
from train.config.groups import ConfigError, TrainConfig
from train.engine import checkpoint, checkpoint_folder, checkpoint_match, optim
from train.engine.monitor import direction
from train.engine.state import GradScaler, TrainState
from train.launch import model_checks, preflight
from train.models import build as models
from train.models import finetune
from train.report.metrics import Reduced

ADADELTA = ("optim._target_=torch.optim.Adadelta", "+optim.args.rho=0.8", "optim.lr=1.0")
STEPLR = ("optim.scheduler._target_=torch.optim.lr_scheduler.StepLR",
          "+optim.scheduler.step_size=2", "+optim.scheduler.gamma=0.5")
GROUPS = ("model=mlp", "model.width=16", "model.freeze=[1]",
          "optim.param_groups=[{prefix: 6, lr_scale: 0.1, weight_decay: 0}]")


def _built(cfg: TrainConfig, steps_per_epoch: int = 4) -> TrainState:
    """The model (digits: 1x8x8, 10 classes), frozen, its optimiser and scheduler as
    train/engine/state.py builds them (without DDP: one process, no ranks)."""
    torch.manual_seed(0)
    model = models.build(cfg.model, models.InputSpec(1, 8, 10))
    finetune.freeze(model, cfg.model.freeze)
    optimizer = optim.build_optimizer(cfg.optim, model)
    peaks = [g["lr"] for g in optimizer.param_groups]
    scheduler = optim.build_scheduler(
        cfg.optim, optimizer, steps_per_epoch, cfg.trainer.epochs, cfg.trainer.max_steps,
        direction(cfg.trainer.monitor, cfg.trainer.monitor_mode))
    return TrainState(model, model, optimizer, scheduler, GradScaler(torch.device("cpu"), False),
                      scheduler_interval=optim.interval(cfg.optim), peak_lrs=peaks)


def _train_epochs(state: TrainState, epochs: int, steps: int, monitor: str = "val/loss",
                  vals: list[Reduced | None] | None = None) -> list[list[float]]:
    """The lr of every group at each optimiser step, as train/engine/loop.py steps them."""
    seen = []
    for epoch in range(epochs):
        for _ in range(steps):
            seen.append([g["lr"] for g in state.optimizer.param_groups])
            state.optimizer.zero_grad()
            state.model(torch.randn(4, 1, 8, 8)).sum().backward()
            state.optimizer.step()
            if state.scheduler_interval == "step":
                state.scheduler.step()
        optim.step_at_epoch_end(state.scheduler, state.scheduler_interval,
                                vals[epoch] if vals else None, monitor)
    return seen


def _same(seen: list[list[float]], expected: list[list[float]]) -> None:
    """Each step's lrs, group by group, as torch's own schedule gives them."""
    torch.testing.assert_close(torch.tensor(seen, dtype=torch.float64),
                               torch.tensor(expected, dtype=torch.float64))


# -- building from config ------------------------------------------------------------------------

def test_adadelta_and_steplr_with_param_groups_and_freeze_follow_torchs_schedule() -> None:
    cfg = typed(*GROUPS, *ADADELTA, *STEPLR, "optim.weight_decay=0.01", "trainer.epochs=5")
    state = _built(cfg)
    assert isinstance(state.optimizer, torch.optim.Adadelta)
    assert isinstance(state.scheduler, lr_scheduler.StepLR)
    assert state.scheduler_interval == "epoch"  # a scheduler of the user's: per epoch
    rest, head = state.optimizer.param_groups
    frozen = state.module[1].weight
    assert all(p is not frozen for g in (rest, head) for p in g["params"])
    assert (rest["lr"], rest["weight_decay"], rest["rho"]) == (1.0, 0.01, 0.8)
    assert (head["lr"], head["weight_decay"], head["rho"]) == (pytest.approx(0.1), 0.0, 0.8)

    seen = _train_epochs(state, epochs=5, steps=4)
    # torch's StepLR on the same groups, stepped once per epoch.
    reference = torch.optim.Adadelta([{"params": [torch.zeros(1)], "lr": 1.0},
                                      {"params": [torch.zeros(1)], "lr": 0.1}])
    steplr = lr_scheduler.StepLR(reference, step_size=2, gamma=0.5)
    expected = []
    for _ in range(5):
        expected += [[g["lr"] for g in reference.param_groups]] * 4
        reference.step()
        steplr.step()
    _same(seen, expected)
    assert [row[0] for row in seen[::4]] == [1.0, 1.0, 0.5, 0.5, 0.25]
    # After the fifth epoch's step: 1.0 x 0.5 ** (5 // 2), and the group's tenth of it.
    assert state.learning_rates(cfg.optim.lr) == pytest.approx({"lr": 0.25, "lr/6": 0.025})


def test_onecycle_steps_per_optimiser_step_over_the_jobs_steps_keeping_the_groups_scales() -> None:
    cfg = typed(*GROUPS, "optim._target_=torch.optim.SGD", "+optim.args.momentum=0.9",
                "optim.lr=0.4", "optim.scheduler._target_=torch.optim.lr_scheduler.OneCycleLR",
                "optim.scheduler_interval=step", "trainer.epochs=3")
    state = _built(cfg, steps_per_epoch=5)
    assert state.scheduler_interval == "step"
    # max_lr and total_steps were filled: each group's lr, and 3 epochs x 5 optimiser steps.
    assert state.scheduler.total_steps == 15
    seen = _train_epochs(state, epochs=3, steps=5)  # one more step would be refused by torch

    reference = torch.optim.SGD([{"params": [torch.zeros(1)], "lr": 0.4},
                                 {"params": [torch.zeros(1)], "lr": 0.04}], momentum=0.9)
    onecycle = lr_scheduler.OneCycleLR(reference, max_lr=[0.4, 0.04], total_steps=15)
    expected = []
    for _ in range(15):
        expected.append([g["lr"] for g in reference.param_groups])
        reference.step()
        onecycle.step()
    _same(seen, expected)
    assert max(row[0] for row in seen) == pytest.approx(0.4, rel=0.01)  # optim.lr: the peak
    assert [b / a for a, b in seen] == pytest.approx([0.1] * 15)  # lr_scale kept


def _val(loss: float, accuracy: float) -> Reduced:
    return Reduced({"loss": loss, "accuracy": accuracy}, samples=10)


@pytest.mark.parametrize(("monitor", "vals"), [
    ("val/loss", [(1.0, 0.5), (0.9, 0.5), (0.95, 0.5), (0.95, 0.5), (0.8, 0.5)]),
    ("val/accuracy", [(1.0, 0.5), (1.0, 0.6), (1.0, 0.55), (1.0, 0.55), (1.0, 0.7)]),
])
def test_plateau_reduces_the_lr_when_trainer_monitor_stops_improving(
        monitor: str, vals: list[tuple[float, float]]) -> None:
    cfg = typed("model=mlp", "optim.lr=0.2", f"trainer.monitor={monitor}",
                "optim.scheduler._target_=torch.optim.lr_scheduler.ReduceLROnPlateau",
                "+optim.scheduler.patience=1", "+optim.scheduler.factor=0.5")
    state = _built(cfg)
    # mode filled from trainer.monitor: min for a loss, max for accuracy
    assert state.scheduler.mode == ("min" if monitor == "val/loss" else "max")
    # Epochs 2 and 4 do not improve on epoch 1 (patience 1): the lr halves after epoch 4;
    # epoch 3, not validated (None), does not count.
    reduced: list[Reduced | None] = [_val(*v) for v in vals]
    reduced.insert(3, None)
    seen = _train_epochs(state, epochs=6, steps=1, monitor=monitor, vals=reduced)
    assert [row[0] for row in seen] == pytest.approx([0.2, 0.2, 0.2, 0.2, 0.2, 0.1])
    assert state.learning_rates(0.2)["lr"] == pytest.approx(0.1)


def test_a_users_optimiser_class_and_function_are_built_by_dotted_path(user_path: None) -> None:
    model = nn.Linear(2, 1, bias=False)
    with torch.no_grad():
        model.weight.copy_(torch.tensor([[1.0, -2.0]]))
    cfg = typed("optim._target_=userpkg.optim.HalfSGD", "+optim.args.share=0.25", "optim.lr=0.5",
                "optim.weight_decay=0", "optim.schedule=constant")
    optimizer = optim.build_optimizer(cfg.optim, model)
    assert type(optimizer).__name__ == "HalfSGD" and optimizer.share == 0.25
    model(torch.tensor([[3.0, 1.0]])).sum().backward()  # grad = input
    optimizer.step()  # w - 0.25 x 0.5 x grad
    assert model.weight.detach()[0].tolist() == pytest.approx([1.0 - 0.125 * 3, -2.0 - 0.125])
    # A function that returns an optimiser; it takes no weight_decay, so none is passed.
    plain = optim.build_optimizer(typed("optim._target_=userpkg.optim.plain_sgd").optim, model)
    assert type(plain) is torch.optim.SGD and plain.param_groups[0]["lr"] == 0.05


# -- checkpoints -------------------------------------------------------------------------------

SCHEDULERS = {
    "StepLR": (STEPLR, "epoch"),
    "MultiStepLR": (("optim.scheduler._target_=torch.optim.lr_scheduler.MultiStepLR",
                     "+optim.scheduler.milestones=[1,3]"), "epoch"),
    "OneCycleLR": (("optim.scheduler._target_=torch.optim.lr_scheduler.OneCycleLR",
                    "optim.scheduler_interval=step"), "step"),
    "ReduceLROnPlateau": (("optim.scheduler._target_=torch.optim.lr_scheduler.ReduceLROnPlateau",
                           "+optim.scheduler.patience=0"), "epoch"),
}


@pytest.mark.parametrize("name", sorted(SCHEDULERS))
def test_the_scheduler_state_comes_back_from_a_checkpoint_and_continues_the_schedule(
        name: str, tmp_path: Path) -> None:
    """Saved as a checkpoint file (train/engine/checkpoint_folder.py's `save`), read back with
    weights_only, restored into a freshly built state: the rest of the schedule is the one the
    uninterrupted job follows."""
    overrides, every = SCHEDULERS[name]
    cfg = typed("model=mlp", "trainer.epochs=6", "trainer.monitor=val/loss", *overrides)
    vals: list[Reduced | None] = [_val(loss, 0.5) for loss in (1.0, 0.9, 0.95, 0.97, 0.99, 1.0)]
    state = _built(cfg)
    assert state.scheduler_interval == every
    _train_epochs(state, epochs=2, steps=4, vals=vals)
    uninterrupted = copy.deepcopy(state)
    later = _train_epochs(uninterrupted, epochs=4, steps=4, vals=vals[2:])

    checkpoint_folder.save(tmp_path, {"model": state.module.state_dict(),
                               "optimizer": state.optimizer.state_dict(),
                               "scheduler": state.scheduler.state_dict(), "scaler": {},
                               "epoch": 2, "step": 8, "batch_in_epoch": 0, "ranks": [None]}, 2)
    resumed = checkpoint_folder.find(str(tmp_path), tmp_path)
    assert resumed is not None
    fresh = _built(cfg)
    checkpoint.restore(fresh, resumed, rank=0, world_size=1)
    assert type(fresh.scheduler) is type(state.scheduler)
    assert fresh.scheduler.last_epoch == state.scheduler.last_epoch  # not stepped again
    _same(_train_epochs(fresh, epochs=4, steps=4, vals=vals[2:]), later)


def test_a_checkpoint_of_another_optimiser_or_scheduler_is_refused() -> None:
    def stored(*overrides: str, drop: tuple[str, ...] = ()) -> dict[str, str]:
        config = preflight.config_dict(typed(*overrides))
        for key in drop:
            del config["optim"][key]
        return {"config": yaml.safe_dump(config)}

    ours = preflight.config_dict(typed())
    assert checkpoint_match.mismatch(stored(*STEPLR), ours, 1) == (
        "optim.scheduler._target_='torch.optim.lr_scheduler.StepLR' there, None here")
    adadelta = preflight.config_dict(typed("optim._target_=torch.optim.Adadelta"))
    assert checkpoint_match.mismatch(stored(), adadelta, 1) == (
        "optim._target_=None there, 'torch.optim.Adadelta' here")
    # The scheduler's arguments may change (its state holds those it was built with).
    assert checkpoint_match.mismatch(stored(*STEPLR), preflight.config_dict(typed(
        *STEPLR, "optim.scheduler.step_size=5")), 1) is None
    # A checkpoint from before these keys continues with the built-in optimiser and schedule.
    old = stored(drop=("_target_", "args", "scheduler", "scheduler_interval"))
    assert checkpoint_match.mismatch(old, ours, 1) is None


# -- pre-flight ----------------------------------------------------------------------------------

@pytest.mark.parametrize(("overrides", "expected"), [
    (("optim._target_=torch.optim.Adadeltaa",),
     "optim._target_='torch.optim.Adadeltaa': 'torch.optim' "),
    (("optim._target_=nosuchpkg.Optim",), "optim._target_='nosuchpkg.Optim': no module named "
                                          "'nosuchpkg' is found"),
    (("optim._target_=torch.nn.Linear",), "is the class torch.nn.modules.linear.Linear (bases: "
                                          "Module), not a torch.optim.Optimizer"),
    (("optim._target_=userpkg.optim.not_an_optimiser",), "returned a dict"),
    (("optim._target_=torch.optim.Adadelta", "+optim.args.momentum=0.9"),
     "calling torch.optim.Adadelta(<the model's parameter groups>, lr=0.05, "
     "weight_decay=0.0005, momentum=0.9) failed: TypeError: "),
    (("optim._target_=torch.optim.Adadelta",
      "optim.scheduler._target_=torch.optim.lr_scheduler.OneCycleLR"),
     "failed: ValueError: optimizer must support momentum or beta1"),
    (("optim.scheduler._target_=torch.optim.lr_scheduler.StepLR",),
     "missing 1 required positional argument: 'step_size'"),
    (("optim.scheduler._target_=torch.optim.SGD",), "optim.scheduler._target_='torch.optim.SGD' "
                                                    "is the class torch.optim.sgd.SGD (bases: "
                                                    "Optimizer), not a torch.optim.lr_scheduler."
                                                    "LRScheduler"),
    (("optim.scheduler._target_=torch.optim.lr_scheduler.ReduceLROnPlateau",
      "optim.scheduler_interval=step"), "set optim.scheduler_interval=epoch"),
    (("+optim.args.rho=0.9",), "optim.args (['rho']) are the arguments of optim._target_'s "
                               "class, which is not set"),
    (("optim._target_=torch.optim.Adadelta", "+optim.args.lr=0.9"),
     "optim.args.lr is the service's: set optim.lr"),
    (("+optim.scheduler.step_size=3",), "optim.scheduler.step_size is set but "
                                        "optim.scheduler._target_ is not"),
    (("optim.scheduler_interval=batch",), "optim.scheduler_interval='batch'; choose one of "
                                          "['epoch', 'step']"),
    ((*STEPLR, "+optim.scheduler.optimizer=x"), "optim.scheduler.optimizer: the service passes"),
])
def test_preflight_refuses_optimisers_and_schedulers_in_one_line(
        user_path: None, overrides: tuple[str, ...], expected: str) -> None:
    cfg = typed("model=mlp", *overrides)
    with pytest.raises(ConfigError) as info:
        preflight.validate(cfg, 1)
        model_checks.check_optimiser(cfg, model_checks.known_input(cfg.data))
    assert expected in str(info.value)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("data", [(), ("data=custom", "data.train._target_=x.Y")])
def test_preflight_builds_them_on_the_models_groups_or_a_stand_in(user_path: None,
                                                                  data: tuple[str, ...]) -> None:
    """With the data's shape known, on the model on the meta device with its groups (a good
    config passes); a custom data set's shape is not known before it is read: a stand-in."""
    cfg = typed(*GROUPS, *ADADELTA, *STEPLR, *data)
    model_checks.check_optimiser(cfg, None if data else model_checks.known_input(cfg.data))
    bad = typed(*GROUPS, "optim._target_=torch.optim.Adadelta", "+optim.args.rho=2", *data)
    with pytest.raises(ConfigError, match="Invalid rho value: 2"):
        model_checks.check_optimiser(bad, None if data else model_checks.known_input(bad.data))


# -- a job -------------------------------------------------------------------------------------

FIVE_EPOCHS = (*SMALL, *ADADELTA, *STEPLR, "trainer.epochs=5",
               "optim.param_groups=[{prefix: '3', lr_scale: 0.1}]",
               # a checkpoint at every logging step (2 steps; 5 per epoch), all of them kept
               "trainer.checkpoint_interval_min=0", "trainer.keep_checkpoints=100")


@pytest.fixture(scope="module")
def five_epochs(tmp_path_factory: pytest.TempPathFactory, store_template: Path
                ) -> tuple[str, Path]:
    """One 5-epoch job with Adadelta and StepLR (the store's uri, its directory), shared by
    the tests below that read its run or resume from its checkpoints."""
    tmp = tmp_path_factory.mktemp("five-epochs")
    uri = new_store(tmp / "mlflow.db", store_template)
    with pytest.MonkeyPatch.context() as env:  # started as on a login node (no_launcher_env)
        for key in [*LAUNCHER_VARS, *(k for k in os.environ if k.startswith("SLURM_"))]:
            env.delenv(key, raising=False)
        env.setenv("MLFLOW_TRACKING_URI", "")  # recorded: mlflow.set_tracking_uri's value is
        env.delenv("MLFLOW_TRACKING_URI")      # undone with the rest (no_leaked_tracking_uri)
        run(composed(*FIVE_EPOCHS, f"tracking.uri={uri}"), str(tmp / "job"),
            "python -m train (test)")
    return uri, tmp / "job"


def test_a_job_with_adadelta_and_steplr_logs_steplrs_lr_each_epoch(
        five_epochs: tuple[str, Path]) -> None:
    uri, _ = five_epochs
    [mlflow_run] = runs_in(uri)
    run_id = mlflow_run.info.run_id
    assert mlflow_run.info.status == "FINISHED"
    lrs = history(uri, run_id, "lr")
    assert [step for step, _ in lrs] == [1, 2, 3, 4, 5]  # epochs, 1-based
    assert [v for _, v in lrs] == pytest.approx([1.0, 1.0, 0.5, 0.5, 0.25])
    assert [v for _, v in history(uri, run_id, "lr/3")] == pytest.approx(
        [0.1, 0.1, 0.05, 0.05, 0.025])
    params: dict[str, Any] = mlflow_run.data.params
    assert params["optim._target_"] == "torch.optim.Adadelta"
    assert params["optim.scheduler._target_"] == "torch.optim.lr_scheduler.StepLR"
    assert params["optim.scheduler_interval"] == "epoch"


@pytest.mark.parametrize(("step", "where"), [(10, "at the end of epoch 2"),
                                             (12, "mid-epoch 3, after 2 of its 5 steps")])
def test_a_job_resumed_from_a_checkpoint_steps_the_per_epoch_scheduler_once_per_epoch(
        five_epochs: tuple[str, Path], tmp_path: Path, store_template: Path,
        no_launcher_env: None, step: int, where: str) -> None:
    """An epoch-end checkpoint is taken after the epoch's scheduler step, a mid-epoch one
    before it: either way the resumed job goes on with StepLR's lr, no epoch's step twice or
    left out."""
    _, first = five_epochs
    uri = new_store(tmp_path / "mlflow.db", store_template)
    resumed_from = first / "checkpoints" / f"step-{step:09d}.pt"
    saved = checkpoint_folder.load_newest([resumed_from])
    assert saved is not None and saved.state["step"] == step
    assert (saved.state["epoch"], saved.state["batch_in_epoch"]) == (
        (2, 0) if step == 10 else (2, 2))
    assert saved.state["scheduler"]["last_epoch"] == 2  # after epochs 1 and 2: not epoch 3's

    run(composed(*FIVE_EPOCHS, f"tracking.uri={uri}", f"trainer.resume={resumed_from}"),
        str(tmp_path / "second"), "python -m train (test)")
    [second] = runs_in(uri)  # a run of its own: another directory, another store
    lrs = history(uri, second.info.run_id, "lr")
    assert [s for s, _ in lrs] == [3, 4, 5], where
    assert [v for _, v in lrs] == pytest.approx([0.5, 0.5, 0.25]), where
    folder = tmp_path / "second" / "checkpoints"
    final = checkpoint_folder.load_newest(checkpoint_folder.candidates(folder))
    assert final is not None and final.state["scheduler"]["last_epoch"] == 5

