"""Where local ranks are forked from: multiprocessing's fork server, started with the imports
the job's ranks need (train/launch/fork_server.py, `preloads`) and the signals it must not die
of held. Light at import: the launching process imports it before torch.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
from typing import Any

from train.distributed import env as distenv
from train.launch import rank_process


def rank_context(data: dict[str, Any] | None = None) -> Any:
    """Ranks are forked from multiprocessing's fork server (one per launching process, shared
    by the jobs of a local sweep): a clean process that imported torch once
    (train/launch/fork_server.py), rather than each rank a fresh interpreter importing it
    again, with what the job's data needs (`preloads`); the first call starts it, later ones
    find it running. Not a fork of this process: it may hold threads and locks (mlflow, a
    sweep's). What the ranks need of this process's state comes with them: its environment and
    umask as arguments, its working directory and sys.path from multiprocessing. The server
    starts with the stop signals blocked - a TERM to the job's process group must not kill it,
    as the ranks' exit codes come back through it - and each rank unblocks them once its own
    handlers are in place (rank_process.end_with)."""
    from multiprocessing import forkserver

    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["train.launch.fork_server", *preloads(data or {})])
    _start_resource_tracker()
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, rank_process.HELD_SIGNALS)
    os.environ[distenv.FORK_SERVER_VAR] = str(os.getpid())
    try:
        forkserver.ensure_running()
    finally:
        os.environ.pop(distenv.FORK_SERVER_VAR, None)
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
    return ctx


def preloads(data: dict[str, Any]) -> list[str]:
    """What the fork server imports, beyond torch and the training code, for the ranks of a
    job on `data`: torchvision for image transforms (each rank imported it after the fork,
    0.3-0.5 s). Not `datasets`: importing it starts pyarrow's jemalloc thread, and the
    server is kept free of threads beyond torch's own; with that thread turned off, the first
    step came 0.66 s later than with each rank importing it (docs/benchmarks.md, 2026-12-04)."""
    return ["torchvision"] if data.get("name") in ("imagefolder", "arrow") else []


def _start_resource_tracker() -> None:
    """multiprocessing's helper process (it unlinks the queue's semaphores) ignores INT and
    TERM but would die of a closed terminal's HUP, and its successor then prints KeyErrors:
    started with HUP ignored, it inherits that."""
    from multiprocessing import resource_tracker

    previous = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        resource_tracker.ensure_running()
    finally:
        signal.signal(signal.SIGHUP, previous)
