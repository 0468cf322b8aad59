"""hydra.run.dir's default (train/launch/rundir.py): one directory per launch, however many
start in one second; the ranks of a torchrun/srun launch agree on theirs without talking."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil

from tests.conftest import LAUNCHER_VARS, REPO
from train.launch.rundir import launch_dir


def test_each_launch_claims_a_directory_of_its_own(tmp_path: Path) -> None:
    pattern = f"{tmp_path}/%Y-%m-%d/job"  # no time of day: every call asks for one name
    claimed = [launch_dir(pattern) for _ in range(3)]
    base = time.strftime(pattern)
    assert claimed == [base, f"{base}-2", f"{base}-3"]
    assert all(Path(d).is_dir() and not any(Path(d).iterdir()) for d in claimed)
    with ThreadPoolExecutor(8) as pool:  # at once: mkdir decides, not a check before it
        together = list(pool.map(launch_dir, [pattern] * 8))
    assert len(set(together)) == 8 and not set(together) & set(claimed)


def test_ranks_of_one_launch_take_their_launchers_start_and_claim_nothing(
        tmp_path: Path) -> None:
    """Two ranks as torchrun starts them (WORLD_SIZE set; this test process is their parent),
    started seconds after the parent: both name the parent's start time, and create nothing."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS}
    env.update(WORLD_SIZE="2", PYTHONPATH=str(REPO))
    code = ("from train.launch.rundir import launch_dir; "
            f"print(launch_dir('{tmp_path}/%Y-%m-%d/%H-%M-%S'))")
    named = [subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                            text=True, check=True, timeout=60).stdout.strip() for _ in range(2)]
    started = time.localtime(psutil.Process().create_time())
    assert named == [time.strftime(f"{tmp_path}/%Y-%m-%d/%H-%M-%S", started)] * 2
    assert list(tmp_path.iterdir()) == []
