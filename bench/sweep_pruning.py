"""Optuna sweeps with pruning against the same sweep without: total epochs trained, wall time
with 2 slots, and the best objective found (docs/benchmarks.md, issue 31).

Every sweep asks the same parameters in the same order (RandomSampler with one seed: what it
proposes does not depend on the results; each trial's training seed is the config's), over
digits with the small MLP (`model=mlp`: cheap epochs, so that the 2-core machine runs the four
sweeps in minutes), on this machine's CPUs. The pruners are the ones a
user would pick: the median rule with a warm-up, successive halving (ASHA) and Hyperband. The
epochs come from each trial's record in the study (a pruned trial trained until `pruned_at`).

    python -m bench.sweep_pruning                       # 16 trials of 10 epochs, 2 slots
    python -m bench.sweep_pruning --trials 12 --epochs 6 --pruners median
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from importlib.metadata import version
from pathlib import Path
from typing import Any

import optuna

REPO = Path(__file__).resolve().parent.parent

PRUNERS: dict[str, list[str]] = {
    "off": [],
    # Prunes a trial whose value at a step is below the median of the completed trials' at
    # that step, once 4 trials completed and from epoch 2 on (Optuna's n_warmup_steps=2: no
    # verdict at a step below 2; epoch 1 says little).
    "median": ["+hydra.sweeper.pruner.name=median", "+hydra.sweeper.pruner.n_startup_trials=4",
               "+hydra.sweeper.pruner.n_warmup_steps=2"],
    # Rungs at epochs 1, 3 and 9: a trial goes on past a rung only in the top third there.
    "successive_halving": ["+hydra.sweeper.pruner.name=successive_halving",
                           "+hydra.sweeper.pruner.min_resource=1",
                           "+hydra.sweeper.pruner.reduction_factor=3"],
    # Several successive-halving brackets, from aggressive to none, trials spread over them.
    "hyperband": ["+hydra.sweeper.pruner.name=hyperband", "+hydra.sweeper.pruner.min_resource=1",
                  "+hydra.sweeper.pruner.reduction_factor=3"],
}


def sweep(out: Path, args: argparse.Namespace, pruner: list[str]) -> dict[str, Any]:
    """One sweep; its wall time, epochs trained, best value and every trial."""
    sweep_dir = out / "sweep"
    started = time.perf_counter()
    result = subprocess.run(
        [sys.executable, "-m", "train", "-m", "+hparams_search=optuna_digits",
         f"hydra.sweeper.n_trials={args.trials}", "hydra.sweeper.n_jobs=2",
         f"trainer.epochs={args.epochs}", f"model={args.model}", "tracking.log_model=false",
         "hydra.sweeper.sampler._target_=optuna.samplers.RandomSampler",
         f"hydra.sweeper.sampler.seed={args.seed}", "optim.lr=tag(log, interval(0.0001, 0.2))",
         *pruner, f"hydra.sweep.dir={sweep_dir}"],
        cwd=REPO, capture_output=True, text=True,
        env={**_env(), "MLFLOW_TRACKING_URI": f"sqlite:///{out}/mlflow.db"})
    wall = time.perf_counter() - started
    if result.returncode:
        raise SystemExit(f"sweep failed:\n{result.stderr[-3000:]}")
    storage = optuna.storages.JournalStorage(
        optuna.storages.journal.JournalFileBackend(str(sweep_dir / "optuna.journal")))
    study = optuna.load_study(study_name="digits", storage=storage)
    done = study.get_trials(deepcopy=False)
    trials = [{"number": t.number, "state": t.state.name, "params": t.params,
               "epochs": int(t.user_attrs.get("pruned_at", args.epochs)), "value": t.value,
               "last_reported": t.intermediate_values.get(max(t.intermediate_values, default=0))}
              for t in done]
    return {"wall_s": round(wall, 1), "epochs_trained": sum(t["epochs"] for t in trials),
            "trials": len(done), "pruned": sum(t["state"] == "PRUNED" for t in trials),
            "failed": sum(t["state"] == "FAIL" for t in trials),
            "best_value": study.best_value, "best_trial": study.best_trial.number,
            "best_params": study.best_params, "per_trial": trials}


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trials", type=int, default=16)
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--model", default="mlp", help="cnn: optuna_digits' own, slower")
    parser.add_argument("--seed", type=int, default=0, help="RandomSampler's seed")
    parser.add_argument("--pruners", nargs="+", default=[p for p in PRUNERS if p != "off"],
                        choices=[p for p in PRUNERS if p != "off"],
                        help="the pruned sweeps, each against the one without pruning")
    parser.add_argument("--out", type=Path,
                        default=Path(tempfile.gettempdir()) / "sweep_pruning.json")
    args = parser.parse_args()
    rows: dict[str, Any] = {}
    loads = [os.getloadavg()[0]]
    with tempfile.TemporaryDirectory() as tmp:
        for name in ("off", *args.pruners):
            rows[name] = sweep(Path(tmp) / name, args, PRUNERS[name])
            loads.append(os.getloadavg()[0])
            off = rows["off"]
            rows[name]["epochs_vs_off"] = round(rows[name]["epochs_trained"]
                                                / off["epochs_trained"], 3)
            rows[name]["wall_vs_off"] = round(rows[name]["wall_s"] / off["wall_s"], 3)
            brief = {k: v for k, v in rows[name].items() if k != "per_trial"}
            print(name, json.dumps(brief), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "date": datetime.now(UTC).isoformat(timespec="seconds"), "trials": args.trials,
        "epochs": args.epochs, "model": args.model, "seed": args.seed, "slots": 2,
        "pruner_overrides": {n: PRUNERS[n] for n in rows},
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                    "load_average_1m_before_and_after_each_sweep": loads,
                    "optuna": optuna.__version__, "torch": version("torch"),
                    "python": platform.python_version()},
        "rows": rows}, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
