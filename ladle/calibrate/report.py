"""Before/after figures on held-out data: the numbers of report.json and the reliability diagram."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from ladle.calibrate import metrics

BINS = 15


def evaluate(probs: np.ndarray, labels: np.ndarray, options: list[str]) -> dict[str, Any]:
    return {
        "accuracy": metrics.accuracy(probs, labels),
        "nll": metrics.nll(probs, labels),
        "brier": metrics.brier(probs, labels),
        "ece": metrics.ece_equal_width(probs, labels, BINS),
        "ece_equal_mass": metrics.ece_equal_mass(probs, labels, BINS),
        "confusion": {"labels": options, "rows_true_columns_chosen": metrics.confusion_matrix(probs, labels).tolist()},
    }


def label_mass_summary(label_mass: np.ndarray) -> dict[str, float]:
    """How much of the model's next-token probability fell on the option labels; answers far
    below the usual mass are ones the model did not read as this question. The suggested floor
    is the 5th percentile: below it, treat an answer as unreliable."""
    q = np.nanquantile(label_mass, [0.0, 0.05, 0.25, 0.5, 0.75, 1.0])
    return {"min": q[0], "p5": q[1], "p25": q[2], "median": q[3], "p75": q[4], "max": q[5], "suggested_floor": q[1]}


def reliability_png(path: Path, labels: np.ndarray, before: np.ndarray, after: np.ndarray, title: str,
                    points: int = 8) -> None:
    """Top-label confidence against accuracy, before and after, on one figure: each point is an
    equal share of the examples (sorted by confidence), so no point stands for one or two."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 5))
    ax.plot([0, 1], [0, 1], color="grey", linestyle=":", label="perfect calibration")
    for name, probs in (("before", before), ("after", after)):
        conf, correct = probs.max(axis=1), probs.argmax(axis=1) == labels
        groups = np.array_split(np.argsort(conf, kind="stable"), min(points, len(conf)))
        xs, ys = [conf[g].mean() for g in groups], [correct[g].mean() for g in groups]
        ece = metrics.ece_equal_width(probs, labels, BINS)
        ax.plot(xs, ys, marker="o", label=f"{name} (ECE {ece:.3f})")
    ax.set(xlabel="confidence (top option's probability)", ylabel=f"accuracy ({points} equal-count groups)",
           xlim=(0, 1), ylim=(0, 1), title=title)
    ax.legend(loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
