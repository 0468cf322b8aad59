"""`python -m train rerun <run_id> [overrides]` and `python -m train diff <run_a> <run_b>`.

rerun: a new job from a run's recorded config (config.yaml), with the overrides on top, run by
the run's own code (train/launch/codesnap.py: refused in one line when it cannot be rebuilt),
locally or on Slurm (`+cluster=slurm`; a Slurm run reruns there), tagged `rerun_of=<run_id>`.
The recorded config becomes the primary config of an ordinary `python -m train`, in a private
temporary directory: the pre-flight, launchers and refusals are those of any job.

diff: what differs between two runs - config keys, code (commits, uncommitted diffs, user
packages) and installed package versions.

Both read the store training logs to: MLFLOW_TRACKING_URI, else the embedded store.
"""

from __future__ import annotations

import argparse
import difflib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import yaml

from train.config.groups import HANDED_KEYS, TrackingConfig
from train.report import code
from train.report.runlog import flatten
from train.tracking import REPO_ROOT, resolve_uri
from train.tracking.recorded import RecordedRun, read_run

TAGS_COMPARED = ("git_commit", "git_dirty", "code.diff_sha256", "python_version",
                 "torch_version", "world_size")
MAX_DIFF_LINES = 200
"""`diff` shows at most this many lines of the difference between two uncommitted diffs."""


def store_uri() -> str:
    return resolve_uri(TrackingConfig(uri=os.environ.get("MLFLOW_TRACKING_URI") or None))


def rerun_config(run: RecordedRun, uri: str, conf_dir: Path) -> dict[str, Any]:
    """The primary config of the rerun: the recorded config under the schema, with the run's
    store, no sweep of the original's, and `tracking.rerun_of`; Hydra's own settings as the
    code that runs has them (its conf/train.yaml)."""
    config = {key: value for key, value in run.config.items()}
    tracking = dict(config.get("tracking") or {})
    for key in HANDED_KEYS:
        tracking[key.split(".", 1)[1]] = None
    tracking.update(uri=uri, rerun_of=run.run_id)
    config["tracking"] = tracking
    defaults: list[Any] = ["train_schema", "local_launcher"]
    if config.get("cluster") is not None:  # a Slurm run reruns on Slurm
        defaults.append({"cluster": "slurm"})
    else:
        config.pop("cluster", None)  # so that `+cluster=slurm` can add it
    defaults.append("_self_")
    hydra = yaml.safe_load((conf_dir / "train.yaml").read_text()).get("hydra", {})
    return {"defaults": defaults, **config, "hydra": hydra}


def rerun(run_id: str, overrides: list[str], current_code: bool) -> int:
    from train.launch import codesnap

    uri = store_uri()
    run = read_run(uri, run_id)
    # With the recorded code: every refusal (codesnap.plan) before anything is made.
    paths = [str(REPO_ROOT)] if current_code else codesnap.build(codesnap.plan(run))
    conf_dir = Path(paths[0]) / "conf"
    where = "the code as it is now" if current_code else f"its recorded code in {paths[0]}"
    print(f"rerunning run {run_id} with {where}", file=sys.stderr, flush=True)
    config_dir = Path(tempfile.mkdtemp(prefix="train-rerun-"))  # private (0700)
    try:
        (config_dir / "rerun.yaml").write_text(
            yaml.safe_dump(rerun_config(run, uri, conf_dir), sort_keys=False))
        env = {**os.environ, "MLFLOW_TRACKING_URI": uri,
               "PYTHONPATH": os.pathsep.join([*paths, os.environ.get("PYTHONPATH", "")])}
        command = [sys.executable, "-m", "train", "--config-dir", str(config_dir),
                   "--config-name", "rerun", *overrides]
        return subprocess.run(command, env=env).returncode
    finally:
        shutil.rmtree(config_dir, ignore_errors=True)


def _changed(a: dict[str, str], b: dict[str, str]) -> list[str]:
    return [f"  {key}: {a.get(key, '(unset)')} -> {b.get(key, '(unset)')}"
            for key in sorted(set(a) | set(b)) if a.get(key) != b.get(key)]


def _requirements(run: RecordedRun) -> dict[str, str]:
    lines = run.files.get(code.REQUIREMENTS_FILE, "").splitlines()
    return dict(line.split("==", 1) for line in lines if "==" in line)


def _code_lines(a: RecordedRun, b: RecordedRun) -> list[str]:
    keys = [k for k in set(a.tags) | set(b.tags) if k in TAGS_COMPARED or k.startswith("code.")]
    lines = _changed({k: a.tags[k] for k in keys if k in a.tags},
                     {k: b.tags[k] for k in keys if k in b.tags})
    for path in sorted(p for p in set(a.files) | set(b.files) if p.endswith(".patch")):
        before, after = a.files.get(path, ""), b.files.get(path, "")
        if before != after:
            shown = list(difflib.unified_diff(before.splitlines(), after.splitlines(),
                                              f"{a.run_id}/{path}", f"{b.run_id}/{path}",
                                              lineterm=""))
            cut = len(shown) > MAX_DIFF_LINES
            lines += [f"    {line}" for line in shown[:MAX_DIFF_LINES]]
            if cut:
                lines.append(f"    ... {len(shown) - MAX_DIFF_LINES} more lines")
    return lines


def diff(run_a: str, run_b: str) -> str:
    uri = store_uri()
    a, b = read_run(uri, run_a), read_run(uri, run_b)
    sections = [("config", _changed(flatten(a.config), flatten(b.config))),
                ("code", _code_lines(a, b)),
                ("packages", _changed(_requirements(a), _requirements(b)))]
    out = [f"runs {run_a} -> {run_b}"]
    for title, lines in sections:
        out.append(f"{title}: " + ("same" if not lines else f"{len(lines)} differ"))
        out += lines
    return "\n".join(out)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m train")
    commands = parser.add_subparsers(dest="command", required=True)
    again = commands.add_parser("rerun", help="a new job from a run's config and code")
    again.add_argument("run_id")
    again.add_argument("overrides", nargs="*", help="key=value on top of the run's config")
    again.add_argument("--current-code", action="store_true",
                       help="run the code as it is now, not the run's recorded code")
    compare = commands.add_parser("diff", help="what differs between two runs")
    compare.add_argument("run_a")
    compare.add_argument("run_b")
    args = parser.parse_args(argv)
    if args.command == "diff":
        print(diff(args.run_a, args.run_b))
        return 0
    return rerun(args.run_id, args.overrides, args.current_code)
