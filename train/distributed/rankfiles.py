"""The files a running rank leaves in its job's output directory, where they lie and how they are
read back: `ranks/rank-<N>.json` (its heartbeat), `stacks/rank-<N>.txt` (its stacks on request),
`stacks/.rank-<N>.dump` (faulthandler's answer to SIGUSR1) and its DataLoader workers' dumps.

The rank writes them (watch.py, workers.py); stacks.py, the local launcher and the login node's
`python -m train status` / `python -m train stacks` read them. A module of its own so that the
readers need not import the writer, nor the writer its readers. The standard library only.
"""

from __future__ import annotations

import json
import signal
import socket
from pathlib import Path
from typing import Any

RANKS_DIR = "ranks"
STACKS_DIR = "stacks"
MEMORY_DIR = "memory"
"""trainer.memory_snapshot: each rank's CUDA allocator snapshot, written when it ran out of GPU
memory (train/engine/profiling.py)."""
STACKS_SIGNAL = signal.SIGUSR1
"""Asks a rank for its stacks (faulthandler answers in C); not a stop or requeue signal."""
POLL_S = 0.5
"""How often a rank's watchdog looks: its heartbeat is written at most this often."""
REFRESH_S = 10.0
"""An unchanged heartbeat is rewritten this often, so that its file's `written` tells a live
watchdog from a frozen process."""
WORKER_SECTION = "\nDataLoader worker "
"""What starts a worker's stacks in a rank's stacks file (workers.py writes it, stacks.py
reads it)."""


def stacks_path(out: Path, rank: int) -> Path:
    return out / STACKS_DIR / f"rank-{rank}.txt"


def dump_path(out: Path, rank: int) -> Path:
    return out / STACKS_DIR / f".rank-{rank}.dump"


def worker_dump_path(out: Path, rank: int, worker: int | str) -> Path:
    """A DataLoader worker's own SIGUSR1 dump (`worker="*"`: the pattern of all of a rank's)."""
    return out / STACKS_DIR / f".rank-{rank}-worker-{worker}.dump"


def beat_path(out: Path, rank: int) -> Path:
    return out / RANKS_DIR / f"rank-{rank}.json"


def header(beat: dict[str, Any]) -> str:
    """The first line of a stacks file: who and where, machine-readable (train/distributed/
    stacks.py reads it back)."""
    return "# " + json.dumps(beat, sort_keys=True) + "\n"


def answers_stacks(out: Path, rank: int, pid: int | None) -> bool:
    """Whether process `pid` (rank `rank`) registered its stack dump: SIGUSR1 before that
    would kill it. Its dump file's header names it."""
    try:
        return f'"pid": {pid},' in dump_path(out, rank).read_text(errors="replace")
    except OSError:
        return False


def read_beat(path: Path) -> dict[str, Any] | None:
    """A rank's last written heartbeat; None if it has none (yet) or it is unreadable."""
    try:
        beat = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return beat if isinstance(beat, dict) else None


def process_state(beat: dict[str, Any] | None) -> str | None:
    """The state letter (/proc/<pid>/stat: R, S, D, T, Z, ...) of the heartbeat's process on
    this host; "" where that process no longer exists; None for a rank on another host (or no
    heartbeat). A heartbeat without a usable pid raises (KeyError, TypeError, ValueError)."""
    if not beat or beat.get("host") != socket.gethostname():
        return None
    try:
        stat = Path(f"/proc/{int(beat['pid'])}/stat").read_text()
    except OSError:
        return ""
    return stat.rsplit(")", 1)[1].split()[0]


def gone(out: Path, rank: int, since: float = 0.0) -> bool:
    """Whether rank `rank` ran on this host and its process no longer exists: it will never
    answer, so waiting for it only delays the job's end (a rank on another node, or one whose
    heartbeat was last written before `since`, an earlier start's: unknown)."""
    beat = read_beat(beat_path(out, rank))
    if not beat or float(beat.get("written") or 0) < since:
        return False
    try:
        state = process_state(beat)
    except (KeyError, TypeError, ValueError):
        return False
    return state in ("", "Z", "X")  # ended; or dead, not yet reaped
