"""ladle's extensions to a decision question (decisions.md, "ladle's extensions").

A question may name a calibration the server loaded (`--decision-calibration NAME=PATH`, a
file from `ladle calibrate fit`), applied to its label probabilities; or a learned head
(`--decision-head NAME=PATH`, from `ladle heads fit`) that answers it from the hidden state of
the same prefill. Either must have been fitted for this model, these labels and this prompt
format, or the question is refused (400 naming the field).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ladle.decisions.question import Question
from ladle.decisions.render import PROMPT_FORMAT_VERSION
from ladle.heads.head import DecisionHead


@dataclass
class Calibration:
    """A fitted calibrator and what it was fitted for."""

    calibrator: Any  # ladle.calibrate.methods.Calibrator
    model: str
    labels: list[str]
    prompt_format_version: int | None
    method: str

    @classmethod
    def load(cls, path: Path) -> Calibration:
        from ladle.calibrate import methods  # numpy and scipy: only for servers that load one

        data = json.loads(Path(path).read_text())
        if "ladle_calibration" not in data:
            raise ValueError(f"{path} is not a calibration written by `ladle calibrate fit`")
        return cls(methods.load(data), data["model"], list(data["labels"]), data.get("prompt_format_version"),
                   data["method"])

    def apply(self, probabilities: list[float]) -> list[float]:
        import numpy as np

        return [float(p) for p in self.calibrator.apply(np.asarray([probabilities], dtype=np.float64))[0]]


@dataclass
class Extensions:
    """What this server loaded, by name, for the model it serves."""

    model_name: str
    calibrations: dict[str, Calibration] = field(default_factory=dict)
    heads: dict[str, DecisionHead] = field(default_factory=dict)

    @classmethod
    def load(cls, model_name: str, calibrations: list[str], heads: list[str]) -> Extensions:
        """From NAME=PATH specs; raises ValueError naming the spec at fault."""
        return cls(model_name, {name: Calibration.load(path) for name, path in map(_name_and_path, calibrations)},
                   {name: DecisionHead.load(path) for name, path in map(_name_and_path, heads)})

    def resolve(self, q: Question, temperature: float) -> Calibration | DecisionHead | None:
        """The calibration or head q names, checked against it; raises InvalidRequestError."""
        if q.calibration is not None and q.head is not None:
            raise q.refuse("name a calibration or a head, not both", q.field_name("head"))
        if q.calibration is not None:
            return self._checked(q, "calibration", self.calibrations, q.calibration, temperature)
        if q.head is not None:
            return self._checked(q, "head", self.heads, q.head, temperature)
        return None

    def _checked(self, q: Question, kind: str, loaded: dict[str, Any], name: str, temperature: float) -> Any:
        where = q.field_name(kind)
        if name not in loaded:
            known = ", ".join(sorted(loaded)) or f"none (start the server with --decision-{kind} NAME=PATH)"
            raise q.refuse(f"no {kind} named {name!r} is loaded; loaded: {known}", where, code=f"unknown_{kind}")
        fitted = loaded[name]
        labels = [o.name for o in q.options]
        if fitted.model != self.model_name:
            raise q.refuse(f"{kind} {name!r} was fitted for model {fitted.model!r}, and this server serves "
                           f"{self.model_name!r}: refit it on this model", where, code=f"{kind}_mismatch")
        if fitted.labels != labels:
            raise q.refuse(f"{kind} {name!r} was fitted for the options {fitted.labels}, and this question has "
                           f"{labels}", where, code=f"{kind}_mismatch")
        if fitted.prompt_format_version not in (None, PROMPT_FORMAT_VERSION):
            raise q.refuse(f"{kind} {name!r} was fitted on prompt format version {fitted.prompt_format_version}; "
                           f"this server renders version {PROMPT_FORMAT_VERSION}", where, code=f"{kind}_mismatch")
        if temperature != 1.0:
            raise q.refuse(f"a {kind} replaces the label softmax, so temperature must stay 1", where)
        return fitted


def _name_and_path(spec: str) -> tuple[str, Path]:
    name, sep, path = spec.partition("=")
    if not sep or not name.strip() or not path.strip():
        raise ValueError(f"expected NAME=PATH, got {spec!r}")
    return name.strip(), Path(path.strip())
