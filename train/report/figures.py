"""What the final validation looks like for a person: confusion matrix and per-class accuracy.

The confusion matrix is drawn as SVG by hand: the MLflow UI shows SVG artifacts as images, and
rank 0 then needs no plotting library (matplotlib would add ~1 s and ~30 MB to it).
"""

from __future__ import annotations

from html import escape
from pathlib import Path

CELL, LEFT, TOP, RIGHT, BOTTOM = 34, 96, 56, 16, 40
# Light to dark blue ("Blues"), interpolated by a cell's share of the largest count.
LIGHT, DARK = (247, 251, 255), (8, 48, 107)


def per_class_accuracy(confusion: list[list[int]], class_names: list[str]) -> dict[str, list]:
    """Columns of the per-class table: class, samples, correct, accuracy."""
    rows = [(name, sum(row), row[i])
            for i, (name, row) in enumerate(zip(class_names, confusion, strict=True))]
    return {"class": [r[0] for r in rows], "samples": [r[1] for r in rows],
            "correct": [r[2] for r in rows],
            "accuracy": [r[2] / r[1] if r[1] else float("nan") for r in rows]}


def _shade(share: float) -> str:
    rgb = (round(a + (b - a) * share) for a, b in zip(LIGHT, DARK, strict=True))
    return "#{:02x}{:02x}{:02x}".format(*rgb)


def render_confusion(confusion: list[list[int]], class_names: list[str], path: Path) -> Path:
    """A labelled confusion-matrix heat map (rows: true class, columns: predicted), as SVG."""
    n = len(class_names)
    width, height = LEFT + n * CELL + RIGHT, TOP + n * CELL + BOTTOM
    total = sum(map(sum, confusion))
    correct = sum(confusion[i][i] for i in range(n))
    peak = max((max(row) for row in confusion), default=0) or 1
    labels = [escape(name[:12]) for name in class_names]
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
           f'viewBox="0 0 {width} {height}" font-family="sans-serif" font-size="11">',
           f'<rect width="{width}" height="{height}" fill="white"/>',
           f'<text x="{LEFT + n * CELL / 2}" y="18" text-anchor="middle" font-size="13">'
           f'validation: {correct}/{total} correct</text>',
           f'<text x="{LEFT + n * CELL / 2}" y="{height - 8}" text-anchor="middle">'
           'predicted class</text>',
           f'<text transform="translate(14 {TOP + n * CELL / 2}) rotate(-90)" '
           'text-anchor="middle">true class</text>']
    for i, name in enumerate(labels):
        centre = i * CELL + CELL / 2
        out.append(f'<text x="{LEFT + centre}" y="{TOP - 6}" text-anchor="middle">{name}</text>')
        out.append(f'<text x="{LEFT - 6}" y="{TOP + centre + 4}" text-anchor="end">{name}</text>')
    for i, row in enumerate(confusion):
        for j, value in enumerate(row):
            x, y = LEFT + j * CELL, TOP + i * CELL
            share = value / peak
            out.append(f'<rect x="{x}" y="{y}" width="{CELL}" height="{CELL}" '
                       f'fill="{_shade(share)}" stroke="#dddddd"/>')
            if value and n <= 30:
                colour = "white" if share > 0.5 else "black"
                out.append(f'<text x="{x + CELL / 2}" y="{y + CELL / 2 + 4}" '
                           f'text-anchor="middle" fill="{colour}">{value}</text>')
    out.append("</svg>")
    path.write_text("\n".join(out) + "\n")
    return path


def render_scatter(points: list[tuple[float, float]], path: Path, title: str,
                   size: int = 360) -> Path:
    """Predicted against true values (x: true, y: predicted) with the diagonal, as SVG."""
    margin = 48
    values = [v for point in points for v in point]
    low, high = min(values), max(values)
    span = (high - low) or 1.0

    def at(value: float, flip: bool) -> float:
        share = (value - low) / span
        return round(margin + (1 - share if flip else share) * (size - 2 * margin), 1)

    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{size}" height="{size}" '
           f'viewBox="0 0 {size} {size}" font-family="sans-serif" font-size="11">',
           f'<rect width="{size}" height="{size}" fill="white"/>',
           f'<text x="{size / 2}" y="18" text-anchor="middle" font-size="13">'
           f'validation: {escape(title)} ({len(points)} values)</text>',
           f'<line x1="{at(low, False)}" y1="{at(low, True)}" x2="{at(high, False)}" '
           f'y2="{at(high, True)}" stroke="#999999" stroke-dasharray="4 3"/>',
           f'<text x="{size / 2}" y="{size - 10}" text-anchor="middle">true value '
           f'({low:.3g} to {high:.3g})</text>',
           f'<text transform="translate(14 {size / 2}) rotate(-90)" '
           'text-anchor="middle">predicted value</text>']
    out += [f'<circle cx="{at(t, False)}" cy="{at(p, True)}" r="2" fill="#1f5fa8" '
            'fill-opacity="0.6"/>' for t, p in points]
    out.append("</svg>")
    path.write_text("\n".join(out) + "\n")
    return path
