"""Submit prefill-only scoring requests to the engine and gather their label log-probabilities.

The prompts of one request usually share a long prefix (chat template head plus the input).
All of them are submitted at once: the scheduler admits the first, which computes the
shared prefix, and starts the others on its blocks (cached, or being computed in the same
step), so each computes only its own suffix.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from ladle.engine.async_engine import AsyncEngine, RequestStream
from ladle.engine.multimodal import ImageSpan, ImageTokens
from ladle.engine.sampling_params import SamplingParams
from ladle.server.protocol import random_id


@dataclass
class ScoreJob:
    prompt_ids: list[int]
    label_ids: list[int] | None
    hidden_state_layers: list[int] | None = None  # also these layers' states (SamplingParams)
    pooling: str = "last"
    pooling_start: int = 0
    images: tuple[ImageSpan, ...] = ()  # the prompt's image placeholder spans (ladle.engine.multimodal)

    @property
    def prompt(self) -> list[int] | ImageTokens:
        return ImageTokens(self.prompt_ids, self.images) if self.images else self.prompt_ids

    def params(self) -> SamplingParams:
        return SamplingParams(max_tokens=1, label_token_ids=self.label_ids,
                              hidden_state_layers=self.hidden_state_layers, hidden_state_pooling=self.pooling,
                              hidden_state_start=self.pooling_start)


@dataclass
class ScoreResult:
    label_logprobs: list[float] | None  # full-vocabulary log-probabilities, one per label id
    num_prompt_tokens: int
    num_cached_tokens: int  # prompt tokens found in the prefix cache
    hidden_states: dict[int, list[float]] | None = None  # layer -> pooled state, when the job asked


async def score(engine: AsyncEngine, jobs: list[ScoreJob], priority: int = 0) -> list[ScoreResult]:
    """Run every job (concurrently, sharing what can be shared); results in job order.

    Cancelling (a client that left) aborts whatever is still in the engine.
    """
    streams = await _submit(engine, random_id("score"), jobs, priority)
    try:
        return list(await asyncio.gather(*(_collect(s) for s in streams)))
    except BaseException:
        for s in streams:
            s.abort()
        raise


async def _submit(engine: AsyncEngine, request_id: str, jobs: list[ScoreJob], priority: int) -> list[RequestStream]:
    """Submit all at once (enqueued in one event-loop turn, so the engine sees them together)."""
    subs = [engine.add_request(f"{request_id}-{i}", job.prompt, job.params(), priority)
            for i, job in enumerate(jobs)]
    accepted = await asyncio.gather(*subs, return_exceptions=True)
    streams = [s for s in accepted if isinstance(s, RequestStream)]
    failed = next((e for e in accepted if isinstance(e, BaseException)), None)
    if failed is not None:
        for s in streams:
            s.abort()
        raise failed
    return streams


async def _collect(stream: RequestStream) -> ScoreResult:
    result = ScoreResult(None, 0, 0)
    finished = False
    try:
        async for out in stream:
            result.num_cached_tokens = out.num_cached_tokens
            for delta in out.deltas:
                finished = finished or delta.finish_reason is not None
                if delta.label_logprobs is not None:
                    result.label_logprobs = delta.label_logprobs
                if delta.hidden_states is not None:
                    result.hidden_states = delta.hidden_states
    finally:
        stream.abort()  # no-op once finished; frees the blocks if we were cancelled
    if not finished:
        raise RuntimeError(f"scoring request {stream.request_id} ended without its result")
    result.num_prompt_tokens = len(stream.prompt_token_ids)
    return result
