"""What the bench learns about a target before loading it: its model, /version and tokenizer, and
whether one request goes through at all (so a misconfigured run fails fast, as vLLM's does)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import httpx

from ladle.bench.client import Target, first_model, get_json, make_http_client, measure_tokens_per_word, send
from ladle.bench.datasets import SampleRequest
from ladle.bench.words import DEFAULT_TOKENS_PER_WORD


@dataclass
class TargetInfo:
    target: Target  # with the model resolved
    version: Any  # the JSON of GET /version, or None
    tokens_per_word: float
    tokens_per_word_source: str  # "flag" | "tokenize" | "default"


async def discover(target: Target, tokens_per_word: float | None = None, calibrate: bool = True) -> TargetInfo:
    """Resolve the model (first of /v1/models when none is given), read /version, and measure the
    target's tokens per word through /tokenize unless `tokens_per_word` is given or `calibrate` is off."""
    async with make_http_client(target) as http:
        try:
            await http.get(target.url("/"), timeout=10.0)
        except httpx.HTTPError as e:
            raise RuntimeError(f"cannot reach {target.base_url}: {type(e).__name__}: {e}") from None
        if not target.model:
            target = replace(target, model=await first_model(http, target))
        version = await get_json(http, target, "/version")
        if tokens_per_word is not None:
            return TargetInfo(target, version, tokens_per_word, "flag")
        measured = await measure_tokens_per_word(http, target) if calibrate else None
        if measured is not None:
            return TargetInfo(target, version, measured, "tokenize")
        return TargetInfo(target, version, DEFAULT_TOKENS_PER_WORD, "default")


async def check_request(target: Target, req: SampleRequest) -> None:
    """Send one request; raise with the server's answer if it fails."""
    async with make_http_client(target) as http:
        result = await send(http, target, req)
    if not result.success:
        raise RuntimeError(f"the initial test request to {target.url(req.endpoint)} failed "
                           f"(check --base-url, --endpoint, --model): {result.error}")


async def reset_prefix_cache(target: Target) -> None:
    """POST /reset_prefix_cache (ladle's and vLLM's): the run that follows starts on a cold prefix cache."""
    async with make_http_client(target) as http:
        try:
            r = await http.post(target.url("/reset_prefix_cache"), timeout=60.0)
        except httpx.HTTPError as e:
            raise RuntimeError(f"--reset-cache: {type(e).__name__}: {e}") from None
    if r.status_code == 404:
        raise RuntimeError(f"--reset-cache: {target.base_url} has no POST /reset_prefix_cache (ladle and vLLM "
                           "have it; vLLM with VLLM_SERVER_DEV_MODE=1)")
    if r.status_code >= 400:
        raise RuntimeError(f"--reset-cache: the server answered {r.status_code}: {r.text[:300]}")
