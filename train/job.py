"""One rank of a training job, from environment to finished (or failed) MLflow run.

`run_rank` is what every process runs, however it was started: by the local launcher, by
torchrun, by srun or by submitit.
"""

from __future__ import annotations

import logging
import os
import resource
import signal
import socket
import sys
from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf
from torch.nn.parallel import DistributedDataParallel as DDP

from train import checkpoint, distenv, distributed, loop, models, optim
from train import data as data_lib
from train.config import TrainConfig, to_typed
from train.report import open_reporter

log = logging.getLogger("train")


def setup_logging(rank: int, log_file: Path) -> None:
    """Rank 0 tells the story; the other ranks speak only about problems. On stderr, and in the
    job's log file beside its outputs (Hydra's train.log), which every rank appends to."""
    level = logging.INFO if rank == 0 else logging.WARNING
    fmt = "[%(asctime)s][rank " + str(rank) + "][%(levelname)s] %(message)s"
    log_file.parent.mkdir(parents=True, exist_ok=True)
    logging.basicConfig(level=level, format=fmt, datefmt="%H:%M:%S", force=True,
                        handlers=[logging.StreamHandler(sys.stderr),
                                  logging.FileHandler(log_file, mode="a")])


def _rank_info(device: torch.device) -> dict[str, str]:
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    return {"host": socket.gethostname(), "device": name}


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def build_state(cfg: TrainConfig, bundle: data_lib.DataBundle,
                device: torch.device) -> loop.TrainState:
    if device.type == "cuda":  # fixed input shapes: let cuDNN pick the fastest kernels once
        torch.backends.cudnn.benchmark = True
    spec = models.InputSpec(bundle.channels, bundle.image_size, bundle.num_classes)
    model: torch.nn.Module = models.build(cfg.model, spec)
    if cfg.distributed.sync_batchnorm:
        model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(model)
    model = model.to(device)
    if cfg.trainer.channels_last:
        model = model.to(memory_format=torch.channels_last)
    ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None,
              find_unused_parameters=cfg.distributed.find_unused_parameters,
              gradient_as_bucket_view=cfg.distributed.gradient_as_bucket_view,
              static_graph=cfg.distributed.static_graph,
              bucket_cap_mb=cfg.distributed.bucket_cap_mb)
    if cfg.trainer.compile:
        ddp = torch.compile(ddp)  # type: ignore[assignment]
    optimizer = optim.build_optimizer(cfg.optim, model)
    scheduler = optim.build_scheduler(cfg.optim, optimizer, len(bundle.train), cfg.trainer.epochs)
    scaler = torch.amp.GradScaler(device.type, enabled=cfg.trainer.precision == "fp16-mixed")
    return loop.TrainState(ddp, optimizer, scheduler, scaler)


def run_rank(config: dict[str, Any], output_dir: str, command: str,
             own_process: bool = True) -> dict[str, float]:
    """Train on this rank; rank 0 returns the final metrics, the other ranks an empty dict.

    `own_process=False`: a one-rank job run inside the launching process (a local sweep runs
    several in turn), which keeps Hydra's logging and gets its signal handlers back.
    """
    env = distenv.detect()
    if own_process:
        setup_logging(env.rank, Path(output_dir) / "train.log")
    if "OMP_NUM_THREADS" not in os.environ:
        # As torchrun does: ranks sharing a node share its CPUs instead of each taking all.
        torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // env.local_world_size))
    cfg: TrainConfig = to_typed(config)
    out = Path(output_dir)
    device = distributed.select_device(cfg.distributed.device, env.local_rank)
    backend = distributed.select_backend(cfg.distributed.backend, device)
    distributed.init(env, backend, device, cfg.distributed.timeout_s)
    reporter = open_reporter(cfg, env.is_main, out)
    checkpointer = checkpoint.Checkpointer(
        checkpoint.directory(out), cfg.trainer.checkpoint_every,
        cfg.trainer.checkpoint_interval_min, cfg.trainer.keep_checkpoints, env.rank,
        env.world_size)
    previous_handlers = checkpointer.install_signal_handlers()
    try:
        resumed = checkpoint.find(cfg.trainer.resume, out)
        # The run exists before anything that can fail on one node (data, model): such a
        # failure then shows in MLflow as a FAILED run with the failing rank's error.
        ranks = distributed.gather_to_main(_rank_info(device))
        reporter.start(config=config, ranks=ranks, backend=backend, output_dir=out, env=env,
                       run_name=cfg.tracking.run_name, config_yaml=OmegaConf.to_yaml(config),
                       command=command, resume=cfg.trainer.resume,
                       checkpoint_run_id=resumed.state.get("run_id") if resumed else None,
                       checkpoint_restarts=resumed.state.get("restarts") if resumed else None)
        bundle = data_lib.build(cfg.data, env.rank, env.world_size, env.local_world_size, device,
                                cfg.trainer.seed, cfg.trainer.channels_last)
        reporter.log_params({"data.num_train": bundle.num_train, "data.num_val": bundle.num_val})
        reporter.class_names = bundle.class_names
        reporter.log_dataset(cfg.data.name, bundle.source, bundle.train_index)
        torch.manual_seed(cfg.trainer.seed)  # identical initial weights on every rank
        state = build_state(cfg, bundle, device)
        reporter.describe_model(state.model, bundle.channels, bundle.image_size, device,
                                cfg.trainer.precision, cfg.trainer.peak_tflops, env.world_size)
        torch.manual_seed(cfg.trainer.seed + env.rank)  # different augmentation per rank
        if resumed is not None:
            checkpoint.restore(state, resumed, env.rank, env.world_size)
        loop.fit(cfg, state, bundle, device, reporter, env.rank, env.local_rank, checkpointer)
        example = next(iter(bundle.val))[0][:4].cpu().numpy()  # batch > 1: any size loads back
        reporter.save_model(state.model, out, example)
        reporter.write_summary(out, distributed.gather_to_main(peak_rss_mb()))
        reporter.finish()
        return dict(reporter.final_metrics)
    except checkpoint.Preempted as stop:
        log.warning("rank %d: %s", env.rank, stop)
        reporter.preempted(stop.signal_name, cfg.cluster.max_requeues if cfg.cluster else 0)
        raise
    except BaseException as exc:
        distributed.publish_failure(env, exc)
        reason = distributed.first_failure() or f"rank {env.rank}: {type(exc).__name__}: {exc}"
        reporter.finish(error=reason)
        raise
    finally:
        distributed.shutdown()
        if not own_process:
            for number, handler in previous_handlers.items():
                signal.signal(number, handler)
