"""What the login node says at submission about a job's time limit and stop signal, without a
cluster (issue 18)."""

from __future__ import annotations

from pathlib import Path

import pytest

from train.config.cluster import ClusterConfig
from train.config.groups import ConfigError, TrainConfig
from train.distributed.slurm import time_limit_note
from train.launch import submit as slurm


def test_a_stop_signal_at_the_start_is_refused_and_one_early_warned(
        capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ConfigError, match="signal_delay_s=120 is not below the time limit"):
        slurm.check_request(TrainConfig(cluster=ClusterConfig(time_min=2)))
    slurm.check_request(TrainConfig(cluster=ClusterConfig(time_min=3, signal_delay_s=120)))
    assert "not well below the time limit" in capsys.readouterr().err
    slurm.check_request(TrainConfig(cluster=ClusterConfig(time_min=60)))  # the defaults
    assert capsys.readouterr().err == ""


def test_the_time_limit_note_names_the_checkpoint_and_the_command() -> None:
    note = time_limit_note(Path("/o/checkpoints/step-40.pt"),
                                 "python -m train +cluster=slurm trainer.resume=auto")
    assert note == ("time limit reached, checkpoint /o/checkpoints/step-40.pt saved; resume with "
                    "python -m train +cluster=slurm trainer.resume=/o/checkpoints/step-40.pt")
