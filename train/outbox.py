"""`python -m train outbox upload FILE [--tracking-uri URI]`: deliver a job's unsent file.

A job whose tracking store was unreachable at its end leaves what MLflow never accepted in
<output dir>/mlflow_unsent.jsonl (train/tracking/unsent.py); this command sends it once the store
is back. Steps the run already holds are not added twice; a run that never existed is created.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from train.tracking import client, unsent


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m train outbox")
    commands = parser.add_subparsers(dest="command", required=True)
    command = commands.add_parser("upload", help=f"deliver a job's {unsent.UNSENT_FILE} to MLflow")
    command.add_argument("file", type=Path)
    command.add_argument("--tracking-uri", help="where the run lives now, if not where the job "
                         "logged it (the file's first line)")
    args = parser.parse_args(argv)
    try:
        # A damaged or foreign file is refused before any request.
        header, _, records = unsent.load(args.file)
        unsent.check_safe(args.file, header, records, args.tracking_uri)
    except (OSError, ValueError) as e:
        sys.exit(f"python -m train outbox: {e}")
    try:
        run_id = unsent.upload(args.file, args.tracking_uri)
    except Exception as e:  # noqa: BLE001 - one line for the user, whatever the store said
        sys.exit(f"python -m train outbox: {args.file} was not delivered "
                 f"({client.describe(e)}); the file is unchanged. Check the run id and the "
                 "store (--tracking-uri URI if it moved).")
    print(f"delivered {args.file} to run {run_id} ({header['status']}); the file is now "
          f"{args.file.with_suffix('.uploaded')}")


if __name__ == "__main__":
    # What it writes (mlflow_run.json) is as private as the job's own files (train/__main__.py).
    os.umask(0o027 if os.environ.get("TRAIN_GROUP_READABLE") == "1" else 0o077)
    main()
