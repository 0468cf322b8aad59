"""A running job's ranks seen from outside it (the login node, another terminal): where each
is (`python -m train status`) and every rank's stacks (`python -m train stacks`), for a job's
output directory or its Slurm job id.

The ranks write their heartbeats and answer SIGUSR1 with faulthandler themselves
(train/distributed/watch.py); this reads the files and sends the signal: to the processes on
this host, through `scancel --signal=USR1` for a Slurm job. Nothing here stops the job.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from train.distributed import rankfiles, stacks
from train.errors import FAILURE_FILE, FailureRecord, LaunchError, TrainError

ANSWER_S = 10.0
"""How long the ranks get to dump their stacks; one that has not by then did not answer."""


def command(name: str, argv: list[str], show: Callable[[Path, str | None], str]) -> int:
    """`python -m train <name> <output dir or Slurm job id>`: what `show` says of the job
    (its output directory, its Slurm job id or None), or one line and the exit code."""
    usage = f"usage: python -m train {name} <output dir or Slurm job id>"
    if argv in (["-h"], ["--help"]):
        print(usage)
        return 0
    if len(argv) != 1 or argv[0].startswith("-"):
        print(usage, file=sys.stderr)
        return 2
    try:
        print(show(*resolve(argv[0])))
    except TrainError as e:
        print(e.terminal_line(), file=sys.stderr)
        return e.exit_code
    return 0


def resolve(target: str) -> tuple[Path, str | None]:
    """The output directory of `target` (that directory, or a Slurm job id's), and the Slurm
    job id if one was given."""
    path = Path(target)
    if (path / rankfiles.RANKS_DIR).is_dir():
        return path, None
    if re.fullmatch(r"\d+(_\d+)?", target):
        return _slurm_output_dir(target), target
    raise LaunchError(f"{target} is neither a running job's output directory (it has no "
                      f"{rankfiles.RANKS_DIR}/ with the ranks' heartbeats) nor a Slurm job id")


def _slurm_output_dir(job: str) -> Path:
    """A submitted job's directory: its log is in <sweep dir>/.submitit/<id>/; of the job
    directories beside it, the one whose ranks write heartbeats (the array task's number)."""
    try:
        shown = subprocess.run(["scontrol", "show", "job", "-o", job], capture_output=True,
                               text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise LaunchError(f"Slurm job {job}: scontrol failed ({e})") from None
    out = re.search(r"\bStdOut=(\S+)", shown.stdout)
    if shown.returncode != 0 or out is None:
        said = (shown.stderr.strip().splitlines() or [""])[-1]  # scontrol's last word
        raise LaunchError(f"Slurm job {job} is not known to Slurm: {said}")
    sweep = next((p.parent for p in Path(out[1]).parents if p.name == ".submitit"), None)
    found = sorted(p.parent for p in sweep.glob(f"*/{rankfiles.RANKS_DIR}")) if sweep else []
    task = re.search(r"\bArrayTaskId=(\d+)", shown.stdout)
    chosen = [p for p in found if task and p.name == task[1]] or found
    if len(chosen) != 1:
        raise LaunchError(f"Slurm job {job}: no single job directory with heartbeats under "
                          f"{sweep} ({len(chosen)} found): give the output directory instead")
    return chosen[0]


def beats(out: Path) -> dict[int, dict[str, Any]]:
    """Every rank's last heartbeat, by rank."""
    found = {}
    for path in (out / rankfiles.RANKS_DIR).glob("rank-*.json"):
        if (beat := rankfiles.read_beat(path)) is not None and isinstance(beat.get("rank"), int):
            found[beat["rank"]] = beat
    return dict(sorted(found.items()))


def ended(out: Path, ranks: dict[int, dict[str, Any]]) -> str | None:
    """How the job in `out` ended, where it has since its ranks entered their last phases (a
    summary.json or failure.json from an earlier start of a job now resumed is not its end);
    None while it runs."""
    last = max((float(b["since"]) for b in ranks.values()), default=0.0)
    summary, failure = out / "summary.json", out / FAILURE_FILE
    with contextlib.suppress(OSError):
        if summary.stat().st_mtime > last:
            return f"the job finished training ({summary})"
    with contextlib.suppress(OSError):
        if failure.stat().st_mtime > last and (record := FailureRecord.read(out)) is not None:
            return f"the job failed: {record.cause} ({failure})"
    return None


def status(out: Path) -> str:
    """One line per rank: its step and phase, for how long, its wait for data in the last
    logging interval, when its watchdog last wrote; for a job that ended, how, and where each
    rank last was."""
    now, lines, ranks = time.time(), [], beats(out)
    if (end := ended(out, ranks)) is not None:
        return "\n".join([f"{end}; where its ranks last were:", *(
            f"rank {rank} on {b['host']} (pid {b['pid']}): step {b['step']}, {b['phase']}"
            for rank, b in ranks.items())])
    for rank, b in ranks.items():
        written = now - float(b["written"])
        silent = " - its watchdog is silent (frozen or dead?)" \
            if written > 3 * rankfiles.REFRESH_S else ""
        waited = "" if b.get("data_share") is None else \
            f", waited for data {float(b['data_share']):.0%} of the last logging interval"
        lines.append(f"rank {rank} on {b['host']} (pid {b['pid']}): step {b['step']}, "
                     f"{b['phase']} for {now - float(b['since']):.1f} s{waited}, heartbeat "
                     f"written {written:.1f} s ago{silent}{stacks.process_state(b)}")
    return "\n".join(lines) or f"no rank of {out} has written a heartbeat yet"


def dump(out: Path, slurm_job: str | None) -> str:
    """Ask every rank for its stacks (SIGUSR1) and group them by identical stack."""
    ranks = beats(out)
    if not ranks:
        raise LaunchError(f"no rank of {out} has written a heartbeat yet: nothing to ask")
    if (end := ended(out, ranks)) is not None:
        raise LaunchError(f"{end}: no rank is left to ask; the stacks its ranks left, if any, "
                          f"are in {out / rankfiles.STACKS_DIR}")
    sizes = {r: _size(rankfiles.dump_path(out, r)) for r in ranks}
    here = socket.gethostname()
    for b in ranks.values():
        if b["host"] == here:
            with contextlib.suppress(OSError):
                os.kill(int(b["pid"]), rankfiles.STACKS_SIGNAL)
    if slurm_job is not None:  # the ranks on other nodes
        subprocess.run(["scancel", f"--signal={signal.Signals(rankfiles.STACKS_SIGNAL).name[3:]}",
                        slurm_job], capture_output=True, timeout=30)
    deadline = time.monotonic() + ANSWER_S
    answered: dict[int, list[stacks.Frame]] = {}
    partial: dict[int, str] = {}
    seen = dict(sizes)
    while len(answered) < len(ranks) and time.monotonic() < deadline:
        time.sleep(0.3)
        for r in set(ranks) - set(answered):
            size = _size(rankfiles.dump_path(out, r))
            if sizes[r] < size == seen[r]:  # it grew, and has stopped growing: dumped
                text = _new_text(rankfiles.dump_path(out, r), sizes[r])
                main = ranks[r].get("main_thread")
                # faulthandler writes the main thread last; on a loaded host its writes can
                # pause for longer than a poll, and a dump without it is not the answer yet.
                if main is None or main in stacks.parse(text):
                    answered[r] = stacks.main_frames(text, main)
                else:
                    partial[r] = text
            seen[r] = size
    for r, text in partial.items():  # the deadline came first: the threads it did write
        answered.setdefault(r, stacks.main_frames(text, ranks[r].get("main_thread")))
    missing = [f"rank {r} on {ranks[r]['host']} did not answer the stack request"
               f"{stacks.process_state(ranks[r])}" for r in ranks if r not in answered]
    return "\n\n".join([stacks.grouped(answered), *missing]).strip()


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def _new_text(path: Path, offset: int) -> str:
    try:
        with path.open("rb") as f:
            f.seek(offset)
            return f.read().decode(errors="replace")
    except OSError:
        return ""
