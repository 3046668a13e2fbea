"""The OpenAPI document: every route's request and response schemas.

Routes validate their bodies themselves, so that every problem is a 400 naming the field
(never FastAPI's 422), which leaves FastAPI nothing to describe. Each route declares its
shapes with `openapi_extra=schemas(...)` instead, and `install_openapi` writes them, with the error
answers, into the document FastAPI generates (`/openapi.json`, `/docs`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import TypeAdapter
from pydantic.json_schema import GenerateJsonSchema

from ladle.server.errors import ErrorResponse

_KEY = "x-ladle-shapes"  # names a RouteDoc in the operation until build_openapi replaces it
COMPONENTS = "#/components/schemas/{model}"
# Any route may answer these: a bad body or parameter, a missing API key, an unknown model or
# id, a body over the limit, a full queue, a stopped engine.
ERRORS = {400: "Invalid request (the error's `param` names the field)", 401: "Missing or wrong API key",
          404: "Unknown model or id", 413: "Request body too large",
          429: "Queue full (`Retry-After` says when to come back)", 503: "The engine is not running"}


@dataclass(frozen=True)
class RouteDoc:
    request: Any = None  # the JSON body's type (a pydantic model, or a union of them)
    response: Any = None  # the 200 answer's JSON type; None: no body
    stream_event: Any = None  # with `"stream": true`, the type of each server-sent event's data
    media_type: str | None = None  # a 200 answer that is not JSON (its schema: a string)
    examples: dict[str, dict] | None = None  # request bodies by name, shown in /docs (each answers 200)
    errors: dict[int, str] | None = None  # this route's own error answers, besides ERRORS


_DOCS: dict[str, RouteDoc] = {}


def schemas(request: Any = None, response: Any = None, *, stream_event: Any = None,
            media_type: str | None = None, examples: dict[str, dict] | None = None,
            errors: dict[int, str] | None = None) -> dict[str, Any]:
    """A route's shapes, passed as its `openapi_extra`; `install_openapi` turns them into schemas.
    (The document holds only JSON, so the shapes wait in a registry under a key.)"""
    key = str(len(_DOCS))
    _DOCS[key] = RouteDoc(request, response, stream_event, media_type, examples, errors)
    return {_KEY: key}


def install_openapi(app: FastAPI) -> None:
    """Have app.openapi() build the document with the declared shapes, once."""
    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = build_openapi(app)
        return app.openapi_schema
    app.openapi = openapi


def build_openapi(app: FastAPI) -> dict[str, Any]:
    doc = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes,
                      servers=app.servers)
    operations = [op for path in doc["paths"].values() for op in path.values() if _KEY in op]
    refs, definitions = _schemas([_DOCS[op[_KEY]] for op in operations])
    for op in operations:
        _describe(op, _DOCS[op.pop(_KEY)], refs)
    schemas = doc.setdefault("components", {}).setdefault("schemas", {})
    for unused in ("HTTPValidationError", "ValidationError"):  # FastAPI's 422, which ladle never sends
        schemas.pop(unused, None)
    schemas.update(definitions)
    return doc


def _schemas(docs: list[RouteDoc]) -> tuple[dict[Any, dict], dict[str, dict]]:
    """One JSON schema per declared type ($refs into components) and the components they use.
    Requests are described as they validate, answers as they serialise."""
    modes: dict[Any, str] = {ErrorResponse: "serialization"}
    for d in docs:
        modes.update({t: "serialization" for t in (d.response, d.stream_event) if t is not None})
        if d.request is not None:
            modes[d.request] = "validation"
    inputs = [(t, mode, TypeAdapter(t).core_schema) for t, mode in modes.items()]
    refs, definitions = GenerateJsonSchema(ref_template=COMPONENTS).generate_definitions(inputs)
    return {t: schema for (t, _mode), schema in refs.items()}, definitions


def _describe(op: dict[str, Any], d: RouteDoc, refs: dict) -> None:
    if d.request is not None:
        body: dict[str, Any] = {"schema": refs[d.request]}
        if d.examples:
            body["examples"] = {name: {"value": value} for name, value in d.examples.items()}
        op["requestBody"] = {"required": True, "content": {"application/json": body}}
    ok: dict[str, Any] = {"description": "Success"}
    content: dict[str, Any] = {}
    if d.response is not None:
        content["application/json"] = {"schema": refs[d.response]}
    if d.media_type is not None:
        content[d.media_type] = {"schema": {"type": "string"}}
    if d.stream_event is not None:
        content["text/event-stream"] = {"schema": _event_schema(refs[d.stream_event], refs[ErrorResponse])}
    if content:
        ok["content"] = content
    error = {"application/json": {"schema": refs[ErrorResponse]}}
    op["responses"] = {"200": ok, **{str(status): {"description": why, "content": error}
                                     for status, why in {**ERRORS, **(d.errors or {})}.items()}}


def _event_schema(event: dict, error: dict) -> dict[str, Any]:
    """One server-sent event (OpenAPI 3.1 describes a stream by its events): `data` holds an
    event's JSON, an error's JSON if the request fails mid-stream, or the closing `[DONE]`."""
    data = {"type": "string", "if": {"const": "[DONE]"},
            "else": {"contentMediaType": "application/json", "contentSchema": {"anyOf": [event, error]}}}
    return {"type": "object", "required": ["data"], "description": 'The answer to "stream": true',
            "properties": {"event": {"type": "string"}, "data": data}}
