"""Hydra multirun sweeps: one parent MLflow run, one child run per job.

The fast tests run the local launcher in this process (Hydra's own config loader and
callbacks, a task function that records what each job got); the slow ones run the real CLI.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from hydra import initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import HydraContext, RunMode

from tests.conftest import REPO, history, run_train, runs_in
from train.config.schema import register_schema

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


@pytest.fixture
def hydra_conf() -> Iterator[None]:
    register_schema()
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
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


# -- the real CLI --------------------------------------------------------------------------------


def parent_and_children(uri: str) -> tuple:
    runs = runs_in(uri)
    parents = [r for r in runs if r.data.tags.get("sweep") == "true"]
    assert len(parents) == 1, [r.data.tags for r in runs]
    parent = parents[0]
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id]
    assert len(children) == len(runs) - 1  # every other run of the experiment is a child
    return parent, children


@pytest.mark.slow
def test_local_sweep_groups_jobs_under_a_parent_run(store: dict[str, str],
                                                    tmp_path: Path) -> None:
    sweep_dir = tmp_path / "sweep"
    result = run_train("-m", "optim.lr=0.1,0.02", "model=cnn,mlp", "trainer.epochs=1",
                       "tracking.log_model=false",
                       f"hydra.sweep.dir={sweep_dir}", env=store, timeout=600)
    assert result.returncode == 0, result.stderr
    uri = store["MLFLOW_TRACKING_URI"]
    parent, children = parent_and_children(uri)
    assert parent.info.status == "FINISHED"
    assert "optim.lr=0.1,0.02" in parent.data.tags["sweep.overrides"]
    assert len(children) == 4
    combos = {(c.data.params["optim.lr"], c.data.params["model.name"]) for c in children}
    assert combos == {(lr, m) for lr in ("0.1", "0.02") for m in ("cnn", "mlp")}
    for child in children:
        assert child.info.status == "FINISHED"
        assert history(uri, child.info.run_id, "val/samples") == [(0, 359.0)]
        # The ids the launcher appended are not part of what the user typed.
        assert "_id=" not in child.data.tags["command"]
        assert "tracking.log_model=" in child.data.tags["command"]
        # Job directory and run point at each other.
        job_dir = Path(child.data.tags["output_dir"])
        assert job_dir.parent == sweep_dir
        assert json.loads((job_dir / "mlflow_run.json").read_text())["run_id"] == \
            child.info.run_id
    best = max(children, key=lambda c: c.data.metrics["val/accuracy"])
    assert parent.data.tags["best_run_id"] == best.info.run_id
    assert parent.data.metrics["best/val/accuracy"] == best.data.metrics["val/accuracy"]
    assert parent.data.metrics["sweep/children"] == 4
    assert parent.data.metrics["sweep/failed_children"] == 0


@pytest.mark.slow
def test_a_sweep_whose_jobs_are_all_refused_leaves_no_run(store: dict[str, str],
                                                         tmp_path: Path) -> None:
    result = run_train("-m", "optim.lr=-0.1,-0.2", f"hydra.sweep.dir={tmp_path}/sweep",
                       env=store, timeout=300)
    assert result.returncode != 0
    assert "optim.lr must be positive" in result.stderr
    assert runs_in(store["MLFLOW_TRACKING_URI"]) == []  # not even an empty parent run


@pytest.mark.slow
def test_a_failing_job_does_not_stop_the_sweep(store: dict[str, str], tmp_path: Path) -> None:
    # Step 0: at start-up, before the job's run exists; no step 10**6 in one epoch: it finishes.
    result = run_train("-m", "trainer.fail_on_rank=0", "trainer.fail_at_step=0,1,1000000",
                       "trainer.epochs=1", "tracking.log_model=false",
                       f"hydra.sweep.dir={tmp_path}/sweep", env=store, timeout=600)
    assert result.returncode != 0  # the sweep reports its failure...
    parent, children = parent_and_children(store["MLFLOW_TRACKING_URI"])
    statuses = sorted(c.info.status for c in children)
    assert statuses == ["FAILED", "FINISHED"]  # ...after running every job
    failed = next(c for c in children if c.info.status == "FAILED")
    assert "FailureDrill" in failed.data.tags["error"]
    # The job that never had a run is on the parent, and counts among the failed.
    [no_run] = [v for k, v in parent.data.tags.items() if k.startswith("sweep.no_run.")]
    assert f"{tmp_path}/sweep/0: " in no_run and "failing on purpose at step 0" in no_run
    assert parent.info.status == "FAILED"
    assert parent.data.metrics["sweep/failed_children"] == 2


@pytest.mark.slow
def test_optuna_sweep_optimises_the_returned_objective(store: dict[str, str],
                                                       tmp_path: Path) -> None:
    sweep_dir = tmp_path / "sweep"
    result = run_train("-m", "+hparams_search=optuna_digits", "hydra.sweeper.n_trials=3",
                       "trainer.epochs=1", "tracking.log_model=false",
                       f"hydra.sweep.dir={sweep_dir}", env=store,
                       timeout=600)
    assert result.returncode == 0, result.stderr
    parent, children = parent_and_children(store["MLFLOW_TRACKING_URI"])
    assert len(children) == 3
    # Optuna saw each job's return value: its best is the best child's final val/accuracy.
    optuna = yaml.safe_load((sweep_dir / "optimization_results.yaml").read_text())
    best = max(c.data.metrics["val/accuracy"] for c in children)
    assert optuna["best_value"] == pytest.approx(best)
    assert parent.data.metrics["best/val/accuracy"] == pytest.approx(best)
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=store["MLFLOW_TRACKING_URI"])
    lrs = {client.get_run(c.info.run_id).data.params["optim.lr"] for c in children}
    assert len(lrs) == 3  # three different trials
