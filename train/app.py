"""The Hydra application: compose the config; in a rank started by torchrun, srun or submitit,
train; otherwise pre-flight, then start this machine's ranks.

Under `-m` (sweeps) and `+cluster=slurm` the project's launchers (hydra_plugins/train_launcher)
pre-flight every job before the first starts and hand each job the experiment and sweep parent
run ids as overrides; a single run is pre-flighted here.
"""

from __future__ import annotations

import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from train import config as config_lib
from train import distenv
from train.config import TrainConfig
from train.schema import register_schema, to_container, to_typed

register_schema()

# An absolute path: under `python -m train` Hydra would read a relative one as a module name.
CONF_DIR = str(Path(__file__).resolve().parent.parent / "conf")


@hydra.main(version_base="1.3", config_path=CONF_DIR, config_name="train")
def main(cfg: DictConfig) -> float | None:
    """Run one job; returns its objective (trainer.objective) for Hydra's sweepers."""
    from train.config import ConfigError
    from train.distenv import DistEnvError
    from train.launch import JobFailedError, LaunchError

    hydra_cfg = HydraConfig.get()
    try:
        # What the user typed (also inside a Slurm job, where argv is submitit's).
        overrides = config_lib.typed_by_user(hydra_cfg.overrides.task)
        command = " ".join(["python -m train", *overrides])
        return run(cfg, hydra_cfg.runtime.output_dir, command,
                   preflighted=launched_by_us(hydra_cfg))
    except (ConfigError, DistEnvError, LaunchError, JobFailedError) as e:
        if hydra_cfg.mode == RunMode.MULTIRUN:
            raise  # Hydra marks this job FAILED; the other jobs of the sweep go on
        # A single job: the message alone, no stack of Hydra frames around it.
        print(f"\nerror: {e}\n", file=sys.stderr)
        raise SystemExit(1 if isinstance(e, JobFailedError) else 2) from None


def launched_by_us(hydra_cfg: DictConfig) -> bool:
    """A job of a multirun started by one of this project's launchers, which pre-flighted it
    together with the rest of its sweep."""
    launcher = str(hydra_cfg.launcher.get("_target_", ""))
    return (hydra_cfg.mode == RunMode.MULTIRUN
            and launcher.startswith("hydra_plugins.train_launcher."))


def run(cfg: DictConfig, output_dir: str, command: str,
        preflighted: bool = False) -> float | None:
    """Run the job this process was asked for; returns the objective for Hydra sweepers.
    `preflighted`: the launcher checked this job already."""
    config = to_container(cfg)
    typed = to_typed(config)
    from train.preflight import preflight, validate

    external = distenv.external_world_size()
    if external is not None:
        # torchrun / srun / submitit started every rank: each validates, then trains.
        validate(typed, external)
        from train.job import run_rank

        return objective(typed, run_rank(config, output_dir, command))
    from train.launch import run_in_process, start_local_ranks

    if not preflighted:
        preflight([typed], output_dir=output_dir)
    nproc = typed.distributed.nproc_per_node
    if nproc == 1:
        return objective(typed, run_in_process(config, output_dir, command))
    return objective(typed, start_local_ranks(config, output_dir, command, nproc))


def objective(cfg: TrainConfig, final: dict[str, float]) -> float | None:
    return final.get(cfg.trainer.objective)
