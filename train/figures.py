"""What the final validation looks like for a person: confusion matrix and per-class accuracy."""

from __future__ import annotations

from pathlib import Path


def per_class_accuracy(confusion: list[list[int]], class_names: list[str]) -> dict[str, list]:
    """Columns of the per-class table: class, samples, correct, accuracy."""
    rows = [(name, sum(row), row[i])
            for i, (name, row) in enumerate(zip(class_names, confusion, strict=True))]
    return {"class": [r[0] for r in rows], "samples": [r[1] for r in rows],
            "correct": [r[2] for r in rows],
            "accuracy": [r[2] / r[1] if r[1] else float("nan") for r in rows]}


def render_confusion(confusion: list[list[int]], class_names: list[str], path: Path) -> Path:
    """A labelled confusion-matrix heat map (rows: true class, columns: predicted) as PNG."""
    import matplotlib

    matplotlib.use("Agg")  # no display on compute nodes
    import matplotlib.pyplot as plt

    n = len(class_names)
    size = max(4.0, 0.45 * n + 2)
    fig, ax = plt.subplots(figsize=(size + 1, size), dpi=100)
    image = ax.imshow(confusion, cmap="Blues")
    fig.colorbar(image, ax=ax, fraction=0.046, pad=0.04)
    ax.set_xticks(range(n), class_names, rotation=90 if n > 10 else 0)
    ax.set_yticks(range(n), class_names)
    ax.set_xlabel("predicted class")
    ax.set_ylabel("true class")
    total = sum(map(sum, confusion))
    correct = sum(confusion[i][i] for i in range(n))
    ax.set_title(f"validation: {correct}/{total} correct")
    if n <= 20:
        peak = max(max(row) for row in confusion) or 1
        for i, row in enumerate(confusion):
            for j, value in enumerate(row):
                if value:
                    ax.text(j, i, str(value), ha="center", va="center", fontsize=8,
                            color="white" if value > peak / 2 else "black")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path
