"""ladle.calibrate: metrics on hand-worked examples; each calibrator undoes a known distortion."""

import json

import numpy as np
import pytest
from scipy.special import softmax

from ladle.calibrate import methods
from ladle.calibrate.metrics import accuracy, brier, confusion_matrix, ece, ece_equal_mass, ece_equal_width, nll


def _draw_labels(rng: np.random.Generator, probs: np.ndarray) -> np.ndarray:
    cum = probs.cumsum(axis=1)
    return np.minimum((rng.random((len(probs), 1)) > cum).sum(axis=1), probs.shape[1] - 1)


def _normalise(p: np.ndarray) -> np.ndarray:
    return p / p.sum(axis=-1, keepdims=True)


# --- metrics ---------------------------------------------------------------------

# predictions 0, 0, 1, 1 against labels 0, 1, 1, 1; top-label confidences .95 .65 .70 .85
P = np.array([[0.95, 0.05], [0.65, 0.35], [0.30, 0.70], [0.15, 0.85]])
Y = np.array([0, 1, 1, 1])


def test_accuracy_nll_brier_confusion():
    assert accuracy(P, Y) == 0.75
    assert nll(P, Y) == pytest.approx(-(np.log(0.95) + np.log(0.35) + np.log(0.70) + np.log(0.85)) / 4)
    # per row: .005 + .845 + .18 + .045
    assert brier(P, Y) == pytest.approx(1.075 / 4)
    assert confusion_matrix(P, Y).tolist() == [[1, 0], [1, 2]]


def test_nll_clips_zero_probability():
    assert nll(np.array([[1.0, 0.0]]), np.array([1])) == pytest.approx(-np.log(1e-12))


def test_ece_equal_width():
    # 2 bins: all four in (.5, 1]: accuracy .75 vs mean confidence .7875
    assert ece_equal_width(P, Y, bins=2) == pytest.approx(0.0375)
    # 4 bins: (.5, .75] holds .65 (wrong) and .70 (right): |.5 - .675| = .175;
    # (.75, 1] holds .95 and .85, both right: |1 - .9| = .1; each weighs half
    assert ece_equal_width(P, Y, bins=4) == pytest.approx(0.1375)
    assert ece(P, Y, bins=4) == ece_equal_width(P, Y, bins=4)


def test_ece_equal_mass():
    # 2 bins of two by sorted confidence: {.65, .70} and {.85, .95}, as equal-width with 4
    assert ece_equal_mass(P, Y, bins=2) == pytest.approx(0.1375)
    # 4 bins of one: (.05 + .65 + .30 + .15) / 4
    assert ece_equal_mass(P, Y, bins=4) == pytest.approx(0.2875)


# --- synthetic data ------------------------------------------------------------------


def _overconfident(seed: int, n: int, k: int = 4, scale: float = 2.5):
    """True logits, labels drawn from their softmax, scores from the logits times `scale`."""
    rng = np.random.default_rng(seed)
    logits = rng.normal(0.0, 1.5, size=(n, k))
    labels = _draw_labels(rng, softmax(logits, axis=1))
    return softmax(logits * scale, axis=1), labels


def test_temperature_recovers_scale():
    train_p, train_y = _overconfident(0, 4000)
    test_p, test_y = _overconfident(1, 4000)
    cal = methods.fit("temperature", train_p, train_y)
    assert cal.temperature == pytest.approx(2.5, rel=0.10)
    out = cal.apply(test_p)
    assert ece(out, test_y) <= 0.5 * ece(test_p, test_y)
    assert np.array_equal(out.argmax(axis=1), test_p.argmax(axis=1))


def _yes_no(seed: int, n: int, slope: float, intercept: float):
    """Labels from true log-odds z; the scores carry z' with z = slope * z' + intercept."""
    rng = np.random.default_rng(seed)
    z = rng.normal(0.0, 2.0, size=n)
    labels = (rng.random(n) < 1.0 / (1.0 + np.exp(-z))).astype(np.int64)
    yes = 1.0 / (1.0 + np.exp(-(z - intercept) / slope))
    return np.stack([1.0 - yes, yes], axis=1), labels


def test_platt_recovers_slope_and_intercept():
    probs, labels = _yes_no(2, 20000, slope=0.4, intercept=-0.8)
    cal = methods.fit("platt", probs, labels)
    assert cal.slope == pytest.approx(0.4, rel=0.10)
    assert cal.intercept == pytest.approx(-0.8, abs=0.1)


LETTER_BIAS = np.array([1.0, 0.0, -0.5, 0.3])  # e.g. a model fond of "A"


def _letter_biased(seed: int, n: int):
    rng = np.random.default_rng(seed)
    logits = rng.normal(0.0, 1.5, size=(n, 4))
    labels = _draw_labels(rng, softmax(logits, axis=1))
    return softmax(logits + LETTER_BIAS, axis=1), labels


def test_vector_recovers_letter_bias():
    train_p, train_y = _letter_biased(3, 8000)
    test_p, test_y = _letter_biased(4, 4000)
    cal = methods.fit("vector", train_p, train_y)
    # the biases undo the letter bias, up to an additive constant
    assert np.allclose(cal.biases, -(LETTER_BIAS - LETTER_BIAS.mean()), atol=0.15)
    assert np.allclose(cal.weights, 1.0, atol=0.2)
    assert nll(cal.apply(test_p), test_y) < nll(test_p, test_y) - 0.02


def _cubed(seed: int, n: int):
    rng = np.random.default_rng(seed)
    probs = softmax(rng.normal(0.0, 1.0, size=(n, 4)), axis=1)
    return _normalise(probs**3), _draw_labels(rng, probs)


def test_isotonic_undoes_monotone_distortion():
    train_p, train_y = _cubed(5, 6000)
    test_p, test_y = _cubed(6, 6000)
    cal = methods.fit("isotonic", train_p, train_y)
    out = cal.apply(test_p)
    assert np.allclose(out.sum(axis=1), 1.0)
    assert ece(out, test_y) <= 0.5 * ece(test_p, test_y)
    # a flat (useless) map is calibrated too: it must also keep the ranking's information
    assert accuracy(out, test_y) >= accuracy(test_p, test_y) - 0.02
    assert nll(out, test_y) < np.log(4) - 0.1


def test_contextual_removes_prior_exactly():
    rng = np.random.default_rng(7)
    prior = np.array([0.5, 0.2, 0.2, 0.1])
    true = softmax(rng.normal(size=(50, 4)), axis=1)
    cal = methods.fit("contextual", prior)  # a content-free input shows the bare prior
    assert np.allclose(cal.apply(_normalise(true * prior)), true, atol=1e-12)
    assert np.allclose(cal.apply(prior[None, :]), 0.25)


POSITION_PRIOR = np.array([0.4, 0.3, 0.2, 0.1])


def _shown(content: np.ndarray, perm: list[int]) -> np.ndarray:
    """Position probabilities when position i shows option perm[i]: prior x content."""
    return _normalise(POSITION_PRIOR * content[..., perm])


def test_pride_recovers_position_prior_and_improves_accuracy():
    rng = np.random.default_rng(8)
    k, perms = 4, methods.cyclic_permutations(4)
    content = softmax(rng.normal(0.0, 1.0, size=(40, k)), axis=1)
    noise = lambda shape: np.exp(rng.normal(0.0, 0.05, size=shape))  # noqa: E731
    permuted = [_normalise(np.stack([_shown(c, p) for p in perms]) * noise((k, k))) for c in content]
    cal = methods.fit("pride", permuted, perms)
    assert np.allclose(cal.prior, POSITION_PRIOR, atol=0.02)

    # other questions, shown in their original order; the answer is the content argmax-ish
    labels = rng.integers(0, k, size=3000)
    content = softmax(rng.normal(0.0, 1.0, size=(3000, k)) + 1.2 * np.eye(k)[labels], axis=1)
    observed = _shown(content, list(range(k)))
    assert accuracy(cal.apply(observed), labels) > accuracy(observed, labels) + 0.03


def test_pride_rejects_unbalanced_permutations():
    with pytest.raises(ValueError):
        methods.fit("pride", [np.full((2, 3), 1 / 3)], [[0, 1, 2], [1, 0, 2]])


# --- serialisation ----------------------------------------------------------------------


def _fitted() -> list:
    probs, labels = _overconfident(9, 500)
    yes_no, yn_labels = _yes_no(10, 500, 0.5, 0.3)
    perms = methods.cyclic_permutations(4)
    permuted = [np.stack([_shown(c, p) for p in perms]) for c in probs[:5]]
    return [
        methods.fit("temperature", probs, labels),
        methods.fit("platt", yes_no, yn_labels),
        methods.fit("vector", probs, labels),
        methods.fit("isotonic", probs, labels),
        methods.fit("contextual", probs[:3]),
        methods.fit("pride", permuted, perms),
    ]


@pytest.mark.parametrize("cal", _fitted(), ids=lambda c: type(c).__name__)
def test_json_round_trip_applies_identically(cal):
    saved = json.loads(json.dumps(cal.to_json()))
    back = methods.load(saved)
    assert type(back) is type(cal)
    rng = np.random.default_rng(11)
    k = 2 if saved["method"] == "platt" else 4
    probs = softmax(rng.normal(size=(100, k)), axis=1)
    assert np.array_equal(back.apply(probs), cal.apply(probs))


def test_unknown_method():
    with pytest.raises(ValueError):
        methods.fit("nope", None)
    with pytest.raises(ValueError):
        methods.load({"method": "nope"})


def test_calibrate_imports_no_engine():
    import subprocess
    import sys

    code = (
        "import sys, ladle.calibrate.methods, ladle.calibrate.metrics; "
        "bad = [m for m in sys.modules if m.startswith(('ladle.engine', 'ladle.model', 'ladle.server', 'torch'))]; "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
