"""The FastAPI application: routes, OpenAI-shaped errors, body limit, optional API key."""

from __future__ import annotations

from contextlib import asynccontextmanager
from typing import AsyncIterator

from fastapi import FastAPI

from ladle import __version__
from ladle.decisions import routes as decision_routes
from ladle.decisions.extensions import Extensions
from ladle.engine.async_engine import AsyncEngine
from ladle.server import embeddings, openai_routes, utility_routes
from ladle.server.context import ServerContext
from ladle.server.errors import install_error_handlers
from ladle.server.middleware import APIKeyMiddleware, BodyLimitMiddleware

DEFAULT_MAX_BODY_BYTES = 16 * 2**20


def create_app(engine: AsyncEngine, served_model_name: str, api_key: str | None = None,
               max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, decision_extensions: Extensions | None = None,
               tool_call_parser: str | None = None) -> FastAPI:
    """The app starts the engine thread on startup; stopping it is the caller's (`engine.shutdown()`),
    so one engine can outlive several apps. tool_call_parser: parse tool calls out of replies to
    tool_choice "auto" (vLLM's --enable-auto-tool-choice --tool-call-parser NAME); None refuses "auto"."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine.add_step_listener(ctx.metrics.on_step)
        engine.start()
        try:
            yield
        finally:
            engine.remove_step_listener(ctx.metrics.on_step)

    app = FastAPI(title="ladle", version=__version__, lifespan=lifespan)
    app.state.ctx = ctx = ServerContext(engine, served_model_name, model_root=str(engine.engine.model_path),
                                        decision_extensions=decision_extensions or Extensions(served_model_name),
                                        tool_call_parser=tool_call_parser)
    install_error_handlers(app)
    app.include_router(openai_routes.router)
    app.include_router(utility_routes.router)
    app.include_router(decision_routes.router)
    app.include_router(embeddings.router)
    app.add_middleware(BodyLimitMiddleware, max_bytes=max_body_bytes)
    if api_key:
        app.add_middleware(APIKeyMiddleware, api_key=api_key)  # outermost: no body is read before the key
    return app
