"""Submit prefill-only scoring requests to the engine and gather their label log-probabilities.

The prompts of one request usually share a long prefix (chat template head plus the input).
The prefix cache only shares blocks that are already computed when a sequence is admitted,
so if all N prompts were admitted in one step each would compute the whole prefix. Instead,
when the shared prefix is worth it, the first prompt runs alone and the others are submitted
together the moment it finishes: they find the shared blocks in the cache and compute only
their own suffixes. The price is one step boundary of latency.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from ladle.engine.async_engine import AsyncEngine, RequestStream
from ladle.engine.sampling_params import SamplingParams
from ladle.server.protocol import random_id

# Run the first prompt alone when the others would together skip at least this many tokens.
STAGE_MIN_SAVED_TOKENS = 64


@dataclass
class ScoreJob:
    prompt_ids: list[int]
    label_ids: list[int]


@dataclass
class ScoreResult:
    label_logprobs: list[float]  # full-vocabulary log-probabilities, one per label id
    num_prompt_tokens: int
    num_cached_tokens: int  # prompt tokens found in the prefix cache


def shared_prefix_len(prompts: list[list[int]]) -> int:
    """Tokens all prompts start with, short of each one's last token (which is always computed)."""
    first = prompts[0]
    n = min(len(p) for p in prompts) - 1
    for p in prompts[1:]:
        k = 0
        while k < n and p[k] == first[k]:
            k += 1
        n = k
    return max(n, 0)


def should_stage(jobs: list[ScoreJob], block_size: int, prefix_caching: bool) -> bool:
    if not prefix_caching or len(jobs) < 2:
        return False
    cached_per_job = shared_prefix_len([j.prompt_ids for j in jobs]) // block_size * block_size
    return cached_per_job * (len(jobs) - 1) >= STAGE_MIN_SAVED_TOKENS


async def score(engine: AsyncEngine, jobs: list[ScoreJob], priority: int = 0) -> list[ScoreResult]:
    """Run every job (concurrently, sharing what can be shared); results in job order.

    Cancelling (a client that left) aborts whatever is still in the engine.
    """
    config = engine.engine.config
    request_id = random_id("score")
    waves = [list(range(len(jobs)))]
    if should_stage(jobs, config.block_size, config.enable_prefix_caching):
        waves = [[0], waves[0][1:]]
    results: list[ScoreResult | None] = [None] * len(jobs)
    for wave in waves:
        streams = await _submit(engine, request_id, jobs, wave, priority)
        try:
            outs = await asyncio.gather(*(_collect(s) for s in streams))
        except BaseException:
            for s in streams:
                s.abort()
            raise
        for i, out in zip(wave, outs):
            results[i] = out
    return results  # type: ignore[return-value]


async def _submit(engine: AsyncEngine, request_id: str, jobs: list[ScoreJob], wave: list[int],
                  priority: int) -> list[RequestStream]:
    """Submit a wave at once (all enqueued in one event-loop turn, so one engine step admits them)."""
    subs = [engine.add_request(f"{request_id}-{i}", jobs[i].prompt_ids,
                               SamplingParams(max_tokens=1, label_token_ids=jobs[i].label_ids), priority)
            for i in wave]
    accepted = await asyncio.gather(*subs, return_exceptions=True)
    streams = [s for s in accepted if isinstance(s, RequestStream)]
    failed = next((e for e in accepted if isinstance(e, BaseException)), None)
    if failed is not None:
        for s in streams:
            s.abort()
        raise failed
    return streams


async def _collect(stream: RequestStream) -> ScoreResult:
    logprobs: list[float] | None = None
    cached = 0
    try:
        async for out in stream:
            cached = out.num_cached_tokens
            for delta in out.deltas:
                if delta.label_logprobs is not None:
                    logprobs = delta.label_logprobs
    finally:
        stream.abort()  # no-op once finished; frees the blocks if we were cancelled
    if logprobs is None:
        raise RuntimeError(f"scoring request {stream.request_id} finished without label log-probabilities")
    return ScoreResult(logprobs, len(stream.prompt_token_ids), cached)
