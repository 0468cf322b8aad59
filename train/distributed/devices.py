"""Everything that differs between a CUDA device and the CPU, in one place.

Each function below is one branch the rest of the code takes on the device: which device and
backend a rank uses, cuDNN's autotuner, SyncBatchNorm, pinned memory, whether an in-memory data
set lives on the device, the device's name and memory (the host's allocator: host_memory.py).
docs/architecture.md ("CUDA") lists
which of them run on the CPU in tests and which only on a GPU (tests/{unit,e2e}/test_gpu.py).

`cuda_only_requests` is what pre-flight refuses on a machine without CUDA
(train/launch/preflight.py):
such an option would otherwise start every rank, create a run and then fail inside it.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Mapping

import torch
from torch import nn

from train.config.groups import DistributedConfig
from train.errors import DistEnvError

log = logging.getLogger(__name__)


def cuda_available() -> bool:
    return torch.cuda.is_available()


def select_device(requested: str, local_rank: int, local_world_size: int = 1) -> torch.device:
    """distributed.device for this rank: cpu, or its GPU (auto: a GPU if any), as `gpu_for_rank`
    binds it; logs which physical GPU that is."""
    if requested == "cpu" or (requested == "auto" and not cuda_available()):
        return torch.device("cpu")
    if not cuda_available():
        raise DistEnvError("distributed.device=cuda but no CUDA device is visible.")
    index, name, visible = gpu_for_rank(torch.cuda.device_count(), local_rank, local_world_size)
    log.info("local rank %d of %d: cuda:%d = GPU %s (CUDA_VISIBLE_DEVICES=%s)", local_rank,
             local_world_size, index, name, os.environ.get("CUDA_VISIBLE_DEVICES", "unset"))
    if visible > max(1, local_world_size):
        log.warning("%d GPUs visible for %d ranks on this node: %d stay idle", visible,
                    local_world_size, visible - local_world_size)
    return torch.device("cuda", index)


def gpu_for_rank(count: int | None, local_rank: int, local_world_size: int,
                 environ: Mapping[str, str] = os.environ) -> tuple[int, str, int]:
    """(CUDA index, physical GPU, GPUs visible) for this rank, from CUDA_VISIBLE_DEVICES as
    Slurm or the user set it; `count` is torch's device count (None: the variable's)."""
    visible = visible_gpus(count, environ.get("CUDA_VISIBLE_DEVICES"))
    index = choose_gpu(visible, local_rank, local_world_size)
    return index, visible[index], len(visible)


def visible_gpus(count: int | None, cuda_visible_devices: str | None) -> list[str]:
    """The GPUs this process sees, in CUDA's order, by the names it was given them under:
    CUDA_VISIBLE_DEVICES' entries (Slurm's physical indices, or UUIDs), else 0..count-1.
    `count` (torch's device count; None: trust the variable) drops entries CUDA ignored."""
    if cuda_visible_devices is None:
        return [str(i) for i in range(count or 0)]
    names = [name.strip() for name in cuda_visible_devices.split(",") if name.strip()]
    return names if count is None else names[:count]


def choose_gpu(visible: list[str], local_rank: int, local_world_size: int) -> int:
    """The CUDA index of this rank's GPU, from what Slurm (or the user) made visible.

    Each rank sees all the node's GPUs (`--gpus-per-node`/`--gres=gpu:N`, one task per GPU):
    it takes the one at its local rank. It sees exactly one (`--gpus-per-task=1`,
    `--gpu-bind=single:1`, a device cgroup): that one. Anything else would put two ranks on
    one GPU or leave a rank without one, so it is refused in one line that says how to ask.
    (More GPUs than ranks is allowed: the extra ones idle, as torchrun on a bigger machine.)
    """
    if len(visible) == 1:
        return 0
    if len(visible) >= local_world_size and local_rank < len(visible):
        return local_rank
    shown = ",".join(visible) if visible else "(none)"
    raise DistEnvError(
        f"GPU binding: local rank {local_rank} of {local_world_size} ranks on this node sees "
        f"{len(visible)} GPUs (CUDA_VISIBLE_DEVICES={shown}), but a rank must see all the "
        f"node's GPUs, one per rank, or exactly one. On Slurm ask for one GPU per task: "
        f"--gpus-per-task=1, or --gpus-per-node={local_world_size} (--gres=gpu:"
        f"{local_world_size}) with --ntasks-per-node={local_world_size} "
        f"(cluster.gpus_per_node = cluster.tasks_per_node).")


def select_backend(requested: str, device: torch.device) -> str:
    """distributed.backend: auto is nccl on a GPU, gloo on the CPU."""
    if requested == "auto":
        return "nccl" if device.type == "cuda" else "gloo"
    return requested


def prepare(device: torch.device) -> None:
    """Before the process group: NCCL needs the rank's GPU set as current; with fixed input
    shapes, cuDNN's autotuner picks the fastest kernels once."""
    if device.type == "cuda":
        torch.cuda.set_device(device)
        torch.backends.cudnn.benchmark = True


def group_backend(backend: str, host_tensors: bool) -> str:
    """init_process_group's backend: nccl with gloo beside it for CPU tensors where the job
    reduces some (offloaded FSDP shards), else the backend alone."""
    return "cuda:nccl,cpu:gloo" if backend == "nccl" and host_tensors else backend


def group_device(device: torch.device) -> torch.device | None:
    """init_process_group's device_id: binds NCCL's communicator to the GPU up front."""
    return device if device.type == "cuda" else None


def ddp_device_ids(device: torch.device) -> list[int] | None:
    return [device.index] if device.type == "cuda" else None


def collective_tensor(value: torch.Tensor, backend: str) -> torch.Tensor:
    """NCCL reduces only tensors on the GPU; gloo takes them where they are."""
    return value.cuda() if backend == "nccl" else value


def sync_batchnorm(module: nn.Module, enabled: bool) -> nn.Module:
    """distributed.sync_batchnorm: BatchNorm statistics over all ranks (GPU modules only;
    pre-flight refuses it without CUDA)."""
    return nn.SyncBatchNorm.convert_sync_batchnorm(module) if enabled else module


def pin_memory(device: torch.device) -> bool:
    """Page-locked host buffers let host-to-GPU copies run asynchronously; no use on a CPU."""
    return device.type == "cuda"


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor onto `device` without making the host wait (pinned first on a GPU)."""
    if pin_memory(device):
        tensor = tensor.pin_memory()
    return tensor.to(device, non_blocking=True)


def keep_data_on_device(on_device: bool, device: torch.device) -> bool:
    """data.on_device: an in-memory data set lives on the GPU (no loader, no per-step copy). On
    a CPU the data is already where training happens: the loader path serves it."""
    return on_device and device.type == "cuda"


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def memory_stats(device: torch.device) -> dict[str, float]:
    """Every visible GPU's memory in use and utilisation; nothing on a CPU. The other ranks'
    GPUs are read through NVML (pynvml; without it, not at all): CUDA's own query would open a
    context of this process on each (~0.5 GB, and an error where GPUs are in exclusive mode)."""
    stats: dict[str, float] = {}
    if device.type != "cuda":
        return stats
    for index in range(torch.cuda.device_count()):
        with contextlib.suppress(Exception):  # NVML (pynvml) may be missing
            if index == device.index:
                free, total = torch.cuda.mem_get_info(index)
                used = total - free
            else:
                used = torch.cuda.device_memory_used(index)
            stats[f"gpu_{index}_memory_usage_megabytes"] = used / 2**20
        with contextlib.suppress(Exception):  # needs NVML (pynvml), which may be missing
            stats[f"gpu_{index}_utilization_percentage"] = float(torch.cuda.utilization(index))
    return stats


def cuda_only_requests(cfg: DistributedConfig) -> list[str]:
    """The options of `cfg` that only a CUDA device can serve."""
    wanted = [f"distributed.backend={cfg.backend}"] if cfg.backend == "nccl" else []
    if cfg.device == "cuda":
        wanted.append("distributed.device=cuda")
    if cfg.sync_batchnorm:
        wanted.append("distributed.sync_batchnorm=true")
    return wanted


_HINTS = {"distributed.backend=nccl": "distributed.backend=auto picks gloo on the CPU",
          "distributed.device=cuda": "distributed.device=auto trains on the CPU",
          "distributed.sync_batchnorm=true": "without it BatchNorm statistics stay per rank"}


def local_gpu_problem(cfg: DistributedConfig, gpus: int | None = None) -> str | None:
    """A local job's GPUs (`gpus`: torch's count): nccl or device=cuda need one per local rank
    on this machine, and so does device=auto where it finds a GPU (auto picks nccl there,
    which refuses two ranks on one GPU); no CUDA-only option without CUDA (sync_batchnorm;
    nccl on device=cpu)."""
    gpus = torch.cuda.device_count() if gpus is None else gpus
    on_gpus = cfg.device == "cuda" or (cfg.device == "auto" and gpus > 0)
    one_each = cfg.backend == "nccl" or (on_gpus and cfg.backend == "auto")
    if (one_each or cfg.device == "cuda") and cfg.nproc_per_node > gpus:
        return (f"distributed.nproc_per_node={cfg.nproc_per_node} ranks need as many GPUs with "
                f"backend={cfg.backend} device={cfg.device}, but this machine has {gpus}. Lower "
                "nproc_per_node, or use distributed.device=cpu distributed.backend=gloo.")
    return refuse_without_cuda(cfg)


MEMORY_SNAPSHOT_REFUSED = (
    "trainer.memory_snapshot=true records the CUDA allocator's history, but this machine has no "
    "GPU: drop it (trainer.profile.enabled=true records tensor memory on the CPU as well).")


def refuse_memory_snapshot(wanted: bool, device: str) -> str | None:
    """trainer.memory_snapshot needs a CUDA device to record."""
    return MEMORY_SNAPSHOT_REFUSED if wanted and (device == "cpu" or not cuda_available()) \
        else None


def refuse_without_cuda(cfg: DistributedConfig) -> str | None:
    """One line for pre-flight when `cfg` asks for CUDA this machine (or device=cpu) lacks."""
    wanted = cuda_only_requests(cfg)
    if cfg.device == "cpu" and wanted:  # CUDA or not, these cannot work on CPU tensors
        return (f"{' '.join(wanted)} needs GPU tensors, but distributed.device=cpu: drop it "
                f"({'; '.join(_HINTS[w] for w in wanted)}) or use distributed.device=auto.")
    if not wanted or cuda_available():
        return None
    return (f"{' '.join(wanted)} needs CUDA, but this machine has no GPU: drop "
            f"{'it' if len(wanted) == 1 else 'them'} ({'; '.join(_HINTS[w] for w in wanted)}).")
