"""Reading faulthandler's stack dumps (train/distributed/watch.py writes them) and saying in one
line which rank is stuck where: the user's frame first (file:line, function, the call on that
line), then the service frame that called it; and the ranks that waited, grouped.

The standard library only: `python -m train stacks` and `train.status` use it on a login node.
"""

from __future__ import annotations

import linecache
import os
import re
import sys
import sysconfig
import time
import traceback
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from train.distributed import rankfiles

_THREAD = re.compile(r"^(?:Current thread|Thread) (0x[0-9a-f]+) .*\(most recent call first\):")
_FRAME = re.compile(r'^  File "(.*)", line (\d+) in (.*)$')
_CALL = re.compile(r"([A-Za-z_][\w.]*)\s*\(")
_TRAIN = str(Path(__file__).resolve().parents[1]) + os.sep
_LAUNCHER = str(Path(__file__).resolve().parents[2] / "hydra_plugins") + os.sep
"""The service's Hydra launcher plugins (outside train/): every Slurm rank's outer frames."""
_LIBRARIES = tuple(sorted({sysconfig.get_paths()[k] + os.sep for k in
                           ("stdlib", "platstdlib", "purelib", "platlib")}))
_STATES = {"R": "running", "S": "sleeping", "D": "in uninterruptible sleep (disk or NFS)",
           "T": "stopped (SIGSTOP)", "t": "stopped by a debugger", "Z": "a zombie"}


@dataclass(frozen=True)
class Frame:
    path: str
    line: int
    function: str

    def short(self) -> str:
        return f"{short_path(self.path)}:{self.line}"


_SNAPSHOT = re.compile(r".*?/code/project/")
"""Where a Slurm job's code snapshot holds the project (train/launch/snapshot.py's layout)."""


def as_here(path: str) -> str:
    """A frame of a Slurm job's code snapshot as the same file of this checkout, so that the
    login node (python -m train stacks) tells the service's frames from the user's as the rank
    does."""
    m = _SNAPSHOT.match(path)
    return str(Path(_TRAIN).parent / path[m.end():]) if m else path


def short_path(path: str) -> str:
    """`path` as its module's place: the service's as train/..., a library's from its
    site-packages, the user's from the PYTHONPATH entry that holds it."""
    path = as_here(path)
    if path.startswith(_TRAIN):
        return "train/" + path[len(_TRAIN):]
    roots = [*_LIBRARIES, *(os.path.abspath(p) + os.sep for p in sys.path if p)]
    best = max((r for r in roots if path.startswith(r)), key=len, default="")
    return path[len(best):] if best else path


def is_service(path: str) -> bool:
    """The service's own code, Python's or an installed library's: not the user's."""
    path = as_here(path)
    return path.startswith((_TRAIN, _LAUNCHER, *_LIBRARIES, "<"))


def parse(text: str) -> dict[str, list[Frame]]:
    """faulthandler's dump (the last one in `text`): each thread's frames, innermost first."""
    threads: dict[str, list[Frame]] = {}
    frames: list[Frame] | None = None
    for line in text.splitlines():
        if m := _THREAD.match(line):
            if m.group(1) in threads:  # a later dump: it replaces the earlier
                threads = {}
            frames = threads.setdefault(m.group(1), [])
        elif frames is not None and (m := _FRAME.match(line)):
            frames.append(Frame(m.group(1), int(m.group(2)), m.group(3)))
    return threads


def read_header(text: str) -> dict[str, Any]:
    import json

    first = text.split("\n", 1)[0]
    try:
        beat = json.loads(first[2:]) if first.startswith("# ") else {}
    except ValueError:
        return {}
    return beat if isinstance(beat, dict) else {}


def main_frames(text: str, main: str | None = None) -> list[Frame]:
    """The main thread's frames of a stacks file (its header names the main thread)."""
    threads = parse(text)
    main = main or read_header(text).get("main_thread")
    if main in threads:
        return threads[main]
    return next(iter(threads.values()), [])


def below_the_service(frames: list[Frame]) -> list[Frame]:
    """`frames` up to the service's outermost: not those of whoever called it (a script or a
    notebook around an in-process job, a test's harness), which are not where it is stuck -
    as user_traceback leaves them out of a user's traceback. All of them if none is the
    service's."""
    ours = [i for i, f in enumerate(frames) if as_here(f.path).startswith(_TRAIN)]
    return frames[:ours[-1] + 1] if ours else frames


def where(frames: list[Frame]) -> str:
    """The user's innermost frame (file:line function (the call on that line)) and what called
    it: the DataLoader or the service's frame; the innermost frame if none is the user's."""
    frames = below_the_service(frames)
    if not frames:
        return "no Python frame"
    user = next((i for i, f in enumerate(frames) if not is_service(f.path)), None)
    at = frames[0 if user is None else user]
    text = f"{at.short()} {at.function}"
    if m := _CALL.search(linecache.getline(at.path, at.line)):
        text += f" ({m.group(1)})"
    if user is None:  # in the service or a library: say from which of the service's lines
        ours = next((f for f in frames[1:] if as_here(f.path).startswith(_TRAIN)), None)
        return f"{text}, called from {ours.short()} {ours.function}" if ours else text
    outer = frames[user + 1:]
    if any("torch/utils/data/" in f.path for f in outer):
        return f"{text}, called from DataLoader"
    caller = next((f for f in outer if f.path.startswith(_TRAIN)), None)
    return f"{text}, called from {caller.short()} {caller.function}" if caller else text


def stuck_in(text: str) -> str:
    """Where a rank's stacks file says it is stuck: its main thread's user frame, else the
    user frame of a DataLoader worker it waits for (its section of the file)."""
    own, *workers = text.split(rankfiles.WORKER_SECTION)
    frames = below_the_service(main_frames(own))
    if any(not is_service(f.path) for f in frames):
        return where(frames)
    for section in workers:
        worker, _, dump = section.partition(":\n")
        for thread in map(below_the_service, parse(dump).values()):
            if any(not is_service(f.path) for f in thread):
                number = worker.split(" (pid")[0]  # the file names its pid too
                return f"its DataLoader worker {number}, at {where(thread)}"
    return where(frames)


def waited_in(exc: BaseException) -> str:
    """Where a rank whose collective timed out waited: the collective, the service's line."""
    tb = traceback.extract_tb(exc.__traceback__)
    if not tb:
        return type(exc).__name__
    ours = [f for f in tb if f.filename.startswith(_TRAIN)]
    line = f" ({short_path(ours[-1].filename)}:{ours[-1].lineno})" if ours else ""
    return f"{tb[-1].name}{line}"


_WORKER_ERROR = re.compile(r"Caught \w+ in (DataLoader worker process \d+)\.\n"
                           r"Original Traceback \(most recent call last\):\n(.*)", re.S)
"""How torch re-raises a DataLoader worker's error in its rank: the worker's traceback as the
message (torch/utils/data/_utils/__init__.py ExceptionWrapper)."""


def error_line(exc: BaseException) -> str:
    """`Type: message` of a rank's error; a DataLoader worker's as its own last line and the
    worker, not the worker's whole traceback."""
    if m := _WORKER_ERROR.match(str(exc)):
        return f"{m.group(2).rstrip().splitlines()[-1]} (in its {m.group(1)})"
    return f"{type(exc).__name__}: {exc}"


def user_traceback(exc: BaseException) -> str | None:
    """An exception raised in the user's code (a model's forward, a Dataset's __getitem__, also
    in a DataLoader worker) as its traceback trimmed to the user's frames and the one frame
    that called the first of them (the service's or a library's, e.g. the DataLoader's fetch);
    None when no frame is the user's. The whole traceback stays in train.log."""
    if m := _WORKER_ERROR.match(str(exc)):
        frames, last = _text_frames(m.group(2))
    else:
        tb = traceback.extract_tb(exc.__traceback__)
        frames = list(zip((f.filename for f in tb), traceback.format_list(tb), strict=True))
        last = "".join(traceback.format_exception_only(exc))
    mine = [not is_service(path) for path, _ in frames]
    # The user's code as the service (or a library) called it; frames of whoever called the
    # service (a test, a script around `run_rank`) are not the failing code.
    start = next((i for i in range(1, len(frames)) if mine[i] and not mine[i - 1]), None)
    if start is None:
        return None
    kept = [frames[start - 1][1], *(text for (_, text), user in
                                     zip(frames[start:], mine[start:], strict=True) if user)]
    return ("Traceback (most recent call last), your code's frames:\n" + "".join(kept)
            + last).rstrip("\n")


def _text_frames(text: str) -> tuple[list[tuple[str, str]], str]:
    """A formatted traceback's frames (path, its lines) and the exception's lines after them."""
    frames: list[tuple[str, str]] = []
    tail: list[str] = []
    for line in text.splitlines(keepends=True):
        if (m := re.match(r'  File "(.*)", line \d+', line)) and not tail:
            frames.append((m.group(1), line))
        elif line.startswith("    ") and frames and not tail:
            frames[-1] = (frames[-1][0], frames[-1][1] + line)
        else:
            tail.append(line)
    return frames, "".join(tail)


def ranks_text(ranks: Iterable[int]) -> str:
    """"rank 3" or "ranks 0, 2-63"."""
    ordered = sorted(set(ranks))
    spans: list[str] = []
    start = prev = None
    for r in [*ordered, None]:
        if start is not None and (r is None or r != prev + 1):  # type: ignore[operator]
            spans.append(str(start) if start == prev else f"{start}-{prev}")
            start = None
        if r is not None and start is None:
            start = r
        prev = r
    return ("rank " if len(ordered) == 1 else "ranks ") + ", ".join(spans)


def process_state(beat: dict[str, Any] | None) -> str:
    """The process state of a rank on this host, in words ("" where it runs elsewhere or is
    unknown; rankfiles.process_state reads it)."""
    try:
        code = rankfiles.process_state(beat)
    except (ValueError, KeyError):
        code = ""
    if code is None or beat is None:  # (beat is None only where code is)
        return ""
    if not code:
        return f"; its process {beat.get('pid')} is gone"
    return f"; its process {beat['pid']} is {_STATES.get(code, code)}"


def explain(out: Path, silent: list[int], node_of: Callable[[int], str], answered: set[int],
            waited: dict[int, str]) -> str:
    """One line: each silent rank stuck where (or that it did not answer the stack request),
    then the ranks that waited, grouped by where."""
    parts: list[str] = []
    for rank in silent:
        if rank in answered:
            text = rankfiles.stacks_path(out, rank).read_text(errors="replace")
            beat = read_header(text)
            age = time.time() - float(beat.get("since", time.time()))
            parts.append(f"rank {rank} on {node_of(rank)} stuck {age:.0f} s in "
                         f"{stuck_in(text)}")
        else:
            beat = rankfiles.read_beat(rankfiles.beat_path(out, rank))
            parts.append(f"rank {rank} on {node_of(rank)} stopped answering (its process or "
                         "node died, or it is frozen): it did not answer the stack request"
                         + process_state(beat))
    by_place: dict[str, list[int]] = {}
    for rank, place in sorted(waited.items()):
        by_place.setdefault(place, []).append(rank)
    parts += [f"{ranks_text(ranks)} waited in {place}" for place, ranks in by_place.items()]
    return "; ".join(parts)


def grouped(stacks: dict[int, list[Frame]]) -> str:
    """py-spy dump's view of many ranks: each distinct main-thread stack once, with its ranks."""
    groups: dict[tuple[Frame, ...], list[int]] = {}
    for rank, frames in sorted(stacks.items()):
        groups.setdefault(tuple(frames), []).append(rank)
    blocks = []
    for frames, ranks in sorted(groups.items(), key=lambda g: g[1]):
        lines = [f"{ranks_text(ranks)}: {where(list(frames))}"]
        lines += [f"    {f.function} ({f.short()})" for f in frames]
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks)
