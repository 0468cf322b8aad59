"""A run's code, back as files: what `python -m train rerun` runs (train/launch/rerun.py).

A run records its project's commit and uncommitted diff, and those of its git-checkout user
packages (train/report/code.py). `plan()` checks, before anything is made, that all of it can be
rebuilt (the commits are still in their repositories, no diff was cut, an installed package is
at its recorded version, a hashed one unchanged) and refuses in one line otherwise; `build()`
then makes each checkout's tree at its commit plus its diff (`git archive` + `git apply`, no
change to the repository itself) under outputs/code/<key>/, once: a later rerun of the same code
reuses it. A snapshot made at Slurm submission (tag `code.snapshot`) is used as it is.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import json
import os
import shutil
import subprocess
import tarfile
from dataclasses import dataclass, field
from pathlib import Path

from train.errors import LaunchError
from train.report import code
from train.tracking import REPO_ROOT
from train.tracking.recorded import RecordedRun

SNAPSHOTS = REPO_ROOT / "outputs" / "code"
"""Where rebuilt code lives (outputs/ is git-ignored): one directory per commit and diff."""


class CodeUnavailable(LaunchError):
    """The code a run ran cannot be rebuilt; the message says which part and what to do."""


@dataclass
class Source:
    """A git checkout's tree at `commit` plus `patch`; `subdir` is what is taken of it and the
    entry put on PYTHONPATH."""

    repo: Path
    commit: str
    patch: str
    subdir: str = "."


@dataclass
class Plan:
    project: Source | Path
    """The project's source, or a snapshot directory made at submission."""
    packages: list[Source] = field(default_factory=list)
    project_paths: list[str] = field(default_factory=list)
    """sys.path entries inside the project (user packages kept in the project's tree)."""


def _unavailable(run: RecordedRun, what: str, todo: str) -> CodeUnavailable:
    return CodeUnavailable(f"the code of run {run.run_id} is not available: {what}. {todo} "
                           "(or add --current-code to rerun with the code as it is now).")


def _has_commit(repo: Path, commit: str) -> bool:
    done = subprocess.run(["git", "-C", str(repo), "cat-file", "-e", f"{commit}^{{commit}}"],
                          capture_output=True, stdin=subprocess.DEVNULL)
    return done.returncode == 0


def _checked_source(run: RecordedRun, what: str, repo: Path, commit: str, patch: str,
                    subdir: str = ".") -> Source:
    if not repo.is_dir():
        raise _unavailable(run, f"{what}'s checkout {repo} no longer exists",
                           "Restore it where it was")
    if not _has_commit(repo, commit):
        raise _unavailable(run, f"{what}'s commit {commit[:12]} is not in {repo}",
                           "Fetch it (git fetch) into that repository")
    return Source(repo, commit, patch, subdir)


def _package(run: RecordedRun, name: str, plan: Plan) -> None:
    """Check one user package (tag code.pkg.<name>) and add what it needs to the plan."""
    key = f"code.pkg.{name}"
    kind, _, value = run.tags[key].partition(":")
    if kind == "project":
        plan.project_paths.append(str(Path(value).parent))
    elif kind == "git":
        plan.packages.append(_checked_source(
            run, f"package {name}", Path(run.tags[f"{key}.repo"]), value,
            run.files.get(f"code/packages/{name}.patch", ""), run.tags[f"{key}.path"]))
    elif kind == "dist":
        dist, _, version = value.partition("==")
        try:
            now = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            now = "not installed"
        if now != version:
            raise _unavailable(run, f"package {name} was {dist}=={version}, here it is {now}",
                               f"Install it: pip install {dist}=={version}")
    elif kind == "sha256":
        where = code.package_dir(name)
        if where is None or code.files_hash(where) != value:
            raise _unavailable(run, f"package {name} was recorded only by a hash of its files, "
                               "and the package found now is " +
                               ("missing" if where is None else "different"),
                               "Put that version of it on PYTHONPATH")


def plan(run: RecordedRun) -> Plan:
    """What rebuilds the run's code, every part checked first (CodeUnavailable otherwise)."""
    tags = run.tags
    if "code.complete" not in tags:
        raise _unavailable(run, "it recorded no code (made before runs recorded it)",
                           "Check out its git_commit tag yourself")
    if tags["code.complete"] != "true":
        raise _unavailable(run, "a diff was larger than the recorded cap and was cut",
                           "Commit the changes before the next run")
    snapshot = Path(tags["code.snapshot"]) if tags.get("code.snapshot") else None
    if snapshot is not None and (snapshot / "train").is_dir():
        result = Plan(project=snapshot)
    elif len(commit := tags.get("git_commit", "")) != 40:
        raise _unavailable(run, "the project was no git checkout when it ran",
                           "Run from a git checkout")
    else:
        result = Plan(project=_checked_source(run, "the project", REPO_ROOT, commit,
                                              run.files.get(code.DIFF_FILE, "")))
    for key in sorted(tags):
        if key.startswith("code.pkg.") and key.count(".") == 2:
            _package(run, key.removeprefix("code.pkg."), result)
    return result


def _key(source: Source) -> str:
    text = f"{source.repo}\0{source.commit}\0{source.subdir}\0{source.patch}"
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def materialise(source: Source) -> Path:
    """The checkout's `subdir` at its commit plus its diff, under SNAPSHOTS (made once)."""
    dest = SNAPSHOTS / _key(source)
    if (dest / code.SNAPSHOT_FILE).is_file():
        return dest
    SNAPSHOTS.mkdir(parents=True, exist_ok=True)
    tmp = SNAPSHOTS / f".{dest.name}.{os.getpid()}"
    try:
        tmp.mkdir()
        archive = subprocess.Popen(["git", "-C", str(source.repo), "archive", "--format=tar",
                                    source.commit, "--", source.subdir],
                                   stdout=subprocess.PIPE, stdin=subprocess.DEVNULL)
        assert archive.stdout is not None
        with tarfile.open(fileobj=archive.stdout, mode="r|") as tar:
            tar.extractall(tmp, filter="data")
        if archive.wait() != 0:
            raise CodeUnavailable(f"git archive of {source.commit[:12]} in {source.repo} failed")
        if source.patch:
            # The tree is no repository: git must not find the one around outputs/.
            done = subprocess.run(["git", "apply", "--whitespace=nowarn", "-"],
                                  input=source.patch, text=True, capture_output=True, cwd=tmp,
                                  env={**os.environ, "GIT_CEILING_DIRECTORIES": str(SNAPSHOTS)})
            if done.returncode != 0:
                raise CodeUnavailable(f"the recorded diff of {source.repo} does not apply to "
                                      f"{source.commit[:12]}: {done.stderr.strip()[:200]}")
        (tmp / code.SNAPSHOT_FILE).write_text(json.dumps(
            {"commit": source.commit, "dirty": bool(source.patch), "diff": source.patch}))
        with contextlib.suppress(OSError):  # another rerun made it meanwhile: theirs is equal
            tmp.rename(dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


def build(p: Plan) -> list[str]:
    """Make the planned trees; the PYTHONPATH entries that import them, the project first."""
    project = p.project if isinstance(p.project, Path) else materialise(p.project)
    paths = [str(project), *(str(project / rel) for rel in p.project_paths)]
    for source in p.packages:
        paths.append(str(materialise(source) / source.subdir))
    return paths
