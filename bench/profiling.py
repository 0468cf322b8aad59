"""`python -m bench.profiling`: what trainer.profile costs the steps outside its window.

Runs `python -m train` (2 gloo ranks, digits, the small CNN, 3 epochs) with and without
`trainer.profile.enabled=true` (window: steps 3-5 of epoch 1, after 2 waited and 1 warm-up),
interleaved, --repeats times, each into a fresh SQLite store, and reads each epoch's
train/samples_per_sec back (plain SQL: no mlflow import here). Epochs 2 and 3 lie outside the
window: their ratio is the floor's figure (issue 41: "a profiled job's steps outside the
profiler window run at the unprofiled speed"). Epoch 1's rate leaves the window's steps out.

    python -m bench.profiling --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import sqlite3
import statistics
import subprocess
import sys
import tempfile
from datetime import UTC, datetime
from pathlib import Path

from bench.run import machine_info

REPO = Path(__file__).resolve().parent.parent
JOB = ["data=digits", "model=cnn", "trainer.epochs=3", "distributed.nproc_per_node=2",
       "data.num_workers=0", "trainer.log_every_n_steps=5", "tracking.log_model=false"]
PROFILED = ["trainer.profile.enabled=true", "trainer.profile.wait=2", "trainer.profile.active=3"]


def run_once(profiled: bool, out: Path) -> list[float]:
    """Each epoch's train/samples_per_sec of one job."""
    env = {**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{out / 'mlflow.db'}"}
    cmd = [sys.executable, "-m", "train", *JOB, *(PROFILED if profiled else []),
           f"hydra.run.dir={out / 'job'}"]
    subprocess.run(cmd, cwd=REPO, env=env, check=True, capture_output=True, timeout=600)
    with sqlite3.connect(out / "mlflow.db") as con:
        rows = con.execute("SELECT step, value FROM metrics WHERE key = "
                           "'train/samples_per_sec' ORDER BY step").fetchall()
    return [value for _, value in rows]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--results", type=Path, default=REPO / ".bench" / "profiling.json")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-profiling-"))
    runs = []
    for repeat in range(args.repeats):
        for profiled in (False, True) if repeat % 2 == 0 else (True, False):  # either first
            out = work / f"{'profiled' if profiled else 'plain'}-{repeat}"
            out.mkdir()
            rates = run_once(profiled, out)
            runs.append({"profiled": profiled, "repeat": repeat, "samples_per_sec": rates})
            print(json.dumps(runs[-1]), flush=True)
    summary = {}
    for epoch in range(3):
        plain = statistics.median(r["samples_per_sec"][epoch] for r in runs if not r["profiled"])
        prof = statistics.median(r["samples_per_sec"][epoch] for r in runs if r["profiled"])
        summary[f"epoch {epoch + 1}"] = {"plain": plain, "profiled": prof,
                                         "ratio": prof / plain}
    print(json.dumps(summary, indent=1))
    args.results.parent.mkdir(parents=True, exist_ok=True)
    args.results.write_text(json.dumps(
        {"date": datetime.now(UTC).isoformat(timespec="seconds"), "machine": machine_info("cpu"),
         "load_avg": os.getloadavg(), "command": JOB, "profiled": PROFILED,
         "summary": summary, "runs": runs}, indent=2))
    print(f"results: {args.results}")


if __name__ == "__main__":
    main()
