"""The suite's warm start (tests/warm.py) runs what a new `python -m train` runs: the same
output and exit code as a cold start, the job's own environment, directory and PYTHONPATH
(the user's package imported fresh, in the job), and a timeout that kills the job."""

from __future__ import annotations

import os
import subprocess
import textwrap
from pathlib import Path

import psutil
import pytest

from tests import warm
from tests.conftest import REPO, USER_PATH, history, process_ended, run_train, runs_in, wait_until


@pytest.mark.parametrize("args", [("--cfg", "job", "trainer.epochs=3"),
                                  ("trainer.epochs=three",), ("stauts",), ("--help", "data")])
def test_a_warm_start_prints_and_exits_as_a_cold_one(args: tuple[str, ...]) -> None:
    cold = run_train(*args, warm=False, timeout=120)
    hot = run_train(*args, timeout=120)
    assert (hot.returncode, hot.stdout, hot.stderr) == (cold.returncode, cold.stdout,
                                                        cold.stderr)


def test_the_job_has_its_own_environment_directory_and_path(tmp_path: Path) -> None:
    """A user package on the job's PYTHONPATH is imported in the job (not the zygote), and
    sees the job's variables."""
    package = tmp_path / "site" / "envprobe"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(textwrap.dedent("""\
        import os
        import torch

        class Probe(torch.nn.Module):
            def __init__(self, num_classes: int = 10, in_channels: int = 1) -> None:
                super().__init__()
                self.fc = torch.nn.Linear(64, num_classes)
                print("PROBE", os.environ.get("PROBE_VALUE"), os.getcwd(), flush=True)

            def forward(self, x):
                return self.fc(x.flatten(1))
        """))
    env = {"PYTHONPATH": os.pathsep.join([str(tmp_path / "site"), USER_PATH]),
           "PROBE_VALUE": "from-the-job", "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path}/m.db"}
    assert warm.eligible(("-m", "train"), REPO, env)
    done = run_train("model=custom", "model._target_=envprobe.Probe", "trainer.epochs=1",
                     "tracking.enabled=false", f"hydra.run.dir={tmp_path / 'job'}", env=env,
                     timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"PROBE from-the-job {REPO}" in done.stdout


def test_another_checkout_on_the_path_or_another_module_starts_cold(tmp_path: Path) -> None:
    (tmp_path / "train").mkdir()
    assert not warm.eligible(("-m", "train"), REPO, {"PYTHONPATH": str(tmp_path)})
    assert not warm.eligible(("-m", "train"), tmp_path, {})
    assert not warm.eligible(("-m", "train.prepare_text"), REPO, {})
    assert warm.eligible(("-m", "train"), REPO, {"PYTHONPATH": USER_PATH})


def test_a_job_past_its_timeout_is_killed(tmp_path: Path) -> None:
    with pytest.raises(subprocess.TimeoutExpired):
        run_train("data=digits", "trainer.epochs=1000", "tracking.enabled=false",
                  f"hydra.run.dir={tmp_path / 'job'}", timeout=5)
    assert not (tmp_path / "job" / "summary.json").exists()


def test_a_warm_two_rank_job_trains_as_a_cold_one_and_its_fork_server_ends_with_it(
        store: dict[str, str], tmp_path: Path) -> None:
    """A warm job's ranks come from a fork server forked from the job as it starts, not from a
    new interpreter (tests/warm.py `_fork_the_fork_server`): from the same seed they train the
    same run as a cold job's, step for step, and nothing of the job is left running after it."""
    args = ("data=digits", "model=mlp", "trainer.epochs=2", "distributed.nproc_per_node=2",
            "trainer.seed=5")
    before = {p.pid for p in psutil.process_iter()}
    hot = run_train(*args, f"hydra.run.dir={tmp_path / 'hot'}", env=store)
    assert hot.returncode == 0, hot.stderr[-3000:]
    cold = run_train(*args, f"hydra.run.dir={tmp_path / 'cold'}", env=store, warm=False)
    assert cold.returncode == 0, cold.stderr[-3000:]
    uri = store["MLFLOW_TRACKING_URI"]
    runs = sorted(runs_in(uri), key=lambda r: r.info.start_time)
    assert [r.info.status for r in runs] == ["FINISHED", "FINISHED"]
    for key in ("train/loss", "val/loss", "val/accuracy"):
        warm_run, cold_run = (history(uri, r.info.run_id, key) for r in runs)
        assert [s for s, _ in warm_run] == [s for s, _ in cold_run] and len(warm_run) == 2
        assert [v for _, v in warm_run] == pytest.approx([v for _, v in cold_run], abs=1e-6), key
    # The job, its fork server, ranks and loader workers are forks of this pytest worker's
    # zygote (never exec'd), so they carry its command line, whose socket path is this worker's
    # alone: another xdist worker's warm jobs, running meanwhile, are not this job's.
    zygote = warm._zygote.pid if warm._zygote else None
    ours = f"tests.warm {warm._socket_path}"
    wait_until(lambda: not [p for p in psutil.process_iter(["cmdline"])
                            if p.pid not in before | {zygote} and not process_ended(p)
                            and ours in " ".join(p.info["cmdline"] or [])],
               10, "the warm job's processes end")
