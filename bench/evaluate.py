"""`python -m bench.evaluate`: `python -m train eval` against the same evaluation inside
training.

Trains one run (2 gloo ranks, synthetic CIFAR-shaped data with a 6,000-sample validation
split, the small CNN, 3 epochs: 3 validations), then evaluates its final weights on that
validation split with `python -m train eval <run_id> eval.split=val` at the same world size,
--repeats times. The floor (issue 43): eval's samples/s (its eval-<name>.json, median over the
repeats) within 5 % of the run's own val/samples_per_sec (median over its epochs) - the same
forwards over the same shards, timed the same way. Both also
check that eval gives the run's val/loss. Plain SQL reads the store (no mlflow import here).

    python -m bench.evaluate --repeats 3
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
JOB = ["data=synthetic", "data.num_samples=12000", "data.val_fraction=0.5", "model=cnn",
       "trainer.epochs=3", "distributed.nproc_per_node=2", "data.batch_size=256",
       "tracking.log_model=false"]


def _metric(db: Path, key: str) -> float:
    with sqlite3.connect(db) as con:
        [(value,)] = con.execute("SELECT value FROM latest_metrics WHERE key = ?", (key,))
    return float(value)


def _history(db: Path, key: str) -> list[float]:
    with sqlite3.connect(db) as con:
        rows = con.execute("SELECT value FROM metrics WHERE key = ? ORDER BY step", (key,))
        return [float(value) for (value,) in rows]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--results", type=Path, default=REPO / ".bench" / "evaluate.json")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-evaluate-"))
    db = work / "mlflow.db"
    env = {**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{db}"}
    subprocess.run([sys.executable, "-m", "train", *JOB, f"hydra.run.dir={work / 'job'}"],
                   cwd=REPO, env=env, check=True, capture_output=True, timeout=900)
    run_id = json.loads((work / "job" / "summary.json").read_text())["run_id"]
    validations = _history(db, "val/samples_per_sec")
    in_training = statistics.median(validations)
    evals = []
    for repeat in range(args.repeats):
        out = work / f"eval-{repeat}"
        subprocess.run([sys.executable, "-m", "train", "eval", run_id, "eval.split=val",
                        f"eval.name=bench{repeat}", f"hydra.run.dir={out}"],
                       cwd=REPO, env=env, check=True, capture_output=True, timeout=900)
        record = json.loads((out / f"eval-bench{repeat}.json").read_text())
        evals.append({"repeat": repeat, "samples_per_sec": record["samples_per_sec"],
                      "samples": record["samples"],
                      "loss": record["metrics"][f"eval/bench{repeat}/loss"]})
        print(json.dumps(evals[-1]), flush=True)
    median = statistics.median(e["samples_per_sec"] for e in evals)
    summary = {"in_training_samples_per_sec": in_training, "in_training_each": validations,
               "eval_samples_per_sec": median,
               "ratio": median / in_training, "val_loss": _metric(db, "val/loss"),
               "eval_losses": [e["loss"] for e in evals]}
    print(json.dumps(summary, indent=1))
    args.results.parent.mkdir(parents=True, exist_ok=True)
    args.results.write_text(json.dumps(
        {"date": datetime.now(UTC).isoformat(timespec="seconds"), "machine": machine_info("cpu"),
         "load_avg": os.getloadavg(), "command": JOB, "summary": summary, "evals": evals},
        indent=2))
    print(f"results: {args.results}")


if __name__ == "__main__":
    main()
