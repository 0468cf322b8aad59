"""Creating a new SQLite store: `python -m bench.new_store [--rounds N] [--dirty-mb MB]`.

Interleaved, each in a fresh process: MLflow's own first opening of a new store
(`MlflowClient(uri).search_experiments()`) against train/tracking/new_store.py's `initialise`.
Reports each one's wall time (median), and its fdatasync/fsync calls when strace is installed
(`--no-strace`: times only, without strace's cost on every system call). The machine, the
load and every round go to `--out` (default .bench/new_store.json).
`--dirty-mb` keeps a writer busy meanwhile (a file of that size written over and over, never
synced), as other jobs' checkpoints and a pip install are on a shared disk.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from bench.report import machine_info

REPO = Path(__file__).resolve().parents[1]

WAYS = {
    "mlflow": "from mlflow import MlflowClient; "
              "MlflowClient(tracking_uri=URI).search_experiments(max_results=1)",
    "initialise": "from train.tracking.new_store import initialise; initialise(URI)",
}
TIMED = ("import sys, time; URI = sys.argv[1]; {setup}; t = time.monotonic(); {code}; "
         "print(time.monotonic() - t)")
IMPORTS = "from mlflow import MlflowClient; import train.tracking.new_store"


def once(way: str, directory: Path, index: int, count: bool) -> tuple[float, int | None]:
    """(seconds, sync calls or None) for one new store made `way`; strace (`count`) slows
    every system call, both ways alike."""
    uri = f"sqlite:///{directory / f'{way}-{index}.db'}"
    code = TIMED.format(setup=IMPORTS, code=WAYS[way])
    command = [sys.executable, "-c", code, uri]
    trace = directory / f"{way}-{index}.strace"
    if count and shutil.which("strace"):
        command = ["strace", "-f", "-c", "-e", "trace=fsync,fdatasync", "-o", str(trace),
                   *command]
    done = subprocess.run(command, capture_output=True, text=True, check=True)
    seconds = float(done.stdout.strip().splitlines()[-1])
    if not trace.exists():
        return seconds, None
    calls = [line.split() for line in trace.read_text().splitlines()
             if line.split()[-1:] in (["fsync"], ["fdatasync"])]
    return seconds, sum(int(fields[3]) for fields in calls)


def keep_writing(path: Path, megabytes: int, stop: threading.Event) -> None:
    block = b"\0" * 2**20
    while not stop.is_set():
        with open(path, "wb") as f:
            for _ in range(megabytes):
                if stop.is_set():
                    break
                f.write(block)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dirty-mb", type=int, default=0)
    parser.add_argument("--no-strace", action="store_true", help="time only; count no syncs")
    parser.add_argument("--out", type=Path, default=REPO / ".bench" / "new_store.json")
    args = parser.parse_args()
    load_before, started = os.getloadavg(), time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    results: dict[str, list[tuple[float, int | None]]] = {way: [] for way in WAYS}
    with tempfile.TemporaryDirectory(dir=Path.cwd()) as tmp:
        stop = threading.Event()
        writer = threading.Thread(target=keep_writing,
                                  args=(Path(tmp) / "load", args.dirty_mb, stop), daemon=True)
        if args.dirty_mb:
            writer.start()
        try:
            for index in range(args.rounds):
                for way in WAYS:
                    results[way].append(once(way, Path(tmp), index, not args.no_strace))
        finally:
            stop.set()
    for way, runs in results.items():
        syncs = {calls for _, calls in runs}
        print(f"{way:>10}: median {statistics.median(s for s, _ in runs):.2f} s over "
              f"{len(runs)} (each: {', '.join(f'{s:.2f}' for s, _ in runs)}); "
              f"sync calls {sorted(syncs) if None not in syncs else 'not counted (no strace)'}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "command": " ".join(["python -m bench.new_store", *sys.argv[1:]]), "started": started,
        "machine": machine_info("cpu"),
        "load_average_1_5_15": {"before": load_before, "after": os.getloadavg()},
        "rounds": {way: [{"seconds": s, "sync_calls": c} for s, c in runs]
                   for way, runs in results.items()},
        "median_s": {way: statistics.median(s for s, _ in runs)
                     for way, runs in results.items()}}, indent=1) + "\n")
    print(f"results: {args.out}")


if __name__ == "__main__":
    main()
