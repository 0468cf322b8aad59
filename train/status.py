"""`python -m train status <output dir or Slurm job id>`: each rank of a running job, its step,
its phase and for how long, from its heartbeat (train/launch/inspect.py)."""

from __future__ import annotations

import sys


def main(argv: list[str]) -> int:
    from train.launch import inspect

    return inspect.command("status", argv, lambda out, _job: inspect.status(out))


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
