"""GET /v1/kv_events: the prefix cache's stored and evicted blocks, as server-sent events.

A cache-aware router (`ladle router --policy kv_events`) subscribes once per worker and keeps an
exact view of what each holds. The first event is a snapshot of every cached block; then come
batches of "stored"/"removed" events, polled from the engine's log every POLL_SECONDS. A
subscriber that fell too far behind gets a fresh snapshot. Lines starting with ':' keep idle
connections alive.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncGenerator

from fastapi import APIRouter, Request
from fastapi.responses import Response

from ladle.engine.kv_events import KVEventLog
from ladle.server.context import get_context
from ladle.server.errors import APIError
from ladle.server.streaming import sse_response

router = APIRouter()

POLL_SECONDS = 0.02
KEEPALIVE_SECONDS = 10.0


# Left out of the OpenAPI document: a stream that never ends is for routers, not for API clients
# (the README documents its events).
@router.get("/v1/kv_events", include_in_schema=False)
async def kv_events(request: Request) -> Response:
    log = get_context(request).engine.kv_events
    if log is None:
        raise APIError(404, "this server keeps no prefix cache (--no-enable-prefix-caching): it has no KV events",
                       code="kv_events_unavailable")
    return sse_response(_events(log, request))


async def _events(log: KVEventLog, request: Request) -> AsyncGenerator[str, None]:
    snapshot = log.snapshot()
    seq, quiet_since = snapshot.seq, time.monotonic()
    yield _data(snapshot.to_json())
    while not await request.is_disconnected():
        await asyncio.sleep(POLL_SECONDS)
        news = log.since(seq)
        if news is None:  # fell behind the log: start again from what the cache holds now
            snapshot = log.snapshot()
            seq = snapshot.seq
            yield _data(snapshot.to_json())
        elif news[1]:
            seq = news[0]
            yield _data({"type": "events", "events": [e.to_json() for e in news[1]]})
        elif time.monotonic() - quiet_since > KEEPALIVE_SECONDS:
            yield ": keep-alive\n\n"
        else:
            continue
        quiet_since = time.monotonic()


def _data(payload: dict) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"
