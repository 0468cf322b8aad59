"""`+cluster=slurm`: hydra-submitit-launcher's Slurm launcher, plus what users need around it.

The stock launcher submits and then blocks on the results in silence. This one pre-flights
every job before anything is submitted (train/launch/preflight.py), creates the MLflow
experiment once and hands its id (and a sweep's parent run id) to every job as overrides
(checked_jobs.py), can print the sbatch script instead of submitting (dry run), prints the job
id and log paths, follows the jobs' states, and on failure shows the block a local job shows
(train/launch/follow.py) and exits non-zero. Submission, arrays and the sbatch script itself
stay submitit's.
"""
# No `from __future__ import annotations`: Hydra's plugin scan executes this module outside
# sys.modules, where dataclasses cannot resolve string annotations.


import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hydra.core.config_store import ConfigStore
from hydra.core.utils import JobReturn, JobStatus
from hydra_plugins.hydra_submitit_launcher.config import SlurmQueueConf
from hydra_plugins.hydra_submitit_launcher.submitit_launcher import SlurmLauncher
from omegaconf import OmegaConf, open_dict

from hydra_plugins.train_launcher import checked_jobs
from train.errors import StoppedBySignal


@dataclass
class TrainSlurmQueueConf(SlurmQueueConf):
    _target_: str = "hydra_plugins.train_launcher.slurm_launcher.TrainSlurmLauncher"
    dry_run: bool = False
    """Print the sbatch script and exit without submitting."""
    wait: bool = True
    """Follow the jobs until they end; False returns right after submission."""
    srun_args: list[str] = field(default_factory=list)
    """Extra arguments for the srun line that starts the tasks (--kill-on-bad-exit=1 is always
    put first)."""
    python: str | None = None
    """The command that runs python on the nodes (submitit's SlurmExecutor `python`), e.g. a
    container's `apptainer exec --nv image.sif python`; None = this interpreter."""
    setup: list[str] = field(default_factory=list)
    """As submitit's (shell lines before srun), but never None: merging `${cluster.setup}`
    onto a None list would resolve it while conf/cluster/slurm.yaml is merged, before
    `cluster` has its schema defaults."""


ConfigStore.instance().store(group="hydra/launcher", name="train_slurm",
                             node=TrainSlurmQueueConf, provider="train")


class TrainSlurmLauncher(SlurmLauncher):
    def __init__(self, **params: Any) -> None:
        self.dry_run = bool(params.pop("dry_run", False))
        self.wait = bool(params.pop("wait", True))
        self.python = params.pop("python", None)
        super().__init__(**params)

    def launch(self, job_overrides: Sequence[Sequence[str]],
               initial_job_idx: int) -> Sequence[JobReturn]:
        from train.launch import follow as slurm_follow
        from train.launch import submit as slurm

        with checked_jobs.nothing_left_behind(self):
            executor, experiment_id, configs = self._checked(job_overrides)
            if self.dry_run:
                print(slurm.show_script(executor, len(job_overrides)))
                raise SystemExit(0)
        job_overrides, parent = checked_jobs.with_ids(self, job_overrides, experiment_id)
        done = checked_jobs.finished_jobs(self, job_overrides, configs, initial_job_idx)
        todo = [i for i in range(len(job_overrides)) if i not in done]
        returns = {i: JobReturn(status=JobStatus.COMPLETED, _return_value=value)
                   for i, value in done.items()}
        if not todo:
            return [returns[i] for i in range(len(job_overrides))]
        submitted_at = time.time()
        job_params = [(job_overrides[i], "hydra.sweep.dir", initial_job_idx + i,
                       f"job_id_for_{i}", self._singleton_state()) for i in todo]
        jobs = slurm.with_all_tasks(executor, executor.map_array(
            self, *zip(*job_params, strict=True)), configs[0].cluster)
        cluster = configs[0].cluster
        slurm_follow.announce(jobs, slurm.rank_request(cluster), slurm.node_request(cluster),
                              per_node=cluster.ranks == "per_node")
        if not self.wait:
            self._leave_unwaited(len(job_overrides), parent)
            # Completed as far as this process goes: Hydra's sweeper reads every return value.
            return [JobReturn(status=JobStatus.COMPLETED, _return_value=None)
                    for _ in job_overrides]
        try:
            outcomes = slurm_follow.collect(jobs, slurm_follow.follow(jobs),
                                            slurm.elastic_tasks_per_node(cluster))
        except KeyboardInterrupt:
            # The jobs go on without us: say so, and leave a sweep's parent run to them.
            self._leave_unwaited(len(job_overrides), parent)
            print(f"\n{slurm_follow.still_running(jobs)}", file=sys.stderr, flush=True)
            raise SystemExit(130) from None
        slurm_follow.report_finished(outcomes.returns)
        slurm_follow.report_failures(
            jobs, outcomes.failed, lambda k: checked_jobs.job_place(
                self, job_overrides[todo[k]], initial_job_idx + todo[k], jobs[k].job_id),
            submitted_at)
        if outcomes.failed or outcomes.stopped:
            if len(job_overrides) > 1 and (hint := checked_jobs.resume_hint(self)) is not None:
                print(hint, file=sys.stderr, flush=True)
            raise SystemExit(1)
        returns.update(zip(todo, outcomes.returns, strict=True))
        return [returns[i] for i in range(len(job_overrides))]

    def _checked(self, job_overrides: Sequence[Sequence[str]]) -> tuple[Any, str | None, list]:
        """Every job pre-flighted and the executor built, or the command refused."""
        import submitit

        sweeper = str(self.config.hydra.sweeper.get("_target_", "BasicSweeper"))
        if not self.wait and "BasicSweeper" not in sweeper:
            checked_jobs.refuse(
                f"cluster.wait=false cannot serve {sweeper.rsplit('.', 1)[-1]}: it needs each "
                "trial's result before it proposes the next. Drop cluster.wait=false (the "
                "search then follows its jobs).")
        configs = checked_jobs.job_configs(self, job_overrides)
        # A dry run checks the request itself but needs no cluster, store or data set.
        experiment_id = checked_jobs.preflight_jobs(configs, on_slurm=True, dry_run=self.dry_run)
        try:
            with _srun_not_needed(self.dry_run):
                executor = self._executor(submitit, None if self.dry_run else configs)
        except RuntimeError as e:  # submitit: no srun here
            checked_jobs.refuse(f"{e} (sbatch and srun must be on PATH to submit)")
        return executor, experiment_id, configs

    def __call__(self, *args: Any) -> JobReturn:
        """One rank, inside the Slurm job. A rank that failed exits non-zero (Hydra would have
        ended it with 0): srun's --kill-on-bad-exit then ends the step, instead of leaving the
        peers of a dead rank to wait, and submitit logs the error instead of "Job completed
        successfully". A stop (time limit, preemption) is no failure: exit 0."""
        ret = super().__call__(*args)
        error = ret._return_value
        # A rank's stop (Preempted), or a per-node task's whose ranks stopped (JobStoppedError).
        if ret.status == JobStatus.FAILED and isinstance(error, BaseException) and \
                not isinstance(error, StoppedBySignal):
            raise error
        return ret

    def _leave_unwaited(self, jobs: int, parent: str | None) -> None:
        if parent is not None:  # a sweep: its last job will end the parent run
            from train.tracking.sweep import find_callback

            find_callback(self.hydra_context).left_unwaited(jobs)

    def _singleton_state(self) -> Any:
        from hydra.core.singleton import Singleton

        return Singleton.get_state()

    def _executor(self, submitit: Any, configs: Any = None) -> Any:
        """The executor the stock launcher would build, from the same parameters (with
        cluster.setup's lines checked: train/launch/submit.py checked_setup); with the jobs'
        `configs` (none for a dry run), their code snapshot taken first (cluster.snapshot_code)."""
        from hydra_plugins.hydra_submitit_launcher.config import BaseQueueConf

        from train.launch import submit as slurm

        assert self.config is not None
        # Concrete, not `${now:...}`: a requeued job must find the same directory (and its
        # checkpoints) when it runs again.
        with open_dict(self.config):
            self.config.hydra.sweep.dir = str(self.config.hydra.sweep.dir)
        params = dict(self.params)
        params.pop("max_num_timeout")
        params["setup"] = slurm.checked_setup(params.get("setup") or [])
        if configs and configs[0].cluster.snapshot_code:
            params["setup"] += self._snapshot(configs)
        params["srun_args"] = slurm.srun_args(params.get("srun_args") or [])
        if "nodes" in (params.get("additional_parameters") or {}):
            # An elastic job (cluster.min_nodes): srun starts each node's tasks, sbatch asks
            # for none (train/config/cluster.py slurm_sbatch_extra).
            params.pop("tasks_per_node", None)
        # One requeue budget: the job's own (cluster.max_requeues, counted in its checkpoints,
        # train/distributed/slurm.py requeue_after_stop). Each rank replaces submitit's USR2
        # handler with
        # its own as it starts, so submitit's count of timeouts is never spent; a second
        # budget would only mislead (hydra.launcher.max_num_timeout is ignored).
        executor = submitit.AutoExecutor(cluster=self._EXECUTOR, folder=params.pop(
            "submitit_folder"), slurm_max_num_timeout=0,
            **({"slurm_python": self.python} if self.python else {}))
        base = set(OmegaConf.structured(BaseQueueConf).keys())
        executor.update_parameters(**{k if k in base else f"slurm_{k}": v
                                      for k, v in params.items()})
        Path(str(self.config.hydra.sweep.dir)).mkdir(parents=True, exist_ok=True)
        return executor


    def _snapshot(self, configs: Any) -> list[str]:
        """Snapshot the jobs' code (train/launch/snapshot.py) and point Hydra's config search
        path at the snapshot's configs, which each job composes its config from again; the
        sbatch lines that make the job import it."""
        import shutil

        from hydra._internal.config_repository import ConfigRepository

        from train.errors import TrainError
        from train.launch import snapshot

        try:
            snap = snapshot.take(Path(str(self.config.hydra.sweep.dir)), configs)
        except TrainError as e:
            checked_jobs.refuse(e)
        loader = self.hydra_context.config_loader
        search_path = loader.get_search_path()
        for i, element in enumerate(search_path.get_path()):
            where = Path(str(element.path).removeprefix("file://"))
            if element.provider not in ("main", "command-line") or not where.is_dir():
                continue
            copy = snapshot.config_copy(snap, where, i)
            if not copy.exists():
                shutil.copytree(where, copy)
            element.path = str(copy)
        loader.repository = ConfigRepository(config_search_path=search_path)
        if snap.reused:
            print(f"code snapshot: {snap.root}, taken when this sweep directory was first "
                  "submitted: its jobs resume with the code they started with (a new sweep "
                  "directory takes a new one)", file=sys.stderr, flush=True)
        else:
            print(f"code snapshot: {snap.root} ({snap.bytes / 1e6:.1f} MB in "
                  f"{snap.seconds:.1f} s; cluster.snapshot_code=false turns it off)",
                  file=sys.stderr, flush=True)
        return snap.setup_lines()


@contextmanager
def _srun_not_needed(dry_run: bool) -> Iterator[None]:
    """submitit's Slurm executor refuses to exist where `srun` is not on PATH, though a dry
    run only prints the script it would submit: for a dry run, it is told srun is there."""
    from submitit.slurm.slurm import SlurmExecutor

    if not dry_run:
        yield
        return
    detected = SlurmExecutor.__dict__["affinity"]
    SlurmExecutor.affinity = classmethod(lambda cls: 1)  # type: ignore[method-assign]
    try:
        yield
    finally:
        SlurmExecutor.affinity = detected  # type: ignore[method-assign]
