"""Forwarding one request to a worker: retries before the first byte, streaming after it.

A request that cannot connect, or gets a 5xx, or breaks while its (non-streamed) reply is read,
goes to another worker, up to max_retries times, and the worker that failed gets no traffic
until its next good health check. A text/event-stream reply is passed on chunk by chunk; once
it started, it is never retried (the client has bytes already): a stream the worker breaks off,
or ends without its last event, ends in an error event (ladle.router.stream_end), counted by
reason. A client that hangs up closes the upstream stream, so the worker aborts the request.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import anyio
import httpx
from starlette.background import BackgroundTask
from starlette.responses import JSONResponse, Response, StreamingResponse

from ladle.router.stream_end import StreamEnd
from ladle.router.workers import Worker, WorkerPool

# never forwarded either way: they describe one connection, not the message
_HOP_HEADERS = {"host", "content-length", "connection", "keep-alive", "transfer-encoding", "te", "trailer",
                "upgrade", "proxy-connection", "proxy-authorization"}

Picker = Callable[[list[Worker], bool], Worker]  # (candidates, is_retry) -> the worker to try
Observer = Callable[[Worker, Any], None]  # (worker, a JSON reply or a stream's first event)


@dataclass
class Outgoing:
    method: str
    path: str  # with the query string, if any
    headers: dict[str, str]
    content: bytes = b""
    route: str = ""  # the metrics label: the path without ids


@dataclass
class Forwarder:
    pool: WorkerPool
    client: httpx.AsyncClient
    max_retries: int
    read_timeout: float
    on_retry: Callable[[], None] = lambda: None
    on_broken_stream: Callable[[str], None] = lambda reason: None  # a stream that ended in an error event

    async def forward(self, out: Outgoing, role: str, pick: Picker, observe: Observer | None = None,
                      pinned: str | None = None) -> Response:
        """Sends out to a worker of role chosen by pick, or only to the worker at URL pinned (a sticky
        route: it may be draining, and no other worker can stand in for it)."""
        tried: set[Worker] = set()
        for attempt in range(self.max_retries + 1):
            candidates = [w for w in self._eligible(role, pinned) if w not in tried]
            if not candidates:
                break
            if attempt:
                self.on_retry()
            worker = pick(candidates, attempt > 0)
            tried.add(worker)
            last_try = attempt == self.max_retries or len(candidates) == 1
            response = await self._attempt(worker, out, last_try, observe)
            if response is not None:
                return response
        return no_worker_response(role, len(tried))

    def _eligible(self, role: str, pinned: str | None) -> list[Worker]:
        if pinned is None:
            return self.pool.available(role)
        return [w for w in self.pool.by_url(pinned) if w.healthy]

    async def _attempt(self, worker: Worker, out: Outgoing, last_try: bool,
                       observe: Observer | None) -> Response | None:
        """The response for the client, or None when the request should go to another worker."""
        self.pool.started(worker, out.route)
        request = self.client.build_request(out.method, worker.url + out.path, headers=out.headers,
                                            content=out.content, timeout=self._timeout())
        upstream = None
        try:
            upstream = await self.client.send(request, stream=True)
            if upstream.status_code >= 500:
                self.pool.mark_failed(worker)
                if not last_try:
                    raise _Retry
            if is_event_stream(upstream):
                return self._stream(worker, upstream, observe, responses=out.path.startswith("/v1/responses"))
            content = b"".join([chunk async for chunk in upstream.aiter_raw()])
        except (httpx.HTTPError, _Retry) as e:
            if upstream is not None:
                await upstream.aclose()
            self.pool.finished(worker)
            if not isinstance(e, _Retry):
                self.pool.mark_failed(worker)
            return None
        await upstream.aclose()
        self.pool.finished(worker)
        if observe is not None and upstream.status_code == 200:
            observe(worker, _json_or_none(content))
        return Response(content, status_code=upstream.status_code, headers=reply_headers(upstream))

    def _stream(self, worker: Worker, upstream: httpx.Response, observe: Observer | None,
                responses: bool) -> StreamingResponse:
        done = False

        async def close() -> None:  # after the last chunk, a failure, or the client hanging up
            nonlocal done
            if not done:
                done = True
                with anyio.CancelScope(shield=True):
                    await upstream.aclose()
                self.pool.finished(worker)

        async def chunks() -> AsyncIterator[bytes]:
            first = FirstEvent(worker, observe) if observe is not None else None
            end = StreamEnd(responses)
            broken = None
            try:
                async for chunk in upstream.aiter_raw():
                    if first is not None:
                        first.feed(chunk)
                    end.feed(chunk)
                    yield chunk
            except httpx.HTTPError as e:  # bytes went out already: no retry, an error event instead
                broken = "worker_disconnected"
                self.pool.mark_failed(worker)
                message = f"the worker serving this stream failed mid-way ({type(e).__name__})"
            finally:
                await close()
            if broken is None and not end.ended:
                broken, message = "ended_without_done", "the worker ended this stream without its last event"
            if broken is not None:
                self.on_broken_stream(broken)
                yield end.failure_event(message)

        return StreamingResponse(chunks(), status_code=upstream.status_code, headers=reply_headers(upstream),
                                 background=BackgroundTask(close))

    def _timeout(self) -> httpx.Timeout:
        return httpx.Timeout(30.0, connect=5.0, read=self.read_timeout)


class _Retry(Exception):
    """The worker answered 5xx and another worker may take the request."""


@dataclass
class FirstEvent:
    """Hands a stream's first `data:` event to the observer (a /v1/responses stream names its
    response id there), buffering until it is complete."""
    worker: Worker
    observe: Observer
    buffer: bytes = b""
    seen: bool = False
    limit: int = 1 << 20

    def feed(self, chunk: bytes) -> None:
        if self.seen:
            return
        self.buffer += chunk
        while b"\n" in self.buffer:
            line, self.buffer = self.buffer.split(b"\n", 1)
            if line.startswith(b"data:"):
                self.seen = True
                self.observe(self.worker, _json_or_none(line[len(b"data:"):]))
                return
        self.seen = len(self.buffer) > self.limit


def is_event_stream(reply: httpx.Response) -> bool:
    return reply.headers.get("content-type", "").startswith("text/event-stream")


def request_headers(headers: Any) -> dict[str, str]:
    """The client's headers a worker should see (Authorization unchanged); we never ask for a
    compressed reply, since it is passed on as it comes."""
    return {k: v for k, v in headers.items() if k.lower() not in _HOP_HEADERS | {"accept-encoding"}}


def reply_headers(reply: httpx.Response) -> dict[str, str]:
    return {k: v for k, v in reply.headers.items() if k.lower() not in _HOP_HEADERS}


def error_response(status: int, message: str, code: str | None = None, type: str | None = None) -> JSONResponse:
    """OpenAI's error shape."""
    kind = type or ("service_unavailable" if status == 503 else "server_error" if status >= 500
                    else "invalid_request_error")
    return JSONResponse({"error": {"message": message, "type": kind, "param": None, "code": code}},
                        status_code=status)


def no_worker_response(role: str, tried: int) -> JSONResponse:
    who = "worker" if role == "worker" else f"{role} worker"
    if tried:
        return error_response(503, f"no {who} could take the request ({tried} tried, all failed)",
                              code="no_healthy_worker")
    return error_response(503, f"no healthy {who} is available", code="no_healthy_worker")


def _json_or_none(content: bytes) -> Any:
    try:
        return json.loads(content)
    except (ValueError, UnicodeDecodeError):
        return None
