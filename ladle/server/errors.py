"""Every error the server returns, in OpenAI's shape: {"error": {message, type, param, code}}."""

from __future__ import annotations

import logging
from http import HTTPStatus
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from ladle.engine.admission import QueueFullError
from ladle.engine.async_engine import EngineStoppedError
from ladle.errors import InvalidRequestError

log = logging.getLogger("ladle")

_TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error",
          405: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_exceeded",
          503: "server_error"}

# pydantic names union members in error locations ("str", "list[TextPart]"): not fields
_UNION_TAGS = {"str", "int", "float", "bool", "none", "list", "dict"}


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    """The body of every error answer."""

    error: ErrorDetail


class APIError(Exception):
    """Raise anywhere in a route to answer with this status and OpenAI error body."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers
        self.type = type or _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")


def error_body(status: int, message: str, param: str | None = None, code: str | None = None,
               type: str | None = None) -> dict[str, Any]:
    kind = type or _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return ErrorResponse(error=ErrorDetail(message=message, type=kind, param=param, code=code)).model_dump()


def error_response(status: int, message: str, param: str | None = None, code: str | None = None,
                   type: str | None = None, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param, code, type), status_code=status, headers=headers)


def api_error_of(exc: BaseException) -> APIError:
    """The client-facing error for an exception raised while serving a request."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, InvalidRequestError):
        message = exc.message if not exc.param or exc.param in exc.message else f"{exc.param}: {exc.message}"
        return APIError(400, message, exc.param, exc.code)
    if isinstance(exc, (ValidationError, RequestValidationError)):
        return validation_error(exc.errors())
    if isinstance(exc, EngineStoppedError):
        return APIError(503, str(exc), code="engine_unavailable")
    if isinstance(exc, QueueFullError):
        return APIError(429, str(exc), code="rate_limit_exceeded", headers={"Retry-After": str(exc.retry_after)})
    log.error("internal error while serving a request", exc_info=exc)
    return APIError(500, "internal server error", type="server_error", code="internal_error")


def validation_error(errors: list[dict[str, Any]] | Any) -> APIError:
    errors = list(errors)
    if not errors:
        return APIError(400, "invalid request")
    err = errors[0]
    kind = err.get("type")
    if kind == "json_invalid":
        detail = (err.get("ctx") or {}).get("error", err.get("msg", ""))
        return APIError(400, f"the request body is not valid JSON: {detail}")
    param = _param(err.get("loc", ()))
    if kind == "model_type" and not param:
        return APIError(400, "the request body must be a JSON object")
    if kind == "missing":
        return APIError(400, f"{param} is required", param=param)
    return APIError(400, f"{param}: {err.get('msg')}" if param else str(err.get("msg")), param=param)


def _param(loc: tuple | list) -> str | None:
    parts: list[str] = []
    for item in loc:
        if item == "body" and not parts:
            continue  # FastAPI prefixes body fields with "body"
        if isinstance(item, int):
            parts.append(f"[{item}]")
        elif item in _UNION_TAGS or any(c in str(item) for c in "[-("):
            continue
        else:
            parts.append(("." if parts else "") + str(item))
    return "".join(parts) or None


def install_error_handlers(app: FastAPI) -> None:
    async def on_api_error(request: Request, exc: Exception) -> JSONResponse:
        e = api_error_of(exc)
        return error_response(e.status, e.message, e.param, e.code, e.type, e.headers)

    async def on_http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 404 and exc.detail == "Not Found":
            message = f"Invalid URL ({request.method} {request.url.path})"
        elif exc.status_code == 405:
            message = f"Method {request.method} not allowed on {request.url.path}"
        else:
            message = str(exc.detail) if exc.detail else HTTPStatus(exc.status_code).phrase
        return JSONResponse(error_body(exc.status_code, message), status_code=exc.status_code, headers=exc.headers)

    for kind in (APIError, InvalidRequestError, ValidationError, RequestValidationError, EngineStoppedError,
                 QueueFullError, Exception):
        app.add_exception_handler(kind, on_api_error)
    app.add_exception_handler(StarletteHTTPException, on_http_error)
