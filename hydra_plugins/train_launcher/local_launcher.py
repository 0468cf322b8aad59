"""The default launcher of `python -m train -m ...` (local sweeps): Hydra's BasicLauncher, which
runs the jobs one after another in this process, after two steps of ours.

Before the first job starts, every job of the batch is pre-flighted (train/launch/preflight.py): a
sweep with a refused job starts none and creates no MLflow run. Then each job's overrides get
the experiment id (created once, here) and, for a sweep, the parent run's id
(hydra_plugins/train_launcher/checked_jobs.py), so the jobs themselves check nothing twice.
A sweep run again in its directory (`python -m train sweep resume`) leaves out the jobs that
finished there.
After the jobs, a failed or stopped one ends the sweep with one line per such job, not
Hydra's report.
"""
# No `from __future__ import annotations`: Hydra's plugin scan executes this module outside
# sys.modules, where dataclasses cannot resolve string annotations.

from collections.abc import Sequence
from dataclasses import dataclass

from hydra._internal.core_plugins.basic_launcher import BasicLauncher
from hydra.core.config_store import ConfigStore
from hydra.core.utils import JobReturn, JobStatus


@dataclass
class TrainLocalLauncherConf:
    _target_: str = "hydra_plugins.train_launcher.local_launcher.TrainLocalLauncher"


ConfigStore.instance().store(group="hydra/launcher", name="train_local",
                             node=TrainLocalLauncherConf, provider="train")


class TrainLocalLauncher(BasicLauncher):
    def launch(self, job_overrides: Sequence[Sequence[str]],
               initial_job_idx: int) -> Sequence[JobReturn]:
        from hydra_plugins.train_launcher import checked_jobs

        with checked_jobs.nothing_left_behind(self):
            configs = checked_jobs.job_configs(self, job_overrides)
            experiment_id = checked_jobs.preflight_jobs(configs)
        handed, _ = checked_jobs.with_ids(self, job_overrides, experiment_id)
        done = checked_jobs.finished_jobs(self, handed, configs, initial_job_idx,
                                          [str(initial_job_idx + i) for i in range(len(handed))])
        if not done:
            results = super().launch(handed, initial_job_idx)
        else:  # one at a time, each with its own number (Hydra numbers a batch from its first)
            returns = {i: JobReturn(status=JobStatus.COMPLETED, _return_value=value)
                       for i, value in done.items()}
            for i in (i for i in range(len(handed)) if i not in done):
                returns[i] = super().launch([handed[i]], initial_job_idx + i)[0]
            results = [returns[i] for i in range(len(handed))]
        checked_jobs.report_failed_jobs(results, job_overrides, initial_job_idx,
                                        checked_jobs.resume_hint(self))
        return results
