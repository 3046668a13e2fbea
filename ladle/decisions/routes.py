"""POST /v1/decisions (reference and OpenAI dialects), /v1/score and /v1/systemone."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Awaitable
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import BaseModel

from ladle.decisions import openai_dialect, reference, score, systemone
from ladle.decisions.examples import DECISION_EXAMPLES, SCORE_EXAMPLES, SYSTEMONE_EXAMPLES
from ladle.decisions.protocol import DecisionsRequest, DecisionsResponse, ScoreRequest, ScoreResponse, parse
from ladle.decisions.extensions import Extensions
from ladle.engine.adapter_engine import AdapterEngine
from ladle.engine.async_engine import AsyncEngine
from ladle.server.context import ServedModel, ServerContext, get_context
from ladle.server.errors import APIError
from ladle.server.openai_routes import json_response
from ladle.server.openapi import schemas
from ladle.server.streaming import ClientDisconnected, unless_disconnected

router = APIRouter()


def _json(raw: bytes) -> Any:
    try:
        return json.loads(raw)
    except ValueError as e:
        raise APIError(400, f"the request body is not valid JSON: {e}") from None


def is_openai_dialect(data: Any) -> bool:
    """OpenAI questions require `instructions`, which the reference dialect refuses."""
    questions = data.get("questions") if isinstance(data, dict) else None
    return isinstance(questions, list) and any(isinstance(q, dict) and "instructions" in q for q in questions)


def _on(ctx: ServerContext, model: ServedModel) -> tuple[AsyncEngine | AdapterEngine, str]:
    """(engine, name) a decision is answered with: an adapter's decisions run on that adapter."""
    return ctx.engine.with_lora(model.lora), model.name


def _extensions(ctx: ServerContext, model: ServedModel) -> Extensions:
    """The calibrations and heads, checked against the model the request names (base or adapter)."""
    return dataclasses.replace(ctx.decision_extensions, model_name=model.name)


async def _images(ctx: ServerContext, parts: list[tuple[str, str]]) -> tuple:
    """The images these (part name, URL) pairs name, fetched and decoded; a 400 names the part at fault."""
    ctx.check_images(parts)
    return (await ctx.image_prompt("", parts)).images


async def _answer(request: Request, work: Awaitable[BaseModel]) -> Response:
    try:
        return json_response(await unless_disconnected(request, work))
    except ClientDisconnected:
        return Response(status_code=499)


@router.post("/v1/decisions", openapi_extra=schemas(
    DecisionsRequest | openai_dialect.OpenAIDecisionRequest, DecisionsResponse | openai_dialect.OpenAIDecision,
    examples=DECISION_EXAMPLES))
async def decisions(request: Request) -> Response:
    ctx = get_context(request)
    raw = await request.body()
    if is_openai_dialect(_json(raw)):
        oreq = parse(openai_dialect.OpenAIDecisionRequest, raw)
        model = ctx.check_model(oreq.model, status=400)
        return await _answer(request, openai_dialect.handle(*_on(ctx, model), oreq, _extensions(ctx, model),
                                                            lambda parts: _images(ctx, parts)))
    req = parse(DecisionsRequest, raw)
    model = ctx.check_model(req.model, status=400)
    return await _answer(request, reference.handle(*_on(ctx, model), req, _extensions(ctx, model)))


@router.post("/v1/score", openapi_extra=schemas(ScoreRequest, ScoreResponse, examples=SCORE_EXAMPLES))
async def score_route(request: Request) -> Response:
    ctx = get_context(request)
    req = parse(ScoreRequest, await request.body())
    model = ctx.check_model(req.model, status=400)
    return await _answer(request, score.handle(*_on(ctx, model), req))


@router.post("/v1/systemone", openapi_extra=schemas(systemone.SystemOneRequest, systemone.SystemOneResponse,
                                                    examples=SYSTEMONE_EXAMPLES))
async def systemone_route(request: Request) -> Response:
    ctx = get_context(request)
    raw = await request.body()
    systemone.refuse_decisions_fields(_json(raw))
    req = parse(systemone.SystemOneRequest, raw)
    model = ctx.check_model(req.model, status=400)
    return await _answer(request, systemone.handle(*_on(ctx, model), req, _extensions(ctx, model)))
