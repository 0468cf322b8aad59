"""The code a Slurm job runs is the code it was submitted with (cluster.snapshot_code).

A job imports the project when it starts, not when it is submitted: a job queued for hours would
run whatever the tree holds by then. At submission the launcher (hydra_plugins/train_launcher)
copies the code into the sweep's directory on shared storage, `<sweep dir>/code/`:
- `project/`: the project's git checkout as it is - a shallow clone at HEAD, then the working
  tree's tracked files copied over it (what submitit's `RsyncSnapshot` does, without needing
  rsync) plus the untracked source files a run records (train/report/code.py), without files
  named like secrets;
- `packages/<name>/`: each user package a `_target_` names that lives outside the project: its
  git checkout the same way, or else a copy of its directory (an installed distribution is not
  copied: the environment holds it).
The job's shell then puts them first on PYTHONPATH, with PYTHONSAFEPATH=1 so that the working
directory (the tree being edited) is not put before them; the lines are part of the sbatch
script (`setup`), so that a requeue runs the same snapshot and `--export=NONE` sites get them.
The working directory stays where the job was submitted from: relative paths mean what they did.
Config files are read from the snapshot too (the launcher repoints Hydra's search path).
"""

from __future__ import annotations

import dataclasses
import fnmatch
import os
import shlex
import shutil
import subprocess
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from train.config.safe_text import has_control
from train.errors import SubmitError
from train.report import code
from train.tracking import REPO_ROOT, embedded_uri

IGNORED = shutil.ignore_patterns("__pycache__", "*.pyc", ".git", *code.SECRET_NAMES)


@dataclass
class Snapshot:
    root: Path
    """<sweep dir>/code"""
    project: Path
    """root/project; or the running code itself where it is a snapshot already (a rerun's)"""
    pythonpath: list[str] = field(default_factory=list)
    seconds: float = 0.0
    bytes: int = 0
    reused: bool = False
    """Taken by an earlier submission into the same sweep directory (a resubmission to resume
    its jobs): they resume with the code they started with, which their runs recorded."""

    def setup_lines(self) -> list[str]:
        """The sbatch script's lines that make the job import the snapshot."""
        path = os.pathsep.join(self.pythonpath)
        # After cluster.setup's lines: a venv or module they load keeps its own entries, behind.
        lines = [f"export PYTHONPATH={shlex.quote(path)}${{PYTHONPATH:+:$PYTHONPATH}}",
                 "export PYTHONSAFEPATH=1"]
        if not os.environ.get("MLFLOW_TRACKING_URI"):
            # The embedded store is the project's, not the snapshot's (tracking/store.py
            # finds it next to the code it runs).
            lines.append(f"export MLFLOW_TRACKING_URI={shlex.quote(embedded_uri())}")
        return lines


def _git_snapshot(into: Path, top: Path) -> None:
    """The checkout `top` as it is, into `into`: a shallow clone at HEAD (so the snapshot is a
    git checkout at the same commit, with the same uncommitted diff), then each tracked file
    of the working tree and each untracked source file a run records copied over it, a file
    deleted in the tree deleted in the copy, secret-looking names left out.

    What submitit's RsyncSnapshot does, without rsync: a login node or a fresh machine may not
    have it, and a few hundred source files copy in well under a second in Python."""
    into.parent.mkdir(parents=True, exist_ok=True)
    clone = subprocess.run(["git", "clone", "-q", "--depth=2", f"file://{top}", str(into)],
                           capture_output=True, text=True)
    if clone.returncode != 0:
        raise SubmitError(f"cluster.snapshot_code=true: git could not clone {top} into {into}: "
                          f"{clone.stderr.strip()[-300:]}; or set cluster.snapshot_code=false.")
    added, removed = _staged(top, "A"), _staged(top, "D")
    for rel in removed:  # `git rm` or the source of a `git mv`: out of the index, not listed
        (into / rel).unlink(missing_ok=True)
    for rel in [*_tracked_files(top), *code.untracked_in(top)]:
        if _secret(rel):
            continue
        source, target = top / rel, into / rel
        if not source.exists() and not source.is_symlink():
            target.unlink(missing_ok=True)  # deleted in the working tree
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        if target.is_symlink() or target.is_file():
            target.unlink()
        shutil.copy2(source, target, follow_symlinks=False)
    # The copy's index gets the same additions and removals, so that its `git diff HEAD` (the
    # diff its runs record) is the tree's own: a `git mv` a rename there as here.
    copied = [r for r in added if not _secret(r)  # nor one deleted again since its `git add`
              and ((into / r).exists() or (into / r).is_symlink())]
    for verb, paths in ((["add", "-f"], copied),
                        (["rm", "--cached", "-q", "--ignore-unmatch"], removed)):
        if paths:
            subprocess.run(["git", "-C", str(into), *verb, "--pathspec-from-file=-",
                            "--pathspec-file-nul"], input="\0".join(paths), text=True,
                           capture_output=True, check=True)


def _tracked_files(top: Path) -> list[str]:
    """git ls-files of `top`, without submodules (mode 160000: another repository)."""
    listed = subprocess.run(["git", "-C", str(top), "ls-files", "-s", "-z"],
                            capture_output=True, text=True, check=True).stdout
    return [entry.split("\t", 1)[1] for entry in listed.split("\0")
            if entry and not entry.startswith("160000")]


def _staged(top: Path, kind: str) -> list[str]:
    """The paths the index of `top` adds ("A") or removes ("D") against HEAD (a rename as
    both)."""
    listed = subprocess.run(["git", "-C", str(top), "diff", "--cached", "--name-only",
                             "--no-renames", f"--diff-filter={kind}", "-z"],
                            capture_output=True, text=True, check=True).stdout
    return [rel for rel in listed.split("\0") if rel]


def _secret(rel: str) -> bool:
    """A path with a part named like a secret (code.SECRET_NAMES, as rsync's --exclude)."""
    return any(fnmatch.fnmatch(part.lower(), pattern) for part in Path(rel).parts
               for pattern in code.SECRET_NAMES)


def _package(name: str, into: Path, mapped: dict[str, str]) -> None:
    """Copy one user package (outside the project), unless an earlier submission into this
    sweep directory did, and note where its sys.path entry went."""
    where = code.package_dir(name)
    if where is None or where.is_relative_to(REPO_ROOT):
        return  # not found (pre-flight refused it already), or part of the project's snapshot
    state = code.git_state(where if where.is_dir() else where.parent, whole_tree=False)
    if state is not None:
        if not into.exists():
            try:
                _git_snapshot(into, state["top"])
            except BaseException:
                shutil.rmtree(into, ignore_errors=True)  # never reused half-made
                raise
        mapped[str(where.parent)] = str(into / where.parent.relative_to(state["top"]))
    elif not code.dist_of(name):  # an installed distribution stays in the environment
        mapped[str(where.parent)] = str(into)
        if into.exists():
            return
        target = into / where.name
        if where.is_dir():
            shutil.copytree(where, target, ignore=IGNORED)
        else:
            into.mkdir(parents=True)
            shutil.copy2(where, target)


def _pythonpath(project: Path, mapped: Mapping[str, str]) -> list[str]:
    """The snapshot first, then the user's PYTHONPATH with each entry that was copied replaced
    by its copy (tests/ of the project: the snapshot's tests/)."""
    paths = [str(project)]
    for entry in filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep)):
        resolved = Path(entry).resolve()
        if str(resolved) in mapped:
            paths.append(mapped[str(resolved)])
        elif resolved.is_relative_to(REPO_ROOT):
            paths.append(str(project / resolved.relative_to(REPO_ROOT)))
        else:
            paths.append(entry)
    return paths


def config_copy(snap: Snapshot, config_dir: Path, index: int) -> Path:
    """Where a config directory of Hydra's search path is read from by the job: the project's
    conf/ in the project's snapshot, any other (a rerun's) copied beside it."""
    if config_dir.resolve() == (REPO_ROOT / "conf").resolve():
        return snap.project / "conf"
    return snap.root / f"config-{index}"


def is_snapshot(project: Path) -> bool:
    """Code that is a snapshot already: taken at a submission, or rebuilt for a rerun."""
    return (project / code.SNAPSHOT_MARK).is_file() or (project / code.SNAPSHOT_FILE).is_file()


def targets_of(cfg: Any) -> dict[str, Any]:
    """A typed TrainConfig as a tree in which every `_target_` can be found."""
    tree = dataclasses.asdict(cfg)
    target = getattr(cfg.model, "target", None)  # model=custom keeps it as `target`
    tree["model"] = {"_target_": target} if target else {}
    return tree


def _copy(root: Path, configs: list[Any]) -> Snapshot:
    mapped: dict[str, str] = {}
    if is_snapshot(REPO_ROOT):  # a rerun's code: made for it, changed by nobody
        snap = Snapshot(root, REPO_ROOT)
        root.mkdir(parents=True, exist_ok=True)
    else:
        snap = Snapshot(root, root / "project")
        snap.reused = (snap.project / code.SNAPSHOT_MARK).is_file()
        if not snap.reused:
            _git_snapshot(snap.project, REPO_ROOT)
            (snap.project / code.SNAPSHOT_MARK).write_text(f"taken from {REPO_ROOT}\n")
        names = sorted({n for c in configs for n in code.user_packages(targets_of(c))})
        for name in names:
            _package(name, root / "packages" / name, mapped)
    snap.pythonpath = _pythonpath(snap.project, mapped)
    return snap


def take(sweep_dir: Path, configs: list[Any]) -> Snapshot:
    """Snapshot the project and the user packages of every job's config into sweep_dir/code."""
    start = time.monotonic()
    root = Path(sweep_dir).absolute() / "code"
    if has_control(str(root)):  # it becomes a line of the job's script
        raise SubmitError(f"hydra.sweep.dir {str(sweep_dir)!r} holds a control character: "
                          "choose a plain path.")
    if has_control(os.environ.get("PYTHONPATH", "")):
        raise SubmitError("PYTHONPATH holds a control character: it would become a line of the "
                          "job's script. Fix PYTHONPATH.")
    if root.exists() and not (root / "project" / code.SNAPSHOT_MARK).is_file() \
            and not is_snapshot(REPO_ROOT):
        raise SubmitError(f"{root} exists and is no code snapshot: submit into another sweep "
                          "directory.")
    try:
        snap = _copy(root, configs)
    except (OSError, subprocess.CalledProcessError) as e:
        if not (root / "project" / code.SNAPSHOT_MARK).is_file():  # never an earlier one
            shutil.rmtree(root, ignore_errors=True)  # nothing half-made is left to be mistaken
        raise SubmitError(f"the code could not be snapshotted into {root} ({e}); fix that, or "
                          "submit without a snapshot: cluster.snapshot_code=false.") from None
    except SubmitError:
        if not (root / "project" / code.SNAPSHOT_MARK).is_file():
            shutil.rmtree(root, ignore_errors=True)
        raise
    snap.seconds = time.monotonic() - start
    snap.bytes = sum(p.stat().st_size for p in snap.root.rglob("*") if p.is_file())
    return snap
