"""The router's FastAPI app: its own routes (/health, /metrics, /workers) and a proxy for every
route a worker serves.

`build_app(RouterConfig(...))` can run under any ASGI server. Readiness: GET /health answers 200
once a worker is healthy (503 before), or, in process, `await app.state.router.pool.wait_until_healthy(t)`.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
from fastapi import FastAPI, Request
from starlette.responses import JSONResponse, Response

from ladle.router import disagg
from ladle.router.config import RouterConfig, strip_url
from ladle.router.kv_feed import follow
from ladle.router.policies import RequestInfo
from ladle.router.proxy import Forwarder, Outgoing, error_response, request_headers
from ladle.router.state import RouterState
from ladle.router.text import routing_text

# POST routes whose body holds a prompt: these go by the policy (the rest by least load)
PROMPT_ROUTES = {"/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/embeddings", "/v1/decisions",
                 "/v1/score", "/v1/systemone"}
KNOWN_ROUTES = PROMPT_ROUTES | {"/v1/models", "/tokenize", "/detokenize", "/version", "/v1/engine/stats",
                                "/v1/kv_events", "/v1/load_lora_adapter", "/v1/unload_lora_adapter"}
BROADCAST_ROUTES = ("/v1/load_lora_adapter", "/v1/unload_lora_adapter")


def build_app(config: RouterConfig) -> FastAPI:
    """The router over config's workers; it checks their health while it runs (the app's lifespan)."""
    state = RouterState.from_config(config)
    app = FastAPI(title="ladle router", lifespan=_lifespan(state), docs_url=None, redoc_url=None)
    app.state.router = state
    _add_own_routes(app, state)
    _add_proxy_routes(app, state)
    return app


def _lifespan(state: RouterState):
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        limits = httpx.Limits(max_connections=4096, max_keepalive_connections=256)
        async with httpx.AsyncClient(limits=limits, timeout=30.0) as client:
            state.client = client
            state.forwarder = Forwarder(state.pool, client, state.config.max_retries, state.config.request_timeout,
                                        on_retry=state.metrics.retries.inc,
                                        on_broken_stream=state.metrics.count_broken_stream)
            await state.pool.check_all(client, timeout=1.0)
            state.tasks = [asyncio.create_task(state.pool.health_loop(client, state.config.health_check_interval))]
            state.tasks += [asyncio.create_task(follow(client, url, view)) for url, view in state.views.items()]
            try:
                yield
            finally:
                for task in state.tasks:
                    task.cancel()
                await asyncio.gather(*state.tasks, return_exceptions=True)
    return lifespan


def _add_own_routes(app: FastAPI, state: RouterState) -> None:
    @app.get("/health")
    async def health() -> Response:
        healthy = len(state.pool.healthy(state.serving_role))
        if not healthy:
            return error_response(503, "no healthy worker yet", code="no_healthy_worker")
        return JSONResponse({"status": "ok", "healthy_workers": healthy})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.exposition(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/workers")
    async def workers() -> Response:
        return JSONResponse(state.pool.to_json(state.views))

    @app.post("/workers/drain")
    async def drain(request: Request) -> Response:
        return await _set_draining(request, state, True)

    @app.post("/workers/undrain")
    async def undrain(request: Request) -> Response:
        return await _set_draining(request, state, False)


async def _set_draining(request: Request, state: RouterState, draining: bool) -> Response:
    body = _json_or_none(await request.body())
    url = body.get("url") if isinstance(body, dict) else None
    if not isinstance(url, str):
        return error_response(400, 'the body must be {"url": "<worker url>"}')
    workers = state.pool.by_url(strip_url(url))
    if not workers:
        return error_response(404, f"no worker {url!r}", code="worker_not_found")
    for w in workers:
        w.draining = draining
    return JSONResponse(state.pool.to_json(state.views))


def _add_proxy_routes(app: FastAPI, state: RouterState) -> None:
    async def proxy(request: Request) -> Response:
        return await _proxy(request, state)

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        healthy = state.pool.healthy(state.serving_role)
        pinned = healthy[0].url if healthy else None
        return await state.forwarder.forward(_outgoing(request, b""), state.serving_role, state.plain_picker(),
                                             pinned=pinned)

    @app.post("/v1/requests/{request_id}/cancel")
    async def cancel(request_id: str, request: Request) -> Response:
        owner = state.sticky.owner(request_id)
        out = _outgoing(request, await request.body())
        if owner is None:
            return await _broadcast(state, out, first_success=True)
        return await state.forwarder.forward(out, state.serving_role, state.plain_picker(reason="sticky"),
                                             pinned=owner)

    for path in BROADCAST_ROUTES:
        app.add_api_route(path, _broadcaster(state), methods=["POST"])
    for path in ("/tokenize", "/detokenize", "/version", "/v1/{rest:path}"):
        app.add_api_route(path, proxy, methods=["GET", "POST", "DELETE"])


def _broadcaster(state: RouterState):
    async def broadcast(request: Request) -> Response:
        return await _broadcast(state, _outgoing(request, await request.body()), first_success=False)
    return broadcast


async def _broadcast(state: RouterState, out: Outgoing, first_success: bool) -> Response:
    """Sends out to every healthy worker. Answers the first worker's reply if all succeeded, else
    the first failure; with first_success (a cancel by an unknown id), the first success if any."""
    workers = state.pool.healthy()
    if not workers:
        return error_response(503, "no healthy worker is available", code="no_healthy_worker")
    replies = await asyncio.gather(*(_send_once(state, w, out) for w in workers))
    good = [r for r in replies if 200 <= r.status_code < 300]
    if first_success and good:
        return good[0]
    bad = [r for r in replies if not 200 <= r.status_code < 300]
    return bad[0] if bad else replies[0]


async def _send_once(state: RouterState, worker, out: Outgoing) -> Response:
    state.pool.started(worker, out.route)
    try:
        reply = await state.client.request(out.method, worker.url + out.path, headers=out.headers,
                                           content=out.content)
    except httpx.HTTPError as e:
        state.pool.mark_failed(worker)
        return error_response(502, f"worker {worker.url} failed: {type(e).__name__}", code="worker_failed")
    finally:
        state.pool.finished(worker)
    headers = {k: v for k, v in reply.headers.items() if k.lower() in ("content-type",)}
    return Response(reply.content, status_code=reply.status_code, headers=headers)


async def _proxy(request: Request, state: RouterState) -> Response:
    content = await request.body()
    out = _outgoing(request, content)
    path = request.url.path
    body = _json_or_none(content) if content else None
    prompted = request.method == "POST" and path in PROMPT_ROUTES
    info = RequestInfo(path, body, routing_text(body) if prompted else "")
    observe = state.record_response_id if path == "/v1/responses" else None
    pinned = _sticky_owner(state, path, body)
    role = state.serving_role
    if pinned is not None:
        return await state.forwarder.forward(out, role, state.plain_picker(info, "sticky"), observe, pinned)
    if not prompted:
        return await state.forwarder.forward(out, role, state.plain_picker(info), observe)
    if state.config.disaggregated and path in disagg.PD_ROUTES:
        return await disagg.prefill_then_decode(state, out, info)
    await state.prepare(role, info)
    return await state.forwarder.forward(out, role, state.policy_picker(role, info), observe)


def _sticky_owner(state: RouterState, path: str, body: Any) -> str | None:
    """The healthy worker that holds the response this request names, if the router knows it."""
    ident = None
    if isinstance(body, dict) and isinstance(body.get("previous_response_id"), str):
        ident = body["previous_response_id"]
    elif path.startswith("/v1/responses/"):
        ident = path.removeprefix("/v1/responses/").split("/")[0]
    owner = state.sticky.owner(ident) if ident else None
    return owner if owner and any(w.healthy for w in state.pool.by_url(owner)) else None


def _outgoing(request: Request, content: bytes) -> Outgoing:
    path = request.url.path
    query = f"?{request.url.query}" if request.url.query else ""
    return Outgoing(request.method, path + query, request_headers(request.headers), content, route_label(path))


def route_label(path: str) -> str:
    """The metrics label of a path: ids collapsed, unknown paths as one label (bounded cardinality)."""
    for prefix, label in (("/v1/responses/", "/v1/responses/{id}"), ("/v1/requests/", "/v1/requests/{id}/cancel"),
                          ("/v1/models/", "/v1/models/{model}")):
        if path.startswith(prefix):
            return label
    return path if path in KNOWN_ROUTES else "other"


def _json_or_none(content: bytes) -> Any:
    try:
        return json.loads(content)
    except (ValueError, UnicodeDecodeError):
        return None
