"""`python -m train eval <run_id> [overrides]`: a finished run's weights evaluated on any data.

The command checks what it can before anything starts - the run exists and FINISHED, it has a
model, its weights are where `eval.weights` says - and then runs an ordinary job (the same
launching as training: local ranks, torchrun, `+cluster=slurm`) from the run's recorded config
with the overrides on top and `eval.run_id` set: such a job evaluates instead of training
(train/engine/evaluate.py) and logs `eval/<name>/<metric>` to the same run, whose status it
leaves as it is. `data=<option>` swaps the run's data set for another (of the same shape and
number of classes; a different one is refused in one line).

The code that evaluates is today's (as `rerun --current-code`): the architecture is rebuilt
from the recorded config, so a run whose model code changed since gives a clear mismatch.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import yaml

from train.config.evaluate import WEIGHTS_WORDS, EvalConfig
from train.errors import ConfigError
from train.launch.rerun import rerun_config, store_uri
from train.tracking import REPO_ROOT
from train.tracking.files import FINAL_WEIGHTS, artifact_size, runs_uri, split_runs_uri
from train.tracking.recorded import RecordedRun, read_run

CHECKPOINT_NAME = r"step-(\d+)\.(pt|dcp)$"
USAGE = """usage: python -m train eval RUN_ID [hydra flags] [key=value ...]

Evaluates the finished run's weights on its own test split or any data set, at any world size,
locally or on Slurm, and records eval/<name>/<metric> in the same run:
  eval.weights=last|best|<checkpoint path>|runs:/<run_id>/<path>
                                             which weights (default: last; the store's
                                             copy of the final weights where the run's
                                             output directory is out of sight)
  eval.split=test|val                        which split (default: test)
  eval.name=<name>                           the metrics' name (default: <data>_<split>)
  data=<option> data.<key>=...               another data set of the same shape
  distributed.nproc_per_node=N, +cluster=slurm, ...   as for training
Reads MLFLOW_TRACKING_URI, else the embedded store. docs/evaluation.md"""


def given_value(overrides: list[str], key: str) -> str | None:
    """The value the command line gives `key` (the last one wins, as in Hydra)."""
    found = None
    for item in overrides:
        name, eq, value = item.lstrip("+").partition("=")
        if eq and name == key:
            found = value.strip("'\"")
    return found


FIXED_GROUPS = ("model", "task")
"""Config groups an evaluation keeps as the run had them: its weights fit that model only."""


def check_overrides(purpose: str, run: RecordedRun, overrides: list[str]) -> None:
    """ConfigError for what `purpose` (eval or predict) cannot take: the other command's keys
    (which it would ignore); another model or task; the test split of a run whose data has
    none (data.num_test unrecorded), where the data stays the run's own."""
    other = "predict" if purpose == "eval" else "eval"
    names = [item.lstrip("+~").partition("=")[0] for item in overrides]  # the keys set
    for item, name in zip(overrides, names, strict=True):
        if name.startswith(f"{other}."):
            raise ConfigError(f"{item}: {other}.* is `python -m train {other}`'s; `{purpose}` "
                              f"takes {purpose}.{name.partition('.')[2]}.")
        if name in FIXED_GROUPS:
            raise ConfigError(f"{item}: {purpose} rebuilds run {run.run_id}'s own {name} from "
                              f"its config, which its weights fit; another {name} needs a run "
                              f"trained with it.")
    split = given_value(overrides, f"{purpose}.split") or "test"
    own_data = not any(name.partition(".")[0] == "data" for name in names)
    given_prompts = given_value(overrides, "predict.prompts")
    prompts = given_prompts is not None
    if prompts and given_prompts.replace(" ", "") in ("[]", "", "null"):
        raise ConfigError(f"predict.prompts={given_prompts} holds no prompt: give one or more, "
                          "or leave it out to predict the split's samples.")
    if prompts and "data.vocab_size" not in run.params:
        raise ConfigError(f"predict.prompts needs a language model's run; run {run.run_id} was "
                          "trained on data that is no token windows: leave predict.prompts out "
                          "to predict its split's samples.")
    if split == "test" and own_data and not prompts and "data.num_test" not in run.params:
        data = (run.config.get("data") or {}).get("name", "?")
        raise ConfigError(f"run {run.run_id}'s data (data={data}) has no test split: use its "
                          f"validation split ({purpose}.split=val), or give a data set with "
                          "one (data=<option>).")


def check_run(run: RecordedRun) -> tuple[str, int]:
    """(input shape, outputs) the run's model was trained for; ConfigError for a run that is
    not finished or has no model."""
    if run.status != "FINISHED":
        state = "is still RUNNING" if run.status == "RUNNING" else f"ended {run.status}"
        raise ConfigError(f"run {run.run_id} {state}: only a run that finished training is "
                          "evaluated (a stopped one finishes with `python -m train rerun "
                          f"{run.run_id}` or by starting its job again).")
    shape, outputs = run.params.get("data.input_shape"), (
        run.params.get("model.outputs") or run.params.get("data.classes"))
    if not shape or not outputs or "final_weights" not in run.tags:
        raise ConfigError(f"run {run.run_id} has no trained model (no input shape, outputs or "
                          "final weights recorded): it is not a training run of this service.")
    return shape, int(outputs)


def _newest_checkpoint(folder: Path) -> Path | None:
    import re

    found = [(int(m.group(1)), p) for p in folder.glob("step-*")
             if (m := re.search(CHECKPOINT_NAME, p.name))]
    return max(found)[1] if found else None


def find_weights(run: RecordedRun, weights: str, key: str = "eval.weights",
                 uri: str | None = None) -> str:
    """The file or directory `eval.weights` (`key`: or predict.weights) names for this run: its
    final model.pt or newest checkpoint (last), its best.pt (best), a path, or a file in the
    store (`runs:/<run_id>/<path>`); ConfigError if there is none. Where the run's final
    weights are asked for and its output directory does not have them (another machine's
    disk, or gone), the copy its store (`uri`) keeps is taken: `runs:/<run_id>/weights/model.pt`."""
    if (parts := split_runs_uri(weights)) is not None:
        if parts[0] != run.run_id:
            raise ConfigError(f"{key}={weights} is run {parts[0]}'s file, not run "
                              f"{run.run_id}'s: its metrics would be logged to the wrong run; "
                              f"name {runs_uri(run.run_id)}, or evaluate run {parts[0]} itself.")
        if uri is None or artifact_size(uri, *parts) is None:
            raise ConfigError(f"{key}={weights}: run {parts[0]} holds no file {parts[1]} in "
                              f"the tracking store; its final weights are {runs_uri(parts[0])}.")
        return weights
    if weights not in WEIGHTS_WORDS:
        path = Path(weights).expanduser().resolve()
        if not path.exists():
            raise ConfigError(f"{key}={weights}: no such file or directory; give a "
                              "checkpoint (step-<N>.pt, step-<N>.dcp, best.pt or model.pt), "
                              "best or last, or runs:/<run_id>/<path> of the store.")
        return str(path)
    out = Path(run.tags.get("output_dir", ""))
    final = out / "model.pt" if run.tags.get("final_weights") == weights else None
    if weights == "best":
        found = out / "checkpoints" / "best.pt"
        found = found if found.is_file() else final
    else:
        found = final if final is not None and final.is_file() else \
            _newest_checkpoint(out / "checkpoints")
    if found is not None and found.exists():
        return str(found.resolve())
    in_store = uri is not None and artifact_size(uri, run.run_id, FINAL_WEIGHTS) is not None
    if final is not None and in_store:
        return runs_uri(run.run_id)
    other = run.tags.get("final_weights")
    in_store_too = (f"; the tracking store keeps its final weights, the {other}: {key}={other}"
                    if in_store else "")
    if not out.is_dir():
        raise ConfigError(f"{key}={weights}: run {run.run_id}'s output directory {out} is not "
                          "on this machine (moved, or another machine's disk), and the "
                          f"tracking store keeps no checkpoints{in_store_too}.")
    what = ("best weights (trainer.save_best=true keeps them)" if weights == "best"
            else "final weights or checkpoint")
    raise ConfigError(f"{key}={weights}: run {run.run_id} left no {what} in its output "
                      f"directory {out}{in_store_too}; give a checkpoint's path with "
                      f"{key}=<path>.")


def eval_config(run: RecordedRun, uri: str, conf_dir: Path, overrides: list[str],
                checkpoint: str, shape: str, outputs: int) -> dict[str, Any]:
    """The primary config of the evaluating job: the run's recorded config (as a rerun's),
    without its cluster (`+cluster=slurm` adds one) and, under `data=<option>`, without its
    data set; tracking off (the job logs to the evaluated run itself, once, at its end)."""
    config = rerun_config(run, uri, conf_dir)
    config["tracking"] = {**config["tracking"], "rerun_of": None, "enabled": False}
    config.pop("cluster", None)
    defaults = [d for d in config["defaults"] if d != {"cluster": "slurm"}]
    if (data := given_value(overrides, "data")) is not None:
        config.pop("data", None)
        defaults.insert(defaults.index("_self_"), {"data": data})
    config["defaults"] = defaults
    config["eval"] = {**(config.get("eval") or {}), "run_id": run.run_id,
                      "checkpoint": checkpoint, "trained_shape": shape,
                      "trained_outputs": outputs}
    return config


def start(purpose: str, run_id: str, overrides: list[str]) -> int:
    """`eval` or `predict` (`purpose`) of run `run_id`: the run checked and its weights found,
    then the job started with them; its exit code."""
    uri = store_uri()
    run = read_run(uri, run_id)
    shape, outputs = check_run(run)
    check_overrides(purpose, run, overrides)
    if purpose == "eval":
        settings = EvalConfig(split=given_value(overrides, "eval.split") or "test",
                              name=given_value(overrides, "eval.name"))
        if problem := settings.problem():
            raise ConfigError(problem)
    key = f"{purpose}.weights"
    asked = given_value(overrides, key) or "last"
    checkpoint = find_weights(run, asked, key, uri)
    copy = "" if asked not in WEIGHTS_WORDS or split_runs_uri(checkpoint) is None \
        else f" (the store's copy: {run.tags.get('output_dir')} does not hold them here)"
    print(f"{'evaluating' if purpose == 'eval' else 'predicting with'} run {run_id}: "
          f"{checkpoint}{copy}", file=sys.stderr, flush=True)
    config_dir = Path(tempfile.mkdtemp(prefix=f"train-{purpose}-"))  # private (0700)
    try:
        config = eval_config(run, uri, REPO_ROOT / "conf", overrides, checkpoint, shape, outputs)
        config["eval"]["purpose"] = purpose
        (config_dir / "job.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
        command = [sys.executable, "-m", "train", "--config-dir", str(config_dir),
                   "--config-name", "job", *overrides]
        env = {**os.environ, "MLFLOW_TRACKING_URI": uri}
        return subprocess.run(command, env=env).returncode
    finally:
        shutil.rmtree(config_dir, ignore_errors=True)


def main(argv: list[str]) -> int:
    """`eval RUN_ID [overrides]` (argv without `python -m train eval`); the exit code."""
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE, file=sys.stderr if not argv else sys.stdout)
        return 2 if not argv else 0
    return start("eval", argv[0], argv[1:])
