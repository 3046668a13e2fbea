"""Pure ASGI layers in front of the routes: body size limit, the optional API key, the request log.

Pure ASGI (not BaseHTTPMiddleware) so that streamed responses and client
disconnects pass through untouched.
"""

from __future__ import annotations

import json
import logging
import secrets
import time
from dataclasses import dataclass

from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ladle.server.errors import error_body


async def send_error(send: Send, status: int, message: str, code: str | None = None,
                     headers: list[tuple[bytes, bytes]] | None = None) -> None:
    body = json.dumps(error_body(status, message, code=code)).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            *(headers or [])]})
    await send({"type": "http.response.body", "body": body})


class BodyLimitMiddleware:
    """Reads each request body up front, answering 413 past `max_bytes`, then replays it to the app."""

    DRAIN_LIMIT = 64 * 2**20  # an oversize body up to this is read and dropped, so the client sees the 413

    def __init__(self, app: ASGIApp, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS"):
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            # with Expect: 100-continue the client waits for our answer before sending the body
            drain = headers.get(b"expect", b"").lower() != b"100-continue" and int(length) <= self.DRAIN_LIMIT
            return await self._too_large(receive, send, int(length), drain)
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            more = message.get("more_body", False)
            if size > self.max_bytes:
                return await self._too_large(receive, send, size, more)
            chunks.append(chunk)
        replay: Message | None = {"type": "http.request", "body": b"".join(chunks), "more_body": False}

        async def replay_then_receive() -> Message:
            nonlocal replay
            if replay is not None:
                message, replay = replay, None
                return message
            return await receive()

        await self.app(scope, replay_then_receive, send)

    async def _too_large(self, receive: Receive, send: Send, size: int, drain: bool) -> None:
        # Closing on a client that is still sending would reset the connection before it reads
        # the answer, so read (and drop) the rest of a body of sane size first.
        read, more = 0, drain
        while more and read <= self.DRAIN_LIMIT:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            read += len(message.get("body", b""))
            more = message.get("more_body", False)
        await send_error(send, 413, f"the request body is too large ({size} bytes or more; the limit is "
                         f"{self.max_bytes} bytes)", code="request_too_large",
                         headers=[(b"connection", b"close")] if more else None)


def route_path(scope: Scope) -> str:
    """The path the routes see: behind a proxy prefix (--root-path) a client may send it or leave it out."""
    path, root = scope["path"], scope.get("root_path", "").rstrip("/")
    if root and (path == root or path.startswith(root + "/")):
        return path[len(root):] or "/"
    return path


class RootPathMiddleware:
    """--root-path: the app is served under a proxy's path prefix. As uvicorn's --root-path does, the
    prefix goes in scope["root_path"] and heads scope["path"] (as ASGI has it), whether or not the proxy
    stripped it; the routes, /docs and the OpenAPI "servers" then all agree. Outermost but for the log,
    so every layer inside sees the prefix."""

    def __init__(self, app: ASGIApp, root_path: str):
        self.app = app
        self.root = root_path.rstrip("/")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] in ("http", "websocket") and self.root:
            path = scope["path"]
            if not (path == self.root or path.startswith(self.root + "/")):
                path = self.root + path
            scope = {**scope, "root_path": self.root, "path": path}
        await self.app(scope, receive, send)


class APIKeyMiddleware:
    """Requires `Authorization: Bearer <key>` on /v1/* (as vLLM's --api-key)."""

    def __init__(self, app: ASGIApp, api_key: str):
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] == "OPTIONS" or not route_path(scope).startswith("/v1"):
            return await self.app(scope, receive, send)
        given = dict(scope["headers"]).get(b"authorization", b"")
        if not secrets.compare_digest(given, self.expected):
            message = "Incorrect API key provided" if given else "Missing API key: send 'Authorization: Bearer <key>'"
            return await send_error(send, 401, message, code="invalid_api_key",
                                    headers=[(b"www-authenticate", b"Bearer")])
        await self.app(scope, receive, send)


# -- the request log (--enable-log-requests) --------------------------------------

REQUEST_LOG = logging.getLogger("ladle.requests")
_RECORD = "ladle.request_record"


@dataclass
class RequestRecord:
    """What a route tells the request log about its request: counts, never content."""

    request_id: str | None = None
    prompt_tokens: int | None = None
    output_tokens: int | None = None  # a stream sets it when it ends


def request_record(request: Request) -> RequestRecord:
    return request.scope.setdefault(_RECORD, RequestRecord())


class RequestLogMiddleware:
    """One line per request, once its response has been sent: id, route, token counts, status, latency."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        record = scope.setdefault(_RECORD, RequestRecord())
        start, status = time.perf_counter(), 500  # 500 unless a response starts

        async def noting_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, noting_status)
        finally:
            latency_ms = (time.perf_counter() - start) * 1000
            REQUEST_LOG.info("request_id=%s route=\"%s %s\" status=%d prompt_tokens=%s output_tokens=%s "
                             "latency_ms=%.1f", record.request_id or "-", scope["method"], scope["path"], status,
                             _count(record.prompt_tokens), _count(record.output_tokens), latency_ms)


def _count(n: int | None) -> str:
    return "-" if n is None else str(n)
