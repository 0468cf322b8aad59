"""`make bench`: the training service side by side with a plain DDP loop, in one invocation.

Seven variants train the same model on the same synthetic data, global batch and ranks:

  a  plain           bench/plain_ddp.py under torchrun (the tutorials' loop, fp32)
  b  service         python -m train data=synthetic ... tracking.enabled=false (eager, fp32)
  c  service+mlflow  the same, recording a run into a fresh SQLite MLflow store
  d  +compile        b with trainer.compile=true
  e  +channels_last  b with trainer.channels_last=true
  f  +bf16           b with trainer.precision=bf16-mixed
  g  -stragglers     b with trainer.straggler_intervals=0: no straggler check

d, e and f are measured against b (and a) in the same invocation; for d the start-up cost of
compiling is reported apart from its steady-state samples/s (`compile_startup_s`: its first
epoch's extra time over its steady rate, less b's). b/g is the straggler check's cost: the
ranks' times shared at every logging step (every step here: its worst case).

b and c log every step (trainer.log_every_n_steps=1 unless --log-every says otherwise), so c/b
is the price of MLflow alone and both sync with the host every step, as a's `loss.item()` does.
Each variant runs --repeats times, interleaved (a b c a b c ...) so a burst of load elsewhere on
the machine spreads over all of them; the table shows medians. Every command gets a fresh output
directory; nothing is written into the repository except the results file.

    python -m bench.run                      # CPU defaults: 2 gloo ranks, ~9 minutes
    python -m bench.run --variants abc       # without d, e, f, g: ~4 minutes
    python -m bench.run --device cuda        # GPU: resnet18, bf16 + channels_last for the service
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sqlite3
import statistics
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from bench.report import VARIANTS, machine_info, print_table, ratios, run_variant, summarise

REPO = Path(__file__).resolve().parent.parent
# What d, e and f add to b's command (on CUDA, b already runs bf16 + channels_last).
OPTION_VARIANTS = {"d": ["trainer.compile=true"], "e": ["trainer.channels_last=true"],
                   "f": ["trainer.precision=bf16-mixed"], "g": ["trainer.straggler_intervals=0"]}

# Per device: what gives a stable figure in a couple of minutes on the project's 2-core CI
# machine (a small CNN: resnet18 runs at a few samples/s there), and a realistic GPU workload.
DEFAULTS: dict[str, dict[str, Any]] = {
    "cpu": {"nproc": 2, "model": "cnn", "width": 16, "batch_size": 256, "num_samples": 8192,
            "epochs": 4},
    "cuda": {"nproc": None, "model": "resnet18", "width": None, "batch_size": 512,
             "num_samples": 50000, "epochs": 3},
}


@dataclass
class Measurement:
    variant: str
    repeat: int
    command: list[str]
    samples_per_sec: float
    time_to_first_step_s: float
    """first_step_at (rank 0, unix time) minus the time the command was started."""
    peak_rss_mb: list[float]
    wall_s: float
    extra: dict[str, Any] = field(default_factory=dict)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--nproc", type=int, help="ranks (cpu: 2; cuda: every visible GPU)")
    p.add_argument("--model", help="cpu: cnn; cuda: resnet18")
    p.add_argument("--width", type=int, help="model.width (cpu default 16, else the model's)")
    p.add_argument("--batch-size", type=int, help="GLOBAL batch (cpu: 256; cuda: 512)")
    p.add_argument("--num-samples", type=int, help="synthetic samples, 10%% held out for val")
    p.add_argument("--epochs", type=int, help="samples/s is taken over every epoch but the first")
    p.add_argument("--repeats", type=int, default=2, help="runs per variant; medians are shown")
    p.add_argument("--log-every", type=int, default=1, help="trainer.log_every_n_steps (b, c)")
    p.add_argument("--compile", action="store_true", help="cuda: trainer.compile=true (b, c)")
    p.add_argument("--variants", default="abcdefg", help="subset to run, e.g. 'bd'")
    p.add_argument("--timeout", type=float, default=900, help="seconds per command")
    p.add_argument("--keep", action="store_true", help="keep the temporary run directories")
    p.add_argument("--out", type=Path, default=REPO / ".bench" / "results.json")
    args = p.parse_args()
    for key, value in DEFAULTS[args.device].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.nproc is None:
        args.nproc = max(1, gpu_count())
    if args.width is None:
        args.width = model_defaults(args.model)["width"]
    if args.batch_size % args.nproc:
        p.error(f"--batch-size {args.batch_size} must split evenly over --nproc {args.nproc}")
    if bad := set(args.variants) - set(VARIANTS):
        p.error(f"unknown variants {sorted(bad)}; choose from {', '.join(VARIANTS)}")
    return args


def model_defaults(name: str) -> dict[str, Any]:
    """conf/model/<name>.yaml over ModelConfig's defaults: what `model=<name>` composes to."""
    from train.config.groups import ModelConfig

    path = REPO / "conf" / "model" / f"{name}.yaml"
    option = OmegaConf.load(path) if path.exists() else OmegaConf.create()
    option.pop("defaults", None)  # `/model_schema@_here_`: ModelConfig, merged here by hand
    merged = OmegaConf.merge(OmegaConf.structured(ModelConfig), option)
    return OmegaConf.to_container(merged)  # type: ignore[return-value]


def gpu_count() -> int:
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return 0
    return sum(line.startswith("GPU ") for line in out.stdout.splitlines())


# -- the three commands --------------------------------------------------------------------------
def plain_command(args: argparse.Namespace, model: dict[str, Any], out: Path) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc_per_node={args.nproc}", str(REPO / "bench" / "plain_ddp.py"),
            "--model", args.model, "--width", str(args.width), "--depth", str(model["depth"]),
            "--dropout", str(model["dropout"]), "--batch-size", str(args.batch_size),
            "--num-samples", str(args.num_samples), "--epochs", str(args.epochs),
            "--device", args.device, "--out", str(out / "plain.json")]


def service_command(args: argparse.Namespace, model: dict[str, Any], out: Path,
                    tracking: bool, options: list[str]) -> list[str]:
    cmd = [sys.executable, "-m", "train", "data=synthetic", f"model={args.model}",
           f"model.width={args.width}", f"model.depth={model['depth']}",
           f"model.dropout={model['dropout']}", f"data.batch_size={args.batch_size}",
           f"data.num_samples={args.num_samples}", f"distributed.nproc_per_node={args.nproc}",
           f"distributed.device={args.device}", f"trainer.epochs={args.epochs}",
           f"trainer.log_every_n_steps={args.log_every}",
           f"tracking.enabled={str(tracking).lower()}", f"hydra.run.dir={out}"]
    if args.device == "cuda":
        cmd += ["trainer.precision=bf16-mixed", "trainer.channels_last=true"]
        if args.compile:
            cmd.append("trainer.compile=true")
    return cmd + [o for o in options if o not in cmd]


def run_one(variant: str, repeat: int, args: argparse.Namespace, model: dict[str, Any],
            tmp: Path) -> Measurement:
    out = tmp / f"{variant}-{repeat}"
    out.mkdir(parents=True)
    env = dict(os.environ)
    env.pop("MLFLOW_TRACKING_URI", None)
    # The `train` package of the tree this harness lives in, whatever the venv's install points at.
    env["PYTHONPATH"] = os.pathsep.join(filter(None, (str(REPO), env.get("PYTHONPATH"))))
    if variant == "a":
        cmd = plain_command(args, model, out)
    else:
        cmd = service_command(args, model, out, tracking=variant == "c",
                              options=OPTION_VARIANTS.get(variant, []))
        # Never the repository's store: a fresh database per run, migrated by the job itself.
        env["MLFLOW_TRACKING_URI"] = f"sqlite:///{out / 'mlflow.db'}"
        # A cold compiler cache, as a job's first start on a fresh node has: the start-up cost
        # measured is the one users pay (a warm cache in /tmp hides most of it).
        env["TORCHINDUCTOR_CACHE_DIR"] = str(out / "inductor-cache")
    started, wall, result = run_variant(cmd, env, out, args.timeout, VARIANTS[variant],
                                        variant == "a")
    if variant == "a":
        by_epoch = [e["samples_per_sec"] for e in result["epochs"]]
        extra = {"epochs": result["epochs"]}
    else:
        epochs = result["by_epoch"]
        by_epoch = [e["samples_per_sec"] for e in epochs]
        extra = {"run_id": result["run_id"], "by_epoch": epochs,
                 "first_epoch_extra_s": first_epoch_extra(by_epoch,
                                                          result["metrics"]["train/samples"])}
        if len(epochs) > 1:  # MLflow's CPU time on rank 0 once set up, over those epochs' time
            extra["tracking_cpu_share"] = (
                (epochs[-1]["tracking_thread_cpu_s"] - epochs[0]["tracking_thread_cpu_s"])
                / sum(e["epoch_time_s"] for e in epochs[1:]))
        if variant == "c":
            extra.update(store_check(out / "mlflow.db", result["run_id"]))
    sps = steady_rate(by_epoch)
    return Measurement(variant, repeat, cmd, sps, result["first_step_at"] - started,
                       result["peak_rss_mb"], wall, extra)


def steady_rate(by_epoch: list[float]) -> float:
    """Samples/s once warmed up: over every epoch but the first (which holds start-up work such
    as the service's deferred MLflow set-up), as total samples over total time."""
    steady = by_epoch[1:] or by_epoch
    return statistics.harmonic_mean(steady)


def first_epoch_extra(by_epoch: list[float], samples: float) -> float:
    """How much longer the first epoch trained than the steady rate says it should have: the
    start-up work inside the loop (torch.compile's compilation, first-touch allocations)."""
    return samples / by_epoch[0] - samples / steady_rate(by_epoch)


def store_check(db: Path, run_id: str | None) -> dict[str, Any]:
    """What the run left in the store (plain SQL: no mlflow import in the harness)."""
    with sqlite3.connect(db) as con:
        status = con.execute("SELECT status FROM runs WHERE run_uuid = ?", (run_id,)).fetchone()
        rows = con.execute("SELECT COUNT(*) FROM metrics WHERE run_uuid = ?", (run_id,)).fetchone()
    return {"run_status": status[0] if status else None, "metric_rows": rows[0]}


def main() -> None:
    args = parse_args()
    model = model_defaults(args.model)
    tmp = Path(tempfile.mkdtemp(prefix="train-bench-"))
    settings = {k: v for k, v in vars(args).items() if k not in ("out", "keep", "timeout")}
    print(f"bench: {settings}\n       runs under {tmp}", flush=True)
    load_before = os.getloadavg()
    runs: list[Measurement] = []
    try:
        for repeat in range(args.repeats):
            for variant in args.variants:
                m = run_one(variant, repeat, args, model, tmp)
                runs.append(m)
                print(f"  {VARIANTS[variant]:<15} #{repeat + 1}: {m.samples_per_sec:8.1f} "
                      f"samples/s  first step {m.time_to_first_step_s:5.1f} s  peak RSS "
                      f"{', '.join(f'{v:.0f}' for v in m.peak_rss_mb)} MB  wall {m.wall_s:.1f} s",
                      flush=True)
    finally:
        if not args.keep:
            shutil.rmtree(tmp, ignore_errors=True)
    summary = summarise(runs)
    found = ratios(summary)
    print_table(summary, found)
    load_after = os.getloadavg()
    results = {"date": datetime.now(UTC).isoformat(timespec="seconds"),
               "machine": machine_info(args.device),
               "load_average_1_5_15": {"before": load_before, "after": load_after},
               "settings": {**settings, "model_config": {**model, "width": args.width}},
               "summary": summary, "ratios": found, "runs": [asdict(r) for r in runs]}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2))
    print(f"\nload average before {load_before[0]:.2f}, after {load_after[0]:.2f} "
          f"(1 min); results in {args.out}")


if __name__ == "__main__":
    main()
