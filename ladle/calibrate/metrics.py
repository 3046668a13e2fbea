"""Calibration metrics for probability matrices P [n, k] (rows sum to 1) and labels y [n]."""

from __future__ import annotations

from typing import Literal

import numpy as np

EPS = 1e-12


def _check(probs: np.ndarray, labels: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    probs = np.asarray(probs, dtype=np.float64)
    labels = np.asarray(labels, dtype=np.int64)
    if probs.ndim != 2 or labels.shape != (probs.shape[0],):
        raise ValueError(f"expected probs [n, k] and labels [n], got {probs.shape} and {labels.shape}")
    return probs, labels


def accuracy(probs: np.ndarray, labels: np.ndarray) -> float:
    probs, labels = _check(probs, labels)
    return float(np.mean(probs.argmax(axis=1) == labels))


def nll(probs: np.ndarray, labels: np.ndarray) -> float:
    """Mean negative log-likelihood of the labels, probabilities clipped at 1e-12."""
    probs, labels = _check(probs, labels)
    picked = probs[np.arange(len(labels)), labels]
    return float(-np.mean(np.log(np.clip(picked, EPS, 1.0))))


def brier(probs: np.ndarray, labels: np.ndarray) -> float:
    """Multi-class Brier score: mean over examples of sum over classes of (p - onehot)^2."""
    probs, labels = _check(probs, labels)
    onehot = np.eye(probs.shape[1])[labels]
    return float(np.mean(np.sum((probs - onehot) ** 2, axis=1)))


def _bin_ids(conf: np.ndarray, bins: int, binning: str) -> np.ndarray:
    if binning == "width":
        # bins are (lo, hi]; a confidence of exactly 0 goes to the first bin
        return np.clip(np.ceil(conf * bins).astype(np.int64) - 1, 0, bins - 1)
    if binning == "mass":
        ids = np.empty(len(conf), dtype=np.int64)
        for b, chunk in enumerate(np.array_split(np.argsort(conf, kind="stable"), bins)):
            ids[chunk] = b
        return ids
    raise ValueError(f"unknown binning {binning!r} (expected 'width' or 'mass')")


def ece(
    probs: np.ndarray,
    labels: np.ndarray,
    bins: int = 15,
    binning: Literal["width", "mass"] = "width",
) -> float:
    """Expected calibration error of the top-label confidence.

    Sum over bins of |accuracy - mean confidence| weighted by the bin's share of
    examples. "width": equal-width bins on [0, 1]; "mass": bins holding (nearly)
    equal numbers of examples, by sorted confidence.
    """
    probs, labels = _check(probs, labels)
    conf = probs.max(axis=1)
    correct = (probs.argmax(axis=1) == labels).astype(np.float64)
    ids = _bin_ids(conf, bins, binning)
    total = 0.0
    for b in np.unique(ids):
        in_bin = ids == b
        total += in_bin.mean() * abs(correct[in_bin].mean() - conf[in_bin].mean())
    return float(total)


def ece_equal_width(probs: np.ndarray, labels: np.ndarray, bins: int = 15) -> float:
    return ece(probs, labels, bins, "width")


def ece_equal_mass(probs: np.ndarray, labels: np.ndarray, bins: int = 15) -> float:
    return ece(probs, labels, bins, "mass")


def confusion_matrix(probs: np.ndarray, labels: np.ndarray) -> np.ndarray:
    """Counts [k, k]: row = true label, column = predicted (argmax) option."""
    probs, labels = _check(probs, labels)
    k = probs.shape[1]
    out = np.zeros((k, k), dtype=np.int64)
    np.add.at(out, (labels, probs.argmax(axis=1)), 1)
    return out
