"""The layout of train/: its wings, the one-way import rule between them, and the modules that
must stay light (docs/architecture.md, "The picture" and "The import rule").

Read from the source with `ast` alone: nothing of train/ is imported and no process is started,
so this takes well under a second and needs neither torch nor mlflow.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

WINGS = [
    "errors",
    "security",
    "config",
    "distributed",
    "models",
    "data",
    "tracking",
    "report",
    "tasks",
    "engine",
    "launch",
]
"""The wings of train/, lowest first. It mirrors docs/architecture.md ("The import rule"):
change both together. A module of a wing may import its own wing and the wings before it, never
one after it and never a root command. `errors` is the one wing that is a single module
(train/errors.py, the user-facing error hierarchy that every wing raises); every other wing is a
package, train/<wing>/."""

ROOT_COMMANDS = {"__init__", "__main__", "app", "load", "server", "outbox", "prepare_text",
                 "prepare_data", "status", "stacks", "sweep", "_moved"}
"""The only other modules at train/'s root: what users run or import (`python -m train` and
its commands - `server`, `outbox`, `prepare-text`, `prepare-data`, `status`, `stacks`,
`sweep`, each also `python -m train.<module>` - and `train.load.load_model`), and `_moved`
(old pickled class paths). They may import any wing, and another root command only as
ROOT_TO_ROOT lists (`__main__` runs a command's module by its name in its COMMANDS table, when
it is asked for)."""

ROOT_TO_ROOT = {("__main__", "app")}

OLD_PATHS = "train._moved"
"""The one root module a wing may import, and only from its __init__ and inside a function (its
module `__getattr__`): a wing that took an old module's name (train.models was a module) answers
that module's names there, for pickles that name them (train/_moved.py)."""

HEAVY = {"torch", "torchvision", "mlflow"}
"""What a light module (LIGHT) must not reach through module-level imports: mlflow's import
alone takes ~1.6 s, torch's longer."""

LIGHT = {
    "train.__main__": "`python -m train --help`, `--cfg` and a refused config answer at once",
    "train.app": "the Hydra main, imported before anything is composed",
    "train.server": "`python -m train server` execs `mlflow server`; its --help is instant",
    "train.outbox": "`python -m train outbox`: mlflow only once a request is made",
    "train.errors": "every wing imports it",
    "train.tracking": "`import train.tracking` imports neither mlflow nor torch (lazy)",
    "train.distributed.env": "read by the launcher before any rank starts",
    "train.data.imagefolder": "pre-flight scans an ImageFolder without torch",
    "train.report.modelcard": "plain data, no torch, no mlflow",
    "train.launch.local": "the local launcher: its ranks import torch in parallel, not after it",
    "train.launch.preflight": "pre-flight imports heavy parts only for the checks that need them",
    "train.launch.submit": "the login node's Slurm side",
    "train.launch.follow": "the login node, following submitted jobs",
    "train.status": "`python -m train status` reads heartbeat files on a login node",
    "train.stacks": "`python -m train stacks` signals ranks and reads their dumps",
    "train.launch.inspect": "train.status and train.stacks on a login node",
    "train.distributed.watch": "the local launcher and train.status read its files",
    "train.distributed.stacks": "train.stacks reads dumps with the standard library",
    "train.distributed.rankfiles": "train.status and train.stacks read the ranks' files with it",
    "hydra_plugins.train_launcher.local_launcher": "Hydra imports every plugin at its start",
    "hydra_plugins.train_launcher.slurm_launcher": "Hydra imports every plugin at its start",
    "hydra_plugins.train_launcher.checked_jobs": "Hydra imports every plugin at its start",
    "hydra_plugins.train_launcher.optuna_sweeper": "Hydra imports every plugin at its start",
    "hydra_plugins.train_launcher.optuna_run": "Hydra imports every plugin at its start",
    "train.sweep": "`python -m train sweep status` reads a journal file, nothing more",
    "train.launch.study": "the sweep's driver: its trials import torch, it need not",
    "train.launch.trials": "the sweep's driver: its trials import torch, it need not",
    "train.engine.trial": "the driver reads the pruner and storage from it",
}
"""Modules whose import must not reach a HEAVY module, and why. So are every wing's __init__
and every module of the security and config wings (`light_modules`)."""

LIGHT_WINGS = ("security", "config")


@dataclass(frozen=True)
class Import:
    """A module an import statement names, resolved to its dotted name."""

    file: str
    line: int
    name: str
    text: str
    runs_at_import: bool

    def where(self) -> str:
        return f"{self.file}:{self.line}"


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def project_modules(root: Path) -> dict[str, Path]:
    """train/'s modules and the project's Hydra launcher plugins, by dotted name."""
    folders = [root / "train", root / "hydra_plugins" / "train_launcher"]
    return {module_name(p, root): p for folder in folders for p in sorted(folder.rglob("*.py"))}


def statements(body: list[ast.stmt], runs: bool) -> Iterator[tuple[ast.stmt, bool]]:
    """Every statement, and whether it runs when its module is imported: at module level, in a
    class body or in an if/try/with there; not in a function or under `if TYPE_CHECKING:`."""
    for node in body:
        yield node, runs
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            yield from statements(node.body, False)
        elif isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            yield from statements(node.body, False)
            yield from statements(node.orelse, runs)
        else:
            for field in ("body", "orelse", "finalbody"):
                yield from statements(getattr(node, field, None) or [], runs)
            for child in getattr(node, "handlers", None) or getattr(node, "cases", None) or []:
                yield from statements(child.body, runs)  # except clauses, match cases


def imports(path: Path, root: Path, modules: dict[str, Path]) -> Iterator[Import]:
    """Every module a file imports, in functions too; relative imports resolved. `from p import
    name` names p, and also p.name where that is a module of the project."""
    here = module_name(path, root).split(".")
    package = here if path.name == "__init__.py" else here[:-1]
    file = str(path.relative_to(root))
    for node, runs in statements(ast.parse(path.read_text()).body, True):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package[: len(package) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            names = [base] + [f"{base}.{a.name}" for a in node.names
                              if f"{base}.{a.name}" in modules]
        else:
            continue
        for name in names:
            yield Import(file, node.lineno, name, ast.unparse(node), runs)


def wing_of(module: str) -> str | None:
    """The wing of a module of train/; None for a root command."""
    parts = module.split(".")
    if len(parts) > 2 or (len(parts) == 2 and parts[1] in WINGS):
        return parts[1]
    return None


def wrong_way_imports(root: Path) -> list[str]:
    """Every import in train/ against the import rule, as `file:line: from -> to: statement`."""
    modules = project_modules(root)
    rank = {wing: i for i, wing in enumerate(WINGS)}
    wrong = []
    for source, path in modules.items():
        if not source.startswith("train.") or source == "train":
            continue
        source_wing = wing_of(source)
        here = source_wing or source.split(".")[1]
        for item in imports(path, root, modules):
            if not item.name.startswith("train.") or item.name == source:
                continue
            if item.name not in modules:
                wrong.append(f"{item.where()}: no such module {item.name}: {item.text}")
                continue
            if item.name == OLD_PATHS and path.name == "__init__.py" and not item.runs_at_import:
                continue
            target_wing = wing_of(item.name)
            there = target_wing or item.name.split(".")[1]
            if source_wing is None:
                if target_wing is None and (here, there) not in ROOT_TO_ROOT:
                    wrong.append(f"{item.where()}: root {here} -> root {there}: {item.text}")
            elif target_wing is None:
                wrong.append(f"{item.where()}: {here} -> root command {there}: {item.text}")
            elif rank[target_wing] > rank[source_wing]:
                wrong.append(f"{item.where()}: {here} -> {there}: {item.text}")
    return list(dict.fromkeys(wrong))  # `from train.x import y` names train.x and train.x.y


def heavy_chain(start: str, root: Path, modules: dict[str, Path]) -> list[str] | None:
    """The first chain of imports run by importing `start` that reaches a HEAVY module, one
    `module (file:line)` a step; None if none does. Importing a.b.c runs a, a.b and a.b.c."""
    seen: set[str] = set()
    queue = [(start, [start])]
    while queue:
        name, chain = queue.pop(0)
        parts = name.split(".")
        for module in (".".join(parts[:i]) for i in range(1, len(parts) + 1)):
            if module in seen or module not in modules:
                continue
            seen.add(module)
            for item in imports(modules[module], root, modules):
                if not item.runs_at_import:
                    continue
                step = [*chain, f"{item.name} ({item.where()})"]
                if item.name.split(".")[0] in HEAVY:
                    return step
                if item.name in modules:
                    queue.append((item.name, step))
    return None


def light_modules(root: Path) -> dict[str, str]:
    light = dict(LIGHT)
    for wing in WINGS[1:]:
        light[f"train.{wing}"] = "a wing's __init__ runs with every module of the wing"
    for wing in LIGHT_WINGS:
        for path in sorted((root / "train" / wing).glob("*.py")):
            light.setdefault(module_name(path, root), f"the {wing} wing needs no torch, no mlflow")
    return light


def test_every_import_in_train_goes_down_the_wings() -> None:
    wrong = wrong_way_imports(REPO)
    assert not wrong, (
        f"{len(wrong)} import(s) against the import rule: a wing's module imports its own wing "
        f"and those before it in {WINGS}, never a root command (docs/architecture.md, "
        "\"The import rule\"):\n" + "\n".join(wrong))


def test_train_holds_only_its_wings_and_root_commands() -> None:
    package = REPO / "train"
    strays = []
    for path in sorted(package.rglob("*.py")):
        parts = path.relative_to(package).parts
        if len(parts) == 1 and path.stem not in ROOT_COMMANDS | {"errors"}:
            strays.append(f"train/{parts[0]}: a module at the root that is no root command")
        elif len(parts) > 1 and (parts[0] not in WINGS or parts[0] == "errors"):
            strays.append(f"{path.relative_to(REPO)}: in a package that is no wing")
    for wing in WINGS:
        expected = package / ("errors.py" if wing == "errors" else f"{wing}/__init__.py")
        if not expected.is_file():
            strays.append(f"{expected.relative_to(REPO)}: missing")
    assert not strays, "train/ differs from its wings and root commands:\n" + "\n".join(strays)


def test_a_wing_package_imports_only_its_own_modules() -> None:
    """A wing's __init__ runs whenever any module of the wing is imported. It says what the
    wing holds, and may re-export the wing's own names (train.tracking does) but import nothing
    else, so that no module drags another wing in through its package. That the re-exported
    modules stay light is test_light_modules_import_neither_torch_nor_mlflow's."""
    modules = project_modules(REPO)
    wrong = []
    for wing in WINGS[1:]:
        init = REPO / "train" / wing / "__init__.py"
        if not init.is_file():
            continue  # test_train_holds_only_its_wings_and_root_commands reports it
        if ast.get_docstring(ast.parse(init.read_text())) is None:
            wrong.append(f"{init.relative_to(REPO)}: no docstring saying what the wing holds")
        for item in imports(init, REPO, modules):
            own = item.name == f"train.{wing}" or item.name.startswith(f"train.{wing}.")
            if item.runs_at_import and not own and item.name != "__future__":
                wrong.append(f"{item.where()}: {item.text}")
    assert not wrong, "a wing's __init__ goes beyond the wing:\n" + "\n".join(wrong)


def test_light_modules_import_neither_torch_nor_mlflow() -> None:
    modules = project_modules(REPO)
    heavy = []
    for module, why in sorted(light_modules(REPO).items()):
        if module not in modules:
            heavy.append(f"{module}: no such module (listed as light: {why})")
        elif chain := heavy_chain(module, REPO, modules):
            heavy.append(f"{module} ({why}):\n    " + "\n    -> ".join(chain))
    assert not heavy, (
        f"a module that must stay light reaches {sorted(HEAVY)} through module-level imports "
        "(import them inside the function that needs them):\n" + "\n".join(heavy))


def test_the_checks_see_every_kind_of_import(tmp_path: Path) -> None:
    """The walker on a made-up train/: absolute, `from train import x`, relative, in-function
    and TYPE_CHECKING imports all count for the rule; only what runs at import for lightness."""
    for folder in ("train", "train/engine", "train/launch", "train/report"):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "__init__.py").write_text('"""A wing."""\n')
    for root_command in ("app", "_moved"):
        (tmp_path / "train" / f"{root_command}.py").write_text("")
    (tmp_path / "train" / "report" / "__init__.py").write_text(
        "def __getattr__(name):\n    from train._moved import old_name\n")
    (tmp_path / "train" / "launch" / "submit.py").write_text("import torch\n")
    (tmp_path / "train" / "report" / "runlog.py").write_text("")
    (tmp_path / "train" / "engine" / "loop.py").write_text(
        "from ..report import runlog\nfrom train._moved import old_name\n")
    (tmp_path / "train" / "engine" / "job.py").write_text(
        "from typing import TYPE_CHECKING\n"
        "import train.launch.submit\n"
        "from train import launch\n"
        "from . import loop\n"
        "if TYPE_CHECKING:\n"
        "    from ..launch.submit import Job\n"
        "def run():\n"
        "    from train.app import main\n"
        "    import train.report.gone\n")
    modules = project_modules(tmp_path)
    found = [(i.line, i.name, i.runs_at_import)
             for i in imports(modules["train.engine.job"], tmp_path, modules)]
    assert found == [(1, "typing", True), (2, "train.launch.submit", True), (3, "train", True),
                     (3, "train.launch", True), (4, "train.engine", True),
                     (4, "train.engine.loop", True), (6, "train.launch.submit", False),
                     (8, "train.app", False), (9, "train.report.gone", False)]
    job = "train/engine/job.py"
    assert wrong_way_imports(tmp_path) == [
        f"{job}:2: engine -> launch: import train.launch.submit",
        f"{job}:3: engine -> launch: from train import launch",
        f"{job}:6: engine -> launch: from ..launch.submit import Job",
        f"{job}:8: engine -> root command app: from train.app import main",
        f"{job}:9: no such module train.report.gone: import train.report.gone",
        "train/engine/loop.py:2: engine -> root command _moved: from train._moved import old_name"]
    assert heavy_chain("train.engine.loop", tmp_path, modules) is None
    assert heavy_chain("train.engine.job", tmp_path, modules) == [
        "train.engine.job", f"train.launch.submit ({job}:2)", "torch (train/launch/submit.py:1)"]
