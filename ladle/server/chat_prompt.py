"""OpenAI chat messages -> prompt text, through the model's own chat template.

Tools and tool messages go through the template when it knows tools, else through
ladle.tools.prompt's fallback convention (the one the `hermes` parser reads).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jinja2

from ladle.errors import InvalidRequestError
from ladle.model.tokenizer import Tokenizer
from ladle.server.protocol import ChatMessage
from ladle.tools import prompt as tool_prompt

ROLES = ("system", "user", "assistant", "developer", "tool")
_RESERVED = {"messages", "add_generation_prompt"}
REPLY_ONLY = ("refusal", "annotations", "audio", "function_call")  # message fields a reply echoed back carries


def chat_prompt(tokenizer: Tokenizer, messages: list[ChatMessage], add_generation_prompt: bool = True,
                continue_final_message: bool = False, template_kwargs: dict[str, Any] | None = None,
                tools: list[dict[str, Any]] | None = None, as_parts: bool = False) -> str:
    """Render the conversation; raises InvalidRequestError naming the message at fault. as_parts: every
    message's content as text and image parts, as vision models' templates read it (SmolVLM's reads
    nothing else); otherwise only messages with images have parts."""
    rendered_messages = [_message_dict(i, m, as_parts) for i, m in enumerate(messages)]
    kwargs = dict(template_kwargs or {})
    if tool_prompt.template_knows_tools(tokenizer.chat_template):
        rendered_messages = tool_prompt.for_template(rendered_messages)
        if tools:
            kwargs["tools"] = tools
    elif tools or any(m["role"] == "tool" or m.get("tool_calls") for m in rendered_messages):
        rendered_messages = tool_prompt.fallback(rendered_messages, tools)
    if _RESERVED & kwargs.keys():
        raise InvalidRequestError(f"chat_template_kwargs may not set {sorted(_RESERVED & kwargs.keys())}",
                                  param="chat_template_kwargs")
    try:
        text = tokenizer.apply_chat_template(
            rendered_messages, add_generation_prompt=add_generation_prompt and not continue_final_message, **kwargs)
    except jinja2.TemplateError as e:
        raise InvalidRequestError(f"the model's chat template rejected the messages: {e}", param="messages") from e
    except (TypeError, ValueError) as e:
        raise InvalidRequestError(f"could not render the chat template: {e}", param="chat_template_kwargs") from e
    if continue_final_message:
        text = _cut_after_final_message(text, rendered_messages[-1])
    return text


def load_chat_template(value: str) -> str:
    """--chat-template as vLLM takes it: a file holding the template, or the template itself."""
    if any(mark in value for mark in ("{{", "{%")):
        return value
    path = Path(value).expanduser()
    if not path.is_file():
        raise ValueError(f"--chat-template {value!r} is neither a file nor a Jinja template")
    return path.read_text(encoding="utf-8")


def _message_dict(i: int, m: ChatMessage, as_parts: bool = False) -> dict[str, Any]:
    if m.role not in ROLES:
        raise InvalidRequestError(f"role {m.role!r} is not supported; use system, user, assistant or tool",
                                  param=f"messages[{i}].role")
    if m.tool_calls and m.role != "assistant":
        raise InvalidRequestError("only assistant messages carry tool_calls", param=f"messages[{i}].tool_calls")
    # "developer" is what newer OpenAI clients call the system message
    where = f"messages[{i}]"
    content = m.parts(where) if as_parts or m.image_urls(where) else m.text(where)  # the template places images
    msg: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role, "content": content}
    if m.name:
        msg["name"] = m.name
    if m.tool_calls:
        msg["tool_calls"] = [c.model_dump(exclude_none=True) for c in m.tool_calls]
    if m.tool_call_id:
        msg["tool_call_id"] = m.tool_call_id
    reasoning = m.reasoning_content if m.reasoning_content is not None else m.reasoning
    if reasoning is not None:
        msg["reasoning_content"] = reasoning  # the name templates read (Qwen3's, DeepSeek's)
        msg["thinking"] = reasoning  # and gpt-oss's (its analysis message)
    for name in REPLY_ONLY:
        if getattr(m, name):
            raise InvalidRequestError(f"messages[{i}].{name} is not supported: send it as null, or leave it out",
                                      param=f"messages[{i}].{name}")
    return msg


def _cut_after_final_message(text: str, final: dict[str, Any]) -> str:
    """Leave the last (assistant) message open, so generation continues it (vLLM's continue_final_message)."""
    content = final["content"]
    if isinstance(content, list):  # parts: the text after its last image is what the prompt ends with
        content = content[-1].get("text", "") if content else ""
    content = content.rstrip()
    at = text.rfind(content) if content else -1
    if final["role"] != "assistant" or at < 0:
        raise InvalidRequestError("continue_final_message needs a final assistant message with content",
                                  param="continue_final_message")
    return text[: at + len(content)]
