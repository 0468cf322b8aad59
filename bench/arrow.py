"""`python -m bench.arrow`: data=arrow (prepare-data's shards) against data=imagefolder on the
same JPEGs, the same model, ranks, workers, batch and transforms.

The harness writes the images itself (tests/images.py): --classes x --per-class small JPEGs
(default 10 x 20,000 = 200,000 of 32x32, + 10 % for validation) and a set --scale times larger;
prepare-data turns each into shards (timed: images/s per writing process). Then, interleaved
--repeats times on the base set: each variant trains 2 epochs (samples/s over the second, time
from the command's start to the first optimiser step, peak RSS per rank); on the larger set
each variant runs --steps steps (first step and peak RSS against the base set's); and once per
variant and set, under `strace -f -e trace=openat` (when strace is installed), the files of the
data set opened over one epoch by every process (launcher, ranks, DataLoader workers).

    python -m bench.arrow                       # the issue's sizes: ~40 min on 2 cores
    python -m bench.arrow --per-class 5000      # 50,000 + 200,000 images: ~15 min
    python -m bench.arrow --first-step-only --repeats 7   # the base set's first step: ~6 min

--first-step-only: only the base set's --steps-step runs, imagefolder's and arrow's in turn.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from datetime import UTC, datetime
from pathlib import Path

from bench.run import Measurement, machine_info
from tests.images import write_image_folder

REPO = Path(__file__).resolve().parent.parent


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--classes", type=int, default=10)
    p.add_argument("--per-class", type=int, default=20_000)
    p.add_argument("--size", type=int, default=32, help="image side in pixels")
    p.add_argument("--scale", type=int, default=4, help="the larger set's size factor")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--workers", type=int, default=2, help="DataLoader workers per rank")
    p.add_argument("--prepare-workers", type=int, default=2)
    p.add_argument("--shard-mb", type=float, default=16.0,
                   help="prepare-data's shard size (small images: several shards a set)")
    p.add_argument("--batch-size", type=int, default=256, help="GLOBAL batch")
    p.add_argument("--steps", type=int, default=30, help="steps of the larger set's runs")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--skip-opens", action="store_true", help="no strace runs")
    p.add_argument("--first-step-only", action="store_true",
                   help="only the base set's first step (see below)")
    p.add_argument("--opens-only", action="store_true",
                   help="only prepare the sets and count each variant's file opens (strace)")
    p.add_argument("--data", type=Path, help="where the images and shards go (kept)")
    p.add_argument("--out", type=Path, default=REPO / ".bench" / "arrow.json")
    return p.parse_args()


def make_set(args: argparse.Namespace, where: Path, factor: int) -> tuple[Path, Path, float]:
    """The image folder, its shards, and prepare-data's images/s per writing process."""
    per_class = args.per_class * factor
    images = where / f"images-{args.classes}x{per_class}"
    if not (images / "val").is_dir():
        started = time.time()
        write_image_folder(images, args.classes, per_class, max(1, per_class // 10),
                           size=args.size, seed=factor)
        print(f"wrote {images} in {time.time() - started:.0f} s", flush=True)
    shards = where / f"shards-{args.classes}x{per_class}"
    shutil.rmtree(shards, ignore_errors=True)
    started = time.time()
    subprocess.run([sys.executable, "-m", "train", "prepare-data", str(images), str(shards),
                    "--workers", str(args.prepare_workers), "--shard-mb", str(args.shard_mb)],
                   cwd=REPO, check=True,
                   stderr=subprocess.DEVNULL)
    seconds = time.time() - started
    count = sum(i["samples"] for i in json.loads((shards / "manifest.json").read_text())
                ["splits"].values())
    rate = count / seconds / args.prepare_workers
    print(f"prepare-data {images.name}: {count} images in {seconds:.1f} s, {rate:.0f} images/s "
          "per process", flush=True)
    return images, shards, rate


def command(args: argparse.Namespace, variant: str, root: Path, out: Path,
            limit: list[str]) -> list[str]:
    return [sys.executable, "-m", "train", f"data={variant}", f"data.root={root}",
            f"data.image_size={args.size}", "data.augment=false", "model=mlp", "model.width=64",
            f"data.batch_size={args.batch_size}", f"data.num_workers={args.workers}",
            f"distributed.nproc_per_node={args.nproc}", "tracking.log_model=false",
            "trainer.checkpoint_every=0", f"hydra.run.dir={out}", *limit]


def run_one(args: argparse.Namespace, variant: str, root: Path, tmp: Path, name: str,
            limit: list[str], trace: bool = False) -> tuple[Measurement, int | None]:
    out = tmp / f"{variant}-{name}-{len(list(tmp.iterdir()))}"
    out.mkdir(parents=True)
    env = {**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{out / 'mlflow.db'}"}
    cmd = command(args, variant, root, out, limit)
    if trace:
        cmd = ["strace", "-f", "-qq", "-e", "trace=openat", "-o", str(out / "opens"), *cmd]
    started = time.time()
    with (out / "output.log").open("w") as sink:
        done = subprocess.run(cmd, cwd=REPO, env=env, stdout=sink, stderr=subprocess.STDOUT)
    if done.returncode != 0:
        raise SystemExit(f"{variant} failed: {' '.join(cmd)}\n"
                         + (out / "output.log").read_text()[-3000:])
    summary = json.loads((out / "summary.json").read_text())
    rates = [e["samples_per_sec"] for e in summary["by_epoch"]]
    m = Measurement(variant, 0, cmd, rates[-1], summary["first_step_at"] - started,
                    summary["peak_rss_mb"], time.time() - started, {"set": name})
    opens = None
    if trace:  # openat calls of a file of the data set, by any process, that did not fail
        # (a call another process interrupted is split: its path stands on the `<unfinished`
        # line, its result on a later `resumed>` one)
        pattern = re.compile(rf'openat\(.*"{re.escape(str(root))}/[^"]*\.(jpg|arrow)"')
        opens = sum(1 for line in (out / "opens").read_text().splitlines()
                    if pattern.search(line) and "= -1 " not in line)
    print(f"  {variant:<12} {name:<6} {m.samples_per_sec:8.0f} samples/s  first step "
          f"{m.time_to_first_step_s:5.1f} s  peak RSS "
          f"{', '.join(f'{v:.0f}' for v in m.peak_rss_mb)} MB"
          + (f"  data files opened {opens}" if opens is not None else ""), flush=True)
    return m, opens


def first_step_only(args: argparse.Namespace, images: Path, shards: Path) -> None:
    tmp = Path(tempfile.mkdtemp(prefix="train-bench-arrow-runs-"))
    arms = {"imagefolder": images, "arrow": shards}
    runs = [run_one(args, variant, root, tmp, "base", ["trainer.epochs=1",
                                                       f"trainer.max_steps={args.steps}"])[0]
            for _ in range(args.repeats) for variant, root in arms.items()]
    found = {variant: statistics.median(r.time_to_first_step_s for r in runs
                                        if r.variant == variant) for variant in arms}
    print(f"first step, base set, median of {args.repeats}: {found}")
    write(args, {"first step, base set (s)": found}, runs)


def write(args: argparse.Namespace, found: dict[str, object], runs: list[Measurement]) -> None:
    results = {"date": datetime.now(UTC).isoformat(timespec="seconds"),
               "machine": machine_info("cpu"), "settings": {k: str(v) for k, v in
                                                            vars(args).items()},
               "found": found, "runs": [asdict(r) for r in runs]}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2))
    print(f"results in {args.out}")


def main() -> None:
    args = parse_args()
    where = args.data or Path(tempfile.mkdtemp(prefix="train-bench-arrow-"))
    where.mkdir(parents=True, exist_ok=True)
    base_images, base_shards, prepare_rate = make_set(args, where, 1)
    if args.first_step_only:
        first_step_only(args, base_images, base_shards)
        return
    large_images, large_shards, _ = make_set(args, where, args.scale)
    roots = {("imagefolder", "base"): base_images, ("arrow", "base"): base_shards,
             ("imagefolder", "large"): large_images, ("arrow", "large"): large_shards}
    tmp = Path(tempfile.mkdtemp(prefix="train-bench-arrow-runs-"))
    runs: list[Measurement] = []
    for _ in range(0 if args.opens_only else args.repeats):
        for variant in ("imagefolder", "arrow"):
            runs.append(run_one(args, variant, roots[variant, "base"], tmp, "base",
                                ["trainer.epochs=2"])[0])
        for variant in ("imagefolder", "arrow"):
            for name in ("base", "large"):
                runs.append(run_one(args, variant, roots[variant, name], tmp, name,
                                    ["trainer.epochs=1", f"trainer.max_steps={args.steps}"])[0])
    opens: dict[str, int | None] = {}
    if shutil.which("strace") and not args.skip_opens:
        for (variant, name), root in roots.items():
            opens[f"{variant} {name}"] = run_one(args, variant, root, tmp, name,
                                                 ["trainer.epochs=1"], trace=True)[1]

    def median(variant: str, name: str, key: str, epochs: bool = False) -> float:
        chosen = [r for r in runs if r.variant == variant and r.extra["set"] == name
                  and ("trainer.epochs=2" in r.command) == epochs]
        values = [getattr(r, key) if key != "peak_rss_mb" else max(r.peak_rss_mb)
                  for r in chosen]
        return statistics.median(values)

    found: dict[str, object] = {} if not runs else {
        "samples_per_sec arrow/imagefolder": median("arrow", "base", "samples_per_sec", True)
        / median("imagefolder", "base", "samples_per_sec", True),
        **{f"first step {v} base, large (s)": [median(v, n, "time_to_first_step_s")
                                               for n in ("base", "large")]
           for v in ("imagefolder", "arrow")},
        **{f"peak RSS per rank {v} large/base": median(v, "large", "peak_rss_mb")
           / median(v, "base", "peak_rss_mb") for v in ("imagefolder", "arrow")}}
    found |= {
        "prepare-data images/s per process": prepare_rate,
        "data files opened in one epoch": opens or "not counted (--skip-opens, or no strace)",
        "shards": {n: len(list(roots["arrow", n].glob("*/data-*.arrow")))
                   for n in ("base", "large")}}
    for key, value in found.items():
        print(f"{key}: {value}")
    write(args, found, runs)


if __name__ == "__main__":
    main()
