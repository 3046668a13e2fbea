"""The FastAPI application: routes, OpenAI-shaped errors, body limit, optional API key, CORS, request log."""

from __future__ import annotations

from contextlib import asynccontextmanager
from typing import AsyncIterator

from fastapi import FastAPI
from starlette.middleware.cors import CORSMiddleware

from ladle import __version__
from ladle.decisions import routes as decision_routes
from ladle.decisions.extensions import Extensions
from ladle.distributed.kv_transfer import KVTransferServer
from ladle.engine.async_engine import AsyncEngine
from ladle.server import cancel, embeddings, kv_events_route, lora_routes, openai_routes, responses, utility_routes
from ladle.server.context import ServerContext
from ladle.server.errors import install_error_handlers
from ladle.server.middleware import APIKeyMiddleware, BodyLimitMiddleware, RequestLogMiddleware, RootPathMiddleware
from ladle.server.openapi import install_openapi
from ladle.server.media import MediaLimits
from ladle.server.protocol import MAX_LOGPROBS
from ladle.server.response_store import DEFAULT_MAX_STORED_RESPONSES
from ladle.server.webui import router as webui_router

DEFAULT_MAX_BODY_BYTES = 16 * 2**20
ROUTERS = (openai_routes.router, cancel.router, responses.router, utility_routes.router, decision_routes.router,
           embeddings.router, lora_routes.router, kv_events_route.router)


def create_app(engine: AsyncEngine, served_model_name: str, api_key: str | None = None,
               max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, decision_extensions: Extensions | None = None,
               tool_call_parser: str | None = None, *, chat_template: str | None = None,
               max_logprobs: int = MAX_LOGPROBS, allowed_origins: list[str] | None = None,
               allowed_methods: list[str] | None = None, allowed_headers: list[str] | None = None,
               allow_credentials: bool = False, root_path: str = "", log_requests: bool = False,
               max_stored_responses: int = DEFAULT_MAX_STORED_RESPONSES, webui: bool = True,
               media: MediaLimits | None = None) -> FastAPI:
    """The app starts the engine thread on startup; stopping it is the caller's (`engine.shutdown()`),
    so one engine can outlive several apps. tool_call_parser: parse tool calls out of replies to
    tool_choice "auto" (vLLM's --enable-auto-tool-choice --tool-call-parser NAME); None refuses "auto".
    chat_template: the Jinja source chat requests are rendered with instead of the tokenizer's.
    allowed_origins: the origins browsers may call from (CORS; None or [] for none, ["*"] for any),
    with allowed_methods and allowed_headers (default any) and allow_credentials. root_path: the
    prefix a proxy serves the app under. log_requests: one log line per request ("ladle.requests").
    webui: serve the browser playground at `/`. media: how images named by URL are fetched and decoded."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine.add_step_listener(ctx.metrics.on_step)
        engine.start()
        ctx.kv_transfer_server = _start_kv_transfer(engine, ctx)
        try:
            yield
        finally:
            engine.remove_step_listener(ctx.metrics.on_step)
            if ctx.kv_transfer_server is not None:
                ctx.kv_transfer_server.close()

    app = FastAPI(title="ladle", version=__version__, lifespan=lifespan)
    app.state.ctx = ctx = ServerContext(engine, served_model_name, model_root=str(engine.engine.model_path),
                                        decision_extensions=decision_extensions or Extensions(served_model_name),
                                        tool_call_parser=tool_call_parser, chat_template=chat_template,
                                        max_logprobs=max_logprobs, max_stored_responses=max_stored_responses,
                                        media=media or MediaLimits())
    install_error_handlers(app)
    for router in ROUTERS:
        app.include_router(router)
    if webui:
        app.include_router(webui_router)
    install_openapi(app)
    app.add_middleware(BodyLimitMiddleware, max_bytes=max_body_bytes)
    if api_key:
        app.add_middleware(APIKeyMiddleware, api_key=api_key)  # no body is read before the key
    if allowed_origins:  # outside the key check: preflights carry no key, and a 401 needs CORS headers to be read
        app.add_middleware(CORSMiddleware, allow_origins=allowed_origins, allow_credentials=allow_credentials,
                           allow_methods=["*"] if allowed_methods is None else allowed_methods,
                           allow_headers=["*"] if allowed_headers is None else allowed_headers)
    if root_path:
        app.add_middleware(RootPathMiddleware, root_path=root_path)
    if log_requests:
        app.add_middleware(RequestLogMiddleware)  # outermost: it logs every answer, refusals included
    return app


def _start_kv_transfer(engine: AsyncEngine, ctx: ServerContext) -> KVTransferServer | None:
    """A prefill worker's TCP server for its handed-over K/V (--kv-transfer-config kv_producer)."""
    config, exports = engine.engine.config.kv_transfer_config, engine.engine.kv_exports
    if config is None or exports is None:
        return None
    return KVTransferServer(exports, config.kv_ip, config.kv_port, ctx.transfer_stats).start()
