"""From label log-probabilities to the numbers every dialect reports.

All arithmetic is float64 Python floats in a fixed order, so the same log-probabilities give
bit-identical probabilities here and in /v1/score (a stored decision replays exactly).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ladle.server.errors import APIError


def check_finite(logprobs: list[float]) -> None:
    """NaN, +inf, or nothing but -inf: a server fault (500), never a NaN in JSON."""
    if any(math.isnan(x) or x == math.inf for x in logprobs) or all(x == -math.inf for x in logprobs):
        raise APIError(500, "the model produced a non-finite score for this request", type="server_error",
                       code="non_finite_score")


def label_softmax(logprobs: list[float], temperature: float) -> list[float]:
    """Softmax over the labels only, of the log-probabilities divided by the temperature."""
    check_finite(logprobs)
    top = max(logprobs)
    weights = [math.exp((x - top) / temperature) for x in logprobs]  # the best label weighs exactly 1
    total = math.fsum(weights)
    probs = [w / total for w in weights]
    if not all(math.isfinite(p) for p in probs):
        raise APIError(500, "the model produced a non-finite score for this request", type="server_error",
                       code="non_finite_score")
    return probs


def full_vocab_probs(logprobs: list[float]) -> list[float]:
    check_finite(logprobs)
    return [math.exp(x) for x in logprobs]


@dataclass
class LabelScores:
    """One question's label log-probabilities (full vocabulary, temperature 1) and what follows from them."""

    logprobs: list[float]
    probabilities: list[float]  # label softmax at the request's temperature
    label_mass: float  # raw probability of all labels together, at temperature 1

    @classmethod
    def of(cls, logprobs: list[float], temperature: float = 1.0) -> "LabelScores":
        probs = label_softmax(logprobs, temperature)
        mass = min(1.0, math.fsum(full_vocab_probs(logprobs)))
        return cls(list(logprobs), probs, mass)

    @property
    def best(self) -> int:
        """Index of the most probable label (the first of equals)."""
        return max(range(len(self.probabilities)), key=lambda i: (self.probabilities[i], -i))

    @property
    def mean_index(self) -> float:
        """Probability-weighted mean of the zero-based label index (a score's value)."""
        return math.fsum(i * p for i, p in enumerate(self.probabilities))

    def raw_probability(self, i: int) -> float:
        """Label i's probability over the full vocabulary (uncalibrated)."""
        return math.exp(self.logprobs[i])


def choice_confidence(probs: list[float]) -> float:
    """System One: how far the top probability q stands above uniform, clamp((n q - 1) / (n - 1), 0, 1)."""
    n = len(probs)
    if n == 1:
        return 1.0
    return min(1.0, max(0.0, (n * max(probs) - 1.0) / (n - 1)))


def score_confidence(probs: list[float]) -> float:
    """System One: 1 - S/U, S the expected distance from the top level, U the same for a uniform spread."""
    n = len(probs)
    top = max(range(n), key=lambda i: (probs[i], -i))
    spread = math.fsum(p * abs(i - top) for i, p in enumerate(probs))
    uniform = math.fsum(abs(i - top) for i in range(n)) / n
    if uniform == 0.0:
        return 1.0
    return max(0.0, 1.0 - spread / uniform)
