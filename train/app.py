"""The Hydra application: compose the config, then hand it to the launcher."""

from __future__ import annotations

import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from train.config import register_schema

register_schema()

# An absolute path: under `python -m train` Hydra would read a relative one as a module name.
CONF_DIR = str(Path(__file__).resolve().parent.parent / "conf")


@hydra.main(version_base="1.3", config_path=CONF_DIR, config_name="train")
def main(cfg: DictConfig) -> float | None:
    """Run one job; returns its objective (trainer.objective) for Hydra's sweepers."""
    from train.config import ConfigError
    from train.distenv import DistEnvError
    from train.launch import JobFailedError, LaunchError, run

    hydra_cfg = HydraConfig.get()
    try:
        # What the user typed (also inside a Slurm job, where argv is submitit's).
        command = " ".join(["python -m train", *hydra_cfg.overrides.task])
        return run(cfg, hydra_cfg.runtime.output_dir, command)
    except (ConfigError, DistEnvError, LaunchError, JobFailedError) as e:
        if hydra_cfg.mode == RunMode.MULTIRUN:
            raise  # Hydra marks this job FAILED; the other jobs of the sweep go on
        # A single job: the message alone, no stack of Hydra frames around it.
        print(f"\nerror: {e}\n", file=sys.stderr)
        raise SystemExit(1 if isinstance(e, JobFailedError) else 2) from None
