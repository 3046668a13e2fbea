"""A decision head on disk and in use: HEAD.safetensors (the weights) beside HEAD.json (what it
was fitted for, and how well it did).

probabilities = softmax(W ((x - mean) / scale) + b), in float64, where x is the hidden state
after `layer` of the rendered decision, pooled: "mean" over the prompt from token `pool_from`
on (where the input begins: the chat template's head before it is the same for every input,
and the prefix cache may still serve it), or "last", the answer position alone.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

FORMAT = 1  # version of the head files' layout
POOLINGS = ("mean", "last")


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
    pooling: str = "mean"
    pool_from: int = 0
    report: dict[str, Any] = field(default_factory=dict)

    def probabilities(self, features: np.ndarray) -> np.ndarray:
        """[n, hidden] (or [hidden]) states -> [n, labels] (or [labels]) probabilities."""
        x = (np.asarray(features, dtype=np.float64) - self.mean) / self.scale
        # elementwise, not a BLAS call: the server runs this beside the engine, and BLAS threads
        # spinning after a call would take cores from the engine's next step
        z = (x[..., None, :] * self.weight).sum(axis=-1) + self.bias
        z = z - z.max(axis=-1, keepdims=True)
        e = np.exp(z)
        return e / e.sum(axis=-1, keepdims=True)

    def save(self, path: Path) -> None:
        from safetensors.numpy import save_file

        tensors = {"weight": self.weight, "bias": self.bias, "mean": self.mean, "scale": self.scale}
        # safetensors writes an array's memory as it lies, and scikit-learn's coefficients are column-major
        save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, str(path))
        sidecar(path).write_text(json.dumps({
            "ladle_head": FORMAT, "model": self.model, "question_id": self.question_id, "labels": self.labels,
            "layer": self.layer, "pooling": self.pooling, "pool_from": self.pool_from,
            "prompt_format_version": self.prompt_format_version,
            "report": self.report}, indent=2) + "\n")

    @classmethod
    def load(cls, path: Path) -> DecisionHead:
        from safetensors.numpy import load_file

        meta = json.loads(sidecar(path).read_text())
        if meta.get("ladle_head") != FORMAT or meta.get("pooling") not in POOLINGS:
            raise ValueError(f"{sidecar(path)} is not a ladle decision head of format {FORMAT}")
        t = {k: v.astype(np.float64) for k, v in load_file(str(path)).items()}
        return cls(t["weight"], t["bias"], t["mean"], t["scale"], int(meta["layer"]), list(meta["labels"]),
                   meta["model"], meta["question_id"], meta.get("prompt_format_version"), meta["pooling"],
                   int(meta.get("pool_from", 0)), meta.get("report", {}))


def sidecar(path: Path) -> Path:
    """HEAD.safetensors -> HEAD.json."""
    return Path(path).with_suffix(".json")
