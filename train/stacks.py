"""`python -m train.stacks <output dir or Slurm job id>`: every rank of a running job dumps its
Python stacks (SIGUSR1, answered in C by faulthandler; not the requeue path's USR2), printed
grouped by identical stack. The job goes on (train/launch/inspect.py)."""

from __future__ import annotations

import sys

from train.errors import TrainError


def main(argv: list[str]) -> int:
    if len(argv) != 1 or argv[0].startswith("-"):
        print("usage: python -m train.stacks <output dir or Slurm job id>", file=sys.stderr)
        return 2
    from train.launch import inspect

    try:
        out, job = inspect.resolve(argv[0])
        print(inspect.dump(out, job))
    except TrainError as e:
        print(e.terminal_line(), file=sys.stderr)
        return e.exit_code
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
