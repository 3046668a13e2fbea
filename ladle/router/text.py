"""The routing key: the text of a request body that a cache-aware policy matches prefixes on.

Fields are read in a stable order (system-ish fields first, as they lead the rendered prompt),
so two requests sharing their start share the start of their key too.
"""

from __future__ import annotations

from typing import Any

# fields of /v1/decisions, /v1/score and /v1/systemone that hold text, ahead of `input`
_DECISION_FIELDS = ("instructions", "system", "context", "question", "questions", "text", "document")


def routing_text(body: Any) -> str:
    """The concatenated text fields of a JSON request body; "" when it has none."""
    if not isinstance(body, dict):
        return ""
    if "messages" in body:
        return _messages_text(body["messages"])
    if "prompt" in body:
        return _prompt_text(body["prompt"])
    parts = [_any_text(body[name]) for name in ("instructions",) if name in body]
    parts += [_any_text(body["input"])] if "input" in body else []
    parts += [_any_text(body[name]) for name in _DECISION_FIELDS[1:] if name in body]
    return "".join(parts)


def _messages_text(messages: Any) -> str:
    if not isinstance(messages, list):
        return ""
    return "".join(f"{m.get('role', '')}:{_any_text(m.get('content'))}\n" for m in messages if isinstance(m, dict))


def _prompt_text(prompt: Any) -> str:
    if isinstance(prompt, list):
        prompt = prompt[0] if prompt else ""
    return prompt if isinstance(prompt, str) else ""


def _any_text(value: Any) -> str:
    """Strings as they are; lists and dicts by the text they hold (content parts, nested inputs)."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        return "".join(_any_text(v) for v in value)
    if isinstance(value, dict):
        if "text" in value:
            return _any_text(value["text"])
        if "content" in value:
            return f"{value.get('role', '')}:{_any_text(value['content'])}\n"
        return "".join(_any_text(v) for k, v in value.items() if k not in ("type", "id", "image_url"))
    return ""
