"""The code a run ran, recorded with it: the project's commit, whether its tree was dirty and
the uncommitted diff; each user package a `_target_` names (a git checkout: commit and diff; an
installed distribution: name and version; else a hash of its .py files); the installed
distributions (pip-freeze style); the Python version.

Plain data only (no MLflow: train/report/runlog.py logs it). What is collected is what git
tracks or would track: nothing a .gitignore names, nothing outside the project and the named
packages, no file whose name looks like a secret (SECRET_NAMES), and of the untracked files
only source-like ones (SOURCE_SUFFIXES: data files are not code). A diff over MAX_DIFF_BYTES is
cut with a note, and the run is tagged `code.complete=false` (a rerun then refuses it).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
import platform
import re
import subprocess
import sys
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

MAX_DIFF_BYTES = 1_000_000
"""A diff larger than this is cut (MLflow artifacts are not the place for vendored trees)."""
MAX_UNTRACKED_BYTES = 256_000
"""An untracked file larger than this is not recorded (generated or data, not code)."""
SECRET_NAMES = (".env", ".env.*", "*.pem", "*.key", "*.p12", "*secret*", "*credential*",
                "*password*", ".netrc", "id_rsa*", "id_ed25519*", "*.token")
"""File names never recorded, tracked or not (git pathspec globs, case-insensitive)."""
SOURCE_SUFFIXES = (".py", ".pyi", ".yaml", ".yml", ".toml", ".cfg", ".ini", ".json", ".txt",
                   ".md", ".sh", ".sbatch")
"""Untracked files with these suffixes are code the job may import or read: recorded."""
NOT_USER_PACKAGES = frozenset({"train", "torch", "torchvision", "hydra", "omegaconf",
                               "hydra_plugins", "mlflow", "submitit", "numpy"})
"""`_target_` roots that are the service's own stack, recorded by requirements.txt."""
CUT_NOTE = "# train: diff cut at {limit} bytes of {total}: the run's code is not complete.\n"
DIFF_FILE = "code/diff.patch"
SNAPSHOT_MARK = ".git/train_snapshot"
"""In a snapshot taken at Slurm submission (train/launch/snapshot.py): the run records the
snapshot's directory as the tag `code.snapshot` (a rerun can run it as it is). Inside .git, so
that the snapshot's tree is exactly the submitted one (not dirty by this file)."""
SNAPSHOT_FILE = ".train_code.json"
"""In a code snapshot that is no git checkout (train/launch/rerun.py makes one from a run):
the commit, dirty flag and diff it was made from, recorded again by the runs it runs."""
REQUIREMENTS_FILE = "code/requirements.txt"


@dataclass
class CodeRecord:
    tags: dict[str, str] = field(default_factory=dict)
    files: dict[str, str] = field(default_factory=dict)
    """artifact path -> text"""


def _git(cwd: Path, *args: str) -> str | None:
    """git's stdout, or None (no git, not a repository, a failure)."""
    try:
        done = subprocess.run(["git", "-C", str(cwd), *args], capture_output=True, text=True,
                              timeout=20, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout if done.returncode == 0 else None


def _pathspec(under: str) -> list[str]:
    return ["--", under, *(f":(exclude,icase,glob)**/{name}" for name in SECRET_NAMES)]


def _new_file_patch(path: str, text: str) -> str:
    """An untracked file as `git apply` takes a new file."""
    lines = text.splitlines(keepends=True)
    body = "".join("+" + line for line in lines)
    if lines and not lines[-1].endswith("\n"):
        body += "\n\\ No newline at end of file\n"
    hunk = f"@@ -0,0 +1,{len(lines)} @@\n" if lines else ""
    return (f"diff --git a/{path} b/{path}\nnew file mode 100644\n--- /dev/null\n"
            f"+++ b/{path}\n{hunk}{body}")


RUN_FOLDER = re.compile(r"(^|/)(m-)?[0-9a-f]{32}/")
"""A folder named by an MLflow run or logged model id: a tracking store kept in the checkout
(`<experiment>/<run id>/artifacts/config.yaml`, `models/m-<id>/artifacts/conda.yaml`)."""


def written_by_jobs(top: Path, rel: str) -> bool:
    """Whether the untracked file `rel` is what jobs wrote, not code: in a tracking store's run
    folders, in a job's output directory (the one holding Hydra's `.hydra/` record), or a data
    file's sidecar (predictions.parquet.json). A store or hydra.run.dir inside the checkout
    otherwise put every earlier run's files into the next run's code/diff.patch."""
    if RUN_FOLDER.search(rel):
        return True
    if rel.endswith(".json") and not rel[:-5].endswith(SOURCE_SUFFIXES) and \
            (top / rel[:-5]).is_file():
        return True  # the sidecar
    if not rel.endswith(SOURCE_SUFFIXES) and (top / f"{rel}.json").is_file():
        return True  # the data file it describes
    return any((top / parent / ".hydra").is_dir() for parent in Path(rel).parents[:-1])


def users_untracked(top: Path, status: str) -> list[str]:
    """The untracked files (relative to `top`) that `git status -z` lists, less those jobs
    wrote (`written_by_jobs`): what the user made."""
    return [entry[3:] for entry in status.split("\0")
            if entry.startswith("?? ") and not written_by_jobs(top, entry[3:])]


def _sources(top: Path, untracked: list[str]) -> list[str]:
    """Of `untracked`, the source files: no data, nothing over MAX_UNTRACKED_BYTES."""
    return [rel for rel in untracked if rel.endswith(SOURCE_SUFFIXES) and
            (top / rel).is_file() and (top / rel).stat().st_size <= MAX_UNTRACKED_BYTES]


def untracked_sources(top: Path, status: str) -> list[str]:
    """The untracked source files (relative to `top`) that `git status -z` lists: no data,
    nothing ignored, nothing jobs wrote, nothing over MAX_UNTRACKED_BYTES."""
    return _sources(top, users_untracked(top, status))


def untracked_in(where: Path) -> list[str]:
    """untracked_sources of the checkout holding `where`, relative to its top."""
    top = _git(where, "rev-parse", "--show-toplevel")
    if not top:
        return []
    status = _git(where, "status", "--porcelain=v1", "-z", "--untracked-files=all",
                  *_pathspec(".")) or ""
    return untracked_sources(Path(top.strip()), status)


def _patches(top: Path, sources: list[str]) -> Iterator[str]:
    """The untracked source files as patches."""
    for rel in sources:
        try:
            yield _new_file_patch(rel, (top / rel).read_text(encoding="utf-8"))
        except (UnicodeDecodeError, OSError):
            continue


def git_state(where: Path, whole_tree: bool = True) -> dict[str, Any] | None:
    """{top, commit, dirty, diff} of the git checkout holding the directory `where` (the diff
    and the dirty flag of the whole tree, or only of `where` itself), or None outside git."""
    top_text = _git(where, "rev-parse", "--show-toplevel")
    commit = _git(where, "rev-parse", "HEAD")
    if not top_text or not commit:
        return None
    top = Path(top_text.strip()).resolve()
    spec = _pathspec("." if whole_tree else str(where.resolve().relative_to(top)))
    status = _git(top, "status", "--porcelain=v1", "-z", "--untracked-files=all", *spec) or ""
    tracked = _git(top, "diff", "HEAD", "--no-color", "--no-ext-diff", *spec) or ""
    mine = users_untracked(top, status)  # once: both the dirty flag and the diff read it
    changed = any(e and not e.startswith("?? ") for e in status.split("\0"))
    diff = tracked + "".join(_patches(top, _sources(top, mine)))
    # git's dirty, less the files jobs wrote: a change to a tracked file, or one the user made
    return {"top": top, "commit": commit.strip(), "dirty": changed or bool(mine), "diff": diff}


def snapshot_state(project: Path) -> dict[str, Any] | None:
    """The state a snapshot was made from (SNAPSHOT_FILE), or None."""
    try:
        saved = json.loads((project / SNAPSHOT_FILE).read_text())
    except (OSError, ValueError):
        return None
    return {"top": project, "commit": str(saved["commit"]), "dirty": bool(saved["dirty"]),
            "diff": str(saved["diff"])}


def capped(diff: str) -> tuple[str, bool]:
    """The diff, cut with a note above MAX_DIFF_BYTES; and whether it is whole."""
    data = diff.encode()
    if len(data) <= MAX_DIFF_BYTES:
        return diff, True
    cut = data[:MAX_DIFF_BYTES].decode(errors="ignore")
    return CUT_NOTE.format(limit=MAX_DIFF_BYTES, total=len(data)) + cut, False


def targets(tree: Any) -> Iterator[str]:
    """Every `_target_` value in a config tree."""
    if isinstance(tree, Mapping):
        for key, value in tree.items():
            if key == "_target_" and isinstance(value, str):
                yield value
            else:
                yield from targets(value)
    elif isinstance(tree, list):
        for item in tree:
            yield from targets(item)


def user_packages(config: Mapping[str, Any]) -> list[str]:
    """The top-level packages of the `_target_`s that are the user's: not the standard
    library and not the service's own stack."""
    roots = {t.split(".", 1)[0] for t in targets(config)}
    return sorted(r for r in roots if r and r not in sys.stdlib_module_names
                  and r not in NOT_USER_PACKAGES)


def package_dir(name: str) -> Path | None:
    """Where a top-level package (or module) lives, found without importing it."""
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None
    if spec is None:
        return None
    if spec.submodule_search_locations:
        return Path(next(iter(spec.submodule_search_locations))).resolve()
    return Path(spec.origin).resolve() if spec.origin else None


def dist_of(name: str) -> str | None:
    """The installed distribution that provides the top-level package `name`, if any."""
    dists = importlib.metadata.packages_distributions().get(name)
    return dists[0] if dists else None


def files_hash(where: Path) -> str:
    """sha256 over a package's .py files (relative names and contents), 16 hex digits."""
    digest = hashlib.sha256()
    files = sorted(where.rglob("*.py")) if where.is_dir() else [where]
    for path in files:
        digest.update(str(path.relative_to(where.parent)).encode() + b"\0")
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def _package(name: str, project: Path, record: CodeRecord) -> None:
    """One user package's tags (`code.pkg.<name>...`) and diff artifact."""
    key = f"code.pkg.{name}"
    where = package_dir(name)
    if where is None:
        record.tags[key] = "not found"
        return
    if where.is_relative_to(project):  # recorded with the project
        record.tags[key] = f"project:{where.relative_to(project)}"
        return
    # A checkout: only the package's own directory (a module file: its directory).
    state = git_state(where if where.is_dir() else where.parent, whole_tree=False)
    if state is not None:
        diff, whole = capped(state["diff"])
        record.tags.update({key: f"git:{state['commit']}",
                            f"{key}.dirty": str(state["dirty"]).lower(),
                            f"{key}.repo": str(state["top"]),
                            # the sys.path entry that holds it, within the checkout
                            f"{key}.path": str(where.parent.relative_to(state["top"]))})
        if diff:
            record.files[f"code/packages/{name}.patch"] = diff
        if not whole:
            record.tags["code.complete"] = "false"
        return
    if dist := dist_of(name):
        record.tags[key] = f"dist:{dist}=={importlib.metadata.version(dist)}"
        return
    record.tags.update({key: f"sha256:{files_hash(where)}", f"{key}.path": str(where.parent)})


def requirements() -> str:
    """Every installed distribution as `name==version`, sorted (pip freeze's form)."""
    # Each METADATA parsed once (`d.version` would parse it again: twice the time).
    metas = [d.metadata for d in importlib.metadata.distributions()]
    names = {f"{m['Name']}=={m['Version']}" for m in metas if m["Name"]}
    return "".join(f"{line}\n" for line in sorted(names, key=str.lower))


def collect(config: Mapping[str, Any], project: Path) -> CodeRecord:
    """What the run records of its code (tags and artifact files). Costs a few git commands
    and a walk over the installed distributions' metadata: tens of milliseconds."""
    record = CodeRecord(tags={"python_version": platform.python_version(),
                              "code.complete": "true"})
    if (project / SNAPSHOT_MARK).is_file():
        record.tags["code.snapshot"] = str(project)
    state = git_state(project) or snapshot_state(project)
    if state is None:
        record.tags["git_dirty"] = "unknown"
    else:
        diff, whole = capped(state["diff"])
        record.tags.update({"git_commit": state["commit"],
                            "git_dirty": str(state["dirty"]).lower(),
                            "code.diff_sha256": hashlib.sha256(diff.encode()).hexdigest()[:16]})
        if diff:
            record.files[DIFF_FILE] = diff
        if not whole:
            record.tags["code.complete"] = "false"
    for name in user_packages(config):
        _package(name, project, record)
    record.files[REQUIREMENTS_FILE] = requirements()
    return record
