"""`make bench`'s task rows: the service's regression and segmentation against a plain DDP loop.

For each task, two variants train the same model class on the same Dataset class
(bench/task_data.py), with the same ranks, global batch, epochs, seed, learning rate and
DataLoader workers per rank:

  a  plain    bench/plain_tasks.py under torchrun (the tutorials' loop: DistributedSampler +
              DataLoader, the loss's mean reduction, `loss.item()` every step)
  b  service  python -m train task=<task> data=custom model=custom ... tracking.enabled=false

Each pair runs --repeats times, interleaved (a b a b ...) task after task, so a burst of load
elsewhere on the machine spreads over both; the table shows medians of samples/s over every
epoch but the first, the time from the command's start to the first optimiser step and the
peak RSS of each rank, and the ratio service/plain of the medians and of each pair.

    python -m bench.tasks                                  # ~7 minutes on a quiet 2-core CPU
    python -m bench.tasks --tasks segmentation --repeats 5
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from bench.report import machine_info, run_variant
from bench.run import steady_rate

REPO = Path(__file__).resolve().parent.parent
NAMES = {"a": "plain", "b": "service"}
# Per task: the Dataset and model classes (bench/task_data.py) and sizes that take ~20-40 s a
# run on the project's 2-core VM.
TASKS: dict[str, dict[str, Any]] = {
    "regression": {"data": "Features", "model": "MLP", "num_samples": 200_000, "val": 4_000,
                   "batch_size": 256, "epochs": 5, "lr": 0.01},
    "segmentation": {"data": "Shapes", "model": "SegNet", "num_samples": 3_000, "val": 256,
                     "batch_size": 64, "epochs": 5, "lr": 0.05},
}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--tasks", default="regression,segmentation", help="comma-separated")
    p.add_argument("--nproc", type=int, default=2, help="gloo ranks on this machine's CPU")
    p.add_argument("--repeats", type=int, default=3, help="pairs per task; medians are shown")
    p.add_argument("--epochs", type=int, help="every task's (else its own default)")
    p.add_argument("--num-samples", type=int, help="every task's training samples")
    p.add_argument("--workers", type=int,
                   help="DataLoader workers per rank, both variants (default: the service's "
                        "own default on this machine, data.num_workers=null)")
    p.add_argument("--log-every", type=int, help="the service's trainer.log_every_n_steps "
                   "(default: its own, 10)")
    p.add_argument("--service-override", action="append", default=[], metavar="KEY=VALUE",
                   help="one more override of the service's command (repeatable), e.g. "
                        "distributed.keep_host_memory=false")
    p.add_argument("--timeout", type=float, default=600, help="seconds per command")
    p.add_argument("--keep", action="store_true", help="keep the temporary run directories")
    p.add_argument("--out", type=Path, default=REPO / ".bench" / "tasks.json")
    args = p.parse_args()
    args.tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    if bad := set(args.tasks) - set(TASKS):
        p.error(f"unknown tasks {sorted(bad)}; choose from {', '.join(TASKS)}")
    if args.workers is None:
        from train.data.batches import default_num_workers

        args.workers = default_num_workers(args.nproc, streamed=True)  # data=custom streams
    return args


def settings_of(task: str, args: argparse.Namespace) -> dict[str, Any]:
    s = dict(TASKS[task])
    s.update({k: getattr(args, k) for k in ("epochs", "num_samples") if getattr(args, k)})
    if s["batch_size"] % args.nproc:
        raise SystemExit(f"{task}: batch {s['batch_size']} does not split over {args.nproc}")
    return s


def plain_command(task: str, s: dict[str, Any], args: argparse.Namespace,
                  out: Path) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc_per_node={args.nproc}", str(REPO / "bench" / "plain_tasks.py"),
            "--task", task, "--num-samples", str(s["num_samples"]),
            "--batch-size", str(s["batch_size"]), "--epochs", str(s["epochs"]),
            "--lr", str(s["lr"]), "--workers", str(args.workers), "--seed", "0",
            "--out", str(out / "plain.json")]


def service_command(task: str, s: dict[str, Any], args: argparse.Namespace,
                    out: Path) -> list[str]:
    data = f"bench.task_data.{s['data']}"
    cmd = [sys.executable, "-m", "train", f"task={task}", "data=custom",
           f"data.train._target_={data}", "+data.train.split=train",
           f"+data.train.length={s['num_samples']}", f"data.val._target_={data}",
           "+data.val.split=val", f"+data.val.length={s['val']}", "model=custom",
           f"model._target_=bench.task_data.{s['model']}", f"data.batch_size={s['batch_size']}",
           f"data.num_workers={args.workers}", f"optim.lr={s['lr']}", "optim.schedule=constant",
           f"trainer.epochs={s['epochs']}", "trainer.seed=0",
           f"distributed.nproc_per_node={args.nproc}", "distributed.device=cpu",
           "tracking.enabled=false", f"hydra.run.dir={out}"]
    if args.log_every:
        cmd.append(f"trainer.log_every_n_steps={args.log_every}")
    return cmd + args.service_override


def run_one(task: str, variant: str, repeat: int, args: argparse.Namespace,
            tmp: Path) -> dict[str, Any]:
    s = settings_of(task, args)
    out = tmp / f"{task}-{variant}-{repeat}"
    out.mkdir(parents=True)
    env = dict(os.environ)
    env.pop("MLFLOW_TRACKING_URI", None)
    # This tree's `train` and `bench` packages, whatever the venv's install points at.
    env["PYTHONPATH"] = os.pathsep.join(filter(None, (str(REPO), env.get("PYTHONPATH"))))
    maker = plain_command if variant == "a" else service_command
    cmd = maker(task, s, args, out)
    started, wall, result = run_variant(cmd, env, out, args.timeout,
                                        f"{task} {NAMES[variant]}", variant == "a")
    epochs = result["epochs" if variant == "a" else "by_epoch"]
    by_epoch = [e["samples_per_sec"] for e in epochs]
    # Rank 0's CPU time per training sample over the steady epochs: the work each variant
    # does, which other load on the machine hardly changes (wall-clock rates it does).
    cpu = [e["cpu_s" if variant == "a" else "train_cpu_s"] for e in epochs][1:]
    cpu_us = 1e6 * sum(cpu) / (s["num_samples"] * max(1, len(cpu)))
    return {"task": task, "variant": variant, "repeat": repeat,
            "samples_per_sec": steady_rate(by_epoch), "cpu_us_per_sample": round(cpu_us, 2),
            "by_epoch": [round(v, 1) for v in by_epoch],
            "first_step_s": round(result["first_step_at"] - started, 2),
            "peak_rss_mb": [round(v) for v in result["peak_rss_mb"]], "wall_s": round(wall, 1),
            "command": [str(c).replace(str(tmp), "$TMP") for c in cmd[1:]]}


def summarise(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per task: each variant's medians, and service/plain of the medians and of each pair."""
    out: dict[str, Any] = {}
    for task in dict.fromkeys(r["task"] for r in runs):
        mine = {v: [r for r in runs if r["task"] == task and r["variant"] == v] for v in NAMES}
        row: dict[str, Any] = {}
        for v, rs in mine.items():
            sps = [r["samples_per_sec"] for r in rs]
            row[NAMES[v]] = {
                "samples_per_sec": round(statistics.median(sps), 1),
                "min": round(min(sps), 1), "max": round(max(sps), 1),
                "first_step_s": round(statistics.median(r["first_step_s"] for r in rs), 2),
                "peak_rss_mb": [statistics.median(x) for x in zip(*(r["peak_rss_mb"] for r in rs),
                                                                  strict=True)],
                "wall_s": round(statistics.median(r["wall_s"] for r in rs), 1),
                "cpu_us_per_sample": round(statistics.median(
                    r["cpu_us_per_sample"] for r in rs), 2)}
        row["ratio"] = round(row["service"]["samples_per_sec"] / row["plain"]["samples_per_sec"],
                             3)
        # plain's CPU per sample over the service's: >= 1.0 when the service costs no more work.
        row["cpu_ratio"] = round(row["plain"]["cpu_us_per_sample"]
                                 / row["service"]["cpu_us_per_sample"], 3)
        row["ratio_per_pair"] = [round(b["samples_per_sec"] / a["samples_per_sec"], 3)
                                 for a, b in zip(mine["a"], mine["b"], strict=True)]
        out[task] = row
    return out


def print_table(summary: dict[str, Any]) -> None:
    print(f"\n{'task':<13} {'variant':<8} {'samples/s':>10} {'(min-max)':>17} {'1st step s':>11} "
          f"{'peak RSS MB per rank':>21} {'wall s':>7}")
    for task, row in summary.items():
        for name in NAMES.values():
            s = row[name]
            spread = f"({s['min']:.0f}-{s['max']:.0f})"
            rss = ", ".join(f"{v:.0f}" for v in s["peak_rss_mb"])
            print(f"{task:<13} {name:<8} {s['samples_per_sec']:>10.1f} {spread:>17} "
                  f"{s['first_step_s']:>11.1f} {rss:>21} {s['wall_s']:>7.1f}")
        pairs = ", ".join(f"{r:.3f}" for r in row["ratio_per_pair"])
        print(f"{task:<13} service/plain = {row['ratio']:.3f} (medians); per pair: {pairs}; "
              f"rank 0 CPU us/sample plain/service = {row['cpu_ratio']:.3f} "
              f"({row['plain']['cpu_us_per_sample']} / {row['service']['cpu_us_per_sample']})")


def main() -> None:
    args = parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="train-bench-tasks-"))
    settings = {"nproc": args.nproc, "repeats": args.repeats, "workers": args.workers,
                "log_every": args.log_every, "service_overrides": args.service_override,
                "tasks": {t: settings_of(t, args) for t in args.tasks}}
    print(f"bench.tasks: {settings}\n             runs under {tmp}", flush=True)
    load_before = os.getloadavg()
    runs: list[dict[str, Any]] = []
    try:
        for repeat in range(args.repeats):
            for task in args.tasks:
                for variant in NAMES:
                    r = run_one(task, variant, repeat, args, tmp)
                    runs.append(r)
                    print(f"  {task:<13} {NAMES[variant]:<8} #{repeat + 1}: "
                          f"{r['samples_per_sec']:9.1f} samples/s (epochs {r['by_epoch']})  "
                          f"first step {r['first_step_s']:5.1f} s  wall {r['wall_s']:.1f} s  "
                          f"CPU {r['cpu_us_per_sample']} us/sample  "
                          f"load {os.getloadavg()[0]:.1f}", flush=True)
    finally:
        if not args.keep:
            shutil.rmtree(tmp, ignore_errors=True)
    summary = summarise(runs)
    print_table(summary)
    load_after = os.getloadavg()
    results = {"date": datetime.now(UTC).isoformat(timespec="seconds"),
               "machine": machine_info("cpu"),
               "load_average_1_5_15": {"before": load_before, "after": load_after},
               "settings": settings, "summary": summary, "runs": runs}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1))
    print(f"\nload average before {load_before[0]:.2f}, after {load_after[0]:.2f} "
          f"(1 min); results in {args.out}")


if __name__ == "__main__":
    main()
