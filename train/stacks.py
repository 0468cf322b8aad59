"""`python -m train stacks <output dir or Slurm job id>`: every rank of a running job dumps its
Python stacks (SIGUSR1, answered in C by faulthandler; not the requeue path's USR2), printed
grouped by identical stack. The job goes on (train/launch/inspect.py)."""

from __future__ import annotations

import sys


def main(argv: list[str]) -> int:
    from train.launch import inspect

    return inspect.command("stacks", argv, inspect.dump)


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
