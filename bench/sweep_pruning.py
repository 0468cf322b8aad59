"""An Optuna sweep with pruning against the same sweep without: total epochs trained, wall time
with 2 slots, and the best objective found (docs/benchmarks.md, issue 31).

Both sweeps ask the same parameters in the same order (RandomSampler with one seed: what it
proposes does not depend on the results), over digits, on this machine's CPUs. The epochs come
from each trial's record in the study (a pruned trial trained until its `pruned_at`).

    python -m bench.sweep_pruning                       # 12 trials of 4 epochs (mlp), 2 slots
    python -m bench.sweep_pruning --trials 16 --epochs 6
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import optuna

REPO = Path(__file__).resolve().parent.parent


def sweep(out: Path, trials: int, epochs: int, seed: int, model: str,
          pruner: list[str]) -> dict:
    """One sweep; its wall time, epochs trained and best value."""
    sweep_dir = out / "sweep"
    started = time.perf_counter()
    result = subprocess.run(
        [sys.executable, "-m", "train", "-m", "+hparams_search=optuna_digits",
         f"hydra.sweeper.n_trials={trials}", "hydra.sweeper.n_jobs=2",
         f"trainer.epochs={epochs}", f"model={model}", "tracking.log_model=false",
         "hydra.sweeper.sampler._target_=optuna.samplers.RandomSampler",
         f"hydra.sweeper.sampler.seed={seed}", "optim.lr=tag(log, interval(0.0001, 0.2))",
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
    trained = sum(int(t.user_attrs.get("pruned_at", epochs)) for t in done)
    return {"wall_s": round(wall, 1), "epochs_trained": trained, "trials": len(done),
            "pruned": sum(t.state.name == "PRUNED" for t in done),
            "best_value": study.best_value, "best_params": study.best_params}


def _env() -> dict[str, str]:
    import os

    return {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--trials", type=int, default=12)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--model", default="mlp", help="cnn: optuna_digits' own model")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--startup", type=int, default=3, help="MedianPruner n_startup_trials")
    parser.add_argument("--out", type=Path,
                        default=Path(tempfile.gettempdir()) / "sweep_pruning.json")
    args = parser.parse_args()
    median = ["+hydra.sweeper.pruner.name=median",
              f"+hydra.sweeper.pruner.n_startup_trials={args.startup}"]
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, pruner in (("off", []), ("median", median)):
            rows[name] = sweep(Path(tmp) / name, args.trials, args.epochs, args.seed, args.model,
                               pruner)
            print(name, json.dumps(rows[name]), flush=True)
    args.out.write_text(json.dumps({"trials": args.trials, "epochs": args.epochs,
                                    "model": args.model,
                                    "seed": args.seed, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
