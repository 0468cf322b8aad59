"""`python -m train rerun` and `python -m train diff` as a user runs them, on runs read back
from a real MLflow store: a rerun of a 1-rank and of a 2-rank job reproduces the metric history
exactly (CPU, gloo, same seed: the same operations in the same order give the same bits), the
diff of two jobs of a sweep names what the sweep varied, and a rerun whose code or run is gone
is refused in one line with nothing started."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.conftest import REPO, composed, history, run_train, runs_in
from tests.unit.test_code_record import PACKAGE, checkout
from tests.unit.test_job import SMALL
from train.app import run as train_run

TINY = (*SMALL, "tracking.log_model=false", "trainer.epochs=2")
METRICS = ("train/loss", "train/step_loss", "val/loss", "val/accuracy")


def run_id_of(job_dir: Path) -> str:
    return json.loads((job_dir / "summary.json").read_text())["run_id"]


@pytest.mark.parametrize("ranks", [1, 2])
def test_a_rerun_reproduces_the_metric_history(ranks: int, store: dict[str, str],
                                               tmp_path: Path, no_launcher_env: None) -> None:
    uri = store["MLFLOW_TRACKING_URI"]
    # The original in this process (seconds sooner than a second CLI start), the rerun by the CLI.
    train_run(composed(*TINY, f"distributed.nproc_per_node={ranks}", f"tracking.uri={uri}"),
        str(tmp_path / "first"), "python -m train (test)")
    original = run_id_of(tmp_path / "first")
    again = run_train("rerun", original, "tracking.run_name=again",
                      f"hydra.run.dir={tmp_path / 'again'}", env=store)
    assert again.returncode == 0, again.stderr
    assert f"rerunning run {original} with its recorded code in " in again.stderr
    rerun = run_id_of(tmp_path / "again")
    [run] = [r for r in runs_in(uri) if r.info.run_id == rerun]
    assert run.data.tags["rerun_of"] == original and run.info.run_name == "again"
    assert run.data.tags["world_size"] == str(ranks)
    assert run.data.tags["command"] == f"python -m train rerun {original} tracking.run_name=again"
    for key in METRICS:
        assert history(uri, rerun, key) == history(uri, original, key), key
        assert history(uri, rerun, key), key


def test_diff_of_two_jobs_of_a_sweep(store: dict[str, str], tmp_path: Path) -> None:
    out = run_train("-m", *TINY, "trainer.epochs=1", "optim.lr=0.1,0.02",
                    f"hydra.sweep.dir={tmp_path / 'sweep'}", env=store)
    assert out.returncode == 0, out.stderr
    a, b = (run_id_of(tmp_path / "sweep" / str(n)) for n in (0, 1))
    shown = run_train("diff", a, b, env=store, timeout=60)
    assert shown.returncode == 0, shown.stderr
    lines = shown.stdout.splitlines()
    assert "config: 1 differ" in lines and "  optim.lr: 0.1 -> 0.02" in lines
    assert "code: same" in lines and "packages: same" in lines


def test_refusals_before_anything_starts(store: dict[str, str], tmp_path: Path) -> None:
    """A run id the store does not hold; and a run whose user package's checkout is gone."""
    uri = store["MLFLOW_TRACKING_URI"]
    user_repo = checkout(tmp_path / "research", {"reprpkg/__init__.py": PACKAGE})
    small = [o for o in TINY if not o.startswith("model")]
    first = run_train(*small, "trainer.epochs=1", "model=custom", "model._target_=reprpkg.Net",
                      f"hydra.run.dir={tmp_path / 'first'}",
                      env={**store, "PYTHONPATH": str(user_repo)})
    assert first.returncode == 0, first.stderr
    original = run_id_of(tmp_path / "first")
    shutil.rmtree(user_repo)
    snapshots = sorted((REPO / "outputs" / "code").glob("*"))
    for run_id, expected in [
            ("0" * 32, f"error: no run {'0' * 32} in the tracking store"),
            (original, f"error: the code of run {original} is not available: package reprpkg's "
                       f"checkout {user_repo} no longer exists")]:
        out = run_train("rerun", run_id, f"hydra.run.dir={tmp_path / 'again'}", env=store,
                        timeout=60)
        assert out.returncode == 2, out.stderr
        [line] = [x for x in out.stderr.splitlines() if x.startswith("error:")]
        assert line.startswith(expected), out.stderr
        assert "Traceback" not in out.stderr
    assert [r.info.run_id for r in runs_in(uri)] == [original]
    assert not (tmp_path / "again").exists()
    assert sorted((REPO / "outputs" / "code").glob("*")) == snapshots
