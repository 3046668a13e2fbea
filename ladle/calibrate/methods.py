"""Post-hoc calibrators for option probabilities.

Every fit returns a small dataclass with `apply(probs) -> probs` (P [n, k] in,
rows summing to 1 out) and `to_json()` / `from_json()` over a plain dict with a
`method` key, so a fitted calibrator can be saved as a small JSON file and
brought back with `load()`. Fits take probabilities; option scores that are raw
log-probabilities (which need not sum to 1 over the options) go through
`probs_from_logprobs` first.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Protocol, Sequence

import numpy as np
from scipy.optimize import minimize, minimize_scalar
from scipy.special import log_softmax, softmax

EPS = 1e-12


class Calibrator(Protocol):
    def apply(self, probs: np.ndarray) -> np.ndarray: ...

    def to_json(self) -> dict[str, Any]: ...


def probs_from_logprobs(logprobs: np.ndarray) -> np.ndarray:
    """Renormalise option log-probabilities [n, k] into probabilities over the options."""
    return softmax(np.asarray(logprobs, dtype=np.float64), axis=-1)


def _log(probs: np.ndarray) -> np.ndarray:
    return np.log(np.clip(np.asarray(probs, dtype=np.float64), EPS, 1.0))


def _normalise(weights: np.ndarray, fallback: np.ndarray) -> np.ndarray:
    """Rows divided by their sum; a row with nothing left keeps its fallback row."""
    sums = weights.sum(axis=-1, keepdims=True)
    ok = sums > 0
    return np.where(ok, weights / np.where(ok, sums, 1.0), fallback)


def _divide_out(probs: np.ndarray, prior: Sequence[float]) -> np.ndarray:
    """Rows divided by a prior over the options, renormalised (contextual calibration, PriDe)."""
    probs = np.asarray(probs, dtype=np.float64)
    return _normalise(probs / np.asarray(prior), fallback=probs)


def _nll_of_logits(logits: np.ndarray, labels: np.ndarray) -> float:
    return float(-np.mean(log_softmax(logits, axis=1)[np.arange(len(labels)), labels]))


# --- temperature -------------------------------------------------------------


@dataclass
class TemperatureScaling:
    temperature: float

    def apply(self, probs: np.ndarray) -> np.ndarray:
        return softmax(_log(probs) / self.temperature, axis=-1)

    def to_json(self) -> dict[str, Any]:
        return {"method": "temperature", "temperature": float(self.temperature)}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> TemperatureScaling:
        return cls(float(d["temperature"]))


def fit_temperature(
    probs: np.ndarray, labels: np.ndarray, bounds: tuple[float, float] = (0.05, 20.0)
) -> TemperatureScaling:
    """One T > 0 minimising NLL of softmax(log p / T); T > 0 never changes the argmax."""
    logp, labels = _log(probs), np.asarray(labels)
    res = minimize_scalar(
        lambda log_t: _nll_of_logits(logp / np.exp(log_t), labels),
        bounds=(np.log(bounds[0]), np.log(bounds[1])),
        method="bounded",
    )
    return TemperatureScaling(float(np.exp(res.x)))


# --- Platt ---------------------------------------------------------------------


@dataclass
class PlattScaling:
    """Binary: column 1 is the positive ("yes") option, column 0 the negative one."""

    slope: float
    intercept: float

    def apply(self, probs: np.ndarray) -> np.ndarray:
        logp = _log(probs)
        z = self.slope * (logp[:, 1] - logp[:, 0]) + self.intercept
        yes = 1.0 / (1.0 + np.exp(-z))
        return np.stack([1.0 - yes, yes], axis=1)

    def to_json(self) -> dict[str, Any]:
        return {"method": "platt", "slope": float(self.slope), "intercept": float(self.intercept)}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> PlattScaling:
        return cls(float(d["slope"]), float(d["intercept"]))


def fit_platt(probs: np.ndarray, labels: np.ndarray) -> PlattScaling:
    """Logistic regression of the label on the single log-odds feature log p1 - log p0."""
    from sklearn.linear_model import LogisticRegression

    logp = _log(probs)
    if logp.shape[1] != 2:
        raise ValueError(f"platt needs two options (no, yes), got {logp.shape[1]}")
    log_odds = (logp[:, 1] - logp[:, 0]).reshape(-1, 1)
    model = LogisticRegression(C=1e6, max_iter=1000)  # large C: next to no regularisation
    model.fit(log_odds, np.asarray(labels))
    return PlattScaling(float(model.coef_[0, 0]), float(model.intercept_[0]))


# --- vector --------------------------------------------------------------------


@dataclass
class VectorScaling:
    weights: list[float]
    biases: list[float]

    def apply(self, probs: np.ndarray) -> np.ndarray:
        return softmax(np.asarray(self.weights) * _log(probs) + np.asarray(self.biases), axis=-1)

    def to_json(self) -> dict[str, Any]:
        return {"method": "vector", "weights": list(self.weights), "biases": list(self.biases)}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> VectorScaling:
        return cls([float(w) for w in d["weights"]], [float(b) for b in d["biases"]])


def fit_vector(probs: np.ndarray, labels: np.ndarray) -> VectorScaling:
    """A weight and a bias per option on log p, minimising NLL with L-BFGS-B."""
    logp, labels = _log(probs), np.asarray(labels)
    n, k = logp.shape
    onehot = np.eye(k)[labels]

    def loss_and_grad(theta: np.ndarray) -> tuple[float, np.ndarray]:
        w, b = theta[:k], theta[k:]
        logq = log_softmax(w * logp + b, axis=1)
        dz = (np.exp(logq) - onehot) / n
        return -np.sum(logq * onehot) / n, np.concatenate([(dz * logp).sum(0), dz.sum(0)])

    res = minimize(loss_and_grad, np.concatenate([np.ones(k), np.zeros(k)]), jac=True, method="L-BFGS-B")
    w, b = res.x[:k], res.x[k:]
    # biases are only defined up to an additive constant: store them centred
    return VectorScaling(w.tolist(), (b - b.mean()).tolist())


# --- isotonic --------------------------------------------------------------------


@dataclass
class IsotonicCalibration:
    """One-vs-rest isotonic maps, one per option: (x, y) knots, linear in between, clipped."""

    knots_x: list[list[float]]
    knots_y: list[list[float]]

    def apply(self, probs: np.ndarray) -> np.ndarray:
        probs = np.asarray(probs, dtype=np.float64)
        mapped = np.stack(
            [np.interp(probs[:, j], self.knots_x[j], self.knots_y[j]) for j in range(probs.shape[1])],
            axis=1,
        )
        return _normalise(mapped, fallback=probs)

    def to_json(self) -> dict[str, Any]:
        return {"method": "isotonic", "knots_x": self.knots_x, "knots_y": self.knots_y}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> IsotonicCalibration:
        return cls([list(map(float, x)) for x in d["knots_x"]], [list(map(float, y)) for y in d["knots_y"]])


def fit_isotonic(probs: np.ndarray, labels: np.ndarray) -> IsotonicCalibration:
    from sklearn.isotonic import IsotonicRegression

    probs, labels = np.asarray(probs, dtype=np.float64), np.asarray(labels)
    xs, ys = [], []
    for j in range(probs.shape[1]):
        iso = IsotonicRegression(y_min=0.0, y_max=1.0, out_of_bounds="clip")
        iso.fit(probs[:, j], (labels == j).astype(np.float64))
        # predict() interpolates linearly between these knots and clips outside them,
        # exactly what np.interp does in apply()
        xs.append(iso.X_thresholds_.tolist())
        ys.append(iso.y_thresholds_.tolist())
    return IsotonicCalibration(xs, ys)


# --- contextual (Zhao et al. 2021) ------------------------------------------------


@dataclass
class ContextualCalibration:
    content_free: list[float]

    def apply(self, probs: np.ndarray) -> np.ndarray:
        return _divide_out(probs, self.content_free)

    def to_json(self) -> dict[str, Any]:
        return {"method": "contextual", "content_free": list(self.content_free)}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> ContextualCalibration:
        return cls([float(p) for p in d["content_free"]])


def fit_contextual(content_free_probs: np.ndarray) -> ContextualCalibration:
    """Option probabilities [k] (or [m, k], averaged) for content-free inputs such as "N/A".

    apply() divides by them and renormalises, so a content-free input comes out uniform.
    """
    cf = np.atleast_2d(np.asarray(content_free_probs, dtype=np.float64)).mean(axis=0)
    cf = np.clip(cf / cf.sum(), EPS, None)
    return ContextualCalibration(cf.tolist())


# --- PriDe (Zheng et al. 2024) ----------------------------------------------------


@dataclass
class PriDe:
    """A prior over option positions (A, B, C, ...), divided out of position probabilities."""

    prior: list[float]

    def apply(self, probs: np.ndarray) -> np.ndarray:
        return _divide_out(probs, self.prior)

    def to_json(self) -> dict[str, Any]:
        return {"method": "pride", "prior": list(self.prior)}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> PriDe:
        return cls([float(p) for p in d["prior"]])


def cyclic_permutations(k: int) -> list[list[int]]:
    """The k cyclic shifts: permutation s shows original option (i + s) % k at position i."""
    return [[(i + s) % k for i in range(k)] for s in range(k)]


def fit_pride(permuted: Sequence[np.ndarray], permutations: Sequence[Sequence[int]]) -> PriDe:
    """Estimate the position prior from a small prior-estimation sample.

    permuted: one array [n_perm, k] per sample question; row r holds the probabilities
    of the k *positions* when the options are shown in order `permutations[r]`
    (position i shows original option permutations[r][i]).
    The permutations must put every option at every position equally often, e.g. the
    k cyclic shifts from `cyclic_permutations(k)`.

    Model: observed(position i) ∝ prior(i) * content(option shown at i). Averaging
    log observed over the permutations turns the content term into the same constant
    for every position, so softmax of that average is the sample's prior; the priors
    of the samples are averaged.
    """
    perms = np.asarray(permutations, dtype=np.int64)
    n_perm, k = perms.shape
    counts = np.zeros((k, k), dtype=np.int64)
    np.add.at(counts, (np.tile(np.arange(k), n_perm), perms.ravel()), 1)
    if not np.all(counts == counts[0, 0]):
        raise ValueError("permutations must put every option at every position equally often")
    priors = []
    for sample in permuted:
        sample = np.asarray(sample, dtype=np.float64)
        if sample.shape != (n_perm, k):
            raise ValueError(f"each sample must be [{n_perm}, {k}], got {sample.shape}")
        priors.append(softmax(_log(sample).mean(axis=0)))
    prior = np.mean(priors, axis=0)
    return PriDe((prior / prior.sum()).tolist())


# --- dispatch -----------------------------------------------------------------------

FITTERS: dict[str, Callable[..., Any]] = {
    "temperature": fit_temperature,
    "platt": fit_platt,
    "vector": fit_vector,
    "isotonic": fit_isotonic,
    "contextual": fit_contextual,
    "pride": fit_pride,
}

CALIBRATORS: dict[str, Any] = {
    "temperature": TemperatureScaling,
    "platt": PlattScaling,
    "vector": VectorScaling,
    "isotonic": IsotonicCalibration,
    "contextual": ContextualCalibration,
    "pride": PriDe,
}


def fit(method: str, *args: Any, **kwargs: Any) -> Calibrator:
    """fit("temperature", probs, labels), fit("contextual", cf_probs), fit("pride", permuted, perms), ..."""
    if method not in FITTERS:
        raise ValueError(f"unknown calibration method {method!r}; known: {sorted(FITTERS)}")
    return FITTERS[method](*args, **kwargs)


def load(d: dict[str, Any]) -> Calibrator:
    """The calibrator a to_json() dict describes."""
    method = d.get("method")
    if method not in CALIBRATORS:
        raise ValueError(f"unknown calibration method {method!r}; known: {sorted(CALIBRATORS)}")
    return CALIBRATORS[method].from_json(d)
