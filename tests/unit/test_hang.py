"""Reading stack dumps in process: a real faulthandler dump of a thread stuck in a user's
module, the one line that names it, ranks grouped; the launcher's one line (issue 29).
The real hang, with ranks and gloo: tests/e2e/test_hang.py."""

from __future__ import annotations

import faulthandler
import importlib
import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from train.distributed import phase, rankfiles, stacks
from train.launch.local import RankOutcome, root_cause
from train.launch.outcomes import failure_block, root_trace


def _user_module(root: Path, monkeypatch: pytest.MonkeyPatch, name: str, source: str) -> Any:
    """A user's module `package.module` written under `root` with `source`, imported from there."""
    package, module = name.split(".")
    (root / package).mkdir()
    (root / package / "__init__.py").write_text("")
    (root / package / f"{module}.py").write_text(source)
    monkeypatch.syspath_prepend(str(root))
    return importlib.import_module(name)


def test_a_thread_stuck_in_user_code_is_named_with_its_line_and_call(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    read = _user_module(tmp_path, monkeypatch, "mypkg.data",
                        "import time\n\n\ndef read(done):\n    while not done.is_set():\n"
                        "        time.sleep(0.01)\n").read
    done = threading.Event()
    thread = threading.Thread(target=read, args=(done,))
    thread.start()
    try:
        dump = tmp_path / "dump.txt"
        with dump.open("w") as f:
            f.write(rankfiles.header({"main_thread": f"0x{thread.ident:016x}"}))
            f.flush()
            faulthandler.dump_traceback(f, all_threads=True)
    finally:
        done.set()
        thread.join()
    frames = stacks.main_frames(dump.read_text())
    assert stacks.where(frames) == "mypkg/data.py:6 read (time.sleep)"
    assert stacks.grouped({0: frames, 1: frames, 3: []}).startswith(
        "ranks 0-1: mypkg/data.py:6 read (time.sleep)\n    read (mypkg/data.py:6)")


def test_ranks_are_grouped_into_spans() -> None:
    assert stacks.ranks_text([3]) == "rank 3"
    assert stacks.ranks_text([0, 2, 3, 4, 63, 7]) == "ranks 0, 2-4, 7, 63"


def test_a_rank_that_did_not_answer_is_named_with_its_process_state(tmp_path: Path) -> None:
    (tmp_path / "ranks").mkdir()
    rankfiles.beat_path(tmp_path, 1).write_text(
        json.dumps({"host": socket.gethostname(), "pid": 999999999}))
    line = stacks.explain(tmp_path, [1], lambda r: "node2", set(), {0: "all_reduce (x.py:1)"})
    assert line == ("rank 1 on node2 stopped answering (its process or node died, or it is "
                    "frozen): it did not answer the stack request; its process 999999999 is "
                    "gone; rank 0 waited in all_reduce (x.py:1)")


def test_the_heartbeat_costs_about_a_microsecond_a_step() -> None:
    """A step's three phase marks; the best of 7 rounds (a busy machine's noise is not the
    heartbeat's cost): about 1 us measured here, bounded at 5."""
    def one_round(steps: int = 20_000) -> float:
        started = time.perf_counter()
        for step in range(steps):
            phase.enter("data")
            phase.enter("forward")
            phase.enter("optimizer", step)
        return (time.perf_counter() - started) / steps

    per_step = min(one_round() for _ in range(7))
    assert per_step < 5e-6, f"{per_step * 1e6:.2f} us per step"


def test_the_launcher_shows_a_ranks_one_line_reason_not_its_traceback() -> None:
    outcomes = [RankOutcome(0, "error", "Traceback (most recent call last):\n...", 100.0,
                            "rank 1 on vm stuck 12 s in mypkg/data.py:6 read (time.sleep)")]
    assert root_cause({0: 1, 1: -15}, outcomes, stopped={1}) == (
        "rank 1 on vm stuck 12 s in mypkg/data.py:6 read (time.sleep)")


def test_a_user_exception_keeps_its_frames_and_the_one_that_called_them(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A user's module called through the service (train/) and a library (json): the trimmed
    traceback holds the user's frames and json's frame that called the first of them."""
    hook = _user_module(tmp_path, monkeypatch, "hookpkg.hook",
                        "def hook(pairs):\n    return check(pairs)\n\n\ndef check(pairs):\n"
                        "    raise KeyError('label')\n").hook
    try:
        json.loads('{"a": 1}', object_pairs_hook=hook)  # json's frames call the user's
    except KeyError as e:
        trace = stacks.user_traceback(e)
    assert trace is not None
    files = [line.split('"')[1] for line in trace.splitlines() if line.startswith("  File")]
    assert [Path(f).name for f in files] == ["decoder.py", "hook.py", "hook.py"], trace
    assert trace.splitlines()[-1] == "KeyError: 'label'"
    try:
        json.loads("{")
    except ValueError as e:
        assert stacks.user_traceback(e) is None  # no user frame: the one line is enough


def test_the_failure_block_says_what_was_kept_and_how_to_resume(tmp_path: Path) -> None:
    out = tmp_path / "my job"
    command = "python -m train trainer.resume=never optim.betas=[0.9,0.99] hydra.run.dir=x"
    block = failure_block("rank 1 on vm: ValueError: bad", out, command, "Traceback ...\nV")
    assert block.splitlines() == [
        "the training job failed; rank 1 on vm: ValueError: bad", "  Traceback ...", "  V",
        "  kept: nothing: no checkpoint yet",
        "  start again: python -m train trainer.resume=never 'optim.betas=[0.9,0.99]' "
        f"'hydra.run.dir={out}'", f"  tracebacks: {out}/train.log"]
    (out / "checkpoints").mkdir(parents=True)
    for name in ("step-000000007.pt", "step-000000012.pt", "step-000000013.pt.tmp"):
        (out / "checkpoints" / name).write_bytes(b"")
    block = failure_block("rank 0 on vm: DiskFull: ...", out, command)
    assert block.splitlines()[1:3] == [  # its own checkpoint, not trainer.resume=never's start
        f"  kept: {out}/checkpoints/step-000000012.pt (step 12), the newest checkpoint",
        f"  resume: python -m train 'optim.betas=[0.9,0.99]' 'hydra.run.dir={out}'"]
    # A Slurm job (train/launch/follow.py): placed again by its sweep directory and subdirectory.
    placed = [f"hydra.sweep.dir={tmp_path}", "hydra.sweep.subdir=3"]
    block = failure_block("rank 0 on node1: DiskFull: ...", out,
                          "python -m train +cluster=slurm hydra.sweep.dir=old", placed=placed,
                          logs="/s/.submitit/7/")
    assert block.splitlines()[-2:] == [
        f"  resume: python -m train +cluster=slurm hydra.sweep.dir={tmp_path} "
        "hydra.sweep.subdir=3", f"  tracebacks: {out}/train.log; each rank's log: /s/.submitit/7/"]


def test_the_trace_shown_is_the_failing_ranks() -> None:
    cause = "rank 1 on vm: ValueError: bad"
    outcomes = [RankOutcome(0, "error", "...", 1.0, cause),
                RankOutcome(1, "error", "...", 2.0, cause, trace="its trace"),
                RankOutcome(2, "error", "...", 0.5, "rank 2 on vm: other", trace="other")]
    assert root_trace(outcomes, cause) == "its trace"


def test_a_rank_slow_to_get_its_data_is_named_after_intervals_in_a_row(
        caplog: pytest.LogCaptureFixture) -> None:
    """Only the wait for data is judged: computing holds the waits for the others (DDP)."""
    from train.engine.stragglers import Stragglers

    tags: list[dict] = []
    judge = Stragglers(0.5, 2, lambda r: f"node{r + 1}", tags.append, speaks=True)
    judge.judge([[0.1, 5.0], [0.5, 1.0], [0.1, 1.0]], step=10)  # one interval: not yet
    judge.judge([[0.1, 5.0], [0.1, 1.0], [0.1, 1.0]], step=20)  # back in line: starts over
    judge.judge([[0.1, 1.0], [0.4, 1.0], [0.1, 1.0]], step=30)
    assert tags == []
    judge.judge([[0.1, 1.0], [0.4, 1.0], [0.1, 1.0]], step=40)
    assert tags == [{"straggler": "rank 1 on node2 is a straggler: 0.40 s waiting for data "
                                  "(300% over the median rank's 0.10 s) and 1.00 s computing in "
                                  "the logging interval up to step 40; 2 intervals in a row"}]
    judge.judge([[0.1, 1.0], [0.4, 1.0], [0.1, 1.0]], step=50)
    assert len(tags) == 1  # named once


def test_a_rank_is_gone_only_when_its_process_on_this_host_has_ended(tmp_path: Path) -> None:
    """The wait for a dead peer's answer ends early only for a process known to be gone: one
    of this host that has exited, by a heartbeat of this start (not an earlier start's)."""
    ended = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                           capture_output=True, text=True, check=True)
    (tmp_path / rankfiles.RANKS_DIR).mkdir()
    now = time.time()

    def beat(rank: int, pid: int, host: str, written: float) -> None:
        rankfiles.beat_path(tmp_path, rank).write_text(json.dumps(
            {"rank": rank, "pid": pid, "host": host, "written": written}))

    beat(0, int(ended.stdout), socket.gethostname(), now)
    beat(1, int(ended.stdout), "another-node", now)
    beat(2, int(ended.stdout), socket.gethostname(), now - 600)  # an earlier start's
    beat(3, os.getpid(), socket.gethostname(), now)  # alive
    assert rankfiles.gone(tmp_path, 0, since=now - 2)
    assert not rankfiles.gone(tmp_path, 1, since=now - 2)
    assert not rankfiles.gone(tmp_path, 2, since=now - 2)
    assert not rankfiles.gone(tmp_path, 3, since=now - 2)
    assert not rankfiles.gone(tmp_path, 4)  # no heartbeat: unknown


_SLOW_DUMPER = """
import faulthandler, io, json, os, signal, socket, sys, tempfile, threading, time
out = sys.argv[1]
main = threading.main_thread().ident
threading.Thread(target=threading.Event().wait, daemon=True).start()  # a second thread

def answer(signum, frame):
    # faulthandler's own dump, written as a loaded host may write it: the other threads,
    # then (after a pause longer than the reader's poll) the main thread, which it puts last.
    with tempfile.TemporaryFile("w+") as f:
        faulthandler.dump_traceback(f, all_threads=True)
        f.seek(0)
        text = f.read()
    cut = text.index("Current thread")
    with open(f"{out}/stacks/.rank-0.dump", "a") as dump:
        dump.write(text[:cut]); dump.flush()
        time.sleep(1.0)
        dump.write(text[cut:])

signal.signal(signal.SIGUSR1, answer)
open(f"{out}/ranks/rank-0.json", "w").write(json.dumps({
    "rank": 0, "host": socket.gethostname(), "pid": os.getpid(), "step": 3,
    "phase": "forward", "since": time.time(), "written": time.time(),
    "main_thread": f"0x{main:016x}"}))

def stuck_in_forward():
    while True:
        time.sleep(0.05)

stuck_in_forward()
"""


def test_a_dump_written_in_pauses_is_read_once_its_main_thread_is_in(tmp_path: Path) -> None:
    """`python -m train.stacks` shows a rank's main thread even where the rank's dump pauses
    between threads for longer than the reader's poll (a loaded host; seen in CI as the
    watchdog's stack shown for rank 0)."""
    from train.launch import inspect

    for folder in (rankfiles.RANKS_DIR, rankfiles.STACKS_DIR):
        (tmp_path / folder).mkdir()
    rank = subprocess.Popen([sys.executable, "-c", _SLOW_DUMPER, str(tmp_path)])
    try:
        deadline = time.monotonic() + 30
        while not rankfiles.beat_path(tmp_path, 0).exists():
            assert time.monotonic() < deadline and rank.poll() is None, "the rank never started"
            time.sleep(0.05)
        shown = inspect.dump(tmp_path, None)
    finally:
        rank.kill()
        rank.wait()
    assert shown.startswith("rank 0: "), shown
    assert "stuck_in_forward" in shown, shown


def test_the_stacks_signal_wakes_the_watchdog_and_is_put_back(tmp_path: Path) -> None:
    """SIGUSR1 lands on the watchdog's socket (no code runs inside the signal: the dump is
    taken by the thread that reads it); other handled signals do not count as it; afterwards
    the signal's handler and the wakeup fd are what they were."""
    from train.distributed import wakeup

    before = signal.getsignal(signal.SIGUSR1)
    winch = signal.signal(signal.SIGWINCH, lambda *_: None)  # another signal Python handles
    stop = threading.Event()
    with (tmp_path / "dump").open("a") as dump:
        wake, restore = wakeup.on_signal(signal.SIGUSR1, dump)
        try:
            assert wake is not None
            assert not wakeup.wait(wake, signal.SIGUSR1, 0.05, stop)  # nothing came
            os.kill(os.getpid(), signal.SIGWINCH)
            assert not wakeup.wait(wake, signal.SIGUSR1, 5.0, stop)
            os.kill(os.getpid(), signal.SIGUSR1)
            assert wakeup.wait(wake, signal.SIGUSR1, 5.0, stop)
        finally:
            restore()
            signal.signal(signal.SIGWINCH, winch)
    assert signal.getsignal(signal.SIGUSR1) == before
    assert signal.set_wakeup_fd(-1) == -1  # none left set


def test_a_rank_stuck_in_the_service_names_the_innermost_frame_and_the_services_line() -> None:
    """A Slurm rank whose frames are all the service's (its launcher plugin, train/) or a
    library's: not "the launcher's __call__" (the outermost frame outside train/, seen in CI),
    but the innermost frame and the service's line that called it."""
    repo = Path(stacks.__file__).resolve().parents[2]
    library = Path(threading.__file__).resolve()
    dump = ("Current thread 0x00007f0000000001 (most recent call first):\n"
            f'  File "{library}", line 331 in wait\n'
            f'  File "{repo}/train/engine/prepare.py", line 102 in _start_run\n'
            f'  File "{repo}/hydra_plugins/train_launcher/slurm_launcher.py", line 138 in '
            "__call__\n")
    frames = stacks.main_frames(dump)
    shown = stacks.where(frames)  # (the call on line 331 as this Python's threading.py has it)
    assert shown.startswith("threading.py:331 wait"), shown
    assert shown.endswith(", called from train/engine/prepare.py:102 _start_run"), shown


def test_the_frames_of_whoever_called_the_service_are_not_where_it_is_stuck(
        tmp_path: Path) -> None:
    """A job run from a user's script (or a rank forked under one, as the suite's warm start
    forks them): the script's frames are outer to the service's, and a rank waiting in a
    collective is in the service, not on the script's line - here or in a DataLoader worker."""
    repo = Path(stacks.__file__).resolve().parents[2]
    library = Path(threading.__file__).resolve()
    script = tmp_path / "launch_it.py"
    script.write_text("import train\n\ntrain.main()\n")
    rank = ("Current thread 0x00007f0000000001 (most recent call first):\n"
            f'  File "{library}", line 331 in wait\n'
            f'  File "{repo}/train/engine/prepare.py", line 102 in _start_run\n'
            f'  File "{repo}/train/launch/rank_process.py", line 70 in rank_entry\n'
            f'  File "{script}", line 3 in <module>\n')
    frames = stacks.main_frames(rank)
    assert [f.path for f in stacks.below_the_service(frames)] == [f.path for f in frames[:3]]
    assert stacks.where(frames).startswith("threading.py:331 wait"), stacks.where(frames)
    assert stacks.stuck_in(rank).endswith("called from train/engine/prepare.py:102 _start_run")
    worker = (f"{rankfiles.WORKER_SECTION}0 (pid 7):\n"
              "Current thread 0x00007f0000000002 (most recent call first):\n"
              f'  File "{tmp_path}/mydata.py", line 9 in __getitem__\n'
              f'  File "{repo}/train/data/loaders.py", line 40 in fetch\n'
              f'  File "{script}", line 3 in <module>\n')
    assert stacks.stuck_in(rank + worker).startswith("its DataLoader worker 0, at ")
    assert "mydata.py:9 __getitem__" in stacks.stuck_in(rank + worker)


def test_a_child_that_cannot_answer_is_named_with_its_kernel_state(tmp_path: Path) -> None:
    """A rank's child with no dump of its own (a DataLoader worker not yet at worker_init_fn:
    SIGUSR1 would kill it) is listed by pid with its state and what its threads wait in, and
    signalled with nothing; no frame of it is taken for the rank's."""
    import io

    from train.distributed import workers

    (tmp_path / rankfiles.STACKS_DIR).mkdir()
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        out = io.StringIO()
        workers.write_stacks(out, tmp_path, 0)
        assert child.poll() is None  # not signalled
    finally:
        child.kill()
        child.wait()
    line = f"{rankfiles.WORKER_SECTION}? (pid {child.pid}, not answering: state "
    assert line in out.getvalue(), out.getvalue()
    assert f"threads waiting in {child.pid}: " in out.getvalue()
    assert stacks.stuck_in("Thread 0x1 (most recent call first):\n" + out.getvalue()) \
        == "no Python frame"


def _stuck_before_worker_init(lock: threading.Lock, ready: int) -> None:
    os.write(ready, b"1")  # the test asks for stacks only once the child is here
    lock.acquire()  # held by the parent: as a lock another thread held at the fork


def test_a_worker_stuck_before_its_init_is_named_with_its_line(tmp_path: Path) -> None:
    """Children forked from a watched rank answer SIGUSR1 from birth: one stuck before
    worker_init_fn (a lock inherited held) shows its Python frames; one past it has the
    worker's number. Neither is killed by the asking."""
    import io
    import types

    from train.distributed import workers

    (tmp_path / rankfiles.STACKS_DIR).mkdir()
    owner = types.SimpleNamespace(out=tmp_path, rank=0, host="here",
                                  main=threading.main_thread().ident or 0)
    held = threading.Lock()
    held.acquire()
    children: list[int] = []
    ready_r, ready_w = os.pipe()
    workers.follow_forks(owner)  # type: ignore[arg-type]
    try:
        for worker in (None, 3):
            pid = os.fork()
            if pid == 0:  # the child: never returns into pytest
                try:
                    if worker is not None:
                        workers.in_worker(worker, owner)  # type: ignore[arg-type]
                    _stuck_before_worker_init(held, ready_w)
                finally:
                    os._exit(0)
            children.append(pid)
    finally:
        workers.follow_forks(None)
    try:
        os.close(ready_w)
        waiting = b""  # both children at their lock, within a deadline
        while len(waiting) < len(children) and select.select([ready_r], [], [], 30)[0]:
            waiting += os.read(ready_r, 2) or b"!"
        os.close(ready_r)
        assert waiting == b"1" * len(children), waiting
        names = {workers.UNKNOWN_WORKER: children[0], 3: children[1]}
        dumps = {n: rankfiles.worker_dump_path(tmp_path, 0, f"{n}.{pid}")
                 for n, pid in names.items()}
        deadline = time.monotonic() + 30
        while not all(p.exists() and p.read_text().count("\n") for p in dumps.values()):
            assert time.monotonic() < deadline, sorted(p.name for p in tmp_path.rglob("*"))
            time.sleep(0.05)
        out = io.StringIO()
        workers.write_stacks(out, tmp_path, 0)
        text = out.getvalue()
        for number, pid in names.items():
            section = f"{rankfiles.WORKER_SECTION}{number} (pid {pid}):\n"
            assert section in text, text
            assert "in _stuck_before_worker_init" in text.split(section)[1], text
        # Only these two answer for themselves here: pytest's process may have other children
        # (the warm job server of tests/warm.py), listed as not answering, as a rank's would be.
        for pid in children:
            assert f"(pid {pid}, not answering" not in text, text
        assert all(os.waitpid(pid, os.WNOHANG) == (0, 0) for pid in children)  # alive
    finally:
        for pid in children:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
