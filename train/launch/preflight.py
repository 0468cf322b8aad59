"""THE pre-flight: everything refused before a rank starts (local runs and sweeps) or a job is
submitted (Slurm), each with one message that says what to do about it.

Light on purpose (no torch, torchvision or mlflow at import time): `--help`, `--cfg` and a refused
configuration answer in well under a second; the heavy imports happen only for the checks that
need them (a torchvision model name, a data set on disk, local GPUs).
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from train.config import groups as config_lib
from train.config.groups import CustomModelConfig, DataConfig, TrainConfig, TrainerConfig

# Re-exported: callers and tests reach validation through the pre-flight.
from train.config.validation import DATASET_NAMES as DATASET_NAMES
from train.config.validation import MODEL_NAMES as MODEL_NAMES
from train.config.validation import monitor_problem
from train.config.validation import validate as validate
from train.errors import ConfigError, LaunchError


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
            if dry_run:
                continue
            resuming = check_resume(cfg, world_size, output_dir if len(cfgs) == 1 else None)
            known = input_before_reading(cfg.data)  # an image folder's: one directory scan
            check_model(cfg)
            check_finetuning(cfg, resuming, known)
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
    if folder is None or not (folder.is_file() or any(folder.glob("step-*.pt"))):
        if resume != "auto":
            raise ConfigError(f"trainer.resume={resume}: no checkpoint there (step-<N>.pt).")
        return False
    from train.engine import checkpoint, job

    if output_dir and job.finished_already(cfg, Path(output_dir)) is not None:
        return True  # the job itself says so, and changes nothing
    try:
        found = checkpoint.find(resume, Path(output_dir or "."))
        if found is not None:
            checkpoint.check_compatible(found, config_dict(cfg), world_size)
    except checkpoint.CheckpointMismatch as e:
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


def check_model(cfg: TrainConfig,
                data_input: tuple[tuple[int, ...], int] | None = None) -> None:
    """The model and the loss. A custom model is built (on the meta device where it can be)
    and run on the data's input shape where that is known: `data_input` (one sample's shape,
    number of classes) as the data check found it, else the built-in sets' (`known_input`);
    where neither is known, it is only imported here, and its output is checked at the first
    training step. No torch import for a built-in model with the default loss."""
    custom = isinstance(cfg.model, CustomModelConfig)
    if not custom and cfg.model.source == "torchvision":
        from train.models.build import torchvision_builders

        if cfg.model.name not in (builders := torchvision_builders()):
            raise ConfigError(f"model=torchvision model.name={cfg.model.name!r} is not a "
                              f"torchvision classification model; choose one of {builders}.")
    if not custom and cfg.trainer.loss == DEFAULT_LOSS:
        return
    from train.config import usercode
    from train.models import build as models

    known = data_input or known_input(cfg.data)
    try:
        if custom and known is not None:
            models.check_output(cfg.model, models.InputSpec.of(*known))
        elif custom:
            models.custom_target(cfg.model)
        if cfg.trainer.loss != DEFAULT_LOSS:
            models.check_loss(cfg.trainer.loss, known[1] if known else None)
    except usercode.UserCodeError as e:
        raise ConfigError(str(e)) from None


def check_finetuning(cfg: TrainConfig, resuming: bool,
                     known: tuple[tuple[int, ...], int] | None) -> None:
    """model.weights found, read (weights only) and, strict, fitting the model; model.freeze
    and optim.param_groups prefixes matching its parameters. The model is built on the meta
    device, where the data's shape is `known` without reading the data (elsewhere the job checks
    at its start). A job that continues a checkpoint takes its weights: model.weights unread."""
    m = cfg.model
    if not (m.weights or m.freeze or cfg.optim.param_groups):
        return  # no torch import
    from train.config import usercode
    from train.models import build as models
    from train.models import finetune, pretrained

    try:
        source = None if resuming else pretrained.resolve(m)
        weights = pretrained.read(source.path, source.label) if source else None
        if known is None:
            return
        spec = models.InputSpec.of(*known)
        model = models.build_on_meta(m, spec)
        if source is not None and weights is not None:
            pretrained.fit(model, source, weights, m.weights_strict, spec.num_classes)
        finetune.check(model, m.freeze, cfg.optim.param_groups)
    except (pretrained.WeightsError, finetune.FinetuneError, usercode.UserCodeError) as e:
        raise ConfigError(str(e)) from None


def input_before_reading(data: DataConfig) -> tuple[tuple[int, ...], int] | None:
    """(one sample's shape, number of classes) of a built-in data set or an image folder's
    class folders; None for a custom data set (known once it is built)."""
    if data.name != "imagefolder":
        return known_input(data)
    from train.data import imagefolder

    return imagefolder.known_input(data.root, data.image_size)


DEFAULT_LOSS = TrainerConfig().loss
BUILTIN_INPUTS: dict[str, tuple[tuple[int, ...], int]] = {
    "digits": ((1, 8, 8), 10), "mnist": ((1, 28, 28), 10), "fashion_mnist": ((1, 28, 28), 10),
    "cifar10": ((3, 32, 32), 10)}
"""One sample's shape and the classes of the built-in data sets (as train/data/datasets.py loads
them), known without loading them."""


def known_input(data: DataConfig) -> tuple[tuple[int, ...], int] | None:
    """(one sample's shape, number of classes) where it is known without reading the data."""
    if data.name == "synthetic":
        return (data.channels, data.image_size, data.image_size), data.num_classes
    return BUILTIN_INPUTS.get(data.name)


def check_data(cfg: TrainConfig) -> int | None:
    """The data is there and readable. Returns a custom data set's number of classes where its
    Dataset names them (`classes`, `targets`), as it is built here once."""
    if cfg.data.name == "imagefolder":
        check_image_folder(cfg.data)
        return None
    if cfg.data.name == "custom":
        from train.data import userdata  # imports the user's package (and torch)

        return userdata.check(cfg.data.train, cfg.data.val, cfg.data.test)
    if not config_lib.reads_files(cfg.data):
        return None  # nothing on disk to look for: no torch import for digits or synthetic
    from train.data import datasets

    try:
        datasets.check_available(cfg.data)
    except datasets.DataMissingError as e:
        raise LaunchError(str(e)) from None
    return None


def check_monitor(cfg: TrainConfig, classes: int | None) -> None:
    """A top-5 monitor on a data set of TOP_K classes or fewer, where the classes are known:
    before the data is read, or named by a custom Dataset (one that does not name them: on
    every rank once it is built)."""
    if classes is not None and (problem := monitor_problem(cfg.trainer.monitor, classes)):
        raise ConfigError(problem)


def check_registrable(cfg: TrainConfig, known: tuple[tuple[int, ...], int] | None,
                      checked: set[str]) -> None:
    """tracking.register_model: torch.export traces the model (train/models/exportable.py), where
    its
    input is `known` before the data is read; once per model and input of a sweep."""
    name = cfg.tracking.register_model
    if name and known and (key := repr((cfg.model, known))) not in checked:
        from train.models import build as models
        from train.models import exportable

        spec = models.InputSpec.of(*known)
        exportable.check_registrable(lambda: models.build(cfg.model, spec), known[0],
                                     models.describe(cfg.model), name)
        checked.add(key)


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
    """A TMPDIR too long for the DataLoader workers' sockets (batches.temp_dir_problem), for
    local jobs; a Slurm node's own TMPDIR is checked by its ranks as they make their workers.
    data.num_workers=null may come to 0 workers on a small machine: refused all the same."""
    from train.data.batches import temp_dir_problem

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
    if d.backend != "nccl" and d.device != "cuda" and not d.sync_batchnorm:
        return  # no torch import
    from train.distributed import devices

    if problem := devices.local_gpu_problem(d):
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
