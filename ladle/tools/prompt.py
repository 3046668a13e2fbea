"""Tools and tool messages in the prompt, through the model's chat template when it knows tools.

A template that reads `tools` (Qwen2.5/3, Llama 3.1+, Hermes, Mistral, ...) gets them as
transformers passes them: the tool list as `tools`, assistant `tool_calls` with their arguments
as objects, `tool` messages as they came. A template that does not (SmolLM2's, plain ChatML)
gets the conversation rewritten in the <tool_call> convention the `hermes` parser reads: the
tool list and the calling convention in the system message, each call as a <tool_call> block in
the assistant's text, each tool result as a user turn in <tool_response> tags.
"""

from __future__ import annotations

import json
from typing import Any

FALLBACK_INSTRUCTIONS = (
    "You can call functions. Their signatures are listed between <tools> and </tools>:\n"
    "<tools>\n{tools}\n</tools>\n"
    "To call a function, answer with one line of JSON between <tool_call> and </tool_call>, "
    "naming it and giving its arguments:\n"
    '<tool_call>\n{{"name": "<function name>", "arguments": {{"<argument>": <value>}}}}\n</tool_call>\n'
    "Results come back between <tool_response> and </tool_response>."
)


def template_knows_tools(template_source: str | None) -> bool:
    return bool(template_source) and "tools" in template_source


def for_template(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages for a tool-aware template: call arguments as objects, as transformers expects."""
    out = []
    for m in messages:
        if m.get("tool_calls"):
            m = {**m, "tool_calls": [_with_object_arguments(c) for c in m["tool_calls"]]}
        out.append(m)
    return out


def fallback(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """The conversation for a template that knows no tools (see the module docstring)."""
    out: list[dict[str, Any]] = []
    if tools:
        instructions = FALLBACK_INSTRUCTIONS.format(tools="\n".join(json.dumps(t) for t in tools))
        if messages and messages[0]["role"] == "system":
            out.append({**messages[0], "content": f"{messages[0].get('content') or ''}\n\n{instructions}".strip()})
            messages = messages[1:]
        else:
            out.append({"role": "system", "content": instructions})
    for m in messages:
        if m["role"] == "tool":
            response = f"<tool_response>\n{m.get('content') or ''}\n</tool_response>"
            if out and out[-1]["role"] == "user" and out[-1].get("_tool_results"):
                out[-1]["content"] += "\n" + response
            else:
                out.append({"role": "user", "content": response, "_tool_results": True})
        elif m.get("tool_calls"):
            blocks = [f"<tool_call>\n{json.dumps(_call_object(c))}\n</tool_call>" for c in m["tool_calls"]]
            text = "\n".join(([m["content"]] if m.get("content") else []) + blocks)
            out.append({k: v for k, v in m.items() if k != "tool_calls"} | {"content": text})
        else:
            out.append(m)
    return [{k: v for k, v in m.items() if k != "_tool_results"} for m in out]


def _call_object(call: dict[str, Any]) -> dict[str, Any]:
    fn = call.get("function", call)
    return {"name": fn["name"], "arguments": _arguments_object(fn.get("arguments"))}


def _with_object_arguments(call: dict[str, Any]) -> dict[str, Any]:
    fn = call.get("function", {})
    return {**call, "function": {**fn, "arguments": _arguments_object(fn.get("arguments"))}}


def _arguments_object(arguments: Any) -> Any:
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except json.JSONDecodeError:
            return arguments
    return arguments if arguments is not None else {}
