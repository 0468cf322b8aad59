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
    from train.report.runlog import flatten  # here: it imports torch, which rerun and eval skip

    uri = store_uri()
    a, b = read_run(uri, run_a), read_run(uri, run_b)
    sections = [("config", _changed(flatten(a.config), flatten(b.config))),
                ("code", _code_lines(a, b)),
                ("packages", _changed(_requirements(a), _requirements(b)))]
    out = [f"runs {run_a} -> {run_b}"]
    for title, lines in sections:
        entries = [line for line in lines if not line.startswith("    ")]  # not a patch's
        out.append(f"{title}: " + ("same" if not lines else f"{len(entries)} differ"))
        out += lines
    return "\n".join(out)


USAGE = """usage: python -m train rerun RUN_ID [--current-code] [hydra flags] [key=value ...]
       python -m train diff RUN_A RUN_B

rerun: a new job from the run's recorded config and code, the overrides on top (tagged
       rerun_of=RUN_ID); --current-code runs today's code instead of the run's; Hydra's flags
       (-m, --cfg job) work as for any job.
diff:  what differs between two runs: config keys, code, package versions.
Both read MLFLOW_TRACKING_URI, else the embedded store. docs/reproducibility.md"""


def main(argv: list[str]) -> int:
    """`rerun ...` or `diff ...` (argv without `python -m train`); the exit code."""
    command, rest = argv[0], argv[1:]
    if not rest or rest[0] in ("-h", "--help"):
        print(USAGE, file=sys.stderr if not rest else sys.stdout)
        return 2 if not rest else 0
    if command == "diff":
        if len(rest) != 2:
            print(USAGE, file=sys.stderr)
            return 2
        print(diff(*rest))
        return 0
    current = "--current-code" in rest
    # The rest goes to Hydra as typed: its flags (-m for a sweep of reruns) and the overrides.
    return rerun(rest[0], [a for a in rest[1:] if a != "--current-code"], current)
