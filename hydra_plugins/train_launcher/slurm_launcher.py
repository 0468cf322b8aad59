"""`+cluster=slurm`: hydra-submitit-launcher's Slurm launcher, plus what users need around it.

The stock launcher submits and then blocks on the results in silence. This one checks the
request before anything is submitted (train/slurm.py), creates the MLflow experiment once and
hands its id to every job, can print the sbatch script instead of submitting (dry run), prints
the job id and log paths, follows the jobs' states, and on failure shows the failing rank's log
and exits non-zero. Submission, arrays and the sbatch script itself stay submitit's.
"""
# No `from __future__ import annotations`: Hydra's plugin scan executes this module outside
# sys.modules, where dataclasses cannot resolve string annotations.


import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from hydra.core.config_store import ConfigStore
from hydra.core.utils import JobReturn, JobStatus
from hydra_plugins.hydra_submitit_launcher.config import SlurmQueueConf
from hydra_plugins.hydra_submitit_launcher.submitit_launcher import SlurmLauncher
from omegaconf import OmegaConf, open_dict


@dataclass
class TrainSlurmQueueConf(SlurmQueueConf):
    _target_: str = "hydra_plugins.train_launcher.slurm_launcher.TrainSlurmLauncher"
    dry_run: bool = False
    """Print the sbatch script and exit without submitting."""
    wait: bool = True
    """Follow the jobs until they end; False returns right after submission."""
    srun_args: list[str] = field(default_factory=list)
    """Extra arguments for the srun line that starts the ranks."""


ConfigStore.instance().store(group="hydra/launcher", name="train_slurm",
                             node=TrainSlurmQueueConf, provider="train")


class TrainSlurmLauncher(SlurmLauncher):
    def __init__(self, **params: Any) -> None:
        self.dry_run = bool(params.pop("dry_run", False))
        self.wait = bool(params.pop("wait", True))
        super().__init__(**params)

    def _job_configs(self, job_overrides: Sequence[Sequence[str]]) -> list[Any]:
        from train import config as config_lib

        assert self.hydra_context is not None and self.config is not None
        typed = []
        for overrides in job_overrides:
            cfg = self.hydra_context.config_loader.load_sweep_config(self.config, list(overrides))
            with open_dict(cfg):
                del cfg["hydra"]
            typed.append(config_lib.to_typed(OmegaConf.to_container(cfg, resolve=True)))
        return typed

    def launch(self, job_overrides: Sequence[Sequence[str]],
               initial_job_idx: int) -> Sequence[JobReturn]:
        import submitit

        from train import slurm
        from train.config import ConfigError
        from train.datasets import DataMissingError
        from train.store import TrackingError

        sweeper = str(self.config.hydra.sweeper.get("_target_", "BasicSweeper"))
        if not self.wait and "BasicSweeper" not in sweeper:
            print(f"\nerror: cluster.wait=false cannot serve {sweeper.rsplit('.', 1)[-1]}: it "
                  "needs each trial's result before it proposes the next. Drop "
                  "cluster.wait=false (the search then follows its jobs).\n", file=sys.stderr)
            raise SystemExit(2)
        try:
            configs = self._job_configs(job_overrides)
            # A dry run checks the request itself but needs no cluster, store or data set.
            experiment_id = None if self.dry_run else slurm.preflight(configs)
            for cfg in configs:
                slurm.check_request(cfg)
        except (ConfigError, slurm.SubmitError, TrackingError, DataMissingError) as e:
            print(f"\nerror: {e}\n", file=sys.stderr)
            raise SystemExit(2) from None
        try:
            executor = self._executor(submitit)
        except RuntimeError as e:  # submitit: no srun here
            print(f"\nerror: {e} (sbatch and srun must be on PATH, even for a dry run)\n",
                  file=sys.stderr)
            raise SystemExit(2) from None
        if self.dry_run:
            print(slurm.show_script(executor, len(job_overrides)))
            raise SystemExit(0)
        parent = None
        if experiment_id is not None:
            from train.sweep import parent_run_for_jobs

            # Explicit overrides, not the environment: sites may submit with --export=NONE.
            handed = [f"tracking.experiment_id={experiment_id}"]
            if (ids := parent_run_for_jobs()) is not None:  # a sweep: all is checked now
                parent = ids[1]
                handed.append(f"tracking.parent_run_id={parent}")
            job_overrides = [[*o, *handed] for o in job_overrides]

        job_params = [(list(o), "hydra.sweep.dir", initial_job_idx + i, f"job_id_for_{i}",
                       self._singleton_state()) for i, o in enumerate(job_overrides)]
        jobs = executor.map_array(self, *zip(*job_params, strict=True))
        cluster = configs[0].cluster
        world_size = cluster.nodes * slurm.ranks_per_node(cluster.tasks_per_node,
                                                          cluster.gpus_per_node)
        slurm.announce(jobs, world_size, cluster.nodes)
        if not self.wait:
            if parent is not None:  # a sweep: its last job will end the parent run
                from train.sweep import UNWAITED_ENV

                os.environ[UNWAITED_ENV] = str(int(os.environ.get(UNWAITED_ENV, 0)) + len(jobs))
            # Completed as far as this process goes: Hydra's sweeper reads every return value.
            return [JobReturn(status=JobStatus.COMPLETED, _return_value=None) for _ in jobs]
        returns, failed = slurm.collect(jobs, slurm.follow(jobs))
        slurm.report_failures(jobs, failed)
        if failed:
            raise SystemExit(1)
        return returns

    def _singleton_state(self) -> Any:
        from hydra.core.singleton import Singleton

        return Singleton.get_state()

    def _executor(self, submitit: Any) -> Any:
        """The executor the stock launcher would build, from the same parameters."""
        from pathlib import Path

        from hydra_plugins.hydra_submitit_launcher.config import BaseQueueConf

        assert self.config is not None
        # Concrete, not `${now:...}`: a requeued job must find the same directory (and its
        # checkpoints) when it runs again.
        with open_dict(self.config):
            self.config.hydra.sweep.dir = str(self.config.hydra.sweep.dir)
        params = dict(self.params)
        executor = submitit.AutoExecutor(cluster=self._EXECUTOR, folder=params.pop(
            "submitit_folder"), slurm_max_num_timeout=params.pop("max_num_timeout"))
        base = set(OmegaConf.structured(BaseQueueConf).keys())
        executor.update_parameters(**{k if k in base else f"slurm_{k}": v
                                      for k, v in params.items()})
        Path(str(self.config.hydra.sweep.dir)).mkdir(parents=True, exist_ok=True)
        return executor
