"""Slurm jobs run the code they were submitted with (cluster.snapshot_code, on by default): a
user package edited while its job is pending, and again before the job is requeued, is run as
submitted both times; and a rerun of a local run on Slurm reproduces its metric history."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

from tests.cluster.conftest import slurm_job
from tests.conftest import composed, history, run_train, runs_in, wait_until
from tests.e2e.test_rerun import METRICS, TINY, run_id_of
from tests.unit.test_code_record import checkout
from train.app import run as train_run

MARKED = '''import os
import sys

from torch import nn

MARK = "{mark}"


class Net(nn.Module):
    def __init__(self, channels: int, image_size: int, num_classes: int) -> None:
        super().__init__()
        attempt = os.environ.get("SLURM_RESTART_COUNT", "0")
        print(f"markpkg code {{MARK}} attempt {{attempt}}", file=sys.stderr, flush=True)
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(channels * image_size ** 2,
                                                         num_classes))

    def forward(self, x):
        return self.net(x)
'''


def _logs(sweep: Path) -> str:
    return "\n".join(p.read_text(errors="replace")
                     for p in sorted((sweep / ".submitit").glob("*/*_log.err")))


def test_a_pending_and_a_requeued_job_run_the_submitted_code(cluster: None, tmp_path: Path,
                                                             store: dict[str, str]) -> None:
    user_repo = checkout(tmp_path / "research", {"markpkg/__init__.py": MARKED.format(mark="A")})
    init = user_repo / "markpkg" / "__init__.py"
    small = [o for o in TINY if not o.startswith(("model", "trainer.epochs"))]
    submitted = slurm_job(tmp_path, *small, "trainer.epochs=60", "model=custom",
                          "model._target_=markpkg.Net", "cluster.wait=false",
                          "+cluster.sbatch_extra.begin=now+10",
                          env={**store, "PYTHONPATH": str(user_repo)}, timeout=120)
    assert submitted.returncode == 0, submitted.stdout + submitted.stderr
    assert "code snapshot: " in submitted.stderr
    init.write_text(MARKED.format(mark="B"))  # while the job is pending
    [job_id] = re.findall(r"Submitted Slurm job (\d+)", submitted.stdout)
    sweep = tmp_path / "sweep"
    wait_until(lambda: "markpkg code A attempt 0" in _logs(sweep), 120, "the first attempt")
    init.write_text(MARKED.format(mark="C"))  # while it runs, before its requeue
    subprocess.run(["scontrol", "requeue", job_id], check=True, capture_output=True)
    wait_until(lambda: (sweep / "0" / "summary.json").is_file(), 240, "the requeued job's end")
    logs = _logs(sweep)
    assert "markpkg code A attempt 1" in logs, logs
    assert "markpkg code B" not in logs and "markpkg code C" not in logs
    runs = runs_in(store["MLFLOW_TRACKING_URI"])
    assert runs and all(r.data.tags["code.snapshot"] == str(sweep / "code" / "project")
                        for r in runs)
    assert all(r.data.tags["code.pkg.markpkg.dirty"] == "false" for r in runs)


def test_a_rerun_on_slurm_reproduces_a_local_run(cluster: None, tmp_path: Path,
                                                 store: dict[str, str],
                                                 no_launcher_env: None) -> None:
    uri = store["MLFLOW_TRACKING_URI"]
    train_run(composed(*TINY, f"tracking.uri={uri}"), str(tmp_path / "first"),
              "python -m train (test)")
    original = run_id_of(tmp_path / "first")
    again = run_train("rerun", original, "+cluster=slurm", "cluster.partition=debug",
                      "cluster.time_min=10", f"hydra.sweep.dir={tmp_path / 'sweep'}", env=store,
                      timeout=300)
    assert again.returncode == 0, again.stdout + again.stderr
    [rerun] = [r for r in runs_in(uri) if r.data.tags.get("rerun_of") == original]
    assert rerun.data.tags["launcher"] == "submitit"
    for key in METRICS:
        assert history(uri, rerun.info.run_id, key) == history(uri, original, key), key
