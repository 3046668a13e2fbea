"""Everything besides generation: models, tokenize/detokenize (vLLM's shapes), health, version, stats, metrics,
and resetting the prefix cache."""

from __future__ import annotations

from dataclasses import asdict

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from ladle import __version__
from ladle.engine.async_engine import EngineSnapshot
from ladle.errors import InvalidRequestError
from ladle.server.chat_prompt import chat_prompt
from ladle.server.context import ServerContext, get_context
from ladle.server.errors import APIError
from ladle.server.openai_routes import json_response, parse_body
from ladle.server.openapi import schemas
from ladle.server.protocol import (
    DetokenizeRequest, DetokenizeResponse, ModelCard, ModelList, TokenizeRequest, TokenizeResponse, VersionInfo,
)

router = APIRouter()


def _cards(ctx: ServerContext) -> list[ModelCard]:
    """The base model, then its LoRA adapters (parent: the base)."""
    base = ModelCard(id=ctx.model_name, created=ctx.created, root=ctx.model_root, max_model_len=ctx.engine.max_model_len)
    return [base, *(ModelCard(id=ref.name, created=ctx.created, root=str(ref.path), parent=ctx.model_name,
                              max_model_len=ctx.engine.max_model_len) for ref in ctx.engine.list_loras())]


@router.get("/v1/models", openapi_extra=schemas(response=ModelList))
async def list_models(request: Request) -> Response:
    return json_response(ModelList(data=_cards(get_context(request))))


@router.get("/v1/models/{model:path}", openapi_extra=schemas(response=ModelCard))
async def retrieve_model(model: str, request: Request) -> Response:
    ctx = get_context(request)
    name = ctx.check_model(model).name
    return json_response(next(card for card in _cards(ctx) if card.id == name))


@router.post("/tokenize", openapi_extra=schemas(TokenizeRequest, TokenizeResponse, examples={
    "prompt": {"prompt": "Hello world", "return_token_strs": True},
    "chat": {"messages": [{"role": "user", "content": "Hi"}]}}))
async def tokenize(request: Request) -> Response:
    ctx = get_context(request)
    req = await parse_body(request, TokenizeRequest)
    ctx.check_model(req.model)
    tok = ctx.engine.tokenizer
    if req.messages is not None:
        tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
        text = chat_prompt(ctx.chat_tokenizer, req.messages, req.add_generation_prompt, req.continue_final_message,
                           req.chat_template_kwargs, tools)
        add_special = bool(req.add_special_tokens)  # vLLM: the template already holds them
    elif req.prompt is not None:
        if req.tools:
            raise InvalidRequestError("tools are rendered by the chat template: send messages with them",
                                      param="tools")
        text = req.prompt
        add_special = req.add_special_tokens is not False
    else:
        raise InvalidRequestError("give either prompt or messages", param="prompt")
    ids = tok.encode(text, add_special_tokens=add_special)
    strs = [tok.id_to_token(i) for i in ids] if req.return_token_strs else None
    body = TokenizeResponse(count=len(ids), max_model_len=ctx.engine.max_model_len, tokens=ids, token_strs=strs)
    return json_response(body)


@router.post("/detokenize", openapi_extra=schemas(DetokenizeRequest, DetokenizeResponse, examples={
    "tokens": {"tokens": [19556, 905]}}))
async def detokenize(request: Request) -> Response:
    ctx = get_context(request)
    req = await parse_body(request, DetokenizeRequest)
    ctx.check_model(req.model)
    vocab = ctx.engine.tokenizer.vocab_size
    bad = next((i for i, t in enumerate(req.tokens) if not 0 <= t < vocab), None)
    if bad is not None:
        raise APIError(400, f"token id {req.tokens[bad]} is out of range [0, {vocab})", param=f"tokens[{bad}]")
    return json_response(DetokenizeResponse(prompt=ctx.engine.tokenizer.decode(req.tokens)))


@router.get("/health", openapi_extra=schemas())
async def health(request: Request) -> Response:
    engine = get_context(request).engine
    if not engine.is_running:
        failure = engine.engine.failure
        raise APIError(503, f"the engine cannot compute: {failure}" if failure else "the engine is not running",
                       code="engine_unavailable")
    return Response(status_code=200)


@router.get("/version", openapi_extra=schemas(response=VersionInfo))
async def version(request: Request) -> Response:
    return json_response(VersionInfo(version=__version__, **get_context(request).engine.runtime_info))


@router.get("/v1/engine/stats", openapi_extra=schemas(response=EngineSnapshot))
async def engine_stats(request: Request) -> Response:
    """Scheduler and KV pool state after the last step (GET /metrics has the same, for Prometheus)."""
    return JSONResponse(asdict(get_context(request).engine.snapshot()))


@router.post("/reset_prefix_cache", openapi_extra=schemas(errors={409: "Running requests hold cached blocks"}))
async def reset_prefix_cache(request: Request) -> Response:
    """Drop the prefix cache (vLLM's route; for cold benchmark runs): 200 once nothing is cached, 409
    when running requests hold cached blocks, which stay (every other block is dropped all the same)."""
    if not await get_context(request).engine.reset_prefix_cache():
        raise APIError(409, "running requests hold cached blocks, which stay cached; every other block was "
                            "dropped (reset again once they finish)", code="prefix_cache_in_use")
    return Response(status_code=200)


@router.get("/metrics", openapi_extra=schemas(media_type="text/plain"))
async def metrics(request: Request) -> Response:
    """Prometheus text format, with vLLM's metric names."""
    return Response(get_context(request).metrics.render(), media_type=CONTENT_TYPE_LATEST)
