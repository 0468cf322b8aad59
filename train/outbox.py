"""`python -m train.outbox upload FILE [--tracking-uri URI]`: deliver a job's unsent file.

A job whose tracking store was unreachable at its end leaves what MLflow never accepted in
<output dir>/mlflow_unsent.jsonl (train/tracking/unsent.py); this command sends it once the store
is back. Steps the run already holds are not added twice; a run that never existed is created.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from train.tracking import unsent


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m train.outbox")
    commands = parser.add_subparsers(dest="command", required=True)
    command = commands.add_parser("upload", help=f"deliver a job's {unsent.UNSENT_FILE} to MLflow")
    command.add_argument("file", type=Path)
    command.add_argument("--tracking-uri", help="where the run lives now, if not where the job "
                         "logged it (the file's first line)")
    args = parser.parse_args(argv)
    try:
        header, _, _ = unsent.load(args.file)  # refuses a damaged file before any request
    except (OSError, ValueError) as e:
        sys.exit(f"python -m train.outbox: {e}")
    run_id = unsent.upload(args.file, args.tracking_uri)
    print(f"delivered {args.file} to run {run_id} ({header['status']}); the file is now "
          f"{args.file.with_suffix('.uploaded')}")


if __name__ == "__main__":
    main()
