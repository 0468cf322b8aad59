"""Hydra multirun sweeps: one parent MLflow run, one child run per job.

The local launcher runs in this process (Hydra's own config loader and callbacks, a task
function that records what each job got); the real CLI: tests/e2e/test_sweeps.py.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hydra.core.global_hydra import GlobalHydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import HydraContext, RunMode

from tests.conftest import hydra_conf

# -- in process: the local launcher ------------------------------------------------------------


class Sweep:
    """A multirun as Hydra's sweeper drives it: the callback's start, the launcher's batch,
    the callback's end; MLflow replaced by fakes that count what they were asked."""

    def __init__(self, overrides: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                 ) -> None:
        from hydra._internal.callbacks import Callbacks

        from hydra_plugins.train_launcher.local_launcher import TrainLocalLauncher
        from train.tracking import client, sweep

        self.jobs: list[dict[str, Any]] = []
        self.parents: list[tuple[str, dict[str, str]]] = []
        self.ended: list[str] = []
        monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'never.db'}")
        monkeypatch.setattr(client, "prepare", lambda cfg: "7")
        monkeypatch.setattr(sweep, "start_parent_run", self._start_parent)
        monkeypatch.setattr(sweep, "end_parent_run", self._end_parent)
        loader = GlobalHydra.instance().config_loader()
        self.config = loader.load_configuration(
            "train", [*overrides, f"hydra.sweep.dir={tmp_path / 'sweep'}",
                      "hydra/job_logging=none", "hydra/hydra_logging=none"], RunMode.MULTIRUN)
        self.callbacks = Callbacks(self.config)
        self.launcher = TrainLocalLauncher()
        self.launcher.setup(hydra_context=HydraContext(loader, self.callbacks),
                            task_function=self._task, config=self.config)

    def _start_parent(self, cfg: Any, experiment_id: str, tags: dict[str, str]) -> str:
        self.parents.append((experiment_id, tags))
        return "parent1"

    def _end_parent(self, cfg: Any, parent_run_id: str, *args: Any, **kwargs: Any) -> dict:
        self.ended.append(parent_run_id)
        return {"children": len(self.jobs), "failed": 0}

    def _task(self, cfg: Any) -> None:
        self.jobs.append({"experiment_id": cfg.tracking.experiment_id,
                          "parent_run_id": cfg.tracking.parent_run_id,
                          "lr": cfg.optim.lr,
                          "overrides": list(HydraConfig.get().overrides.task)})

    def run(self, *job_overrides: list[str]) -> None:
        self.callbacks.on_multirun_start(config=self.config)
        self.launcher.launch([list(o) for o in job_overrides], initial_job_idx=0)
        self.callbacks.on_multirun_end(config=self.config)


@pytest.fixture(name="hydra_conf")
def hydra_conf_fixture() -> Iterator[None]:
    with hydra_conf():
        yield


def test_local_launcher_hands_every_job_the_experiment_and_parent(
        hydra_conf: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    sweep = Sweep(["optim.lr=0.1,0.2", "trainer.epochs=1"], tmp_path, monkeypatch)
    sweep.run(["optim.lr=0.1", "trainer.epochs=1"], ["optim.lr=0.2", "trainer.epochs=1"])
    assert [(j["experiment_id"], j["parent_run_id"], j["lr"]) for j in sweep.jobs] == \
        [("7", "parent1", 0.1), ("7", "parent1", 0.2)]
    # Explicit overrides, appended to what the sweep asked for.
    assert sweep.jobs[0]["overrides"] == ["optim.lr=0.1", "trainer.epochs=1",
                                          "tracking.experiment_id='7'",
                                          "tracking.parent_run_id='parent1'"]
    [(experiment_id, tags)] = sweep.parents  # one parent for the sweep, created once
    assert experiment_id == "7" and tags["sweep.overrides"] == "optim.lr=0.1,0.2 trainer.epochs=1"
    assert sweep.ended == ["parent1"]


def test_one_job_under_multirun_gets_the_experiment_but_no_parent(
        hydra_conf: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    sweep = Sweep(["trainer.epochs=1"], tmp_path, monkeypatch)
    sweep.run(["trainer.epochs=1"])
    assert [(j["experiment_id"], j["parent_run_id"]) for j in sweep.jobs] == [("7", None)]
    assert sweep.parents == [] and sweep.ended == []


def test_a_refused_sweep_starts_no_job_and_no_parent(
        hydra_conf: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    sweep = Sweep(["optim.lr=0.1,-0.1"], tmp_path, monkeypatch)
    with pytest.raises(SystemExit) as exit_info:
        sweep.run(["optim.lr=0.1"], ["optim.lr=-0.1"])
    assert exit_info.value.code == 2
    assert "optim.lr must be positive (got -0.1)" in capsys.readouterr().err
    assert sweep.jobs == [] and sweep.parents == []


def test_without_tracking_no_ids_are_handed(
        hydra_conf: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    sweep = Sweep(["optim.lr=0.1,0.2", "tracking.enabled=false"], tmp_path, monkeypatch)
    sweep.run(["optim.lr=0.1", "tracking.enabled=false"],
              ["optim.lr=0.2", "tracking.enabled=false"])
    assert [(j["experiment_id"], j["parent_run_id"]) for j in sweep.jobs] == [(None, None)] * 2
    assert sweep.parents == []
