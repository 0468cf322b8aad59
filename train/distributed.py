"""The torch.distributed process group: the only module that initialises or tears it down.

Also the few collectives the loop needs, and how the first failing rank's error reaches rank 0.
"""

from __future__ import annotations

import socket
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from train import devices
from train.distenv import DistEnv

_FAILURE_KEY = "train/first_failure"


# Device and backend choice live with the rest of what CUDA decides (train/devices.py).
select_device = devices.select_device
select_backend = devices.select_backend


def init(env: DistEnv, backend: str, device: torch.device, timeout_s: int) -> None:
    """Initialise the default process group; the CUDA device is set first, as NCCL requires."""
    devices.prepare(device)
    dist.init_process_group(backend=backend, init_method="env://", rank=env.rank,
                            world_size=env.world_size, timeout=timedelta(seconds=timeout_s),
                            device_id=devices.group_device(device))


def shutdown() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def gather_to_main(obj: Any) -> list[Any] | None:
    """Every rank's `obj` on rank 0 (in rank order); None on the other ranks."""
    rank = dist.get_rank()
    out: list[Any] | None = [None] * dist.get_world_size() if rank == 0 else None
    dist.gather_object(obj, out, dst=0)
    return out


def gather_to_all(obj: Any) -> list[Any]:
    """Every rank's `obj` on every rank (in rank order)."""
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def publish_failure(env: DistEnv, exc: BaseException) -> None:
    """Leave the first failing rank's error in the job's store so rank 0 can report it.

    Peers of a failed rank only see "connection closed"; the store (hosted by rank 0) keeps
    what actually went wrong. Best effort: the store may already be gone.
    """
    if not dist.is_initialized():
        return
    text = f"rank {env.rank} on {socket.gethostname()}: {type(exc).__name__}: {exc}"
    try:
        store = dist.distributed_c10d._get_default_store()
        store.compare_set(_FAILURE_KEY, "", text)
    except Exception:  # noqa: BLE001 - reporting must never mask the original error
        pass


def first_failure(wait_s: float = 2.0) -> str | None:
    """The error the first failing rank published, if any (waits briefly for it)."""
    if not dist.is_initialized():
        return None
    try:
        store = dist.distributed_c10d._get_default_store()
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            if store.check([_FAILURE_KEY]):
                return store.get(_FAILURE_KEY).decode()
            time.sleep(0.1)
    except Exception:  # noqa: BLE001
        return None
    return None


def barrier() -> None:
    dist.barrier()


def any_rank(flag: bool) -> bool:
    """True on every rank if `flag` is true on any (one small collective)."""
    value = devices.collective_tensor(torch.tensor([1 if flag else 0], dtype=torch.int64),
                                      dist.get_backend())
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return bool(value.item())
