"""`python -m bench.arrow_shuffle`: data=arrow's two training orders - data.shuffle=shards (the
default: the shards in a random order, then the samples of each window of shuffle_window shards)
against data.shuffle=global (one permutation of every sample) - read through the service's own
pieces (arrow_samples.ArrowSamples, the samplers, the DataLoader and its collate) over one epoch.

Figures per order: how many shards a batch touches (from the order itself), and samples/s of
reading and decoding the epoch with a warm page cache and with a cold one (the kernel's caches
dropped first: what a job meets on a parallel filesystem or a data set larger than memory).
The harness writes the JPEGs and runs prepare-data itself (bench/arrow.py's make_set).

    python -m bench.arrow_shuffle --per-class 5000 --shard-mb 4
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import time
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
from torch.utils.data import DataLoader, DistributedSampler

from bench.arrow import make_set
from bench.run import machine_info
from train.config.groups import DataConfig
from train.data import arrow, arrow_split
from train.data.arrow_samples import ArrowSamples
from train.data.shard_order import ShardWindowSampler
from train.data.streaming import collate_readable, transforms

REPO = Path(__file__).resolve().parent.parent


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--classes", type=int, default=10)
    p.add_argument("--per-class", type=int, default=5000)
    p.add_argument("--size", type=int, default=32)
    p.add_argument("--shard-mb", type=float, default=4.0)
    p.add_argument("--prepare-workers", type=int, default=2)
    p.add_argument("--window", type=int, default=4, help="data.shuffle_window")
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--workers", type=int, default=2, help="DataLoader workers")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--data", type=Path, default=REPO / ".bench" / "arrow-shuffle")
    p.add_argument("--out", type=Path, default=REPO / ".bench" / "arrow-shuffle.json")
    return p.parse_args()


def sampler(order: str, samples: ArrowSamples, sizes: list[int], window: int) -> object:
    if order == "shards":
        return ShardWindowSampler(samples, 1, 0, seed=0, shard_sizes=sizes, window=window)
    return DistributedSampler(samples, num_replicas=1, rank=0, seed=0)


def shards_per_batch(indices: list[int], sizes: list[int], batch: int) -> float:
    """The mean number of distinct shards a batch's samples lie in."""
    shard_of = np.searchsorted(np.cumsum(sizes), np.asarray(indices), side="right")
    return float(np.mean([len(set(shard_of[i:i + batch].tolist()))
                          for i in range(0, len(indices), batch)]))


def drop_caches() -> bool:
    """The kernel's page cache emptied (root only): the shards are read from the disk again."""
    try:
        subprocess.run(["sync"], check=True)
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def read_epoch(samples: ArrowSamples, order: object, args: argparse.Namespace) -> float:
    """Samples/s of one epoch read, decoded and collated by the DataLoader's workers."""
    loader = DataLoader(samples, batch_size=args.batch_size, sampler=order,  # type: ignore[arg-type]
                        num_workers=args.workers, collate_fn=collate_readable)
    started, seen = time.perf_counter(), 0
    for inputs, _, _ in loader:
        seen += len(inputs)
    return seen / (time.perf_counter() - started)


def main() -> None:
    args = parse_args()
    args.data.mkdir(parents=True, exist_ok=True)
    _, shards, _ = make_set(args, args.data, 1)
    layout = arrow.find(shards)
    split = layout.splits["train"]
    sizes = arrow.shard_rows(arrow.shard_files(split))
    cfg = DataConfig(name="arrow", image_size=args.size)
    columns = arrow_split.columns(layout, "auto", "auto")
    samples = ArrowSamples(split, *columns, transforms(cfg, train=False))
    results = {"command": f"python -m bench.arrow_shuffle --per-class {args.per_class} "
                          f"--shard-mb {args.shard_mb} --repeats {args.repeats}",
               "date": datetime.now(UTC).isoformat(timespec="seconds"),
               "machine": machine_info("cpu"), "samples": len(samples), "shards": len(sizes),
               "window": args.window, "batch_size": args.batch_size, "workers": args.workers,
               "orders": {}}
    for order in ("shards", "global"):
        indices = list(iter(sampler(order, samples, sizes, args.window)))  # type: ignore[call-overload]
        results["orders"][order] = {
            "shards_per_batch": shards_per_batch(indices, sizes, args.batch_size),
            "warm": [], "cold": []}
    cold_possible = drop_caches()
    for _ in range(args.repeats):  # interleaved: the machine's drift spread over both
        for order in ("shards", "global"):
            entry = results["orders"][order]
            if cold_possible:
                drop_caches()
                entry["cold"].append(read_epoch(samples, sampler(order, samples, sizes,
                                                                 args.window), args))
            entry["warm"].append(read_epoch(samples, sampler(order, samples, sizes,
                                                             args.window), args))
            print(order, {k: v for k, v in entry.items()}, flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1) + "\n")
    print(f"\n{len(samples)} samples in {len(sizes)} shards, batch {args.batch_size}, "
          f"{args.workers} workers, window {args.window}")
    print(f"{'order':<8} {'shards/batch':>13} {'warm samples/s':>15} {'cold samples/s':>15}")
    for order, entry in results["orders"].items():
        cold = f"{statistics.median(entry['cold']):.0f}" if entry["cold"] else "-"
        print(f"{order:<8} {entry['shards_per_batch']:>13.1f} "
              f"{statistics.median(entry['warm']):>15.0f} {cold:>15}")


if __name__ == "__main__":
    main()
