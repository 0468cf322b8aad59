"""One rank of an evaluating job (`python -m train eval <run_id>`: train/launch/evaluate.py):
the run's model rebuilt as training built it (DDP or FSDP, at this job's world size), its
weights loaded from the checkpoint the command found, one pass over the split's strided shard
(each sample on exactly one rank: train/engine/evaluation.py), and on rank 0 the result logged
to the evaluated run as eval/<name>/<metric> - its status left as it is - and kept in
eval-<name>.json beside the job's other files.

Loading: a checkpoint file (step-<N>.pt, best.pt) or final weights (model.pt) is read with
`torch.load(weights_only=True)` and loaded whole (FSDP: each rank keeps its shards); a sharded
step-<N>.dcp directory is resharded for this world size by torch.distributed.checkpoint. Weights
the command found only in the store (`runs:/<run_id>/<path>`) are downloaded by rank 0 into the
job's output directory first, where every rank reads them.
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from train.config.groups import TrainConfig
from train.data import build as data_lib
from train.data.batches import Batches
from train.distributed import phase
from train.distributed import process_group as distributed
from train.engine import evaluation, fsdp, sharded
from train.engine import state as train_state
from train.engine.prepare import Job, set_up_task
from train.errors import ConfigError
from train.models import build as models
from train.report.metrics import Reduced
from train.tasks import build as tasks
from train.tasks.base import Task

log = logging.getLogger("train")
RESULT_FILE = "eval-{name}.json"
"""What rank 0 writes in the job's output directory, and logs to the run under eval/."""


def _weights_and_epoch(path: Path) -> tuple[dict[str, Any], int | None]:
    """A weights file's state dict and the epoch it was saved after (None: not recorded); of a
    checkpoint of a trainer.ema run, the average (what the run validated)."""
    state = torch.load(path, map_location="cpu", weights_only=True)
    if isinstance(state, dict) and isinstance(state.get("model"), dict):  # a checkpoint
        return state.get("ema") or state["model"], state.get("epoch")
    summary = path.parent / "summary.json"  # model.pt: its job's summary says how far
    epochs = json.loads(summary.read_text()).get("epochs") if summary.is_file() else None
    return state, epochs


def load_weights(module: nn.Module, path: Path) -> int | None:
    """Collective under FSDP: the checkpoint's model weights into `module`; returns their
    epoch. Weights of another model are a ConfigError naming the first difference."""
    try:
        if sharded.is_checkpoint_dir(path):
            sharded.load_model(path, module)
            return sharded.load_meta(path).get("epoch")
        weights, epoch = _weights_and_epoch(path)
        if fsdp.is_sharded(module):
            fsdp.load_full(module, None, weights)
        else:
            module.load_state_dict(weights)
        return epoch
    except (RuntimeError, KeyError, ValueError) as e:
        first = str(e).strip().splitlines()[0:2]
        raise ConfigError(f"eval.weights: {path} does not hold this run's model "
                          f"({' '.join(first)[:300]}): give a checkpoint of the run.") from None


def results(name: str, reduced: Reduced) -> dict[str, float]:
    """The evaluation's metrics as the run records them: eval/<name>/<metric>."""
    values = {f"eval/{name}/{key}": float(value) for key, value in reduced.values.items()}
    values[f"eval/{name}/samples"] = float(reduced.samples)
    if reduced.items_name is not None:
        values[f"eval/{name}/{reduced.items_name}"] = float(reduced.items)
    return values


@dataclass
class Loaded:
    """The evaluated run's model on this rank, with its weights, and the data it is run on."""

    task: Task
    bundle: data_lib.DataBundle
    spec: models.InputSpec
    state: train_state.TrainState
    batches: Batches | None
    """This rank's strided shard of the split (rank r: samples r, r+W, ...); None: no split
    was asked for (a language model's prompts)."""
    epoch: int | None
    """The epoch the weights were saved after (None: not recorded)."""


def load_run_model(job: Job, split: str | None) -> Loaded:
    """Every rank: the task set up with the data, data of the run's shape checked, the model
    built as training built it (DDP or FSDP at this world size) with the run's weights, and the
    split's shard. Used by `eval` and `predict` (train/engine/predict.py)."""
    cfg, env, device = job.cfg, job.env, job.device
    if cfg.eval.run_id is None or cfg.eval.checkpoint is None:  # as pre-flight refuses it
        raise ConfigError(str(cfg.eval.problem()))
    task = tasks.build(cfg.task)
    phase.enter("data")
    bundle = data_lib.build(cfg.data, env, device, cfg.trainer.seed,
                            channels_last=cfg.trainer.channels_last,
                            classes=getattr(task, "class_targets", False))
    spec = set_up_task(cfg, task, bundle, device)
    if problem := cfg.eval.data_problem(cfg.data.name, bundle.input_shape, spec.num_classes):
        raise ConfigError(problem)
    batches = bundle.test if split == "test" else bundle.val if split == "val" else None
    if batches is None and split is not None:
        raise ConfigError(f"data={cfg.data.name} has no test split: use the val split "
                          f"({cfg.eval.purpose}.split=val), or give a data set with one.")
    phase.enter("model")
    torch.manual_seed(cfg.trainer.seed)
    state = train_state.build(cfg, spec, 1, device, resuming=True)
    path = weights_file(job)
    epoch = load_weights(state.module, path)
    if str(path) != str(cfg.eval.checkpoint):  # the store's: once every rank holds them,
        distributed.barrier()  # it goes (a model of gigabytes, downloaded at each eval)
        if env.is_main:
            shutil.rmtree(path.parent, ignore_errors=True)
    return Loaded(task, bundle, spec, state, batches, epoch)


STORE_WEIGHTS_DIR = "from-store"
"""Where in the job's output directory rank 0 puts weights downloaded from the store."""


def weights_file(job: Job) -> Path:
    """The weights this job loads: the path the command found, or the store's file it named
    (`runs:/<run_id>/<path>`), downloaded by rank 0 into the job's output directory (shared by
    a multi-node job's nodes, as its checkpoints are) while the others wait in a barrier."""
    from train.tracking.files import download_weights, local_copy, split_runs_uri

    ref = str(job.cfg.eval.checkpoint)
    if (parts := split_runs_uri(ref)) is None:
        return Path(ref)
    folder = job.out / STORE_WEIGHTS_DIR
    if job.env.is_main:
        from train.tracking import resolve_uri

        started = time.perf_counter()
        path = download_weights(resolve_uri(job.cfg.tracking), ref, folder)
        log.info("%s downloaded from the store to %s (%.1f MB, %.1f s)", ref, path,
                 path.stat().st_size / 1e6, time.perf_counter() - started)
    distributed.barrier()  # the file is whole before anyone reads it
    return local_copy(folder, parts[1])


def evaluate_run(job: Job) -> dict[str, float]:
    """Every rank: the run's weights evaluated on the split; returns eval/<name>/<metric>."""
    cfg, env = job.cfg, job.env
    loaded = load_run_model(job, cfg.eval.split)
    started = time.perf_counter()
    assert loaded.batches is not None
    reduced = evaluation.test(loaded.state.module, loaded.batches, job.device,
                              cfg.trainer.precision, loaded.task, filler=loaded.state.filler)
    seconds = time.perf_counter() - started
    name = cfg.eval.default_name(cfg.data.name)
    metrics = results(name, reduced)
    if env.is_main:
        record = {"run_id": cfg.eval.run_id, "name": name, "weights": cfg.eval.weights,
                  "checkpoint": cfg.eval.checkpoint, "epoch": loaded.epoch,
                  "data": cfg.data.name, "split": cfg.eval.split, "samples": reduced.samples,
                  "world_size": env.world_size, "seconds": seconds,
                  "samples_per_sec": reduced.samples / seconds if seconds else None,
                  "metrics": metrics}
        result_file = job.out / RESULT_FILE.format(name=name)
        result_file.write_text(json.dumps(record, indent=2))
        log.info("eval %s: %s", name, "  ".join(f"{k}={v:.6g}" for k, v in metrics.items()))
        _log_to_run(cfg, record, result_file)
    return metrics


def _log_to_run(cfg: TrainConfig, record: dict[str, Any], result_file: Path) -> None:
    """Rank 0: the metrics (at the weights' epoch), the data set and weights as tags, and the
    result file, into the evaluated run; its status is left as it is."""
    from train.tracking import resolve_uri
    from train.tracking.client import log_to_finished_run

    run_id, name = str(cfg.eval.run_id), record["name"]
    tags = {f"eval/{name}/data": f"data={record['data']} split={record['split']} "
                                 f"samples={record['samples']}",
            f"eval/{name}/weights": record["checkpoint"] if record["weights"] ==
            record["checkpoint"] else f"{record['weights']}: {record['checkpoint']}"}
    log_to_finished_run(resolve_uri(cfg.tracking), run_id, record["metrics"],
                        int(record["epoch"] or 0), tags, result_file, "eval")
    log.info("logged to run %s as eval/%s/*", run_id, name)
