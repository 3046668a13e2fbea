"""A decision head on disk and in use: HEAD.safetensors (the weights) beside HEAD.json (what it
was fitted for, and how well it did).

probabilities = softmax(W ((x - mean) / scale) + b), x the hidden state after `layer` at the
last prompt position of the rendered decision (pooling "last"), in float64.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

FORMAT = 1  # version of the head files' layout
POOLING = "last"  # the answer position: always computed, even when the prompt's prefix is cached


@dataclass
class DecisionHead:
    weight: np.ndarray  # [labels, hidden]
    bias: np.ndarray  # [labels]
    mean: np.ndarray  # [hidden]
    scale: np.ndarray  # [hidden]
    layer: int  # transformers' numbering; negative counts from the end (-1: the final normed output)
    labels: list[str]  # option names in the question's order
    model: str
    question_id: str
    prompt_format_version: int | None
    report: dict[str, Any] = field(default_factory=dict)

    def probabilities(self, features: np.ndarray) -> np.ndarray:
        """[n, hidden] (or [hidden]) states -> [n, labels] (or [labels]) probabilities."""
        x = (np.asarray(features, dtype=np.float64) - self.mean) / self.scale
        z = x @ self.weight.T + self.bias
        z = z - z.max(axis=-1, keepdims=True)
        e = np.exp(z)
        return e / e.sum(axis=-1, keepdims=True)

    def save(self, path: Path) -> None:
        from safetensors.numpy import save_file

        save_file({"weight": self.weight, "bias": self.bias, "mean": self.mean, "scale": self.scale}, str(path))
        sidecar(path).write_text(json.dumps({
            "ladle_head": FORMAT, "model": self.model, "question_id": self.question_id, "labels": self.labels,
            "layer": self.layer, "pooling": POOLING, "prompt_format_version": self.prompt_format_version,
            "report": self.report}, indent=2) + "\n")

    @classmethod
    def load(cls, path: Path) -> DecisionHead:
        from safetensors.numpy import load_file

        meta = json.loads(sidecar(path).read_text())
        if meta.get("ladle_head") != FORMAT or meta.get("pooling") != POOLING:
            raise ValueError(f"{sidecar(path)} is not a ladle decision head of format {FORMAT}")
        t = {k: v.astype(np.float64) for k, v in load_file(str(path)).items()}
        return cls(t["weight"], t["bias"], t["mean"], t["scale"], int(meta["layer"]), list(meta["labels"]),
                   meta["model"], meta["question_id"], meta.get("prompt_format_version"), meta.get("report", {}))


def sidecar(path: Path) -> Path:
    """HEAD.safetensors -> HEAD.json."""
    return Path(path).with_suffix(".json")
