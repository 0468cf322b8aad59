"""The final validation's figures for a person: per-class table and confusion-matrix SVG."""

from __future__ import annotations

import math
import xml.etree.ElementTree as ET
from pathlib import Path

from train.report import figures

SVG = "{http://www.w3.org/2000/svg}"


def test_per_class_accuracy_reads_rows_as_true_classes() -> None:
    confusion = [[8, 2, 0],
                 [1, 3, 0],
                 [0, 0, 0]]  # class "c" has no validation sample
    table = figures.per_class_accuracy(confusion, ["a", "b", "c"])
    assert table["class"] == ["a", "b", "c"]
    assert table["samples"] == [10, 4, 0]
    assert table["correct"] == [8, 3, 0]
    assert table["accuracy"][:2] == [0.8, 0.75]
    assert math.isnan(table["accuracy"][2])  # unknown, not 0% and not a ZeroDivisionError
    assert len({len(column) for column in table.values()}) == 1


def _cells(root: ET.Element) -> list[ET.Element]:
    return [r for r in root.iter(f"{SVG}rect") if r.get("stroke")]


def test_the_svg_is_valid_xml_with_one_cell_per_count(tmp_path: Path) -> None:
    confusion = [[5, 1, 0, 0], [0, 7, 2, 0], [1, 0, 9, 0], [0, 0, 0, 3]]
    names = ["zero", "one", "two", "three"]
    path = figures.render_confusion(confusion, names, tmp_path / "cm.svg")
    assert path == tmp_path / "cm.svg"
    root = ET.parse(path).getroot()  # raises on malformed XML
    assert root.tag == f"{SVG}svg"
    cells = _cells(root)
    assert len(cells) == 16
    texts = [t.text for t in root.iter(f"{SVG}text")]
    assert "validation: 24/28 correct" in texts
    assert texts.count("three") == 2  # a column label and a row label
    # Every non-zero count is written in its cell; zero cells stay blank.
    assert sorted(int(t) for t in texts if t and t.isdigit()) == sorted(
        v for row in confusion for v in row if v)
    # The largest count is the darkest cell, an empty one the lightest.
    fills = {(int(c.get("x")), int(c.get("y"))): c.get("fill") for c in cells}
    left, top, cell = figures.LEFT, figures.TOP, figures.CELL
    assert fills[(left + 2 * cell, top + 2 * cell)] == "#08306b"  # 9, the peak
    assert fills[(left + 3 * cell, top)] == "#f7fbff"  # 0
    width, height = int(root.get("width")), int(root.get("height"))
    assert all(int(c.get("x")) + cell <= width and int(c.get("y")) + cell <= height
               for c in cells)


def test_class_names_are_escaped_and_shortened(tmp_path: Path) -> None:
    names = ["<cat & dog>", 'say "hi"', "a-very-long-class-name"]
    path = figures.render_confusion([[1, 0, 0], [0, 1, 0], [0, 0, 1]], names,
                                    tmp_path / "cm.svg")
    raw = path.read_text()
    assert "<cat" not in raw and "&lt;cat &amp; dog&gt;" in raw
    root = ET.parse(path).getroot()
    texts = {t.text for t in root.iter(f"{SVG}text")}
    assert {"<cat & dog>", 'say "hi"', "a-very-long-"} <= texts
    assert len(_cells(root)) == 9


def test_an_all_zero_matrix_still_draws(tmp_path: Path) -> None:
    path = figures.render_confusion([[0, 0], [0, 0]], ["a", "b"], tmp_path / "cm.svg")
    root = ET.parse(path).getroot()
    assert len(_cells(root)) == 4
    assert "validation: 0/0 correct" in {t.text for t in root.iter(f"{SVG}text")}
