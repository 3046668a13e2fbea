"""A decision head's file round trip and arithmetic, against numpy written out by hand."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ladle.heads.fit import fit_logistic, shared_prefix_len
from ladle.heads.head import DecisionHead


def test_saved_head_answers_as_the_fitted_one(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    weight = np.asfortranarray(rng.normal(size=(3, 16)))  # scikit-learn's coefficients are column-major
    head = DecisionHead(weight, rng.normal(size=3), rng.normal(size=16), rng.uniform(0.5, 2, 16), -4,
                        ["a", "b", "c"], "m", "q", 1, "mean", 7)
    head.save(tmp_path / "h.safetensors")
    loaded = DecisionHead.load(tmp_path / "h.safetensors")
    x = rng.normal(size=(5, 16))
    z = ((x - head.mean) / head.scale) @ np.asarray(weight).T + head.bias
    want = np.exp(z) / np.exp(z).sum(axis=1, keepdims=True)
    np.testing.assert_allclose(loaded.probabilities(x), want, rtol=1e-12)
    assert (loaded.layer, loaded.pooling, loaded.pool_from, loaded.labels) == (-4, "mean", 7, ["a", "b", "c"])


def test_two_option_head_is_a_softmax_over_both() -> None:
    rng = np.random.default_rng(1)
    x = np.concatenate([rng.normal(-1, 1, (40, 4)), rng.normal(1, 1, (40, 4))])
    labels = np.repeat([0, 1], 40)
    weight, bias, mean, scale = fit_logistic(x, labels, 2, 1.0)
    probs = DecisionHead(weight, bias, mean, scale, -1, ["yes", "no"], "m", "q", 1).probabilities(x)
    assert probs.shape == (80, 2) and np.allclose(probs.sum(axis=1), 1.0)
    assert (probs.argmax(axis=1) == labels).mean() > 0.8


def test_shared_prefix_is_what_every_prompt_starts_with() -> None:
    assert shared_prefix_len([[1, 2, 3, 4], [1, 2, 5], [1, 2, 3]]) == 2
    assert shared_prefix_len([[9, 8], [9, 8, 7]]) == 2
