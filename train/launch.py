"""Local ranks: one run in this process, or N ranks started and supervised on this machine.

This module stays light (no torch, torchvision or mlflow at import time): `--help`, `--cfg` and
a refused configuration answer in well under a second, and the ranks do the heavy imports in
parallel.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing as mp
import multiprocessing.connection
import os
import queue
import signal
import time
import traceback
from dataclasses import dataclass
from typing import Any

from train import distenv

log = logging.getLogger("train")

GRACE_S = 15.0
"""After one rank fails, how long the others get to notice (closed connections) and exit."""


class LaunchError(RuntimeError):
    """Something the user must fix before the job can start."""


class JobFailedError(RuntimeError):
    """A rank failed; the message names the root cause."""


@dataclass
class RankOutcome:
    rank: int
    kind: str  # "error" or "result"
    payload: Any
    at: float


def run_in_process(config: dict[str, Any], output_dir: str, command: str) -> dict[str, float]:
    """A one-rank job in this process: no second interpreter to start (seconds saved per job,
    and per job of a local sweep). Its torchrun-style variables are removed again afterwards,
    so that the next job of a sweep is launched afresh."""
    env = distenv.torchrun_env(0, 0, 1, 1, "127.0.0.1", distenv.free_port())
    saved = {key: os.environ.get(key) for key in env}
    os.environ.update(env)
    try:
        from train.job import run_rank

        return run_rank(config, output_dir, command, own_process=False)
    except Exception as e:
        # As from several ranks: the job failed, with the error and where it happened.
        raise JobFailedError("the training job failed; rank 0 failed:\n"
                             + "".join(traceback.format_exception(e))) from None
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _rank_entry(config: dict[str, Any], output_dir: str, command: str, env: dict[str, str],
                outcomes: mp.Queue) -> None:
    os.environ.update(env)
    rank = int(env["RANK"])
    try:
        from train.job import run_rank

        result = run_rank(config, output_dir, command)
        outcomes.put(RankOutcome(rank, "result", result, time.time()))
    except BaseException as e:
        outcomes.put(RankOutcome(rank, "error", "".join(traceback.format_exception(e)),
                                 time.time()))
        raise SystemExit(1) from None


def start_local_ranks(config: dict[str, Any], output_dir: str, command: str,
                      nproc: int) -> dict[str, float]:
    """Start `nproc` ranks on this machine and supervise them until all end.

    A rank that fails makes the others fail at their next collective (their connections to it
    close); any still running after GRACE_S is killed. The earliest error is the root cause and
    is what the user sees.
    """
    port = distenv.free_port()
    ctx = mp.get_context("spawn")
    outcomes: mp.Queue = ctx.Queue()
    procs = []
    for rank in range(nproc):
        env = distenv.torchrun_env(rank, rank, nproc, nproc, "127.0.0.1", port)
        p = ctx.Process(target=_rank_entry, args=(config, output_dir, command, env, outcomes),
                        name=f"rank {rank}")
        p.start()
        procs.append(p)
    deadline: float | None = None
    stopped_by_us: set[str] = set()
    try:
        while any(p.is_alive() for p in procs):
            # Bounded waits: exit codes are polled even if a sentinel is never signalled.
            timeout = 1.0 if deadline is None else min(1.0, max(0.0, deadline - time.monotonic()))
            multiprocessing.connection.wait([p.sentinel for p in procs if p.is_alive()], timeout)
            if deadline is None and any(p.exitcode not in (None, 0) for p in procs):
                deadline = time.monotonic() + GRACE_S
            if deadline is not None and time.monotonic() >= deadline:
                break
    finally:
        for p in procs:
            if p.is_alive():
                stopped_by_us.add(p.name)
                p.terminate()
        for p in procs:
            p.join(5)
            if p.is_alive():
                p.kill()
                p.join()
    results: list[RankOutcome] = []
    with contextlib.suppress(queue.Empty):
        while True:
            results.append(outcomes.get(timeout=0.2))
    finished = {o.rank for o in results if o.kind == "result"}
    for rank, p in enumerate(procs):
        if p.exitcode != 0 and rank in finished:
            # Its work was done and delivered; only the interpreter's teardown failed.
            log.warning("%s exited with code %s after finishing its work", p.name, p.exitcode)
    if all(p.exitcode == 0 or rank in finished for rank, p in enumerate(procs)):
        return next((o.payload for o in results if o.kind == "result" and o.rank == 0), {})
    raise JobFailedError(f"the training job failed; {root_cause(procs, results, stopped_by_us)}")


def root_cause(procs: list, results: list[RankOutcome], stopped_by_us: set[str]) -> str:
    """A rank killed by a signal (not ours) caused the rest; else the earliest Python error."""
    killed = [p for p in procs
              if p.exitcode is not None and p.exitcode < 0 and p.name not in stopped_by_us]
    errors = sorted((o for o in results if o.kind == "error"), key=lambda o: o.at)
    if killed:
        p = killed[0]
        cause = f"{p.name} was killed by {signal.Signals(-p.exitcode).name}"
        if errors:
            last_line = errors[0].payload.strip().splitlines()[-1]
            cause += f"; then rank {errors[0].rank} stopped: {last_line}"
        return cause
    if errors:
        return f"rank {errors[0].rank} failed first:\n{errors[0].payload}"
    return ", ".join(f"{p.name} exited with code {p.exitcode}" for p in procs if p.exitcode)
