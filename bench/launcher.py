"""`python -m bench.launcher`: how fast local ranks start, and what a user sees when one fails.

Runs `python -m train distributed.nproc_per_node=2` (digits, a fresh SQLite MLflow store per
run) from each source tree given (default: this checkout), interleaved, --repeats times:

  start          1 epoch: command start -> first optimiser step (summary.json's first_step_at)
  fail           rank 1 fails at step 3 (TRAIN_FAIL_DRILL=1:3): exit code, seconds to exit,
                 whether rank 1's traceback reaches the terminal and the run's `error` tag
  kill-rank      rank 1 SIGKILLed once training is under way (first checkpoint written):
                 seconds from the kill to exit, the message, the run's status and tag
  kill-launcher  the launching process SIGKILLed instead: do its ranks end too?

Every process started under the command is tracked; `left` counts those still alive 5 s after
the command ended (the harness then kills them). `cpu_s` is the CPU time of the whole tree (the
harness is the subreaper of what the command leaves, and waits for it). Compare launchers by
giving one tree per variant, e.g. an unpacked older revision (`git archive REV | tar -x -C
DIR`), or a copy with bench/elastic_launch.py as its train/launch/local.py:

    python -m bench.launcher --tree hand=. --tree elastic=/tmp/elastic --repeats 5
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import resource
import signal
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import psutil

from bench.run import machine_info

REPO = Path(__file__).resolve().parent.parent
SCENARIOS: dict[str, list[str]] = {
    "start": ["trainer.epochs=1"],
    "fail": ["trainer.epochs=3"],
    "kill-rank": ["trainer.epochs=200"],
    "kill-launcher": ["trainer.epochs=200"],
}
PR_SET_CHILD_SUBREAPER = 36  # <linux/prctl.h>
LEFT_AFTER_S = 5.0
"""How long after the command ended a process it started may still live before it counts as
left behind (PDEATHSIG and SIGTERM handling take a moment)."""


def _fail_drill(tree: Path) -> list[str]:
    """Trees before TRAIN_FAIL_DRILL took the drill as config keys."""
    old = "fail_on_rank" in (tree / "train" / "config" / "groups.py").read_text() \
        if (tree / "train" / "config" / "groups.py").exists() else True
    return ["trainer.fail_on_rank=1", "trainer.fail_at_step=3"] if old else []


def run_once(tree: Path, scenario: str, out: Path, timeout: float) -> dict[str, Any]:
    """One command; what it printed, how it ended and what it left behind."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                        "MASTER_PORT") and not k.startswith(("SLURM_", "SUBMITIT_"))}
    env.update(PYTHONPATH=str(tree), MLFLOW_TRACKING_URI=f"sqlite:///{out / 'mlflow.db'}")
    drill = _fail_drill(tree) if scenario == "fail" else []
    if scenario == "fail" and not drill:
        env["TRAIN_FAIL_DRILL"] = "1:3"
    # data.num_workers=0: the ranks are then the leaves of the process tree.
    cmd = [sys.executable, "-m", "train", "distributed.nproc_per_node=2", "data.num_workers=0",
           f"hydra.run.dir={out / 'job'}", *SCENARIOS[scenario], *drill]
    cpu_before = _children_cpu_s()
    with (out / "stderr.log").open("w") as err, (out / "stdout.log").open("w") as std:
        started = time.time()
        proc = subprocess.Popen(cmd, cwd=tree, env=env, stdout=std, stderr=err,
                                start_new_session=True)
        seen, killed_at = _watch(proc, scenario, out / "job", timeout)
        ended = time.time()
    result: dict[str, Any] = {"rc": proc.returncode, "wall_s": ended - started}
    if killed_at is not None:
        result["exit_after_kill_s"] = ended - killed_at
    if scenario == "kill-launcher":
        result["ranks_gone_after_s"] = _gone_after(seen)
    result["left"] = _left_behind(seen)
    _reap_orphans()
    result["cpu_s"] = _children_cpu_s() - cpu_before
    result.update(_what_user_sees(scenario, (out / "stderr.log").read_text()))
    result.update(_run_record(out / "mlflow.db"))
    if scenario == "start" and (summary := out / "job" / "summary.json").exists():
        result["first_step_s"] = json.loads(summary.read_text())["first_step_at"] - started
    return result


def _watch(proc: subprocess.Popen, scenario: str, job: Path,
           timeout: float) -> tuple[dict[int, psutil.Process], float | None]:
    """Poll the command's process tree until it exits; kill what the scenario says, once
    training is under way. Returns every process seen and when the kill was sent."""
    launcher = psutil.Process(proc.pid)
    seen: dict[int, psutil.Process] = {}
    killed_at = None
    deadline = time.monotonic() + timeout
    while proc.poll() is None:
        if time.monotonic() > deadline:
            proc.kill()
            proc.wait()
            break
        with contextlib.suppress(psutil.NoSuchProcess):
            for child in launcher.children(recursive=True):
                seen.setdefault(child.pid, child)
        if killed_at is None and scenario.startswith("kill-") and any(job.glob("checkpoints/*")):
            victim = launcher if scenario == "kill-launcher" else _ranks(seen)[1]
            victim.send_signal(signal.SIGKILL)
            killed_at = time.time()
            if scenario == "kill-launcher":
                proc.wait()
                break
        time.sleep(0.1)
    return seen, killed_at


def _children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _reap_orphans() -> None:
    """Wait for what the command left to this harness, its subreaper (a launcher's fork server
    ends just after the launcher): their CPU time then counts in RUSAGE_CHILDREN."""
    with contextlib.suppress(ChildProcessError):
        while True:
            os.waitpid(-1, 0)


def _alive(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _ranks(seen: dict[int, psutil.Process]) -> list[psutil.Process]:
    """The live leaves of the tree, oldest first: rank 0, rank 1 (started in that order)."""
    alive = [p for p in seen.values() if _alive(p)
             and "resource_tracker" not in " ".join(_cmdline(p))]
    parents = {p.ppid() for p in alive}
    return sorted((p for p in alive if p.pid not in parents), key=lambda p: p.create_time())


def _cmdline(p: psutil.Process) -> list[str]:
    try:
        return p.cmdline()
    except psutil.Error:
        return []


def _gone_after(seen: dict[int, psutil.Process], limit: float = 30.0) -> float | None:
    """Seconds until every process of the tree has ended (None: some outlived `limit`)."""
    start = time.monotonic()
    while time.monotonic() - start < limit:
        if not any(_alive(p) for p in seen.values()):
            return time.monotonic() - start
        time.sleep(0.1)
    return None


def _left_behind(seen: dict[int, psutil.Process]) -> int:
    deadline = time.monotonic() + LEFT_AFTER_S
    while any(_alive(p) for p in seen.values()) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = [p for p in seen.values() if _alive(p)]
    for p in left:  # started by this harness: end them, by pid
        with contextlib.suppress(psutil.NoSuchProcess):
            p.kill()
    return len(left)


def _what_user_sees(scenario: str, stderr: str) -> dict[str, Any]:
    """The command's final error message, and whether it names rank 1 and its traceback."""
    message = stderr.rsplit("\nerror: ", 1)[1].strip() if "\nerror: " in stderr else ""
    found: dict[str, Any] = {"stderr_lines": len(stderr.splitlines()), "message": message}
    if scenario == "fail":
        # One block: the cause in its first line, the tracebacks in train.log (issue 29).
        found["message_ok"] = (message.startswith("the training job failed; rank 1 on ")
                               and "FailureDrill" in message.splitlines()[0]
                               and "Traceback" not in message)
    elif scenario == "kill-rank":
        found["message_ok"] = "rank 1 was killed by SIGKILL" in message
    return found


def _run_record(db: Path) -> dict[str, Any]:
    """The MLflow run's status and `error` tag (plain SQL: no mlflow import here)."""
    if not db.exists():
        return {}
    with sqlite3.connect(db) as con:
        row = con.execute("SELECT run_uuid, status FROM runs").fetchone()
        if row is None:
            return {}
        tag = con.execute("SELECT value FROM tags WHERE run_uuid = ? AND key = 'error'",
                          (row[0],)).fetchone()
    return {"run_status": row[1], "error_tag": tag[0] if tag else None}


def summarise(runs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per tree and scenario: medians of the timings, counts of the checks that held."""
    table: dict[str, list[dict[str, Any]]] = {}
    for run in runs:
        table.setdefault(f"{run['tree']} {run['scenario']}", []).append(run)
    summary = {}
    for key, mine in table.items():
        row: dict[str, Any] = {"runs": len(mine)}
        for field in ("first_step_s", "wall_s", "cpu_s", "exit_after_kill_s", "ranks_gone_after_s",
                      "stderr_lines"):
            values = [r[field] for r in mine if r.get(field) is not None]
            if values:
                row[field] = statistics.median(values)
        for field in ("message_ok",):
            if any(field in r for r in mine):
                row[field] = sum(bool(r.get(field)) for r in mine)
        row["failed_run_with_tag"] = sum(r.get("run_status") == "FAILED" and bool(r.get(
            "error_tag")) for r in mine)
        row["runs_with_left"] = sum(r["left"] > 0 for r in mine)
        summary[key] = row
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tree", action="append", default=[], metavar="NAME=DIR",
                        help="a source tree to run `python -m train` from (repeatable)")
    parser.add_argument("--scenarios", default=",".join(SCENARIOS))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=180.0)
    parser.add_argument("--results", type=Path, default=REPO / ".bench" / "launcher.json")
    args = parser.parse_args()
    trees = dict(t.split("=", 1) for t in args.tree) or {"this": str(REPO)}
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1)  # for cpu_s
    work = Path(tempfile.mkdtemp(prefix="bench-launcher-"))
    runs: list[dict[str, Any]] = []
    for repeat in range(args.repeats):
        for scenario in args.scenarios.split(","):
            for name, tree in trees.items():  # interleaved: load elsewhere hits every tree
                out = work / f"{name}-{scenario}-{repeat}"
                out.mkdir(parents=True)
                run = {"tree": name, "scenario": scenario, "repeat": repeat,
                       **run_once(Path(tree).resolve(), scenario, out, args.timeout)}
                runs.append(run)
                print(json.dumps({k: v for k, v in run.items() if k != "message"}), flush=True)
    summary = summarise(runs)
    for key, row in summary.items():
        print(f"{key:<28} {json.dumps(row)}")
    args.results.parent.mkdir(parents=True, exist_ok=True)
    args.results.write_text(json.dumps(
        {"date": datetime.now(UTC).isoformat(timespec="seconds"), "machine": machine_info("cpu"),
         "load_avg": os.getloadavg(), "trees": trees, "work": str(work), "summary": summary,
         "runs": runs}, indent=2))
    print(f"results: {args.results}; outputs: {work}")


if __name__ == "__main__":
    main()
