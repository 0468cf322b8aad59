"""What a job records and shows: the run's params and tags, step and epoch metrics, the final
artifacts, and the lines on the console.

Every rank holds a RunLogger and calls it at the same points; only its backend differs. Rank 0's
is `tracking.MlflowRun` (a background thread: training never waits on MLflow), every other
rank's is `tracking.NullRun`, which does nothing, and their console lines are dropped by the
logging level (train/engine/ranklog.py, setup_logging). The metrics themselves are the same on every
rank (train/report/metrics.py reduces them to all ranks).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from train.config.groups import TrainConfig
from train.config.naming import default_run_name
from train.data.build import DataBundle
from train.distributed.env import DistEnv
from train.report import code, modelcard, params
from train.report.progress import Progress
from train.report.trainlog import TrainingLog
from train.tracking import REPO_ROOT, NullRun, TrackingIncomplete, how_to_view, records
from train.tracking.attribution import source_commit

log = logging.getLogger("train")


def flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    """{"optim": {"lr": 0.1}} -> {"optim.lr": "0.1"}; lists and None as their text."""
    flat: dict[str, str] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            flat.update(flatten(value, name + "."))
        else:
            flat[name] = str(value)
    return flat


class RunLogger:
    def __init__(self, cfg: TrainConfig, run: NullRun, progress: Progress) -> None:
        self.cfg, self.run = cfg, run
        self.training = TrainingLog(cfg, run, progress)
        """What the training loop reports (train/report/trainlog.py), over the same backend."""
        self.restarts = 0
        self.started = False
        """Whether start() ran - on every rank, right after the ranks' first collective: from
        then on rank 0's run is on its way to the store."""
        self.config_yaml = ""
        self.data_digest: str | None = None
        """data=arrow: the shards' digest (train/data/arrow.py), kept in checkpoints."""
        self._finished = False
        self._flushed = True
        self.output_dir = ""
        """The job's output directory, for messages (set by train/engine/job.py)."""
        self.stop_reason: str | None = None
        """Why training ended before trainer.epochs (early stopping), for summary.json."""
        self.model_card: dict[str, Any] | None = None
        """What the logged model expects and returns (train/report/modelcard.py), once the data
        exists."""

    def start(self, config: Mapping[str, Any], ranks: list[dict[str, str]], env: DistEnv,
              backend: str, tags: Mapping[str, str], config_yaml: str,
              previous: tuple[str, int] | None) -> None:
        """Create the run, or continue `previous` = (run id, restarts so far) as RUNNING."""
        import torch

        self.started = True
        self.config_yaml = config_yaml
        hosts = ",".join(sorted({r["host"] for r in ranks}))
        devices = ",".join(sorted({r["device"] for r in ranks}))
        self.restarts = previous[1] + 1 if previous else 0
        all_tags = {"world_size": str(env.world_size), "launcher": env.launcher,
                    "backend": backend, "hostnames": hosts, "devices": devices,
                    # Each rank's host, in rank order: where a multi-node job put its ranks.
                    # (MLflow keeps tag values up to 8,000 characters: thousands of ranks cut.)
                    "rank_hostnames": ",".join(r["host"] for r in ranks)[:4000],
                    "torch_version": str(torch.__version__),
                    "git_commit": source_commit() or "unknown",
                    "restarts": str(self.restarts), **tags}
        if self.cfg.tracking.rerun_of:
            all_tags["rerun_of"] = self.cfg.tracking.rerun_of
        # The code it runs (report/code.py): once, by the rank that records (git runs here,
        # before any DataLoader worker is forked: see tracking/run.py's start).
        code_record = code.collect(config, REPO_ROOT) if env.is_main and not previous else None
        if code_record is not None:
            all_tags.update(code_record.tags)
        name = self.cfg.tracking.run_name or default_run_name(self.cfg, self.output_dir)
        self.run.start(all_tags, run_name=name,
                       resume_run_id=previous[0] if previous else None)
        if previous:
            log.info("continuing MLflow run %s (restart %d)", previous[0], self.restarts)
        else:  # a continued run holds them already
            self.run.log_params(flatten(params.applicable(config)))
            self.run.log(records.Text(text=config_yaml, artifact_file="config.yaml"))
            for artifact_file, text in (code_record.files if code_record else {}).items():
                self.run.log(records.Text(text=text, artifact_file=artifact_file))
        # Each start of the job (restarts: 0 the first): a requeued job may run on other nodes
        # and another number of them (cluster.min_nodes), while world_size and hostnames say
        # the last. Tags, not metrics: a chart section of its own would push train/ and val/
        # down every run's page in the UI.
        self.run.set_tags({f"attempt.{self.restarts}.world_size": str(env.world_size),
                           f"attempt.{self.restarts}.nodes": str(len({r["host"] for r in ranks}))})
        log.info("training on %d rank(s) (%s, %s) over %s", env.world_size, backend, devices,
                 hosts)

    def log_data(self, bundle: DataBundle, outputs: int,
                 output_card: dict[str, Any] | None = None) -> None:
        """The data's facts as params (and `model.outputs`: the model's outputs per sample,
        which train/load.py rebuilds it with), the data set as the run's input, the model card."""
        # Not data.num_classes: that key is the config's (the synthetic set's class count).
        facts: dict[str, Any] = {
            "data.num_train": bundle.num_train, "data.num_val": bundle.num_val,
            "data.input_shape": "x".join(map(str, bundle.input_shape)),
            "data.classes": bundle.num_classes,  # train/load.py rebuilds the model
            "model.outputs": outputs}
        if bundle.test is not None:
            facts["data.num_test"] = bundle.num_test
        if bundle.vocab_size is not None:  # token windows: a vocabulary, not classes
            del facts["data.classes"]
            facts.update({"data.vocab_size": bundle.vocab_size,
                          "data.tokenized_with": bundle.tokenizer})
        self.run.log_params({k: str(v) for k, v in facts.items()})
        log.info("data: %s", ", ".join(f"{k}={v}" for k, v in facts.items()))
        if not self.restarts:  # recorded by the first start
            self.run.log(records.DatasetInput(name=f"{self.cfg.data.name}-train",
                                              **asdict(bundle.description())))
        if self.cfg.data.name == "arrow":  # its checkpoints name the shards they trained on
            self.data_digest = bundle.description().digest
        self.model_card = modelcard.describe(bundle.val, self.cfg.data, bundle.input_shape,
                                             bundle.class_names, output_card)
        # The normalisation every batch got (the data set's own statistics, or data.mean/std
        # for an image folder), not the config's defaults.
        used = {f"data.{k}": self.model_card["preprocessing"].get(k) for k in ("mean", "std")}
        self.run.log_params({k: str(v) for k, v in used.items() if v is not None})

    def log_model_params(self, model: Any) -> None:
        """Parameters trained and frozen (model.freeze), and the weights' source (tag
        `weights_source`: a path or a torchvision weights name, never the contents)."""
        from train.models import finetune, pretrained

        counts = finetune.counts(model)
        self.run.log_params({k: str(v) for k, v in counts.items()})
        if weights := pretrained.label(self.cfg.model):
            self.run.set_tags({"weights_source": weights})
        log.info("model: %s", ", ".join(f"{k}={v}" for k, v in counts.items()))

    def stopped_early(self, reason: str) -> None:
        self.stop_reason = reason
        self.run.set_tags({"stop_reason": reason})
        log.info("%s", reason)

    def task_outputs(self, files: Sequence[Path], tables: Mapping[str, dict[str, list]]) -> None:
        """The task's pictures (at the artifact root) and tables (train/tasks/)."""
        for path in files:
            self.run.log(records.ArtifactFile(str(path), None))
        for name, table in tables.items():
            self.run.log(records.Table(table, name))

    def rank_files(self, folder: Path, pattern: str) -> None:
        """Each rank's files in `folder` (stacks, profiles, memory snapshots) as the run's
        `<folder name>/` artifacts."""
        for path in sorted(folder.glob(pattern)):
            self.run.log(records.ArtifactFile(str(path), artifact_path=folder.name))

    def run_fields(self) -> dict[str, Any]:
        """What a checkpoint needs to continue this run."""
        fields = {"run_id": self.run.run_id, "config": self.config_yaml,
                  "restarts": self.restarts}
        if self.data_digest is not None:  # data=arrow: checkpoint_match compares it
            fields["data_digest"] = self.data_digest
        return fields

    def log_outputs(self, files: Sequence[tuple[str, Path]], model: Any, example: Any) -> None:
        """The job's final files (artifact folder, file) and the model (and its registration:
        tracking.register_model)."""
        for artifact_path, path in files:
            self.run.log(records.ArtifactFile(str(path), artifact_path or None))
        tracking = self.cfg.tracking
        if tracking.log_model:
            card = self.model_card and {**self.model_card, "input": {
                **self.model_card["input"], "dtype": str(example.dtype)}}
            self.run.log(records.Model(model, example, card, export=bool(tracking.register_model)))
        # A sweep's jobs with register_best_of_sweep leave it to the sweep's end
        # (train/tracking/sweep.py).
        if tracking.register_model and not (tracking.register_best_of_sweep
                                            and tracking.parent_run_id):
            self.run.log(records.RegisterModel(tracking.register_model))

    def summary(self, peak_rss_mb: list[float]) -> dict[str, Any]:
        """summary.json: what scripts (and `make bench`) read back."""
        self.run.log_metrics({"peak_rss_mb_max": max(peak_rss_mb)}, step=self.cfg.trainer.epochs)
        # For the run id. If MLflow has not taken everything within flush_timeout_s now, the
        # end does not wait that long a second time.
        self._flushed = self.run.flush()
        return {"run_id": self.run.run_id, "epochs": self.cfg.trainer.epochs,
                "max_steps": self.cfg.trainer.max_steps,
                "stop_reason": self.stop_reason,
                "metrics": self.training.final_metrics,
                "by_epoch": self.training.by_epoch,
                "first_step_at": self.training.first_step_at,
                "peak_rss_mb": peak_rss_mb}

    def finish(self, error: str | None = None, stopped_by: str | None = None) -> None:
        """End the run: FINISHED; FAILED with `error`; or KILLED after a stop signal, when it
        waits, with its checkpoint, for the job to run again. Once: a later call does nothing.

        Raises TrackingIncomplete when training succeeded but the store did not take the run's
        end: the job must not look successful then (the message says how to deliver the rest).
        """
        if self._finished:
            return
        self._finished = True
        if stopped_by is not None:
            self.run.set_tags({"stopped_by": stopped_by})
            self.run.finish(status="KILLED", timeout_s=self.cfg.tracking.checkpoint_flush_s)
            return
        delivered = self.run.finish(
            status="FAILED" if error else "FINISHED", error=error,
            timeout_s=None if self._flushed else min(self.cfg.tracking.checkpoint_flush_s,
                                                     self.cfg.tracking.flush_timeout_s))
        run_id = self.run.run_id
        if error is None and not delivered:
            raise TrackingIncomplete(self._undelivered())
        if run_id and error is None:
            shown = "  ".join(f"{k}={v:.4g}" for k, v in self.training.final_metrics.items()
                              if k.startswith(("val/", "test/")) or k == "train/loss")
            log.info("MLflow run %s FINISHED  %s\n  view it: %s", run_id, shown,
                     how_to_view(self.run.uri, self.run.experiment_id, run_id))
        elif run_id:
            # The cause is the run's `error` tag; the launcher's block shows it with the run.
            log.error("MLflow run %s marked FAILED", run_id)

    def _undelivered(self) -> str:
        run = self.run
        where = f"run {run.run_id}" if run.run_id else "the run (never created)"
        if run.unsent_path is not None:
            return (f"training finished, but the MLflow store {run.uri} did not take all of "
                    f"{where} ({run.failure or 'timed out'}); the rest, its FINISHED status "
                    f"included, is in {run.unsent_path}: once the store is fixed, deliver it "
                    f"with `python -m train outbox upload {run.unsent_path}` (add "
                    "--tracking-uri URI if the store moved).")
        return (f"training finished, but the MLflow store {run.uri} does not hold {where}: "
                f"{run.failure}. The job's files (model.pt, summary.json, checkpoints) are in "
                f"{self.output_dir}.")
