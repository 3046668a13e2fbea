"""Follows one worker's GET /v1/kv_events stream into its KVView, reconnecting with backoff.

While the stream is down the view is stale (kv_events then leaves the decision to cache_aware);
the first event of every connection is a snapshot, so a reconnect starts from the truth.
"""

from __future__ import annotations

import asyncio
import json

import httpx

from ladle.router.kv_view import KVView

FIRST_BACKOFF = 0.25
MAX_BACKOFF = 5.0
READ_TIMEOUT = 30.0  # the worker sends a keep-alive comment every 10 s when idle


async def follow(client: httpx.AsyncClient, url: str, view: KVView) -> None:
    """Runs until cancelled."""
    backoff = FIRST_BACKOFF
    while True:
        try:
            await _read_stream(client, url, view)
            backoff = FIRST_BACKOFF  # it was up: a clean end (a worker restart) reconnects quickly
        except (httpx.HTTPError, ValueError, KeyError, TypeError):  # down, refused, or a malformed event
            backoff = min(backoff * 2, MAX_BACKOFF)
        view.mark_stale()
        await asyncio.sleep(backoff)


async def _read_stream(client: httpx.AsyncClient, url: str, view: KVView) -> None:
    timeout = httpx.Timeout(10.0, read=READ_TIMEOUT)
    async with client.stream("GET", f"{url}/v1/kv_events", timeout=timeout) as reply:
        if reply.status_code != 200:
            raise ValueError(f"{url}/v1/kv_events answered {reply.status_code}")
        async for line in reply.aiter_lines():
            if line.startswith("data:"):
                view.apply(json.loads(line[len("data:"):]))
