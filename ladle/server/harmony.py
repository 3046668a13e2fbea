"""Chat requests to a gpt-oss model served with --reasoning-parser gpt_oss, whose replies are harmony
messages (ladle.reasoning.harmony):

- the replies are decoded with their special tokens, for the parser to read; the parser keeps the
  markers out of what the client sees, which is what skip_special_tokens true (the default) asks
  for. A request setting it false would get no special tokens all the same: it is a 400.
- reasoning_effort is the system message's `Reasoning: low|medium|high` line: the chat template's
  `reasoning_effort` variable (as gpt-oss's template and vLLM take it), not a thinking budget.
  The levels gpt-oss knows are these three; an effort the template would not read is a 400.
- calls come back through --tool-call-parser openai, which reads harmony: the two go together.
"""

from __future__ import annotations

from typing import Any

from ladle.errors import InvalidRequestError
from ladle.reasoning.parser import is_harmony
from ladle.server.protocol import ChatCompletionRequest
from ladle.tools.parsers import HARMONY_TOOL_PARSERS

EFFORTS = ("low", "medium", "high")
EFFORT_VARIABLE = "reasoning_effort"


def check_parsers(reasoning_parser: str | None, tool_call_parser: str | None) -> None:
    """A harmony tool parser needs the harmony reasoning parser, and a harmony model no other tool parser."""
    harmony_tools = tool_call_parser in HARMONY_TOOL_PARSERS
    if harmony_tools and not is_harmony(reasoning_parser):
        raise ValueError(f"--tool-call-parser {tool_call_parser} reads gpt-oss's harmony replies: serve them "
                         "with --reasoning-parser gpt_oss")
    if is_harmony(reasoning_parser) and tool_call_parser is not None and not harmony_tools:
        raise ValueError(f"gpt-oss's harmony replies make calls in messages to functions.NAME: use "
                         f"--tool-call-parser openai, not {tool_call_parser}")


def check_request(req: ChatCompletionRequest, template_source: str | None) -> None:
    """400s naming the field for what a harmony request cannot have."""
    if not req.skip_special_tokens:
        raise InvalidRequestError("skip_special_tokens false is not supported with gpt-oss: its replies' special "
                                  "tokens are its harmony format, read by the server and never returned",
                                  param="skip_special_tokens")
    if req.reasoning_effort is None:
        return
    if req.reasoning_effort not in EFFORTS:
        raise InvalidRequestError(f"reasoning_effort {req.reasoning_effort!r} is not one of gpt-oss's levels "
                                  f"({', '.join(EFFORTS)})", param="reasoning_effort")
    if EFFORT_VARIABLE in (req.chat_template_kwargs or {}):
        raise InvalidRequestError("set reasoning_effort or chat_template_kwargs.reasoning_effort, not both",
                                  param="reasoning_effort")
    if EFFORT_VARIABLE not in (template_source or ""):
        raise InvalidRequestError("this model's chat template does not read reasoning_effort, so the effort would "
                                  "not reach the prompt", param="reasoning_effort")


def template_kwargs(req: ChatCompletionRequest) -> dict[str, Any] | None:
    """The chat template's variables: chat_template_kwargs, and the effort as the template reads it."""
    if req.reasoning_effort is None:
        return req.chat_template_kwargs
    return {**(req.chat_template_kwargs or {}), EFFORT_VARIABLE: req.reasoning_effort}


def without_effort(req: ChatCompletionRequest) -> ChatCompletionRequest:
    """The request whose sampling parameters are made: its effort is in the prompt, not a budget."""
    return req if req.reasoning_effort is None else req.model_copy(update={"reasoning_effort": None})
