"""The documentation cannot rot: docs/configuration.md is what the dataclasses say, every relative
link of README.md, CONTRIBUTING.md and docs/ leads to a file (and heading) that exists, and every
`python -m train ...` command they show composes with Hydra, as `--cfg job` would."""

from __future__ import annotations

import functools
import re
import shlex
from pathlib import Path

import pytest

from tests.conftest import REPO, composed
from train.__main__ import COMMANDS
from train.config import reference

PAGES = sorted([REPO / "README.md", REPO / "CONTRIBUTING.md", *(REPO / "docs").glob("*.md")])
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"```(?:bash|sh|console)\n(.*?)```", re.DOTALL)
FLAGS_WITHOUT_VALUE = {"-m", "--multirun"}
HELP = {"--help", "-h"}
FLAGS_WITH_VALUE = {"--cfg", "-c", "--package", "-p"}


def test_the_configuration_reference_is_the_dataclasses() -> None:
    page = (REPO / "docs" / "configuration.md").read_text()
    assert page == reference.render(), (
        "docs/configuration.md is stale: python -m train.config.reference > docs/configuration.md")


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation but - and _ dropped, spaces -."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    return {slug(line.lstrip("#")) for line in page.read_text().splitlines()
            if line.startswith("#")}


def relative_links() -> list[tuple[Path, str]]:
    return [(page, target) for page in PAGES for target in LINK.findall(page.read_text())
            if not re.match(r"[a-z]+:", target)]


@pytest.mark.parametrize(("page", "target"), relative_links(),
                         ids=lambda x: x.name if isinstance(x, Path) else x)
def test_every_relative_link_resolves(page: Path, target: str) -> None:
    path, _, anchor = target.partition("#")
    file = (page.parent / path).resolve() if path else page
    assert file.exists(), f"{page.name}: {target} does not exist"
    assert file.is_relative_to(REPO), f"{page.name}: {target} leaves the repository"
    if anchor:
        assert anchor in anchors(file), f"{page.name}: no heading #{anchor} in {file.name}"


def train_commands() -> list[tuple[str, str]]:
    """(page, command) for each `python -m train ...` line of a shell block (continuations
    joined), placeholders (`...`) excepted."""
    found = []
    for page in PAGES:
        for block in FENCE.findall(page.read_text()):
            for line in block.replace("\\\n", " ").splitlines():
                line = re.split(r"\s#\s", line)[0].strip()
                if re.search(r"(^|\s|/)python -m train(\s|$)|-m train(\s|$)", line) \
                        and "..." not in line and "<" not in line:
                    found.append((page.name, line))
    return found


def train_args(command: str) -> list[str]:
    """The words after `python -m train` in a shown command."""
    words = shlex.split(command.replace("$USER", "me"))
    # A command quoted inside another (`sbatch --wrap "python -m train ..."`): its own words.
    words = [w for word in words
             for w in (shlex.split(word) if " -m train" in f" {word}" else [word])]
    return words[words.index("train", words.index("-m")) + 1:]


def overrides_of(command: str) -> list[str]:
    args = train_args(command)
    if args and args[0] in COMMANDS:
        return []  # `python -m train status DIR`: a command of the command line, no job
    if HELP & set(args):
        return []  # `--help [GROUP]`: tests/unit/test_config.py runs the help itself
    out, skip = [], False
    for arg in args:
        if skip:
            skip = False
        elif arg in FLAGS_WITH_VALUE:
            skip = True
        elif arg not in FLAGS_WITHOUT_VALUE:
            out.append(arg)
    multirun = "-m" in args or "--multirun" in args
    # A sweep's comma lists: the first value of each composes as every other does.
    return [o.split("=", 1)[0] + "=" + o.split("=", 1)[1].split(",")[0]
            if multirun and "=" in o and "[" not in o else o for o in out]


def test_the_docs_show_train_commands() -> None:
    assert len(train_commands()) >= 30


@pytest.mark.parametrize(("page", "command"), train_commands(),
                         ids=[f"{p}:{c[:60]}" for p, c in train_commands()])
def test_every_train_command_shown_composes(page: str, command: str) -> None:
    from train.__main__ import unknown_command

    first = train_args(command)[:1]
    assert not (first and unknown_command(first[0])), f"{page}: {command}: no such command"
    assert _typed_config(tuple(overrides_of(command))) is not None


@functools.cache
def _typed_config(overrides: tuple[str, ...]) -> object:
    """The typed config the job gets (composed, resolved, checked against the schema), once
    per set of overrides: a fifth of the commands shown compose what another one does."""
    from train.config.schema import to_container, to_typed

    return to_typed(to_container(composed(*overrides)))
