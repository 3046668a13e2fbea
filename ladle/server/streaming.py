"""Plumbing between engine streams and HTTP: SSE framing, merging, collecting, disconnects."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel

from ladle.engine.async_engine import RequestStream
from ladle.llm import Completion, GenerationResult
from ladle.server.errors import api_error_of, error_body

T = TypeVar("T")

DONE = "data: [DONE]\n\n"


class ClientDisconnected(Exception):
    """The client went away before its (non-streamed) response was ready."""


def sse_event(payload: BaseModel | dict[str, Any], exclude: set[str] | None = None, event: str | None = None) -> str:
    """One server-sent event; `event` names it (the Responses API's typed events), else it is unnamed."""
    data = payload.model_dump_json(exclude=exclude) if isinstance(payload, BaseModel) else json.dumps(payload)
    return f"event: {event}\ndata: {data}\n\n" if event else f"data: {data}\n\n"


def sse_error(exc: BaseException) -> str:
    """An error after the stream began can only travel as an event (as vLLM and OpenAI do)."""
    e = api_error_of(exc)
    return sse_event(error_body(e.status, e.message, e.param, e.code, e.type))


class EventStreamResponse(StreamingResponse):
    """Closes its event generator however the response ends, so the generator's cleanup
    (aborting the request) runs now, not whenever the generator is garbage collected."""

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()


def sse_response(events: AsyncGenerator[str, None]) -> StreamingResponse:
    return EventStreamResponse(events, media_type="text/event-stream",
                               headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


async def merge(streams: list[RequestStream]) -> AsyncIterator[tuple[int, Any]]:
    """(stream index, output) from all streams, in arrival order."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()
    end = object()

    async def pump(i: int, stream: RequestStream) -> None:
        try:
            async for out in stream:
                queue.put_nowait((i, out))
            queue.put_nowait((i, end))
        except Exception as e:
            queue.put_nowait((i, e))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(streams)
        while remaining:
            i, item = await queue.get()
            if item is end:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()


async def collect(stream: RequestStream, n: int) -> tuple[GenerationResult, int]:
    """All of one request's output; returns (result, number of prompt tokens served from cache)."""
    result = GenerationResult(stream.request_id, stream.prompt_token_ids, [Completion(i) for i in range(n)])
    cached = 0
    try:
        async for out in stream:
            result.absorb(out)
            cached = out.num_cached_tokens
    finally:
        stream.abort()  # no-op once finished; frees the blocks if we were cancelled
    return result, cached


def abort_all(streams: list[RequestStream]) -> None:
    for s in streams:
        s.abort()


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await `work`, but cancel it (aborting its requests) when the client disconnects first."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    if task.cancelled():
        raise ClientDisconnected()
    return task.result()


async def _wait_for_disconnect(request: Request) -> None:
    # The body was read already, so the next ASGI message is the disconnect.
    while (await request.receive())["type"] != "http.disconnect":
        pass
