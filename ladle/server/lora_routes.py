"""LoRA adapters at run time, as vLLM serves them: POST /v1/load_lora_adapter and /v1/unload_lora_adapter.

Both answer plain text, as vLLM does; refusals are OpenAI-shaped errors naming the field.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse, Response
from pydantic import Field

from ladle.lora.adapter import AdapterError, AdapterNameError
from ladle.server.context import ServerContext, get_context
from ladle.server.errors import APIError
from ladle.server.openai_routes import parse_body
from ladle.server.openapi import schemas
from ladle.server.protocol import _Request

router = APIRouter()


class LoadLoRAAdapterRequest(_Request):
    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1, description="a PEFT folder: adapter_config.json + adapter_model.safetensors")
    load_inplace: bool = Field(False, description="replace an adapter already loaded under this name")


class UnloadLoRAAdapterRequest(_Request):
    lora_name: str = Field(min_length=1)


def _enabled(ctx: ServerContext) -> None:
    if not ctx.engine.lora_enabled:
        raise APIError(400, "LoRA adapters are not enabled: start the server with --enable-lora", param="lora_name")


@router.post("/v1/load_lora_adapter", openapi_extra=schemas(LoadLoRAAdapterRequest, media_type="text/plain",
                                                            examples={"adapter": {"lora_name": "sql",
                                                                                  "lora_path": "/adapters/sql"}}))
async def load_lora_adapter(request: Request) -> Response:
    ctx = get_context(request)
    req = await parse_body(request, LoadLoRAAdapterRequest)
    _enabled(ctx)
    if req.lora_name == ctx.model_name:
        raise APIError(400, f"`{req.lora_name}` is the base model's name", param="lora_name")
    if req.load_inplace:
        ctx.engine.remove_lora(req.lora_name)
    try:
        await ctx.engine.add_lora(req.lora_name, req.lora_path)
    except AdapterError as e:
        param = "lora_name" if isinstance(e, AdapterNameError) else "lora_path"
        raise APIError(400, f"The lora adapter '{req.lora_name}' cannot be loaded: {e}", param=param) from None
    return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' added successfully.")


@router.post("/v1/unload_lora_adapter", openapi_extra=schemas(UnloadLoRAAdapterRequest, media_type="text/plain",
                                                              examples={"adapter": {"lora_name": "sql"}}))
async def unload_lora_adapter(request: Request) -> Response:
    ctx = get_context(request)
    req = await parse_body(request, UnloadLoRAAdapterRequest)
    _enabled(ctx)
    if not ctx.engine.remove_lora(req.lora_name):
        raise APIError(404, f"The lora adapter '{req.lora_name}' cannot be found.", param="lora_name",
                       code="model_not_found")
    return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' removed successfully.")
