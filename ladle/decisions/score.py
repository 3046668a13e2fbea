"""POST /v1/score: label-token probabilities after exact prompts, so any stored decision can be replayed.

Each item makes one sequence, query + item (item + query with item_first); with no items the
query alone is the sequence. Text is tokenized as /v1/completions does (special tokens added).
"""

from __future__ import annotations

import math

from ladle.decisions import scoring
from ladle.decisions.answers import full_vocab_probs, label_softmax
from ladle.decisions.pipeline import usage
from ladle.decisions.protocol import ScoreRequest, ScoreResponse
from ladle.engine.async_engine import AsyncEngine
from ladle.errors import InvalidRequestError
from ladle.server.errors import APIError
from ladle.server.protocol import Usage

MAX_ITEMS = 1024


def sequences(engine: AsyncEngine, req: ScoreRequest) -> list[tuple[list[int], str]]:
    """(token ids, the field to blame) of every sequence to score."""
    items = [req.items] if isinstance(req.items, str) else list(req.items or [])
    if len(items) > MAX_ITEMS:
        raise InvalidRequestError(f"items: at most {MAX_ITEMS} per request (got {len(items)})", param="items")
    query_is_text = isinstance(req.query, str)
    if any(isinstance(item, str) != query_is_text for item in items):
        raise InvalidRequestError("query and items must both be text or both be token ids", param="items")
    tok = engine.tokenizer
    if not items:
        seqs = [(req.query, "query")]
    elif req.item_first:
        seqs = [(item + req.query, f"items[{i}]") for i, item in enumerate(items)]
    else:
        seqs = [(req.query + item, f"items[{i}]") for i, item in enumerate(items)]
    out = []
    for seq, where in seqs:
        ids = tok.encode(seq, add_special_tokens=True) if query_is_text else seq
        if not ids:
            raise InvalidRequestError(f"{where}: the sequence to score is empty", param=where)
        if any(not 0 <= t < engine.vocab_size for t in ids):
            raise InvalidRequestError(f"{where}: token ids must be in [0, {engine.vocab_size})", param=where)
        if len(ids) >= engine.max_model_len:
            raise InvalidRequestError(f"{where}: the sequence is {len(ids)} tokens, and this model's context holds "
                                      f"{engine.max_model_len} (sequence and answer token); nothing is truncated",
                                      param=where, code="context_length_exceeded")
        out.append((ids, where))
    return out


def label_lists(engine: AsyncEngine, req: ScoreRequest, n: int) -> list[list[int]]:
    given = req.label_token_ids
    if given and isinstance(given[0], list):
        if len(given) != n:
            raise InvalidRequestError(f"label_token_ids has {len(given)} lists for {n} sequences (give one shared "
                                      "list, or one list per item)", param="label_token_ids")
        lists = [list(x) for x in given]
    else:
        lists = [list(given)] * n
    for i, labels in enumerate(lists):
        where = f"label_token_ids[{i}]" if given and isinstance(given[0], list) else "label_token_ids"
        if not labels:
            raise InvalidRequestError(f"{where} must not be empty", param=where)
        if any(not 0 <= t < engine.vocab_size for t in labels):
            raise InvalidRequestError(f"{where}: token ids must be in [0, {engine.vocab_size})", param=where)
    return lists


async def handle(engine: AsyncEngine, model_name: str, req: ScoreRequest) -> ScoreResponse:
    seqs = sequences(engine, req)
    labels = label_lists(engine, req, len(seqs))
    results = await scoring.score(engine, [scoring.ScoreJob(ids, lab) for (ids, _), lab in zip(seqs, labels)])
    lps = [r.label_logprobs for r in results]
    scores = [label_softmax(x, req.temperature) if req.apply_softmax else full_vocab_probs(x) for x in lps]
    if req.return_token_logprobs and not all(math.isfinite(v) for x in lps for v in x):
        raise APIError(500, "the model produced a non-finite log-probability for this request", type="server_error",
                       code="non_finite_score")
    prompt, cached, _ = usage(engine, [(r.num_prompt_tokens, r.num_cached_tokens) for r in results])
    return ScoreResponse(model=model_name, scores=scores, token_logprobs=lps if req.return_token_logprobs else None,
                         usage=Usage.of(prompt, 0, cached))
