"""One benchmark request against an OpenAI-compatible server, timed on the client.

Timing (as `vllm bench serve`, but counting only chunks that carry text):
- TTFT: from sending the request to the first streamed chunk with non-empty text;
- ITL: the gaps between consecutive chunks with text;
- E2EL: from sending to the last chunk with text (the trailing usage chunk and
  `[DONE]` are not part of the answer).
A reasoning model's thinking (delta.reasoning_content or delta.reasoning) is text
too: its first token is the first token of the answer. Output tokens come from the
final `usage` chunk (stream_options.include_usage); servers that send none are
counted one token a text chunk. The usage's prompt_tokens_details.cached_tokens,
when given, is the share of the prompt the server found in its prefix cache.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from collections.abc import AsyncIterator
from typing import Any

import httpx
import numpy as np

from ladle.bench.datasets import SampleRequest
from ladle.bench.words import random_words


@dataclass
class Target:
    """Where and how to send requests: everything a request needs besides its prompt."""

    base_url: str  # without the endpoint, e.g. http://127.0.0.1:8000
    model: str
    endpoint: str = "/v1/completions"
    api_key: str | None = None
    ignore_eos: bool = False
    extra_body: dict[str, Any] = field(default_factory=dict)  # sampling parameters and --extra-body
    headers: dict[str, str] = field(default_factory=dict)
    timeout_s: float = 6 * 3600.0

    def url(self, endpoint: str | None = None) -> str:
        return self.base_url.rstrip("/") + (endpoint or self.endpoint)

    def request_headers(self) -> dict[str, str]:
        key = self.api_key or os.environ.get("OPENAI_API_KEY")
        auth = {"Authorization": f"Bearer {key}"} if key else {}
        return {**auth, **self.headers}


@dataclass
class RequestResult:
    success: bool = False
    error: str = ""
    prompt_len: int = 0  # usage.prompt_tokens when reported, else the dataset's estimate
    output_tokens: int = 0  # usage.completion_tokens when reported, else the text chunks
    usage_reported: bool = False
    ttft: float = 0.0  # seconds
    itl: list[float] = field(default_factory=list)
    latency: float = 0.0  # E2EL, seconds
    start_time: float = 0.0  # time.perf_counter() when sent
    queue_time: float = 0.0  # from arrival to sending: waiting for a --max-concurrency slot, or client lag
    generated_text: str = ""
    reasoning_text: str = ""  # a reasoning model's thinking (it counts for TTFT and ITL too)
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens, when the server reports it
    turn: int | None = None  # the request's turn in its agent session


def make_http_client(target: Target, max_connections: int | None = None) -> httpx.AsyncClient:
    # Unbounded pools by default: a request queued inside the client would count its wait as TTFT.
    limits = httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections)
    timeout = httpx.Timeout(target.timeout_s, connect=min(target.timeout_s, 60.0))
    return httpx.AsyncClient(limits=limits, timeout=timeout, headers=target.request_headers())


def is_chat(endpoint: str) -> bool:
    return endpoint.rstrip("/").endswith("chat/completions")


def build_payload(target: Target, req: SampleRequest) -> dict[str, Any]:
    if req.body is not None:
        return {"model": target.model, **req.body}
    payload: dict[str, Any] = {"model": target.model, "max_tokens": req.output_len, "stream": True,
                               "stream_options": {"include_usage": True}}
    if is_chat(req.endpoint or target.endpoint):
        payload["messages"] = [{"role": "user", "content": req.prompt}]
    else:
        payload["prompt"] = req.prompt
    if target.ignore_eos:
        payload["ignore_eos"] = True
    payload.update(target.extra_body)
    return payload


async def send(http: httpx.AsyncClient, target: Target, req: SampleRequest) -> RequestResult:
    """Send one request and time it; never raises (a failure is a result with success=False)."""
    if req.body is not None:
        return await _post_json(http, target, req)
    return await _stream(http, target, req)


def http_error(status: int, body: bytes) -> str:
    return f"HTTP {status}: {body.decode('utf-8', 'replace')[:300]}"


async def sse_chunks(resp: httpx.Response) -> AsyncIterator[tuple[float, dict[str, Any]]]:
    """The JSON events of a server-sent event stream up to [DONE], each with its arrival time
    (time.perf_counter()). An error event ends the stream with StreamError."""
    async for line in resp.aiter_lines():
        now = time.perf_counter()
        if not line.startswith("data:"):
            continue  # blank separators, SSE comments (pings), event names
        data = line[5:].strip()
        if data == "[DONE]":
            return
        chunk = json.loads(data)
        if chunk.get("error"):
            raise StreamError(f"error in stream: {json.dumps(chunk['error'])[:300]}")
        yield now, chunk


class StreamError(Exception):
    """The server sent an error event in the middle of a stream."""


async def _stream(http: httpx.AsyncClient, target: Target, req: SampleRequest) -> RequestResult:
    endpoint = req.endpoint or target.endpoint
    chat = is_chat(endpoint)
    payload = build_payload(target, req)
    out = RequestResult(prompt_len=req.prompt_len, turn=req.turn)
    parts: list[str] = []
    reasoning: list[str] = []
    last = st = out.start_time = time.perf_counter()
    try:
        async with http.stream("POST", target.url(endpoint), json=payload) as resp:
            if resp.status_code != 200:
                out.error = http_error(resp.status_code, await resp.aread())
                return out
            async for now, chunk in sse_chunks(resp):
                choices = chunk.get("choices") or []
                text = thought = None
                if choices:
                    delta = choices[0].get("delta") or {}
                    text = delta.get("content") if chat else choices[0].get("text")
                    # reasoning_content (DeepSeek, ladle, older vLLM) or reasoning (vLLM since late 2025)
                    thought = (delta.get("reasoning_content") or delta.get("reasoning")) if chat else None
                if text or thought:
                    if parts or reasoning:
                        out.itl.append(now - last)
                    else:
                        out.ttft = now - st
                    last = now
                    if text:
                        parts.append(text)
                    if thought:
                        reasoning.append(thought)
                usage = chunk.get("usage")
                if usage:
                    if usage.get("completion_tokens") is not None:
                        out.output_tokens = int(usage["completion_tokens"])
                        out.usage_reported = True
                    if usage.get("prompt_tokens") is not None:
                        out.prompt_len = int(usage["prompt_tokens"])
                    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
                    if cached is not None:
                        out.cached_tokens = int(cached)
    except StreamError as e:
        out.error = str(e)
        return out
    except Exception as e:  # noqa: BLE001 - any failure is recorded, the run goes on
        out.error = f"{type(e).__name__}: {e}"
        return out
    if not (parts or reasoning):
        out.error = "the stream ended without a chunk with text"
        return out
    if not out.usage_reported:
        out.output_tokens = len(parts) + len(reasoning)
    out.latency = last - st
    out.generated_text = "".join(parts)
    out.reasoning_text = "".join(reasoning)
    out.success = True
    return out


async def _post_json(http: httpx.AsyncClient, target: Target, req: SampleRequest) -> RequestResult:
    """A non-streaming request (decisions): its first and last byte are one answer, so TTFT = E2EL."""
    out = RequestResult(prompt_len=req.prompt_len, turn=req.turn)
    st = out.start_time = time.perf_counter()
    try:
        resp = await http.post(target.url(req.endpoint), json=build_payload(target, req))
        body = await resp.aread()
        out.latency = out.ttft = time.perf_counter() - st
        if resp.status_code != 200:
            out.error = http_error(resp.status_code, body)
            return out
        data = json.loads(body)
    except Exception as e:  # noqa: BLE001
        out.error = f"{type(e).__name__}: {e}"
        return out
    usage = data.get("usage") or {}
    prompt_tokens = usage.get("prompt_tokens", usage.get("input_tokens"))
    if prompt_tokens is not None:
        out.prompt_len = int(prompt_tokens)
    out.usage_reported = bool(usage)
    out.success = "answers" in data
    if not out.success:
        out.error = f"no answers in the response: {body[:200]!r}"
    return out


async def get_json(http: httpx.AsyncClient, target: Target, path: str) -> Any | None:
    """GET `path` as JSON; None when the server has no such route or answers something else."""
    try:
        resp = await http.get(target.url(path), timeout=10.0)
        return resp.json() if resp.status_code == 200 else None
    except (httpx.HTTPError, ValueError):
        return None


async def first_model(http: httpx.AsyncClient, target: Target) -> str:
    """The first model the server lists at /v1/models (what vLLM's bench uses when --model is absent)."""
    data = await get_json(http, target, "/v1/models")
    try:
        return str(data["data"][0]["id"])
    except (TypeError, KeyError, IndexError):
        raise RuntimeError(f"cannot list models at {target.url('/v1/models')}; pass --model") from None


async def count_tokens(http: httpx.AsyncClient, target: Target, text: str) -> int | None:
    """Tokens of `text` by the target's own tokenizer via /tokenize (vLLM and ladle's shape first,
    then llama.cpp's); None when the target has no such route."""
    bodies = ({"model": target.model, "prompt": text, "add_special_tokens": False}, {"content": text})
    for body in bodies:
        try:
            resp = await http.post(target.url("/tokenize"), json=body, timeout=30.0)
        except httpx.HTTPError:
            return None
        if resp.status_code == 404:
            return None
        if resp.status_code == 200:
            try:
                data = resp.json()
                return int(data["count"]) if "count" in data else len(data["tokens"])
            except (ValueError, KeyError, TypeError):
                return None
    return None


async def measure_tokens_per_word(http: httpx.AsyncClient, target: Target, words: int = 2000) -> float | None:
    """The target tokenizer's tokens per word of words.WORDS text; None without /tokenize."""
    text = random_words(np.random.default_rng(1234), words)
    count = await count_tokens(http, target, text)
    if not count:
        return None
    ratio = count / words
    return ratio if 0.3 <= ratio <= 5.0 else None
