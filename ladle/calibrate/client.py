"""Asks a server's /v1/decisions (ladle's, or SGLang's reference dialect) for each example's
option probabilities: an HTTP client only, like `ladle bench`."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from tqdm import tqdm


@dataclass
class Labelled:
    """A question, its option names in order, and examples with the index of their label."""

    question: dict[str, Any]
    options: list[str]
    inputs: list[Any]
    labels: np.ndarray


@dataclass
class Scored:
    probs: np.ndarray  # [n, k], the options in the question's order
    label_mass: np.ndarray  # [n]
    model: str
    prompt_format_version: int | None


def option_names(question: dict[str, Any]) -> list[str]:
    kind = question.get("type")
    if kind == "yes_no":
        return ["yes", "no"]
    if kind == "choice":
        return [o["name"] if isinstance(o, dict) else str(o) for o in question["options"]]
    if kind == "score":
        return [lv["label"] if isinstance(lv, dict) else str(lv) for lv in question["levels"]]
    raise ValueError(f"question type must be yes_no, choice or score, not {kind!r}")


def read_labelled(data: Path, question: dict[str, Any]) -> Labelled:
    """JSONL lines {"input": text or JSON, "label": an option name}; other keys are ignored."""
    options = option_names(question)
    inputs, labels = [], []
    for n, line in enumerate(data.read_text().splitlines(), 1):
        if not line.strip():
            continue
        row = json.loads(line)
        if row.get("label") not in options:
            raise ValueError(f"{data}:{n}: label {row.get('label')!r} is not one of {options}")
        inputs.append(row["input"])
        labels.append(options.index(row["label"]))
    return Labelled(question, options, inputs, np.array(labels, dtype=np.int64))


async def _score(client: httpx.AsyncClient, model: str | None, question: dict[str, Any], text: Any,
                 names: list[str]) -> tuple[list[float], float, dict]:
    body = {"input": text, "questions": [question], **({"model": model} if model else {})}
    r = await client.post("/v1/decisions", json=body)
    if r.status_code != 200:
        raise RuntimeError(f"/v1/decisions answered {r.status_code}: {r.text[:500]}")
    reply = r.json()
    answer = reply["answers"][question["id"]]
    probs = answer["probabilities"]
    return [probs[name] for name in names], answer.get("label_mass", answer.get("x_label_mass", float("nan"))), reply


async def score_all(base_url: str, model: str | None, question: dict[str, Any], inputs: list[Any],
                    concurrency: int = 4, desc: str = "scoring") -> Scored:
    """Each input's option probabilities, in the question's option order, `concurrency` at a time."""
    names = option_names(question)
    limit = asyncio.Semaphore(concurrency)
    bar = tqdm(total=len(inputs), desc=desc, unit="ex")

    async def one(client: httpx.AsyncClient, text: Any) -> tuple[list[float], float, dict]:
        async with limit:
            out = await _score(client, model, question, text, names)
        bar.update()
        return out

    async with httpx.AsyncClient(base_url=base_url.rstrip("/").removesuffix("/v1"), timeout=300) as client:
        results = await asyncio.gather(*(one(client, text) for text in inputs))
    bar.close()
    last = results[-1][2] if results else {}
    return Scored(np.array([p for p, _, _ in results], dtype=np.float64),
                  np.array([m for _, m, _ in results], dtype=np.float64),
                  last.get("model", model or ""), last.get("prompt_format_version"))


async def score_permuted(base_url: str, model: str | None, question: dict[str, Any], inputs: list[Any],
                         permutations: list[list[int]], concurrency: int = 4) -> list[np.ndarray]:
    """For PriDe: each input under each option order; per input an array [n_perm, k] of the
    probabilities of the k positions."""
    key = "options" if question["type"] == "choice" else "levels"
    per_perm = []
    for r, perm in enumerate(permutations):
        shown = {**question, key: [question[key][i] for i in perm]}
        # score_all answers in the shown order, which is the order of positions
        scored = await score_all(base_url, model, shown, inputs, concurrency, desc=f"order {r + 1}/{len(permutations)}")
        per_perm.append(scored.probs)
    return [np.stack([p[i] for p in per_perm]) for i in range(len(inputs))]
