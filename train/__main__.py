"""`python -m train` (and the `train` command): one command line.

`python -m train [overrides]` composes and runs a job (train/app.py); `python -m train COMMAND
...` runs one of COMMANDS: a root module that also answers as `python -m train.<module>` (the
older form, kept), or for the newer commands (rerun, diff, eval, predict) a module of
train/launch/. `python -m train --help` lists the commands before Hydra's help.

Two things happen before anything else, so that they hold for every file and record the job or
command makes (and for Slurm jobs, which inherit both the umask and the environment):
- umask 077: outputs, checkpoints, stores and logs are the user's alone (TRAIN_GROUP_READABLE=1:
  027, for a team that shares its outputs on purpose);
- a password in the tracking URI (MLFLOW_TRACKING_URI or a `tracking.uri=` override) moves to
  the environment MLflow's client reads (train/security/redact.py), so it is never logged as a
  param, in config.yaml, mlflow_run.json, a checkpoint or a log line.
"""

import difflib
import importlib
import os
import re
import sys
from typing import NamedTuple, NoReturn

from train.security.redact import move_uri_credentials_to_env

URI_OVERRIDE = re.compile(r"^(\+{0,2}tracking\.uri=)(.*)$", re.DOTALL)


class Command(NamedTuple):
    module: str
    """The root module whose `main(argv)` runs it (argv without the command's name, except
    for train.launch.rerun, which serves two commands)."""
    usage: str
    summary: str


COMMANDS: dict[str, Command] = {
    "status": Command("train.status", "<output dir or Slurm job id>",
                      "each rank of a running job: its step, its phase and for how long"),
    "stacks": Command("train.stacks", "<output dir or Slurm job id>",
                      "every rank's Python stacks, grouped; the job goes on"),
    "sweep": Command("train.sweep", "status|resume <sweep dir>",
                     "a sweep's jobs or an Optuna search's trials; run its unfinished jobs again"),
    "rerun": Command("train.launch.rerun", "<run id> [overrides]",
                     "a new job from a run's recorded config and code, overrides on top"),
    "diff": Command("train.launch.rerun", "<run a> <run b>",
                    "what differs between two runs: config, code, package versions"),
    "eval": Command("train.launch.evaluate", "<run id> [overrides]",
                    "a finished run's weights evaluated on any data set, logged to the run"),
    "predict": Command("train.launch.predict", "<run id> [overrides]",
                       "a finished run's outputs for every sample of a data set, in one file"),
    "prepare-text": Command("train.prepare_text", "<text files or dirs> <out dir>",
                            "text to token files for data=tokens"),
    "prepare-data": Command("train.prepare_data", "<image folder, tars or Dataset> <out dir>",
                            "many files as a few Arrow shards for data=arrow"),
    "server": Command("train.server", "[--host H --port P ...]",
                      "an MLflow tracking server with logins, for a cluster"),
    "outbox": Command("train.outbox", "upload <mlflow_unsent.jsonl>",
                      "deliver what a job could not send to an unreachable store"),
}
"""`python -m train COMMAND`: what each command runs, its arguments and what it does."""


OFFLINE = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")
"""Hugging Face libraries read these at import: set (unless the user set them) so that nothing
is downloaded at run time - models from model.path, data sets from the local cache only."""


def private_by_default() -> None:
    os.umask(0o027 if os.environ.get("TRAIN_GROUP_READABLE") == "1" else 0o077)
    for name in OFFLINE:
        os.environ.setdefault(name, "1")
    if uri := os.environ.get("MLFLOW_TRACKING_URI"):
        os.environ["MLFLOW_TRACKING_URI"] = move_uri_credentials_to_env(uri, os.environ)
    for i, arg in enumerate(sys.argv):
        if match := URI_OVERRIDE.match(arg):
            uri = match[2].strip("'\"")
            sys.argv[i] = match[1] + move_uri_credentials_to_env(uri, os.environ)


def commands_help() -> str:
    """The block `python -m train --help` shows before Hydra's own help."""
    width = max(len(name) for name in COMMANDS)
    lines = ["usage: python -m train [overrides]         compose and run a job (below)",
             "       python -m train COMMAND [args]      (or `train COMMAND`, the same)", "",
             "commands (`python -m train COMMAND --help` for one):"]
    lines += [f"  {name:<{width}}  {c.summary}" for name, c in COMMANDS.items()]
    return "\n".join(lines) + "\n"


def unknown_command(word: str) -> str | None:
    """The one line for a first argument that is neither an override nor a flag nor a
    command (`python -m train stauts`), else None: Hydra takes the arguments."""
    if not word or word[0] in "-+~" or "=" in word or word in COMMANDS:
        return None
    close = difflib.get_close_matches(word, list(COMMANDS), n=1, cutoff=0.6)
    hint = f"did you mean `python -m train {close[0]}`? " if close else ""
    return (f"error: {word!r} is no command of python -m train and no override (key=value); "
            f"{hint}`python -m train --help` lists the commands.")


def run_command(name: str, argv: list[str]) -> int:
    """COMMANDS[name] with `argv`; a TrainError as its one line, and its exit code."""
    from train.errors import TrainError

    module = importlib.import_module(COMMANDS[name].module)
    try:
        # train.launch.rerun serves rerun and diff, so it is handed its command's name too.
        code = module.main([name, *argv] if name in ("rerun", "diff") else argv)
    except TrainError as e:
        print(f"\n{e.terminal_line()}\n", file=sys.stderr)
        return e.exit_code
    return int(code or 0)


def cli() -> NoReturn:
    """The `train` console script and `python -m train`. Its process ends as soon as the
    command is done, with the interpreter's exit code but not its teardown of every module
    (1.7-3 s with torch and MLflow imported: train/distributed/process_end.py). An uncaught
    error still ends it as the interpreter does, with its traceback."""
    from train.distributed.process_end import end_process, exit_code

    try:
        code = command_line(sys.argv[1:])
    except SystemExit as e:
        code = exit_code(e)
    except BrokenPipeError:  # `train sweep status ... | head`: the reader left; no traceback
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        code = 1
    end_process(code)


def command_line(argv: list[str]) -> int:
    """`python -m train ARGV`: a command of COMMANDS, or a training job (Hydra's main)."""
    private_by_default()
    if argv and argv[0] in COMMANDS:
        return run_command(argv[0], argv[1:])
    if argv and (line := unknown_command(argv[0])):
        print(line, file=sys.stderr)
        return 2
    from train.app import help_group, main, unknown_help_topic

    if (line := unknown_help_topic(argv)) is not None:
        print(line, file=sys.stderr)
        return 2
    if any(flag in ("--help", "-h") for flag in argv) and help_group(argv) is None:
        print(commands_help())  # then Hydra's help: the groups, the options, the config
    main()
    return 0


if __name__ == "__main__":
    cli()
