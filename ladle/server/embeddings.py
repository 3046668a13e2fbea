"""POST /v1/embeddings: OpenAI's shape, read from the chat model's own hidden states.

ladle serves generative models, so an embedding is a pooled hidden state of the prompt:
`pooling` "last" (default; the last token, which has attended to all the others) or "mean"
(every token from `pooling_start`, default 0; the prefix cache serves only tokens before
it, so those are computed even when cached), after `layer`
(transformers' numbering: 0 the embeddings, i the output of decoder layer i, the last one
the final normed output; negative counts from the end, default -1). `normalize` (default
true, as OpenAI's embeddings are unit length) divides by the L2 norm. `ladle heads fit`
reads its features here, unnormalised, from the exact token ids a decision renders.
"""

from __future__ import annotations

import base64
import math
import struct
from typing import Literal

from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field

from ladle.decisions import scoring
from ladle.errors import InvalidRequestError
from ladle.server.context import get_context
from ladle.server.openai_routes import json_response, parse_body
from ladle.server.openapi import schemas
from ladle.server.protocol import Usage

router = APIRouter()


class EmbeddingRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    input: str | list[str] | list[int] | list[list[int]]
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None
    layer: int = -1
    pooling: Literal["last", "mean"] = "last"
    pooling_start: int = Field(0, ge=0)
    normalize: bool = True


class Embedding(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str


class EmbeddingResponse(BaseModel):
    object: Literal["list"] = "list"
    data: list[Embedding]
    model: str
    usage: Usage


def prompts_of(req: EmbeddingRequest, encode) -> list[list[int]]:
    """Token ids of each input: a text, a list of texts, one id list or a list of id lists."""
    raw = req.input
    if isinstance(raw, str):
        raw = [raw]
    if not raw:
        raise InvalidRequestError("input must not be empty", param="input")
    if all(isinstance(x, int) for x in raw):
        raw = [raw]
    prompts = [encode(x) if isinstance(x, str) else list(x) for x in raw]
    for i, ids in enumerate(prompts):
        if not ids:
            raise InvalidRequestError(f"input[{i}] is empty", param="input")
    return prompts


def encode_vector(values: list[float], normalize: bool, encoding: str) -> list[float] | str:
    if normalize:
        norm = math.sqrt(math.fsum(v * v for v in values)) or 1.0
        values = [v / norm for v in values]
    if encoding == "base64":  # little-endian float32, as OpenAI's clients decode it
        return base64.b64encode(struct.pack(f"<{len(values)}f", *values)).decode()
    return values


@router.post("/v1/embeddings", openapi_extra=schemas(EmbeddingRequest, EmbeddingResponse, examples={
    "text": {"input": ["a red apple", "a green pear"]},
    "mean pooled, base64": {"input": "a red apple", "pooling": "mean", "encoding_format": "base64"}}))
async def embeddings(request: Request) -> Response:
    ctx = get_context(request)
    req = await parse_body(request, EmbeddingRequest)
    model = ctx.check_model(req.model)
    if req.dimensions is not None:
        raise InvalidRequestError("dimensions is not supported: ladle's embeddings are the model's hidden size",
                                  param="dimensions")
    try:
        layer = ctx.engine.hidden_state_index(req.layer)
    except ValueError as e:
        raise InvalidRequestError(str(e), param="layer") from None
    prompts = prompts_of(req, ctx.engine.tokenizer.encode)
    if req.pooling_start and req.pooling != "mean":
        raise InvalidRequestError("pooling_start applies to mean pooling only", param="pooling_start")
    if any(req.pooling_start >= len(ids) for ids in prompts):
        raise InvalidRequestError("pooling_start must be below every input's token count", param="pooling_start")
    jobs = [scoring.ScoreJob(ids, None, [layer], req.pooling, req.pooling_start) for ids in prompts]
    results = await scoring.score(ctx.engine.with_lora(model.lora), jobs)
    data = [Embedding(index=i, embedding=encode_vector(r.hidden_states[layer], req.normalize, req.encoding_format))
            for i, r in enumerate(results)]
    usage = Usage.of(sum(r.num_prompt_tokens for r in results), 0, sum(r.num_cached_tokens for r in results))
    return json_response(EmbeddingResponse(data=data, model=model.name, usage=usage))
