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


PHASE_COLOURS = {"data": "#d62728", "forward": "#1f77b4", "backward": "#6baed6",
                 "optimizer": "#2ca02c", "collective": "#ff7f0e", "other": "#bdbdbd"}
"""Waiting for data in red: the share to look for first."""


def render_breakdown(totals: list[list[float]], phases: tuple[str, ...], path: Path,
                     title: str) -> Path:
    """One stacked bar per rank of where its training time went (`totals`: each rank's
    seconds per phase, in `phases` order), as SVG: a starving or straggling rank stands out."""
    left, bar, row, top = 64, 480, 20, 56
    width, height = left + bar + 96, top + row * len(totals) + 16
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
           f'viewBox="0 0 {width} {height}" font-family="sans-serif" font-size="11">',
           f'<rect width="{width}" height="{height}" fill="white"/>',
           f'<text x="{width / 2}" y="16" text-anchor="middle" font-size="13">'
           f'{escape(title)}</text>']
    x = left
    for phase in phases:  # the legend
        out += [f'<rect x="{x}" y="28" width="10" height="10" fill="{PHASE_COLOURS[phase]}"/>',
                f'<text x="{x + 14}" y="37">{phase}</text>']
        x += 14 + 7 * len(phase) + 16
    for rank, seconds in enumerate(totals):
        y, total = top + rank * row, sum(seconds) or 1.0
        out.append(f'<text x="{left - 6}" y="{y + 13}" text-anchor="end">rank {rank}</text>')
        x = float(left)
        for phase, spent in zip(phases, seconds, strict=True):
            w = bar * spent / total
            out.append(f'<rect x="{x:.1f}" y="{y + 2}" width="{w:.1f}" height="{row - 4}" '
                       f'fill="{PHASE_COLOURS[phase]}"><title>rank {rank} {phase}: '
                       f'{spent:.2f} s ({spent / total:.0%})</title></rect>')
            x += w
        out.append(f'<text x="{left + bar + 6}" y="{y + 13}">{sum(seconds):.1f} s</text>')
    out.append("</svg>")
    path.write_text("\n".join(out) + "\n")
    return path
