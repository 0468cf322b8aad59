"""`python -m train`: see train/app.py.

Two things happen before Hydra composes anything, so that they hold for every file and record
the job makes (and for Slurm jobs, which inherit both the umask and the environment):
- umask 077: outputs, checkpoints, stores and logs are the user's alone (TRAIN_GROUP_READABLE=1:
  027, for a team that shares its outputs on purpose);
- a password in the tracking URI (MLFLOW_TRACKING_URI or a `tracking.uri=` override) moves to
  the environment MLflow's client reads (train/security/redact.py), so it is never logged as a
  param, in
  config.yaml, mlflow_run.json, a checkpoint or a log line.
"""

import os
import re
import sys

from train.security.redact import move_uri_credentials_to_env

URI_OVERRIDE = re.compile(r"^(\+{0,2}tracking\.uri=)(.*)$", re.DOTALL)


def private_by_default() -> None:
    os.umask(0o027 if os.environ.get("TRAIN_GROUP_READABLE") == "1" else 0o077)
    if uri := os.environ.get("MLFLOW_TRACKING_URI"):
        os.environ["MLFLOW_TRACKING_URI"] = move_uri_credentials_to_env(uri, os.environ)
    for i, arg in enumerate(sys.argv):
        if match := URI_OVERRIDE.match(arg):
            uri = match[2].strip("'\"")
            sys.argv[i] = match[1] + move_uri_credentials_to_env(uri, os.environ)


RUN_COMMANDS = ("rerun", "diff")
"""`python -m train rerun RUN_ID [overrides]`, `python -m train diff RUN_A RUN_B`: commands on
recorded runs (train/launch/rerun.py), not a Hydra job."""


def run_command(argv: list[str]) -> int:
    from train.errors import TrainError
    from train.launch.rerun import main as commands

    try:
        return commands(argv)
    except TrainError as e:
        print(f"\n{e.terminal_line()}\n", file=sys.stderr)
        return e.exit_code


if __name__ == "__main__":
    private_by_default()
    if len(sys.argv) > 1 and sys.argv[1] in RUN_COMMANDS:
        sys.exit(run_command(sys.argv[1:]))
    from train.app import main

    main()
