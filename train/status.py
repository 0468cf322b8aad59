"""`python -m train.status <output dir or Slurm job id>`: each rank of a running job, its step,
its phase and for how long, from its heartbeat (train/launch/inspect.py)."""

from __future__ import annotations

import sys

from train.errors import TrainError


def main(argv: list[str]) -> int:
    if len(argv) != 1 or argv[0].startswith("-"):
        print("usage: python -m train.status <output dir or Slurm job id>", file=sys.stderr)
        return 2
    from train.launch import inspect

    try:
        out, _ = inspect.resolve(argv[0])
        print(inspect.status(out))
    except TrainError as e:
        print(e.terminal_line(), file=sys.stderr)
        return e.exit_code
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
