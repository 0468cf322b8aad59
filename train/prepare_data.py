"""`python -m train prepare-data SOURCE OUT`: a data set of many files as a few large Arrow
shards, for `data=arrow data.root=OUT` (train/data/shards.py writes them, train/data/arrow.py
reads them). Run it once, on a login or data node: it needs no GPU and no network.

    python -m train prepare-data /shared/imagenet /scratch/$USER/imagenet-arrow --workers 8
    python -m train data=arrow data.root=/scratch/$USER/imagenet-arrow distributed.nproc_per_node=4

SOURCE is an image folder (train/<class>/*.jpg, val/..., test/...: imagefolder's layout and
class indices), a folder of WebDataset tars (<key>.jpg with <key>.cls), or the dotted path of
your map-style Dataset (its arguments with --arg name=value). The training split is written in
a mixed order (--seed; --source-order keeps the source's), so that each shard holds every class
and data=arrow's shard-local shuffle makes mixed batches; validation and test keep the source's
order. An interrupted call keeps the shards it finished: the same command again writes only the
rest.
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from pathlib import Path
from typing import Any

from train.errors import TrainError


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m train prepare-data",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("source", help="an image folder, a folder of .tar shards, or a Dataset's "
                                  "dotted path (mypkg.data.Scans)")
    p.add_argument("out", type=Path, help="the directory to write (a new one, or an "
                                          "interrupted call's to finish it)")
    p.add_argument("--workers", type=int, default=1, help="processes writing shards (default 1)")
    p.add_argument("--shard-mb", type=float, default=500.0,
                   help="about this many MB of samples a shard (default 500)")
    p.add_argument("--seed", type=int, default=0,
                   help="the seed of the training split's mixed order (default 0)")
    p.add_argument("--source-order", action="store_true",
                   help="write the training split in the source's order (a folder's and a "
                        "tar set's are class by class: batches of one class under "
                        "data.shuffle=shards)")
    p.add_argument("--arg", action="append", default=[], metavar="NAME=VALUE",
                   help="an argument of the Dataset named as SOURCE (repeatable)")
    return p.parse_args(argv)


def _dataset_spec(target: str, args: list[str]) -> dict[str, Any]:
    import yaml

    spec: dict[str, Any] = {"_target_": target}
    for arg in args:
        name, eq, value = arg.partition("=")
        if not eq or not name:
            raise SystemExit(f"error: --arg {arg!r}: give NAME=VALUE")
        spec[name] = yaml.safe_load(value)  # 3 -> int, true -> bool, as Hydra would read it
    return spec


def out_problem(source: Path, out: Path) -> str | None:
    """What is wrong with OUT, in one line: the source itself or inside it (the shards would
    become part of the data: the next run finds a class folder `train/`), a file, or a folder
    holding something else than an interrupted call's work (.prepare/ beside its shards)."""
    from train.data.shards import MANIFEST, WORK_DIR

    where = out.expanduser().resolve()
    if source.is_dir() and where.is_relative_to(source.expanduser().resolve()):
        return (f"OUT {out} is inside the source {source}: its shards would become part of the "
                "data; give a folder outside it.")
    if where.exists() and not where.is_dir():
        return f"OUT {out} is a file: give a new folder's path."
    finished_or_not = (where / WORK_DIR).is_dir() or (where / MANIFEST).exists()  # said later
    if where.is_dir() and any(where.iterdir()) and not finished_or_not:
        return (f"OUT {out} is not empty and holds no interrupted preparation ({WORK_DIR}/): "
                "give a new or empty folder.")
    return None


def main(argv: list[str] | None = None) -> int:
    from tqdm import tqdm

    from train.data import shard_plan, shards

    args = parse_args(sys.argv[1:] if argv is None else argv)
    source, limit = Path(args.source), int(args.shard_mb * 1e6)
    seed = None if args.source_order else args.seed
    if args.workers < 1 or args.shard_mb <= 0:
        print("error: --workers and --shard-mb must be positive.", file=sys.stderr)
        return 2
    if (problem := out_problem(source, Path(args.out))) is not None:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    command = shlex.join(["python", "-m", "train", "prepare-data", *(argv or sys.argv[1:])])
    started = time.monotonic()
    try:
        if source.is_dir():
            plan = (shard_plan.plan_tars(source, limit, seed) if any(source.rglob("*.tar"))
                    else shard_plan.plan_image_folder(source, limit, seed))
        elif "/" not in args.source and "." in args.source:
            plan = shard_plan.plan_dataset(_dataset_spec(args.source, args.arg), limit, seed)
        else:
            raise shard_plan.PrepareError(f"{source}: no such directory (and no Dataset's "
                                          "dotted path).")
        total = sum(len(s.items) if plan.kind != "dataset" else
                    sum(b - a for a, b in s.items) for s in plan.shards)
        with tqdm(total=total, unit=" samples", desc="prepare-data", file=sys.stderr) as bar:
            manifest = shards.prepare(plan, args.out, args.workers, command, bar.update)
    except KeyboardInterrupt:
        print(f"\nprepare-data: interrupted; the same command finishes it, keeping the shards "
              f"already in {args.out}.", file=sys.stderr)
        return 130
    except (shard_plan.PrepareError, TrainError, ValueError, OSError) as e:
        print(f"error: {str(e).splitlines()[0] if str(e) else type(e).__name__}",
              file=sys.stderr)
        return 2
    seconds = time.monotonic() - started
    written = len(plan.shards) - manifest["kept_shards"]
    counts = ", ".join(f"{split} {info['samples']:,} samples in {len(info['shards'])} shards"
                       for split, info in manifest["splits"].items())
    print(f"wrote {args.out}: {counts} ({written} shards written, {manifest['kept_shards']} "
          f"kept from an earlier call) in {seconds:.1f} s, {total / seconds:,.0f} samples/s\n"
          f"train on it: python -m train data=arrow data.root={args.out}")
    return 0


if __name__ == "__main__":
    import os

    os.umask(0o027 if os.environ.get("TRAIN_GROUP_READABLE") == "1" else 0o077)
    raise SystemExit(main())
