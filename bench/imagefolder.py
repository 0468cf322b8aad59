"""`python -m bench.imagefolder`: the service on an ImageFolder of JPEGs against a plain loop.

The harness writes the data itself (tests/images.py): 10 classes x 500 JPEGs of 96x96 for
training (+ 50 per class for validation), cropped to 64x64 by the training transforms, and a
set 4x larger (2,000 + 200 per class). Two variants train the same model on the same files,
global batch, ranks, workers and transforms:

  plain    bench/plain_imagefolder.py under torchrun: torchvision ImageFolder + DistributedSampler
           + DataLoader, transforms.v2 in the workers, `loss.item()` every step, no tracking
  service  python -m train data=imagefolder ..., recording a run into a fresh SQLite MLflow store

interleaved (plain service plain service ...) --repeats times; the table shows medians of
samples/s over every epoch but the first, of the time from the command's start to the first
optimiser step and of each rank's peak RSS. Then the service runs one epoch on each set, the
two interleaved --repeats times, to show that its peak RSS does not grow with the data set.
The model defaults to a small MLP so that decoding, not the model, sets the pace: this measures
the data path.

    python -m bench.imagefolder                   # 2 ranks, CPU: ~3 minutes on 2 cores
    python -m bench.imagefolder --device cuda --model resnet18 --nproc 1
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from datetime import UTC, datetime
from pathlib import Path

from bench.run import Measurement, machine_info, steady_rate
from tests.images import write_image_folder

REPO = Path(__file__).resolve().parent.parent


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--nproc", type=int, default=2, help="ranks")
    p.add_argument("--workers", type=int, help="DataLoader workers per rank (both variants); "
                   "default: the service's own default for this machine")
    p.add_argument("--model", default="mlp")
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--depth", type=int, default=1)
    p.add_argument("--batch-size", type=int, default=128, help="GLOBAL batch")
    p.add_argument("--lr", type=float, default=0.01, help="SGD (the MLP diverges at 0.05)")
    p.add_argument("--image-size", type=int, default=64, help="the training crop")
    p.add_argument("--classes", type=int, default=10)
    p.add_argument("--per-class", type=int, default=500, help="training JPEGs per class")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--rss-scale", type=int, default=4, help="the larger set's size factor")
    p.add_argument("--data", type=Path, help="where the JPEGs go (kept); default: a temp dir")
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--out", type=Path, default=REPO / ".bench" / "imagefolder.json")
    args = p.parse_args()
    if args.workers is None:
        from train.data.build import default_num_workers

        args.workers = default_num_workers(args.nproc, streamed=True)
    return args


def make_sets(args: argparse.Namespace, where: Path) -> dict[str, Path]:
    """The base set and the larger one (written once; an existing --data folder is reused)."""
    sets = {}
    for name, factor in (("base", 1), ("large", args.rss_scale)):
        root = where / f"{name}-{args.classes}x{args.per_class * factor}"
        if not (root / "val").is_dir():
            started = time.time()
            write_image_folder(root, args.classes, args.per_class * factor,
                               args.per_class * factor // 10, size=96, seed=factor)
            print(f"wrote {root} in {time.time() - started:.0f} s", flush=True)
        sets[name] = root
    return sets


def plain_command(args: argparse.Namespace, root: Path, out: Path, epochs: int) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc_per_node={args.nproc}", str(REPO / "bench" / "plain_imagefolder.py"),
            "--root", str(root / "train"), "--image-size", str(args.image_size),
            "--model", args.model, "--width", str(args.width), "--depth", str(args.depth),
            "--batch-size", str(args.batch_size), "--epochs", str(epochs), "--lr", str(args.lr),
            "--workers", str(args.workers), "--device", args.device,
            "--out", str(out / "plain.json")]


def service_command(args: argparse.Namespace, root: Path, out: Path, epochs: int) -> list[str]:
    cmd = [sys.executable, "-m", "train", "data=imagefolder", f"data.root={root}",
           f"data.image_size={args.image_size}", f"model={args.model}",
           f"model.width={args.width}", f"model.depth={args.depth}", "model.dropout=0.0",
           f"data.batch_size={args.batch_size}", f"data.num_workers={args.workers}",
           f"optim.lr={args.lr}",
           f"distributed.nproc_per_node={args.nproc}", f"distributed.device={args.device}",
           f"trainer.epochs={epochs}", "tracking.log_model=false", f"hydra.run.dir={out}"]
    return cmd + (["trainer.precision=bf16-mixed"] if args.device == "cuda" else [])


def run_one(variant: str, repeat: int, args: argparse.Namespace, root: Path, tmp: Path,
            epochs: int) -> Measurement:
    out = tmp / f"{variant}-{root.name}-{repeat}"
    out.mkdir(parents=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (str(REPO),
                                                                      os.environ.get("PYTHONPATH"))))}
    env["MLFLOW_TRACKING_URI"] = f"sqlite:///{out / 'mlflow.db'}"  # a fresh store per run
    cmd = (plain_command if variant == "plain" else service_command)(args, root, out, epochs)
    with (out / "output.log").open("w") as sink:
        started = time.time()
        proc = subprocess.run(cmd, cwd=REPO, env=env, stdout=sink, stderr=subprocess.STDOUT,
                              timeout=args.timeout, check=False)
        wall = time.time() - started
    if proc.returncode != 0:
        tail = "\n".join((out / "output.log").read_text().splitlines()[-30:])
        raise SystemExit(f"{variant} failed (exit {proc.returncode}):\n  {' '.join(cmd)}\n{tail}")
    if variant == "plain":
        result = json.loads((out / "plain.json").read_text())
        by_epoch = [e["samples_per_sec"] for e in result["epochs"]]
    else:
        result = json.loads((out / "summary.json").read_text())
        by_epoch = [e["samples_per_sec"] for e in result["by_epoch"]]
    m = Measurement(variant, repeat, cmd, steady_rate(by_epoch), result["first_step_at"] - started,
                    result["peak_rss_mb"], wall, {"set": root.name, "by_epoch": by_epoch})
    print(f"  {variant:<15} {root.name:<14} #{repeat + 1}: {m.samples_per_sec:7.1f} samples/s  "
          f"first step {m.time_to_first_step_s:5.1f} s  peak RSS "
          f"{', '.join(f'{v:.0f}' for v in m.peak_rss_mb)} MB  wall {wall:.0f} s", flush=True)
    return m


def summarise(runs: list[Measurement]) -> dict[str, dict[str, object]]:
    summary: dict[str, dict[str, object]] = {}
    for key in dict.fromkeys(f"{r.variant} {r.extra['set']}" for r in runs):
        mine = [r for r in runs if f"{r.variant} {r.extra['set']}" == key]
        rates = [r.samples_per_sec for r in mine]
        summary[key] = {
            "samples_per_sec": statistics.median(rates), "min": min(rates), "max": max(rates),
            "time_to_first_step_s": statistics.median(r.time_to_first_step_s for r in mine),
            "peak_rss_mb": [statistics.median(x) for x in zip(*(r.peak_rss_mb for r in mine),
                                                               strict=True)]}
    return summary


def main() -> None:
    args = parse_args()
    where = args.data or Path(tempfile.mkdtemp(prefix="train-bench-images-"))
    sets = make_sets(args, where)
    tmp = Path(tempfile.mkdtemp(prefix="train-bench-if-"))
    print(f"bench.imagefolder: {vars(args)}\n  runs under {tmp}", flush=True)
    load_before = os.getloadavg()
    runs = [run_one(variant, repeat, args, sets["base"], tmp, args.epochs)
            for repeat in range(args.repeats) for variant in ("plain", "service")]
    # Memory against the data set's size: one epoch of the service on each set, interleaved.
    runs += [run_one("service-1-epoch", repeat, args, sets[name], tmp, 1)
             for repeat in range(args.repeats) for name in sets]
    summary = summarise(runs)
    plain, service = (summary[f"{v} {sets['base'].name}"] for v in ("plain", "service"))
    base, large = (summary[f"service-1-epoch {sets[n].name}"] for n in ("base", "large"))
    found = {"samples_per_sec service/plain": service["samples_per_sec"] / plain["samples_per_sec"],
             "first step service - plain (s)":
                 service["time_to_first_step_s"] - plain["time_to_first_step_s"],
             "peak RSS per rank, large/base (medians, 1 epoch each)": [
                 b / a for a, b in zip(base["peak_rss_mb"], large["peak_rss_mb"], strict=True)]}
    for key, value in summary.items():
        print(f"{key:<31} {value['samples_per_sec']:7.1f} samples/s ({value['min']:.0f}-"
              f"{value['max']:.0f})  first step {value['time_to_first_step_s']:.1f} s  peak RSS "
              f"{', '.join(f'{v:.0f}' for v in value['peak_rss_mb'])} MB")
    for key, value in found.items():
        print(f"{key}: {value}")
    results = {"date": datetime.now(UTC).isoformat(timespec="seconds"),
               "machine": machine_info(args.device),
               "load_average_1_5_15": {"before": load_before, "after": os.getloadavg()},
               "settings": {k: str(v) for k, v in vars(args).items()}, "summary": summary,
               "found": found, "runs": [asdict(r) for r in runs]}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2))
    print(f"results in {args.out}")


if __name__ == "__main__":
    main()
