"""The distributed environment as torchrun, Slurm or nothing sets it, read in process."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from train.distributed import env as distenv

TORCHRUN_KEYS = distenv.TORCHRUN_VARS


def _clear(monkeypatch: pytest.MonkeyPatch) -> None:
    """Start from no launcher; whatever detect() exports is removed again after the test."""
    for key in {*TORCHRUN_KEYS, "SUBMITIT_EXECUTOR", distenv.LAUNCHER_VAR}:
        monkeypatch.setenv(key, "")
        monkeypatch.delenv(key)
    for key in list(os.environ):
        if key.startswith(("SLURM_", "SUBMITIT_")):
            monkeypatch.delenv(key)


def test_half_set_torchrun_env_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    _clear(monkeypatch)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(distenv.DistEnvError, match="LOCAL_RANK"):
        distenv.detect()


def test_torchrun_env_is_read(monkeypatch: pytest.MonkeyPatch) -> None:
    _clear(monkeypatch)
    for key, value in distenv.torchrun_env(3, 1, 4, 2, "node1", 29500).items():
        monkeypatch.setenv(key, value)
    env = distenv.detect()
    assert (env.rank, env.local_rank, env.world_size, env.local_world_size) == (3, 1, 4, 2)
    assert (env.master_addr, env.master_port, env.launcher) == ("node1", 29500, "torchrun")


def test_ranks_of_a_plain_python_m_train_are_tagged_local(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Not "torchrun": the user started no torchrun; this package's local launcher did."""
    _clear(monkeypatch)
    for key, value in distenv.this_machine(2).env(1).items():
        monkeypatch.setenv(key, value)
    assert distenv.detect().launcher == "local"


def test_slurm_step_env_is_exported_torchrun_style(monkeypatch: pytest.MonkeyPatch) -> None:
    """What `srun -N2 --ntasks-per-node=2 python -m train` gives the task with PROCID 3."""
    _clear(monkeypatch)
    slurm = {"SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "0", "SLURM_PROCID": "3",
             "SLURM_LOCALID": "1", "SLURM_NTASKS": "4", "SLURM_NNODES": "2", "SLURM_NODEID": "1",
             "SLURM_JOB_NODELIST": "node[1-2]", "SLURM_JOB_NUM_NODES": "2"}
    for key, value in slurm.items():
        monkeypatch.setenv(key, value)
    assert distenv.external_world_size() == 4
    env = distenv.detect()
    assert (env.rank, env.local_rank, env.world_size, env.local_world_size) == (3, 1, 4, 2)
    # Below the kernel's ephemeral ports, which any outgoing connection may hold.
    low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    assert env.master_addr == "node1" and 20000 <= env.master_port < low
    assert env.launcher == "slurm"
    assert os.environ["RANK"] == "3" and os.environ["MASTER_ADDR"] == "node1"
    # Every task of the job derives the same port from the job id.
    port = env.master_port
    for key in TORCHRUN_KEYS:
        monkeypatch.delenv(key)
    monkeypatch.setenv("SLURM_PROCID", "0")
    monkeypatch.setenv("SLURM_LOCALID", "0")
    assert distenv.detect().master_port == port


def test_outside_any_launcher_nothing_is_external(monkeypatch: pytest.MonkeyPatch) -> None:
    _clear(monkeypatch)
    monkeypatch.setenv("SLURM_JOB_ID", "7")  # a batch script, not an srun step
    assert distenv.external_world_size() is None
