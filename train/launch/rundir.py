"""The default output directory of a job (`hydra.run.dir`) and of a sweep or Slurm submission
(`hydra.sweep.dir`): one per launch, even for two started in the same second from the same
directory.

Hydra's default, `outputs/<date>/<HH-MM-SS>`, is one directory for every job started in that
second: a shell loop that starts jobs with `&` gives them one directory, and the second job's
`.hydra/` overwrites the first's record of what it ran before job.lock refuses it (two sweeps:
one multirun.yaml and sweep.json, jobs 0, 1, ... twice). Here the
launching process claims the directory with mkdir (atomic, also on NFS and Lustre); where it is
taken, the next free `<HH-MM-SS>-2`, `-3`, ... is claimed instead.

Ranks that torchrun or srun started each compose the config themselves and must agree on one
directory without talking: they claim nothing and all take the time their launcher (their
parent process) started, not their own, which a slow import can push past a second boundary.

Registered as the `${launch_dir:<strftime pattern>}` resolver with Hydra's cache, as `${now:}`
is: Hydra copies the cache into every config it composes again for the same job.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import time
from pathlib import Path

from train.distributed import env as distenv
from train.launch import joblock

MOST_PER_SECOND = 1000
"""Directories tried for one second's name before giving up (a runaway loop, not a user)."""
UNUSED = {".hydra", "train.log", "multirun.yaml"}
"""All a job (or sweep) directory holds when its command was refused before anything started:
Hydra's record of the command (a sweep's multirun.yaml) and its (empty) log file, made before
the job's first line."""
_made: list[Path] = []
"""The directories this process made for its launch, in the order made: the parents the
pattern's directory lacked (outputs/, outputs/<date>/), then the one it claimed."""


def launch_dir(pattern: str) -> str:
    """`pattern` (strftime, e.g. `outputs/%Y-%m-%d/%H-%M-%S`) at this launch's start time;
    claimed for this process unless its ranks were started by torchrun or srun."""
    if distenv.external_world_size() is not None:
        return time.strftime(pattern, time.localtime(_started(os.getppid()) or time.time()))
    base = time.strftime(pattern)
    parent = Path(base).resolve().parent
    _made.extend(reversed([d for d in (parent, *parent.parents) if not d.exists()]))
    parent.mkdir(parents=True, exist_ok=True)
    for n in range(1, MOST_PER_SECOND + 1):
        candidate = base if n == 1 else f"{base}-{n}"
        try:
            os.mkdir(candidate)
        except FileExistsError:
            continue
        _made.append(Path(candidate).resolve())
        return candidate
    raise FileExistsError(f"{base}: {MOST_PER_SECOND} launches in one second; give each its "
                          "own hydra.run.dir (hydra.sweep.dir with -m or +cluster=slurm)")


def _started(pid: int) -> float | None:
    """When process `pid` started (seconds since the epoch): its start in clock ticks after
    boot (joblock's reading of /proc) plus the boot time; None without /proc."""
    ticks = joblock.start_ticks(pid)
    try:
        boot = next(float(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines()
                    if line.startswith("btime "))
    except (OSError, ValueError, IndexError, StopIteration):
        return None
    return boot + int(ticks) / os.sysconf("SC_CLK_TCK") if ticks else None


def discard_unused(out: Path | None = None) -> None:
    """Remove what a refused command made: job directory `out` (a directory the user named
    too) and the directories this process made for its launch, where each holds no more than
    UNUSED with an empty log - a refusal leaves no empty outputs/<date>/<time>/ beside the
    real jobs. A directory that holds anything else, and any that existed before, stay."""
    for folder in [*([out.resolve()] if out is not None else []), *reversed(_made)]:
        with contextlib.suppress(OSError):
            log = folder / "train.log"
            if {p.name for p in folder.iterdir()} <= UNUSED and not (
                    log.exists() and log.stat().st_size):
                shutil.rmtree(folder)
