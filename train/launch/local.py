"""Local ranks: one rank in this process, or N rank processes started and supervised here.

Light at import (no torch, torchvision or mlflow): `--help`, `--cfg` and a refused configuration
answer in well under a second. The ranks are forked from a fork server that imported torch once
(train/launch/rank_server.py), not from this process, which holds mlflow's clients and threads.
That is why torch's `elastic_launch` does not start them: it needs torch here first, which put
the first training step 0.6-3.6 s later in each of 11 paired runs, and it reports only the
first rank it sees exit (docs/benchmarks.md, "Local launcher"). What it does
well is done here too: ranks end with their launcher, and the first failing rank's traceback
is the error. A Slurm node's one task (cluster.ranks=per_node) starts its node's ranks here as
well, for the same reasons and so that a per-node job stops, fails and reports as a local one.
What runs in each rank's own process (its death signal, its outcome sent back) is
train/launch/rank_process.py's.
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
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from train.distributed import env as distenv
from train.distributed import rankfiles, stopping
from train.distributed.stopping import Preempted
from train.errors import FAILURE_REASON, USER_TRACE
from train.errors import JobFailedError as JobFailedError
from train.errors import JobStoppedError as JobStoppedError
from train.errors import LaunchError as LaunchError  # re-exported
from train.launch import joblock, rank_process, rank_server
from train.launch.outcomes import RankOutcome as RankOutcome  # re-exported
from train.launch.outcomes import failure, root_cause, root_trace, signal_name

if TYPE_CHECKING:
    from multiprocessing.synchronize import Event

log = logging.getLogger("train")

GRACE_S = 15.0
"""After one rank fails, how long the others get to notice (closed connections), mark the run
FAILED and exit, before they are stopped. Rank 0, once it has begun ending its run, gets up to
tracking.flush_timeout_s more: on a busy machine the run may not even exist yet (its sender
starts at the first step), and stopping rank 0 then would leave no run at all."""
STACKS_S = 0.5
"""How long ranks that are to be stopped get to dump their stacks (faulthandler, in C)."""


def run_in_process(config: dict[str, Any], output_dir: str, command: str) -> dict[str, float]:
    """A one-rank job in this process: no second interpreter to start (seconds saved per job,
    and per job of a local sweep). Its torchrun-style variables are removed again afterwards,
    so that the next job of a sweep is launched afresh."""
    env = {**distenv.torchrun_env(0, 0, 1, 1, "127.0.0.1", distenv.free_port()),
           distenv.LAUNCHER_VAR: distenv.LOCAL}
    saved = {key: os.environ.get(key) for key in env}
    os.environ.update(env)
    started = time.time()
    try:
        from train.engine import job, ranklog

        with ranklog.rank_log_format(0):
            return job.run_rank(config, output_dir, command, own_process=False)
    except Preempted as e:
        raise JobStoppedError(e.signal_name, output_dir) from None
    except Exception as e:
        # As from several ranks: the job failed, with the error and where it happened.
        trace = "".join(traceback.format_exception(e))
        if (reason := getattr(e, FAILURE_REASON, None)) is None:  # before its run could end
            raise JobFailedError(f"the training job failed; rank 0 failed:\n{trace}") from None
        failed = failure(reason, Path(output_dir), command, getattr(e, USER_TRACE, None),
                         since=started)
        raise JobFailedError(failed.block(), failed) from None
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def start_local_ranks(config: dict[str, Any], output_dir: str, command: str, nproc: int,
                      node: distenv.NodeRanks | None = None) -> dict[str, float]:
    """Start `nproc` ranks on this machine and supervise them until all end; their final
    metrics (rank 0's where it runs here). A rank that fails makes the others fail at their
    next collective (their connections to it close); any still running GRACE_S later is
    stopped. The root cause (root_cause) is the JobFailedError's message. TERM, HUP, INT or
    USR2 here reach the ranks: their coordinated stop (a checkpoint, the run KILLED), then
    JobStoppedError. `node`: this machine's share of a multi-node job (a Slurm node's one
    task, cluster.ranks=per_node); None = the whole job is here."""
    node = node or distenv.this_machine(nproc, output_dir)
    ctx = rank_server.rank_context(config["data"])
    umask = os.umask(0)  # read, and put back at once: the ranks get this process's
    os.umask(umask)
    outcomes: mp.Queue = ctx.Queue()
    ranks = [node.rank(local) for local in range(nproc)]
    ending = [ctx.Event() for _ in range(nproc)]  # set by rank 0 as it begins to end its run
    procs = [ctx.Process(target=rank_process.rank_entry, name=f"rank {ranks[local]}", args=(
        config, output_dir, command, os.getpid(), {**os.environ, **node.env(local)}, umask,
        outcomes, ending[local])) for local in range(nproc)]
    from train.data import shard_guard

    watched = shard_guard.watch(config["data"])  # to name a shard a rank died of (SIGBUS)
    started = time.time()
    with stopping.PassOn(procs) as forwarding:
        for p in procs:
            p.start()
        joblock.add_ranks(Path(output_dir), [p.pid for p in procs if p.pid is not None])
        got: list[RankOutcome] = []
        try:
            _supervise(procs, ending, float(config["tracking"]["flush_timeout_s"]) + GRACE_S,
                       lambda: _only_silent_left(procs, ranks, outcomes, got))
        finally:
            node.remove_store_port_file()
            silent = {r for o in got if o.kind == "error" for r in o.silent}
            stopped = {ranks[local] for local in _stop(
                procs, {local for local, rank in enumerate(ranks) if rank in silent},
                lambda local: rankfiles.answers_stacks(Path(output_dir), ranks[local],
                                                   procs[local].pid))}
    results = got + _drain(outcomes)
    exits = {ranks[local]: p.exitcode for local, p in enumerate(procs)}
    done = {o.rank for o in results if o.kind in ("result", "stopped")}
    for rank, code in exits.items():
        if code != 0 and rank in done:
            # Its work was done and delivered; only the interpreter's teardown failed.
            log.warning("rank %d exited with code %s after finishing its work", rank, code)
    if all(code == 0 or rank in done for rank, code in exits.items()):
        stops = {o.rank: o.payload for o in results if o.kind == "stopped"}
        if stops:  # rank 0's signal names the stop (the others may only know of a request)
            raise JobStoppedError(stops.get(0) or next(iter(stops.values())), output_dir)
        # The same on every rank: rank 0's, or on another node its first rank's.
        return next((o.payload for o in sorted(results, key=lambda o: o.rank)
                     if o.kind == "result"), {})
    stopped |= forwarding.signalled_ranks(exits)
    why = _shard_changed(exits, stopped, watched)
    _end_abandoned_run(output_dir, started, exits, results, stopped,
                       {ranks[local]: p.pid for local, p in enumerate(procs)}, why)
    cause = root_cause(exits, results, stopped) + (f": {why}" if why else "")
    failed = failure(cause, Path(output_dir), command, root_trace(results, cause),
                     since=started)
    raise JobFailedError(failed.block(), failed)


def _only_silent_left(procs: list[mp.Process], ranks: list[int], outcomes: mp.Queue,
                      got: list[RankOutcome]) -> bool:
    """Whether the ranks still running are only those a failed rank found not answering
    (stuck, frozen): nobody is left to wait for (`got`: the outcomes read so far)."""
    with contextlib.suppress(queue.Empty):
        while True:
            got.append(outcomes.get_nowait())
    silent = {r for o in got if o.kind == "error" for r in o.silent}
    return bool(silent) and all(ranks[local] in silent
                                for local, p in enumerate(procs) if p.is_alive())


def reads_shards_itself(data: dict[str, Any]) -> bool:
    """A rank that reads memory-mapped shards in its own process (data=arrow without
    DataLoader workers) dies of SIGBUS, without a word, if a shard changes under it: such a
    job's one rank runs as a process of its own, whose death this one reports
    (_shard_changed), instead of in this process, which would die with it."""
    return data.get("name") == "arrow" and data.get("num_workers") == 0


def _shard_changed(exits: dict[int, int | None], stopped: set[int],
                   watched: dict[str, Any] | None) -> str | None:
    """Why a rank died of SIGBUS, when a shard it had memory-mapped changed since."""
    if not watched or not any(code == -signal.SIGBUS and rank not in stopped
                              for rank, code in exits.items()):
        return None
    from train.data import shard_guard

    return shard_guard.changed(watched)


def _end_abandoned_run(output_dir: str, started: float, exits: dict[int, int | None],
                       results: list[RankOutcome], stopped: set[int],
                       pids: dict[int, int | None], why: str | None = None) -> None:
    """Rank 0 alone ends the run. If it died without a word, its run would stay RUNNING; if
    another rank was killed, rank 0 blamed the closed connection it saw. Either way this
    process knows better: it ends the run FAILED with the rank that died (and `why`, where
    this process knows it)."""
    killed = sorted((rank, -code) for rank, code in exits.items()
                    if code is not None and code < 0 and rank not in stopped)
    reported = {o.rank for o in results}
    if killed:
        rank, number = killed[0]
        cause = f"rank {rank} (pid {pids[rank]}) killed by {signal_name(number)}"
        cause += f": {why}" if why else ""
    elif 0 in exits and 0 not in reported:  # hung and stopped, or gone without a word
        lines = root_cause(exits, results, stopped).strip().splitlines()
        cause = lines[0] if len(lines) == 1 else f"{lines[0]} {lines[-1]}"
    else:
        return
    from train.tracking import abandoned

    abandoned.end_with_cause(Path(output_dir), started, cause,
                             stacks=Path(output_dir) / rankfiles.STACKS_DIR)


def _supervise(procs: list[mp.Process], ending: list[Event] | None = None,
               ending_s: float = 0.0, only_silent_left: Callable[[], bool] | None = None) -> None:
    """Until every rank has exited, or GRACE_S after the first one failed; if a rank still
    running then has set its `ending` event (rank 0 ending its run), up to `ending_s` more.
    After a failure, at once when `only_silent_left()`: the ranks left are stuck."""
    deadline: float | None = None
    extended = False
    while any(p.is_alive() for p in procs):
        # Bounded waits: exit codes are polled even if a sentinel is never signalled.
        wait = 1.0 if deadline is None else min(1.0, max(0.0, deadline - time.monotonic()))
        multiprocessing.connection.wait([p.sentinel for p in procs if p.is_alive()], wait)
        if deadline is None and any(p.exitcode not in (None, 0) for p in procs):
            deadline = time.monotonic() + GRACE_S
        if deadline is not None and only_silent_left is not None and only_silent_left():
            return
        if deadline is not None and time.monotonic() >= deadline:
            if extended or not any(p.is_alive() and e.is_set()
                                   for p, e in zip(procs, ending or [], strict=False)):
                return
            extended, deadline = True, time.monotonic() + ending_s


def _stop(procs: list[mp.Process], hopeless: set[int] | frozenset[int] = frozenset(),
          answers_stacks: Callable[[int], bool] = lambda _local: False) -> set[int]:
    """SIGTERM to the ranks still running, SIGKILL 5 s later (at once to the `hopeless`: stuck
    or frozen, they cannot stop by themselves); first the stacks of those that
    `answers_stacks` (stacks/.rank-N.dump: why did they not end?). Returns their indices in
    `procs` (local ranks)."""
    stopped = {rank for rank, p in enumerate(procs) if p.is_alive()}
    asked = {rank for rank in stopped if answers_stacks(rank)}
    for rank in asked:
        with contextlib.suppress(OSError, TypeError):
            os.kill(procs[rank].pid, rankfiles.STACKS_SIGNAL)  # type: ignore[arg-type]
    if asked:
        time.sleep(STACKS_S)
    for rank in stopped:
        if rank in hopeless:
            procs[rank].kill()
        else:
            procs[rank].terminate()
    for p in procs:
        p.join(5)
        if p.is_alive():
            p.kill()
            p.join()
    return stopped


def _drain(outcomes: mp.Queue) -> list[RankOutcome]:
    results: list[RankOutcome] = []
    with contextlib.suppress(queue.Empty):
        while True:
            results.append(outcomes.get(timeout=0.2))
    return results
