"""The suite's warm start (tests/warm.py) runs what a new `python -m train` runs: the same
output and exit code as a cold start, the job's own environment, directory and PYTHONPATH
(the user's package imported fresh, in the job), and a timeout that kills the job."""

from __future__ import annotations

import os
import subprocess
import textwrap
from pathlib import Path

import pytest

from tests import warm
from tests.conftest import REPO, USER_PATH, run_train


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
