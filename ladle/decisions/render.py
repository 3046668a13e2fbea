"""Prompt format version 1: each question is one user message, through the model's own chat template.

Changing any wording here changes every probability: bump PROMPT_FORMAT_VERSION with it
(tests/test_decisions_render.py pins the text and the token ids).
"""

from __future__ import annotations

import json
from typing import Any

import jinja2

from ladle.decisions.question import Question, is_blank
from ladle.errors import InvalidRequestError
from ladle.model.tokenizer import Tokenizer

PROMPT_FORMAT_VERSION = 1

# Reasoning stays off: these go to every template (templates ignore keys they do not use).
DEFAULT_TEMPLATE_KWARGS: dict[str, Any] = {"enable_thinking": False, "thinking": False}
_REASONING_SWITCHES = ("enable_thinking", "thinking")
_RESERVED = {"messages", "add_generation_prompt"}
_REASONING_TAGS = (("<think>", "</think>"), ("<thinking>", "</thinking>"), ("<reasoning>", "</reasoning>"),
                   ("<seed:think>", "</seed:think>"))

_ENDINGS = {
    "choice": "Answer with the letter of one option only.",
    "choice2": "Answer with the two letters of one option only.",
    "score": "Answer with the number of one level only.",
    "yes_no": "Answer with yes or no only.",
}


def render_json_or_text(value: Any, where: str) -> str:
    """Text as given; JSON objects and arrays as compact JSON. Refuses blank text."""
    if isinstance(value, str):
        if is_blank(value):
            raise InvalidRequestError(f"{where} must not be blank", param=where)
        return value
    if isinstance(value, (dict, list)):
        return json.dumps(value, ensure_ascii=False, separators=(",", ":"))
    raise InvalidRequestError(f"{where} must be a string, a JSON object or a JSON array", param=where)


def question_message(input_text: str, q: Question, labels: list[str]) -> str:
    """The user message of one question: the input, a blank line, the question, its labelled options."""
    lines = [input_text, ""]
    if q.kind == "yes_no":
        lines.append(f"Is the following true? {q.text}".rstrip())
        lines += [f"{label}: {opt.description}" for label, opt in zip(labels, q.options)
                  if not is_blank(opt.description)]
        lines.append(_ENDINGS["yes_no"])
        return "\n".join(lines)
    lines.append(f"Question: {q.text}")
    for label, opt in zip(labels, q.options):
        described = "" if is_blank(opt.description) else f" - {opt.description}"
        lines.append(f"{label}: {opt.name.strip()}{described}")
    two_letters = q.kind == "choice" and len(labels[0]) == 2
    lines.append(_ENDINGS["choice2" if two_letters else q.kind])
    return "\n".join(lines)


def template_kwargs(requested: dict[str, Any] | None, param: str = "chat_template_kwargs") -> dict[str, Any]:
    """The request's chat_template_kwargs over the server defaults; refuses turning reasoning on."""
    requested = dict(requested or {})
    if _RESERVED & requested.keys():
        raise InvalidRequestError(f"{param} may not set {sorted(_RESERVED & requested.keys())}", param=param)
    for key in _REASONING_SWITCHES:
        if requested.get(key):
            raise InvalidRequestError(f"{param}.{key}: decisions read the answer at once, so reasoning stays off",
                                      param=f"{param}.{key}")
    effort = requested.get("reasoning_effort")
    if effort not in (None, "none"):
        raise InvalidRequestError(f"{param}.reasoning_effort: decisions read the answer at once, so reasoning "
                                  "stays off", param=f"{param}.reasoning_effort")
    return {**DEFAULT_TEMPLATE_KWARGS, **requested}


def render_prompt(tokenizer: Tokenizer, message: str, kwargs: dict[str, Any], q: Question,
                  image_marker: str | None = None) -> str:
    """One user message with the generation prompt; refuses a prompt that leaves reasoning open.
    image_marker: a vision model's, which marks the message's images: its template is given text and
    image parts (the marker's place), as vision models' templates read content."""
    content: str | list[dict[str, str]] = message
    if image_marker is not None:
        pieces = message.split(image_marker)
        content = [{"type": "text", "text": pieces[0]}] if pieces[0] else []
        for piece in pieces[1:]:
            content += [{"type": "image"}] + ([{"type": "text", "text": piece}] if piece else [])
        message = pieces[-1]  # the text the template's own tail follows
    try:
        text = tokenizer.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                             **kwargs)
    except jinja2.TemplateError as e:
        raise q.refuse(f"the model's chat template rejected the question: {e}") from e
    except (TypeError, ValueError) as e:
        raise InvalidRequestError(f"could not render the chat template: {e}", param="chat_template_kwargs") from e
    # Only the template's own text after the message counts: the input may quote tags freely.
    at = text.rfind(message)
    tail = text[at + len(message):] if at >= 0 else text
    for open_tag, close_tag in _REASONING_TAGS:
        if tail.rfind(open_tag) > tail.rfind(close_tag):
            raise q.refuse(f"the chat template leaves a reasoning block ({open_tag}) open at the answer position; "
                           "this model is not supported for decisions with these chat_template_kwargs")
    return text
