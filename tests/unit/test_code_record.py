"""What a run records of its code (train/report/code.py): the commit, the dirty flag and the
uncommitted diff of a real git checkout - without ignored, secret or data files - and of the
user's own package, read back from the real MLflow store of a run trained in process."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
from mlflow import MlflowClient

from tests.conftest import composed, new_store, runs_in
from tests.unit.test_job import SMALL
from train.app import run
from train.report import code

PACKAGE = '''from torch import nn


class Net(nn.Module):
    def __init__(self, channels: int, image_size: int, num_classes: int) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(channels * image_size ** 2,
                                                         num_classes))

    def forward(self, x):
        return self.net(x)
'''


def git(where: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(where), "-c", "user.email=t@t", "-c", "user.name=t",
                           *args], check=True, capture_output=True, text=True).stdout


def checkout(root: Path, files: dict[str, str]) -> Path:
    """A git repository holding `files`, committed."""
    root.mkdir(parents=True)
    git(root, "init", "-q")
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    git(root, "add", "-A")
    git(root, "commit", "-qm", "first")
    return root


def test_a_dirty_tree_is_recorded_without_ignored_secret_or_data_files(tmp_path: Path) -> None:
    repo = checkout(tmp_path / "project", {"main.py": "print(1)\n", ".gitignore": "ignored.py\n"})
    commit = git(repo, "rev-parse", "HEAD").strip()
    assert code.collect({}, repo).tags["git_dirty"] == "false"
    (repo / "main.py").write_text("print(2)\n")
    (repo / "helper.py").write_text("X = 1")  # untracked source, no final newline
    (repo / "ignored.py").write_text("IGNORED = 1\n")
    (repo / ".env").write_text("TOKEN=hunter2\n")
    (repo / "samples.bin").write_bytes(b"\0" * 100)
    record = code.collect({}, repo)
    assert record.tags["git_commit"] == commit and record.tags["git_dirty"] == "true"
    assert record.tags["code.complete"] == "true"
    patch = record.files[code.DIFF_FILE]
    assert "+print(2)" in patch and "+X = 1" in patch
    assert "IGNORED" not in patch and "hunter2" not in patch and "samples.bin" not in patch
    # The patch is one `git apply` takes: it turns the commit into the dirty tree.
    clean = tmp_path / "clean"
    git(repo, "worktree", "add", "-q", "--detach", str(clean), commit)
    subprocess.run(["git", "apply"], input=patch, text=True, cwd=clean, check=True)
    assert (clean / "main.py").read_text() == "print(2)\n"
    assert (clean / "helper.py").read_text() == "X = 1"
    assert "torch==" in record.files[code.REQUIREMENTS_FILE]


def test_what_jobs_wrote_inside_the_checkout_is_not_code(tmp_path: Path) -> None:
    """A tracking store, a job's output directory and predictions kept in the checkout: the
    next run records none of them as code, nor calls the tree dirty for them."""
    repo = checkout(tmp_path / "project", {"main.py": "print(1)\n"})
    run_id, model_id = "0123456789abcdef" * 2, "m-" + "fedcba9876543210" * 2
    written = {f"artifacts/1/{run_id}/artifacts/config.yaml": "data: {}\n",
               f"artifacts/1/models/{model_id}/artifacts/conda.yaml": "name: x\n",
               "runs/eval-1/.hydra/config.yaml": "eval: {}\n",
               "runs/eval-1/eval-digits_val.json": "{}\n",
               "preds.parquet": "PAR1", "preds.parquet.json": "{}\n"}
    for name, text in written.items():
        (repo / name).parent.mkdir(parents=True, exist_ok=True)
        (repo / name).write_text(text)
    record = code.collect({}, repo)
    assert record.tags["git_dirty"] == "false"
    assert not record.files.get(code.DIFF_FILE)
    (repo / "conf").mkdir()
    (repo / "conf" / "exp.yaml").write_text("lr: 1\n")  # the user's: code, and dirty
    (repo / "config.json").write_text("{}\n")
    record = code.collect({}, repo)
    assert record.tags["git_dirty"] == "true"
    patch = record.files[code.DIFF_FILE]
    assert sorted(line[len("+++ b/"):] for line in patch.splitlines()
                  if line.startswith("+++ b/")) == ["conf/exp.yaml", "config.json"]


def test_a_diff_over_the_cap_is_cut_with_a_note(monkeypatch: pytest.MonkeyPatch,
                                                tmp_path: Path) -> None:
    repo = checkout(tmp_path / "project", {"main.py": "print(1)\n"})
    (repo / "main.py").write_text("print(2)\n" * 1000)
    monkeypatch.setattr(code, "MAX_DIFF_BYTES", 2000)
    record = code.collect({}, repo)
    assert record.tags["code.complete"] == "false"
    assert record.files[code.DIFF_FILE].startswith("# train: diff cut at 2000 bytes of ")


def test_user_packages_are_the_targets_outside_the_stack() -> None:
    config = {"model": {"_target_": "mypkg.models.Net"},
              "trainer": {"loss": {"_target_": "torch.nn.CrossEntropyLoss"}},
              "optim": {"scheduler": {"_target_": "functools.partial"}},
              "data": {"train": {"_target_": "otherpkg.Data"}}}
    assert code.user_packages(config) == ["mypkg", "otherpkg"]


def test_a_run_records_its_dirty_user_package(tmp_path: Path, no_launcher_env: None,
                                              store_template: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """A user package in its own git checkout, edited without a commit: the run holds its
    commit, the dirty flag and the edit; the installed distributions; Python's version."""
    user_repo = checkout(tmp_path / "research", {"src/reprpkg/__init__.py": PACKAGE})
    commit = git(user_repo, "rev-parse", "HEAD").strip()
    init = user_repo / "src" / "reprpkg" / "__init__.py"
    init.write_text(PACKAGE.replace("num_classes))", "num_classes))  # edited"))
    monkeypatch.syspath_prepend(str(user_repo / "src"))
    uri = new_store(tmp_path / "mlflow.db", store_template)
    small = [o for o in SMALL if not o.startswith("model")]
    cfg = composed(*small, "trainer.epochs=1", f"tracking.uri={uri}", "model=custom",
                   "model._target_=reprpkg.Net", "tracking.log_model=false")
    run(cfg, str(tmp_path / "job"), "python -m train (test)")

    [mlflow_run] = runs_in(uri)
    tags = mlflow_run.data.tags
    assert tags["code.pkg.reprpkg"] == f"git:{commit}"
    assert tags["code.pkg.reprpkg.dirty"] == "true" and tags["code.pkg.reprpkg.path"] == "src"
    assert tags["python_version"].count(".") == 2 and tags["torch_version"]
    assert tags["git_dirty"] in ("true", "false") and len(tags["git_commit"]) == 40
    client = MlflowClient(tracking_uri=uri)
    files = {f.path for f in client.list_artifacts(mlflow_run.info.run_id, "code")}
    assert {"code/requirements.txt", "code/packages"} <= files
    patch = Path(client.download_artifacts(mlflow_run.info.run_id, "code/packages/reprpkg.patch",
                                           str(tmp_path / "got"))).read_text()
    assert "+                                                         num_classes))  # edited" \
        in patch


def test_a_submission_snapshot_holds_the_tree_and_the_user_package_as_they_are(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """train/launch/snapshot.py, as the Slurm launcher takes it: the project's checkout with
    its uncommitted state (the same commit and diff a run records), the user's dirty package,
    and the sbatch lines that put them first on the job's PYTHONPATH. Taken with nothing on
    PATH but git: a login node or a fresh machine without rsync snapshots all the same."""
    from tests.conftest import REPO, typed
    from train.launch import snapshot

    user_repo = checkout(tmp_path / "research", {"src/snappkg/__init__.py": PACKAGE,
                                                 "src/snappkg/old.py": "OLD = 1\n",
                                                 "src/snappkg/before.py": "MOVED = 1\n",
                                                 "src/snappkg/gone.py": "GONE = 1\n"})
    git(user_repo, "mv", "src/snappkg/before.py", "src/snappkg/after.py")  # staged, both
    git(user_repo, "rm", "-q", "src/snappkg/gone.py")
    (user_repo / "src" / "snappkg" / "__init__.py").write_text(PACKAGE + "# edited\n")
    (user_repo / "src" / "snappkg" / "extra.py").write_text("NEW = 1\n")  # untracked
    (user_repo / "src" / "snappkg" / "old.py").unlink()  # deleted, not yet committed
    (user_repo / "src" / "snappkg" / "api_secret.py").write_text("KEY = 'x'\n")
    only_git = tmp_path / "bin"
    only_git.mkdir()
    (only_git / "git").symlink_to(shutil.which("git"))
    monkeypatch.setenv("PATH", str(only_git))
    monkeypatch.syspath_prepend(str(user_repo / "src"))
    monkeypatch.setenv("PYTHONPATH", f"{user_repo / 'src'}:{REPO / 'tests'}")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    cfg = typed("+cluster=slurm", "model=custom", "model._target_=snappkg.Net")
    assert cfg.cluster.snapshot_code is True

    snap = snapshot.take(tmp_path / "sweep", [cfg])
    project = tmp_path / "sweep" / "code" / "project"
    assert snap.project == project and (project / "train" / "app.py").is_file()
    recorded, here = code.git_state(project), code.git_state(REPO)
    assert recorded is not None and here is not None
    assert (recorded["commit"], recorded["diff"]) == (here["commit"], here["diff"])
    assert code.collect({}, project).tags["code.snapshot"] == str(project)
    package = tmp_path / "sweep" / "code" / "packages" / "snappkg" / "src"
    assert (package / "snappkg" / "__init__.py").read_text().endswith("# edited\n")
    assert (package / "snappkg" / "extra.py").read_text() == "NEW = 1\n"
    assert not (package / "snappkg" / "old.py").exists()
    assert (package / "snappkg" / "after.py").read_text() == "MOVED = 1\n"
    assert not (package / "snappkg" / "before.py").exists()
    assert not (package / "snappkg" / "gone.py").exists()
    # What a job from the snapshot records: the rename as the user's tree shows it.
    recorded_diff = code.git_state(package.parent)["diff"]  # type: ignore[index]
    assert "rename from src/snappkg/before.py\nrename to src/snappkg/after.py" in recorded_diff
    assert "deleted file mode 100644" in recorded_diff.split("a/src/snappkg/gone.py")[1]
    assert not (package / "snappkg" / "api_secret.py").exists()
    assert snap.pythonpath == [str(project), str(package), str(project / "tests")]
    assert snap.setup_lines()[:2] == [
        f"export PYTHONPATH={':'.join(snap.pythonpath)}${{PYTHONPATH:+:$PYTHONPATH}}",
        "export PYTHONSAFEPATH=1"]
    assert snap.bytes > 0 and snap.seconds > 0 and not snap.reused
    # Submitted again into the same sweep directory (to resume its jobs): the same code.
    (user_repo / "src" / "snappkg" / "__init__.py").write_text(PACKAGE + "# edited again\n")
    again = snapshot.take(tmp_path / "sweep", [cfg])
    assert again.reused and again.pythonpath == snap.pythonpath
    assert (package / "snappkg" / "__init__.py").read_text().endswith("# edited\n")


def test_a_snapshot_is_refused_in_one_line_with_nothing_made(tmp_path: Path) -> None:
    from tests.conftest import typed
    from train.errors import SubmitError
    from train.launch import snapshot

    cfg = typed("+cluster=slurm")
    with pytest.raises(SubmitError, match="holds a control character: choose a plain path"):
        snapshot.take(tmp_path / "bad\nsweep", [cfg])
    assert list(tmp_path.iterdir()) == []
    (tmp_path / "sweep" / "code").mkdir(parents=True)
    with pytest.raises(SubmitError, match="exists and is no code snapshot: submit into another"):
        snapshot.take(tmp_path / "sweep", [cfg])
