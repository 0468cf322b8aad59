"""One job per output directory: a lock file naming the process that holds it.

Two jobs in one directory would train into one MLflow run and one checkpoint series (steps
logged twice, checkpoints overwritten). The process that launches a job holds `job.lock` in its
output directory until the job ends: the local launcher (for all of its ranks), or the first
rank of a job whose ranks were started by torchrun or Slurm (they share the directory).

A lock whose holder is gone is taken over: a dead pid on this host (its start time is compared
too: pids are reused; a local launcher's ranks count as holders, as they may outlive it by a
checkpoint), a Slurm job that squeue no longer knows, or the same Slurm job id (a requeued job
taking its directory back). A holder on another host that Slurm cannot vouch for is taken as
alive: the message says which file to delete if it is not.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from train.errors import JobLockedError as JobLockedError  # re-exported

LOCK_FILE = "job.lock"


@dataclass(frozen=True)
class Holder:
    pid: int
    host: str
    started: str
    """The process's start time in clock ticks after boot (/proc/<pid>/stat): a reused pid
    has another."""
    slurm_job_id: str
    since: float
    """time.time() when it took the lock."""
    ranks: tuple[tuple[int, str], ...] = ()
    """(pid, start ticks) of the local ranks it started: they may outlive it by a checkpoint
    (a launcher killed with -9 leaves them a TERM), and hold the directory until they end."""

    def describe(self) -> str:
        job = f" (Slurm job {self.slurm_job_id})" if self.slurm_job_id else ""
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.since))
        return f"pid {self.pid} on {self.host}{job}, since {when}"


def start_ticks(pid: int) -> str:
    """Field 22 of /proc/<pid>/stat ('' where there is no /proc, no such process, or only
    its zombie: an orphan's exit status waits for PID 1, which reaps lazily)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return ""
    fields = stat.rsplit(")", 1)[-1].split()
    return "" if fields[0] == "Z" else fields[19]


def me() -> Holder:
    return Holder(os.getpid(), socket.gethostname(), start_ticks(os.getpid()),
                  os.environ.get("SLURM_JOB_ID", ""), time.time())


def _read(path: Path) -> Holder | None:
    try:
        fields = json.loads(path.read_text())
        fields["ranks"] = tuple(tuple(rank) for rank in fields.get("ranks", ()))
        return Holder(**fields)
    except (OSError, ValueError, TypeError, AttributeError):
        return None  # gone, or not ours to read: a half-written or foreign file is stale


def squeue_states(job_ids: str, timeout: float = 20) -> list[str] | None:
    """squeue's states of the jobs `job_ids` (comma-separated) still lists, one per job or
    array element ([] for jobs it no longer knows); None when squeue cannot tell."""
    try:
        out = subprocess.run(["squeue", "-h", "-j", job_ids, "-o", "%T"], capture_output=True,
                             text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if out.returncode != 0:
        return [] if "Invalid job id" in out.stderr else None
    return out.stdout.split()


def _slurm_job_known(job_id: str) -> bool | None:
    """Whether squeue still lists the job; None when squeue cannot tell."""
    states = squeue_states(job_id)
    return None if states is None else bool(states)


def is_live(holder: Holder, mine: Holder) -> bool:
    """Whether `holder` may still be using the directory (`mine`: this process)."""
    if holder.slurm_job_id and holder.slurm_job_id == mine.slurm_job_id:
        return False  # this very Slurm job, requeued: its earlier start is over
    if holder.host == mine.host:
        if holder.pid == mine.pid:
            return False
        return any(_lives(pid, started)
                   for pid, started in ((holder.pid, holder.started), *holder.ranks))
    if holder.slurm_job_id:
        return _slurm_job_known(holder.slurm_job_id) is not False
    return True


def _lives(pid: int, started: str) -> bool:
    ticks = start_ticks(pid)
    return bool(ticks) and (not started or ticks == started)


def take(output_dir: Path) -> Holder:
    """Hold `output_dir`'s lock for this process, or raise JobLockedError naming the holder."""
    output_dir.mkdir(parents=True, exist_ok=True)
    path, mine = output_dir / LOCK_FILE, me()
    draft = output_dir / f".{LOCK_FILE}.{mine.pid}"
    draft.write_text(json.dumps(asdict(mine)))
    try:
        with _guard(output_dir):  # check-then-replace is one step for every starter here
            holder = _read(path)
            if holder is not None and is_live(holder, mine):
                raise JobLockedError(
                    f"{output_dir} is in use by another job: {holder.describe()}. Wait for it "
                    f"to end, stop it (kill {holder.pid} stops it after a checkpoint), or choose "
                    f"another hydra.run.dir; if that job is gone, delete {path}.")
            os.replace(draft, path)
    finally:
        draft.unlink(missing_ok=True)
    return mine


def add_ranks(output_dir: Path, pids: list[int]) -> None:
    """The local launcher's ranks hold the directory with it (if this process holds it)."""
    path = output_dir / LOCK_FILE
    with _guard(output_dir):
        holder = _read(path)
        if holder is None or (holder.pid, holder.host) != (os.getpid(), socket.gethostname()):
            return
        ranks = tuple((pid, start_ticks(pid)) for pid in pids)
        draft = output_dir / f".{LOCK_FILE}.{os.getpid()}"
        draft.write_text(json.dumps(asdict(replace(holder, ranks=ranks))))
        os.replace(draft, path)


def release(output_dir: Path, mine: Holder) -> None:
    """Remove the lock if it is still this process's (never another job's)."""
    path = output_dir / LOCK_FILE
    with _guard(output_dir):
        holder = _read(path)
        if holder is not None and (holder.pid, holder.host) == (mine.pid, mine.host):
            path.unlink(missing_ok=True)


@contextlib.contextmanager
def held(output_dir: Path, holds: bool = True) -> Iterator[None]:
    """The job's lock, held while the block runs; `holds=False`: a rank that is not the first
    of its job (the first one holds the lock for all of them)."""
    if not holds:
        yield
        return
    mine = take(output_dir)
    try:
        yield
    finally:
        release(output_dir, mine)


@contextlib.contextmanager
def _guard(directory: Path) -> Iterator[None]:
    """An flock on the directory itself: two starters never both take over a stale lock.
    Best effort where the file system has no flock (some network mounts)."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        with contextlib.suppress(OSError):
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing releases the flock
