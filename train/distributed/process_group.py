"""The torch.distributed process group: the only module that initialises or tears it down.

Also the few collectives the loop needs, and how the first failing rank's error reaches rank 0.
"""

from __future__ import annotations

import contextlib
import os
import socket
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from train.distributed import devices, phase, stacks, watch
from train.distributed.env import LOCAL, STORE_PORT_FILE_VAR, DistEnv

_FAILURE_KEY = "train/first_failure"
_ANSWERING_KEY = "train/answering/"
_PEER_LOST = ("connection closed by peer", "connection reset by peer", "broken pipe",
              "timed out waiting", "connection refused", "socket timeout",
              "timeout caused pair closure")
"""What gloo/nccl say when a peer stopped answering: the survivor's own error says nothing of
which peer that was."""
STACKS_WAIT_S = 5.0
"""How long the ranks get to dump their stacks after a collective timed out (their watchdogs
poll every watch.POLL_S); a rank that does not answer by then is frozen or dead."""


# Device and backend choice live with the rest of what CUDA decides (train/distributed/devices.py).
select_device = devices.select_device
select_backend = devices.select_backend


def init(env: DistEnv, backend: str, device: torch.device, timeout_s: int,
         host_tensors: bool = False) -> None:
    """Initialise the default process group; the CUDA device is set first, as NCCL requires.
    `host_tensors` (FSDP's shards offloaded to host memory): collectives on CPU tensors too -
    nccl's group gets gloo beside it for them, as torchtitan does (clipping's norm of offloaded
    gradients was all-reduced on the CPU: "No backend type associated with device type cpu")."""
    devices.prepare(device)
    timeout = timedelta(seconds=timeout_s)
    store = _local_store(env, timeout)
    where: dict[str, Any] = {"init_method": "env://"} if store is None else {"store": store}
    dist.init_process_group(backend=devices.group_backend(backend, host_tensors),
                            rank=env.rank, world_size=env.world_size, timeout=timeout,
                            device_id=devices.group_device(device), **where)


def _local_store(env: DistEnv, timeout: timedelta) -> dist.TCPStore | None:
    """A job of the local launcher on this machine alone: rank 0 hosts its store on the port
    the OS gives it as it binds (port 0), and leaves it in STORE_PORT_FILE_VAR's file for the
    other ranks. The port the launcher found free before the ranks started may be another
    process's by then (jobs started together on one machine: EADDRINUSE, the job failed).
    Other launchers (torchrun, Slurm, a node's task): MASTER_PORT, as they set it."""
    port_file = os.environ.get(STORE_PORT_FILE_VAR, "")
    if env.launcher != LOCAL or (env.world_size > 1 and not port_file):
        return None
    if env.rank == 0:  # the others connect to it: it may not wait for them here
        store = dist.TCPStore(env.master_addr, 0, env.world_size, is_master=True,
                              timeout=timeout, wait_for_workers=False)
        if port_file:
            written = Path(f"{port_file}.tmp")
            written.write_text(str(store.port))
            written.replace(port_file)
    else:
        store = dist.TCPStore(env.master_addr, _port_left(Path(port_file), timeout),
                              env.world_size, is_master=False, timeout=timeout)
    os.environ["MASTER_PORT"] = str(store.port)  # where the job's store is, for what reads it
    return store


def _port_left(port_file: Path, timeout: timedelta) -> int:
    """The port rank 0's store bound, once rank 0 has left it in `port_file`."""
    deadline = time.monotonic() + timeout.total_seconds()
    while True:
        with contextlib.suppress(OSError, ValueError):
            return int(port_file.read_text())
        if time.monotonic() > deadline:
            raise TimeoutError(f"rank 0 did not start the job's store within "
                               f"{timeout.total_seconds():.0f} s (distributed.timeout_s)")
        time.sleep(0.02)


def shutdown() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def gather_to_main(obj: Any) -> list[Any] | None:
    """Every rank's `obj` on rank 0 (in rank order); None on the other ranks."""
    phase.enter("collective")
    rank = dist.get_rank()
    out: list[Any] | None = [None] * dist.get_world_size() if rank == 0 else None
    dist.gather_object(obj, out, dst=0)
    return out


def gather_to_all(obj: Any) -> list[Any]:
    """Every rank's `obj` on every rank (in rank order)."""
    phase.enter("collective")
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
    text = f"rank {env.rank} on {socket.gethostname()}: {stacks.error_line(exc)}"
    try:
        store = dist.distributed_c10d._get_default_store()
        store.compare_set(_FAILURE_KEY, "", text)
    except Exception:  # noqa: BLE001 - reporting must never mask the original error
        pass


def lost_a_peer(exc: BaseException) -> bool:
    """Whether `exc` is what gloo/nccl say when a peer stopped answering (not this rank's own
    error)."""
    return any(p in str(exc).lower() for p in _PEER_LOST)


def main_answers() -> bool:
    """Whether rank 0 is still there: its process hosts the job's store."""
    if not dist.is_initialized():
        return False
    try:
        dist.distributed_c10d._get_default_store().check([_FAILURE_KEY])
    except Exception:  # noqa: BLE001 - any failure to reach the store: it is gone
        return False
    return True


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


def failure_reason(env: DistEnv, exc: BaseException, node_of: Callable[[int], str],
                   wait_s: float = 3.0) -> tuple[str, list[int]]:
    """The job's root cause as this rank knows it, and the ranks that stopped answering.

    A rank whose own error is a lost peer does not publish it: it says it still answers and
    waits up to `wait_s` for the others, so the error names the rank (and node) that did not,
    or the real error a living peer published. When rank 0 (hosting the store) is gone, it is
    the one that stopped answering.
    """
    own = f"rank {env.rank} on {socket.gethostname()}: {stacks.error_line(exc)}"
    if not dist.is_initialized() or not lost_a_peer(exc):
        publish_failure(env, exc)
        return first_failure() or own, []
    watch.note_waited(exc)
    try:
        store = dist.distributed_c10d._get_default_store()
        store.set(f"{_ANSWERING_KEY}{env.rank}", "1")
        keys = [f"{_ANSWERING_KEY}{r}" for r in range(env.world_size)]
        deadline = time.monotonic() + wait_s
        while not store.check(keys) and time.monotonic() < deadline:
            if store.check([_FAILURE_KEY]):  # a living peer's real error
                return store.get(_FAILURE_KEY).decode(), []
            if watch.all_gone(r for r, key in enumerate(keys) if not store.check([key])):
                break  # the dead (their processes gone from this host) will not answer
            time.sleep(0.1)
        silent = [r for r, key in enumerate(keys) if not store.check([key])]
    except Exception:  # noqa: BLE001 - the store lives in rank 0's process
        silent = [0] if env.rank != 0 else []
    if not silent:
        publish_failure(env, exc)
        return first_failure() or own, []
    text = _silent_ranks(env, exc, silent, node_of)
    with contextlib.suppress(Exception):
        dist.distributed_c10d._get_default_store().compare_set(_FAILURE_KEY, "", text)
    return text, silent


def _silent_ranks(env: DistEnv, exc: BaseException, silent: list[int],
                  node_of: Callable[[int], str]) -> str:
    """The silent ranks named, stuck where (their stacks, asked for now) or dead or frozen (no
    answer); without a watch (no output directory), as dead."""
    own = watch.current()
    if own is None:
        names = ", ".join(f"rank {r} on {node_of(r)}" for r in silent)
        return f"{names} stopped answering (its process or node died); rank {env.rank} saw: {exc}"
    answered, waited = watch.request_stacks(STACKS_WAIT_S)
    return stacks.explain(own.out, silent, node_of, answered, waited)


def barrier() -> None:
    phase.enter("collective")
    dist.barrier()


def any_rank(flag: bool) -> bool:
    """True on every rank if `flag` is true on any (one small collective)."""
    phase.enter("collective")
    value = devices.collective_tensor(torch.tensor([1 if flag else 0], dtype=torch.int64),
                                      dist.get_backend())
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return bool(value.item())
