"""THE pre-flight: everything refused before a rank starts (local runs and sweeps) or a job is
submitted (Slurm), each with one message that says what to do about it.

Light on purpose (no torch, torchvision or mlflow at import time): `--help`, `--cfg` and a refused
configuration answer in well under a second; the heavy imports happen only for the checks that
need them (a torchvision model name, a data set on disk, local GPUs).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from train.config import groups as config_lib
from train.config.groups import CustomModelConfig, DataConfig, TrainConfig

# Re-exported: callers and tests reach validation through the pre-flight.
from train.config.validation import DATASET_NAMES as DATASET_NAMES
from train.config.validation import MODEL_NAMES as MODEL_NAMES
from train.config.validation import validate as validate
from train.errors import ConfigError, LaunchError
from train.launch.model_checks import (
    check_finetuning,
    check_model,
    check_monitor,
    check_optimiser,
    check_registrable,
    check_task,
    check_text_model,
    check_token_data,
    input_before_reading,
)


def preflight(cfgs: Sequence[TrainConfig], on_slurm: bool = False, dry_run: bool = False,
              prepare_tracking: bool = False, output_dir: str | None = None) -> str | None:
    """Check every job of a run or sweep; returns the experiment id when `prepare_tracking`
    (the launching process then creates the experiment once, for all of its jobs).

    Locally each job's world size is distributed.nproc_per_node, and that many GPUs must be
    here for nccl/cuda. `on_slurm`: the world size is the cluster request's, checked first
    along with sbatch, the controller and the partitions; `dry_run` checks only the request
    and the config (no cluster, data set or store needed to print a script).

    Raises ConfigError (the config itself) or LaunchError (what this machine, the cluster, the
    data or the store lacks); nothing has started or been submitted then. `output_dir`: a
    single job's directory, whose own checkpoint (trainer.resume=auto) is checked too.
    """
    from train.launch import submit as slurm

    checked: set[str] = set()
    try:
        if on_slurm and not dry_run:
            slurm.check_slurm(cfg.cluster.partition for cfg in cfgs if cfg.cluster)
        for cfg in cfgs:
            world_size = slurm.check_request(cfg) if on_slurm else cfg.distributed.nproc_per_node
            validate(cfg, world_size)
            if on_slurm and (fewest := slurm.smallest_world_size(cfg.cluster)) != world_size:
                validate(cfg, fewest)  # an elastic job may resume on cluster.min_nodes
            if dry_run:
                continue
            resuming = check_resume(cfg, world_size, output_dir if len(cfgs) == 1 else None)
            known = input_before_reading(cfg.data)  # an image folder's: one directory scan
            if cfg.task.name != "classification":  # the input shape is not all of its data
                known = None
                check_task(cfg)
            if known and (problem := cfg.eval.data_problem(cfg.data.name, *known)):
                raise ConfigError(problem)  # python -m train eval on data of another shape
            check_model(cfg)
            check_finetuning(cfg, resuming, known)
            check_optimiser(cfg, known)
            named_classes = check_data(cfg)  # a custom Dataset's, where it names them
            check_monitor(cfg, known[1] if known else named_classes)
            check_registrable(cfg, known, checked)
            if not on_slurm:
                check_local_devices(cfg)
                check_temp_dir(cfg)
        if dry_run or not cfgs[0].tracking.enabled:
            return None
        return check_tracking(cfgs[0], on_slurm, prepare_tracking)
    except slurm.SubmitError as e:
        raise LaunchError(str(e)) from None


def check_resume(cfg: TrainConfig, world_size: int, output_dir: str | None) -> bool:
    """trainer.resume names a checkpoint that exists, and the checkpoint to be resumed (that
    one, or this output directory's own) fits this job: the same model, data shape and
    optimiser, and the same world size if it was taken mid-epoch. No torch import when there
    is no checkpoint to look at. Returns whether the job will continue from a checkpoint (or
    has finished already)."""
    from pathlib import Path

    resume = cfg.trainer.resume
    if resume == "never":
        return False
    if resume != "auto" and not Path(resume).exists():
        raise ConfigError(f"trainer.resume={resume}: no such file or directory. Give a "
                          "checkpoint file or a checkpoints/ directory, or trainer.resume=auto "
                          "or never.")
    folder = (Path(output_dir) / "checkpoints") if resume == "auto" and output_dir else (
        None if resume == "auto" else Path(resume))
    if folder is None or not (folder.is_file() or folder.name.endswith(".dcp")
                              or any(folder.glob("step-*.pt")) or any(folder.glob("step-*.dcp"))):
        if resume != "auto":
            raise ConfigError(f"trainer.resume={resume}: no checkpoint there (step-<N>.pt or "
                              "step-<N>.dcp).")
        return False
    from train.engine import checkpoint_folder, checkpoint_match, job

    if output_dir and job.finished_already(cfg, Path(output_dir)) is not None:
        return True  # the job itself says so, and changes nothing
    try:
        found = checkpoint_folder.find(resume, Path(output_dir or "."))
        if found is not None:
            checkpoint_match.check_compatible(found, config_dict(cfg), world_size)
    except checkpoint_match.CheckpointMismatch as e:
        raise ConfigError(str(e)) from None
    return found is not None


def config_dict(cfg: TrainConfig) -> dict:
    """The typed config as the composed dict it came from (as a checkpoint stores it)."""
    from dataclasses import asdict

    as_dict = asdict(cfg)
    if isinstance(cfg.model, CustomModelConfig):
        m = cfg.model
        as_dict["model"] = {"_target_": m.target, **m.kwargs, "weights": m.weights,
                            "weights_strict": m.weights_strict, "freeze": m.freeze}
    return as_dict


def check_text_data(cfg: TrainConfig, layout: Any, encoder: Any, target: str) -> None:
    """data=arrow's text column (`target`: the target's column): the model takes the
    tokenizer's ids and data.max_length of them; data.tokenize=map's cache can be written (a
    staged set's goes into the copy)."""
    from train.data import arrow_split

    names = arrow_split.class_names(arrow_split.read_split(layout.splits["train"]), target) or []
    check_text_model(cfg, encoder.vocab_size, encoder.pad_id, len(names))
    if cfg.data.tokenize == "map" and (cfg.data.tokenized_to or not cfg.data.stage_to):
        from train.data.pretokenize import writable_problem

        if problem := writable_problem(layout.root, cfg.data.tokenized_to):
            raise LaunchError(problem)


def check_data(cfg: TrainConfig) -> int | None:
    """The data is there and readable. Returns a custom data set's number of classes where its
    Dataset names them (`classes`, `targets`), as it is built here once."""
    if cfg.data.name == "imagefolder":
        check_image_folder(cfg.data)
        return None
    if cfg.data.name == "tokens":
        check_token_data(cfg)
        return None
    if cfg.data.name == "arrow":
        from train.data import arrow, arrow_split  # shards' headers, a sample of checksums

        try:
            layout = arrow.check(cfg.data.root)
            column, target = arrow_split.columns(layout, cfg.data.input_column,
                                                 cfg.data.target_column)
        except arrow.ArrowDataError as e:
            raise LaunchError(str(e)) from None
        if arrow_split.holds_text(layout, column):  # its tokenizer, loaded (this imports torch)
            from train.data.arrow_source import text_encoder

            check_text_data(cfg, layout, text_encoder(cfg.data, layout, column), target)
        return None
    if cfg.data.name == "custom":
        from train.data import userdata  # imports the user's package (and torch)
        from train.tasks import build as tasks

        task = tasks.build(cfg.task)
        return userdata.check(cfg.data.train, cfg.data.val, cfg.data.test,
                              task.target_problem, classes=cfg.task.name == "classification")
    if not config_lib.reads_files(cfg.data):
        return None  # nothing on disk to look for: no torch import for digits or synthetic
    from train.data import datasets

    try:
        datasets.check_available(cfg.data)
    except datasets.DataMissingError as e:
        raise LaunchError(str(e)) from None
    return None


def check_image_folder(data: DataConfig) -> None:
    """The layout (a directory scan, no torch); configured transforms only if there are any
    (they import torchvision). Images are not opened: an unreadable one is skipped when read."""
    from train.data import imagefolder

    try:
        imagefolder.find(data.root)
    except (imagefolder.LayoutError, OSError) as e:
        raise LaunchError(str(e)) from None
    if data.train_transforms is not None or data.eval_transforms is not None:
        from train.data import streaming

        streaming.transforms(data, train=True)
        streaming.transforms(data, train=False)


def check_temp_dir(cfg: TrainConfig) -> None:
    """A TMPDIR too long for the DataLoader workers' sockets (data/tempdir.py), for
    local jobs; a Slurm node's own TMPDIR is checked by its ranks as they make their workers.
    data.num_workers=null may come to 0 workers on a small machine: refused all the same."""
    from train.data.tempdir import temp_dir_problem

    workers = 1 if cfg.data.num_workers is None else cfg.data.num_workers
    if (problem := temp_dir_problem(workers)) is not None:
        raise LaunchError(problem)


RANKS_PER_CPU = 2
"""Local ranks beyond this many per CPU only slow each other down (and each holds a copy of
the model and its data): 3 ranks on 2 CPUs still run, 1000 are refused."""


def check_local_devices(cfg: TrainConfig) -> None:
    """At most RANKS_PER_CPU local ranks per CPU; nccl or device=cuda: one GPU per local rank; no
    CUDA-only option without CUDA."""
    d = cfg.distributed
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    if d.nproc_per_node > RANKS_PER_CPU * (cpus or 1):
        raise LaunchError(
            f"distributed.nproc_per_node={d.nproc_per_node} local ranks, but this machine lets "
            f"this process use {cpus} CPUs (at most {RANKS_PER_CPU} ranks per CPU). Lower "
            "nproc_per_node, or run on more nodes (+cluster=slurm cluster.nodes=N).")
    # device=auto on a machine with GPUs (its device files; the count needs torch) puts each
    # rank on a GPU of its own.
    gpus_for_auto = d.device == "auto" and d.nproc_per_node > 1 \
        and next(Path("/dev").glob("nvidia[0-9]*"), None) is not None
    if d.backend != "nccl" and d.device != "cuda" and not d.sync_batchnorm \
            and not cfg.trainer.memory_snapshot and not gpus_for_auto:
        return  # no torch import
    from train.distributed import devices

    if problem := devices.local_gpu_problem(d) or devices.refuse_memory_snapshot(
            cfg.trainer.memory_snapshot, d.device):
        raise LaunchError(problem)


def check_tracking(cfg: TrainConfig, on_slurm: bool, prepare: bool) -> str | None:
    """The store answers from here; with `prepare`, the experiment id for every job.

    The experiment is created (and a new SQLite store migrated) here, once: parallel jobs
    racing to do either put runs into the Default experiment or corrupt the database."""
    from train import tracking
    from train.launch import submit as slurm

    try:
        uri = tracking.resolve_uri(cfg.tracking)
        tracking.check_reachable(uri)
        from train.tracking import auth, client

        # A refused login or experiment, a store that can never take a run: one line now,
        # not a job retrying later.
        auth.check_credentials(uri, None if cfg.tracking.experiment_id else cfg.tracking.experiment)
        client.check_usable(uri, cfg.tracking.experiment)
        if on_slurm and tracking.is_local_path_uri(uri):
            slurm.warn_local_store(uri)
        if not prepare:
            return None
        return client.prepare(cfg.tracking)
    except tracking.TrackingError as e:
        raise LaunchError(str(e)) from None
