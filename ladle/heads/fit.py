"""Fit a decision head from labelled examples, through any ladle server's HTTP API.

For each example: /v1/decisions (with return_prompt_token_ids) gives the zero-shot answer
and the exact tokens the decision renders; /v1/embeddings on those tokens gives the hidden
states after a layer, mean-pooled from where the input begins (the tokens every rendered
prompt shares before it are the chat template's head), the same pooled state the server
computes when it answers with the head (scoring is batch-invariant, so the bits agree). A
standardised logistic regression (scikit-learn) on those states is the head, its
regularisation chosen by cross-validation on the fit set.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

import httpx
import numpy as np
from tqdm import tqdm

from ladle.calibrate.client import Labelled, option_names
from ladle.heads.head import DecisionHead

EMBED_BATCH = 8  # prompts per /v1/embeddings request


@dataclass
class Rendered:
    """Zero-shot answers and rendered prompts of a set of examples."""

    probs: np.ndarray  # [n, k] the decision's probabilities, options in the question's order
    prompt_ids: list[list[int]]
    model: str
    prompt_format_version: int | None


def _client(base_url: str) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=base_url.rstrip("/").removesuffix("/v1"), timeout=600)


async def render(base_url: str, model: str | None, question: dict[str, Any], inputs: list[Any],
                 concurrency: int = 4, desc: str = "decisions") -> Rendered:
    names, limit = option_names(question), asyncio.Semaphore(concurrency)
    bar = tqdm(total=len(inputs), desc=desc, unit="ex")

    async def one(client: httpx.AsyncClient, text: Any) -> dict:
        body = {"input": text, "questions": [question], "return_prompt_token_ids": True,
                **({"model": model} if model else {})}
        async with limit:
            r = await client.post("/v1/decisions", json=body)
        if r.status_code != 200:
            raise RuntimeError(f"/v1/decisions answered {r.status_code}: {r.text[:500]}")
        bar.update()
        return r.json()

    async with _client(base_url) as client:
        replies = await asyncio.gather(*(one(client, text) for text in inputs))
    bar.close()
    answers = [reply["answers"][question["id"]] for reply in replies]
    return Rendered(np.array([[a["probabilities"][n] for n in names] for a in answers], dtype=np.float64),
                    [a["prompt_token_ids"] for a in answers], replies[-1]["model"],
                    replies[-1].get("prompt_format_version"))


def shared_prefix_len(prompts: list[list[int]]) -> int:
    """Tokens every prompt starts with: the chat template's head, before the input."""
    first = prompts[0]
    n = min(map(len, prompts))
    for ids in prompts[1:]:
        n = next((i for i in range(n) if ids[i] != first[i]), n)
    return n


async def features(base_url: str, model: str | None, prompts: list[list[int]], layer: int, pooling: str = "mean",
                   pool_from: int = 0, concurrency: int = 2, desc: str = "hidden states") -> np.ndarray:
    """[n, hidden]: each prompt's unnormalised states after `layer`, pooled as the head will."""
    batches = [prompts[i : i + EMBED_BATCH] for i in range(0, len(prompts), EMBED_BATCH)]
    limit = asyncio.Semaphore(concurrency)
    bar = tqdm(total=len(prompts), desc=desc, unit="ex")

    async def one(client: httpx.AsyncClient, batch: list[list[int]]) -> list[list[float]]:
        body = {"input": batch, "layer": layer, "pooling": pooling, "normalize": False,
                **({"pooling_start": pool_from} if pooling == "mean" else {}),
                **({"model": model} if model else {})}
        async with limit:
            r = await client.post("/v1/embeddings", json=body)
        if r.status_code != 200:
            raise RuntimeError(f"/v1/embeddings answered {r.status_code}: {r.text[:500]}")
        bar.update(len(batch))
        return [d["embedding"] for d in sorted(r.json()["data"], key=lambda d: d["index"])]

    async with _client(base_url) as client:
        parts = await asyncio.gather(*(one(client, b) for b in batches))
    bar.close()
    return np.array([row for part in parts for row in part], dtype=np.float64)


def fit_logistic(x: np.ndarray, labels: np.ndarray, k: int, c: float) -> tuple[np.ndarray, ...]:
    """(weight [k, d], bias [k], mean [d], scale [d]) of a standardised multinomial logistic
    regression with inverse regularisation strength c."""
    from sklearn.linear_model import LogisticRegression

    if len(np.unique(labels)) != k:
        raise ValueError(f"every option needs labelled examples to fit a head; the data covers "
                         f"{len(np.unique(labels))} of {k}")
    mean, scale = x.mean(axis=0), x.std(axis=0) + 1e-6
    model = LogisticRegression(C=c, max_iter=5000).fit((x - mean) / scale, labels)
    weight, bias = model.coef_, model.intercept_
    if k == 2:  # scikit-learn keeps one row for two classes: the logit of class 1 against class 0
        weight, bias = np.vstack([np.zeros_like(weight[0]), weight[0]]), np.array([0.0, bias[0]])
    return weight, bias, mean, scale


def cross_validated_nll(x: np.ndarray, labels: np.ndarray, k: int, c: float, folds: int = 5, seed: int = 0) -> float:
    """Mean held-out log-loss over stratified folds of the fit set."""
    from sklearn.model_selection import StratifiedKFold

    losses = []
    for train, test in StratifiedKFold(folds, shuffle=True, random_state=seed).split(x, labels):
        w, b, m, s = fit_logistic(x[train], labels[train], k, c)
        z = ((x[test] - m) / s) @ w.T + b
        z -= z.max(axis=1, keepdims=True)
        logp = z - np.log(np.exp(z).sum(axis=1, keepdims=True))
        losses.append(-logp[np.arange(len(test)), labels[test]].mean())
    return float(np.mean(losses))


@dataclass
class FitResult:
    head: DecisionHead
    before: np.ndarray  # zero-shot probabilities of the held-out examples
    after: np.ndarray  # the head's on the same examples
    search: list[dict[str, float]]  # the layers and strengths tried, with their cross-validated NLL
    seconds: float


async def fit_head(base_url: str, model: str | None, question: dict[str, Any], fit_set: Labelled,
                   held: Labelled, layers: list[int], strengths: list[float], pooling: str = "mean",
                   concurrency: int = 4, seed: int = 0) -> FitResult:
    """Choose the layer and regularisation by cross-validation on the fit set, fit there,
    and answer the held-out set with the head and zero-shot."""
    start = time.perf_counter()
    k = len(fit_set.options)
    fit_r = await render(base_url, model, question, fit_set.inputs, concurrency, "fit set")
    held_r = await render(base_url, model, question, held.inputs, concurrency, "held out")
    pool_from = shared_prefix_len(fit_r.prompt_ids) if pooling == "mean" else 0
    search, best = [], None
    fit_x: dict[int, np.ndarray] = {}
    for layer in layers:
        fit_x[layer] = await features(base_url, model, fit_r.prompt_ids, layer, pooling, pool_from,
                                      desc=f"layer {layer}")
        for c in strengths:
            nll = cross_validated_nll(fit_x[layer], fit_set.labels, k, c, seed=seed)
            search.append({"layer": layer, "C": c, "cv_nll": nll})
            if best is None or nll < best[0]:
                best = (nll, layer, c)
    _, layer, c = best
    weight, bias, mean, scale = fit_logistic(fit_x[layer], fit_set.labels, k, c)
    head = DecisionHead(weight, bias, mean, scale, layer, list(fit_set.options), fit_r.model, question["id"],
                        fit_r.prompt_format_version, pooling, pool_from)
    held_x = await features(base_url, model, held_r.prompt_ids, layer, pooling, pool_from, desc="held out states")
    return FitResult(head, held_r.probs, head.probabilities(held_x), search, time.perf_counter() - start)
