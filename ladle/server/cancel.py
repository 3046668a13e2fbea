"""POST /v1/requests/{request_id}/cancel: stop a running request without closing its connection.

An agent framework (a voice agent dropping an eager draft when the caller keeps talking) cancels
by the `request_id` it put in the body, or by the response id. The request's stream ends at once
with finish_reason "abort" (and its usage); its blocks go back to the pool, and what its prompt
computed stays in the prefix cache for the request that follows.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from ladle.server.context import get_context
from ladle.server.errors import APIError
from ladle.server.openapi import schemas
from ladle.server.protocol import CancelResponse

router = APIRouter()


@router.post("/v1/requests/{request_id}/cancel", openapi_extra=schemas(response=CancelResponse))
async def cancel_request(request_id: str, request: Request) -> Response:
    ctx = get_context(request)
    engine_ids = ctx.live.get(request_id)
    if engine_ids is None:
        raise APIError(404, f"no running request {request_id!r} (it finished, or was never sent)",
                       param="request_id", code="request_not_found")
    for engine_id in engine_ids:
        ctx.engine.abort(engine_id)
    return Response(CancelResponse(id=request_id).model_dump_json(), media_type="application/json")
