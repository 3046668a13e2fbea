"""tool_choice "required" and named functions as JSON schemas, so the arguments always parse."""

from __future__ import annotations

from typing import Any

ANY_OBJECT: dict[str, Any] = {"type": "object"}


def function_of(tool: dict[str, Any]) -> dict[str, Any]:
    return tool.get("function", tool)


def named_schema(tool: dict[str, Any]) -> dict[str, Any]:
    """The reply is the function's arguments."""
    return function_of(tool).get("parameters") or ANY_OBJECT


def required_schema(tools: list[dict[str, Any]], parallel: bool) -> dict[str, Any]:
    """The reply is a JSON array of one call (or several, with parallel_tool_calls) to the tools."""
    calls = [{"type": "object",
              "properties": {"name": {"type": "string", "enum": [function_of(t)["name"]]},
                             "parameters": named_schema(t)},
              "required": ["name", "parameters"], "additionalProperties": False} for t in tools]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": calls[0] if len(calls) == 1 else {"anyOf": calls}}
    if not parallel:
        schema["maxItems"] = 1
    return schema
