"""Tool-call parsers: model text in, content and tool-call events out, streamed or whole.

`hermes` reads <tool_call>{"name": ..., "arguments": {...}}</tool_call> blocks (Hermes, Qwen2.5,
Qwen3 and the fallback prompt of ladle.tools.prompt); `llama3_json` reads a reply that is JSON
calls, {"name": ..., "parameters": {...}} (separated by ";" when several), optionally after
<|python_tag|> (Llama 3.1-3.3); `openai` (vLLM's name; `gpt_oss` and `harmony` too) reads
gpt-oss's harmony messages to functions.NAME (ladle.tools.harmony). Two more serve tool_choice
under a grammar: `named` (the whole reply is the named function's arguments) and `required` (a
JSON array of calls).

Every parser answers `feed(text)` with events as soon as they are certain (content is held
back only while it could be the start of a tag), and `finish()` with the rest; feeding the
whole reply at once gives the same calls as feeding it piece by piece.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field

from ladle.tools.scanner import CallScanner, ScannedCall

HARMONY_TOOL_PARSERS = ("openai", "gpt_oss", "harmony")
TOOL_CALL_PARSERS = ("hermes", "llama3_json", *HARMONY_TOOL_PARSERS)


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str


@dataclass
class ParserEvents:
    """What one feed released: content text, calls that began (index, id, name), argument text, and
    reasoning text (only the harmony parser reads reasoning: gpt-oss's analysis channel)."""

    content: str = ""
    started: list[tuple[int, str, str]] = field(default_factory=list)
    arguments: list[tuple[int, str]] = field(default_factory=list)
    reasoning: str = ""

    def __bool__(self) -> bool:
        return bool(self.content or self.started or self.arguments or self.reasoning)

    def extend(self, later: "ParserEvents") -> None:
        """Add what a later feed (or finish) released."""
        self.content += later.content
        self.started += later.started
        self.arguments += later.arguments
        self.reasoning += later.reasoning


class ToolParser:
    """Turns scanned calls into events; subclasses decide which text is scanned."""

    def __init__(self) -> None:
        self.content = ""
        self._scanners: list[CallScanner] = []
        self._ids: list[str] = []
        self._sent_arguments: list[int] = []

    @property
    def _calls(self) -> list[ScannedCall]:
        return [c for s in self._scanners for c in s.calls]

    def feed(self, text: str) -> ParserEvents:
        raise NotImplementedError

    def finish(self) -> ParserEvents:
        return self._events("")

    def _events(self, content: str) -> ParserEvents:
        self.content += content
        events = ParserEvents(content=content)
        for i, call in enumerate(self._calls):
            if call.name is None:
                break  # calls are announced in order, each once its name is known
            if i == len(self._ids):
                self._ids.append(new_call_id())
                self._sent_arguments.append(0)
                events.started.append((i, self._ids[i], call.name))
            released = call.released_arguments
            if len(released) > self._sent_arguments[i]:
                events.arguments.append((i, released[self._sent_arguments[i]:]))
                self._sent_arguments[i] = len(released)
        return events

    def tool_calls(self) -> list[ToolCall] | None:
        """The calls of the whole reply, or None when any is unnamed or its arguments are not JSON
        (then the reply is content, as vLLM answers)."""
        calls = []
        for i, call in enumerate(self._calls):
            args = call.released_arguments if call.arguments_done else ""
            if call.name is None or not _is_json(args):
                return None
            calls.append(ToolCall(self._ids[i] if i < len(self._ids) else new_call_id(), call.name, args))
        return calls


class HermesParser(ToolParser):
    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def __init__(self) -> None:
        super().__init__()
        self._pending = ""
        self._inside = False

    def feed(self, text: str) -> ParserEvents:
        self._pending += text
        content = ""
        while True:
            tag = self.CLOSE if self._inside else self.OPEN
            at = self._pending.find(tag)
            if at < 0:
                keep = _partial_tag_length(self._pending, tag)
                ready, self._pending = self._pending[: len(self._pending) - keep], self._pending[len(self._pending) - keep:]
                content += self._take(ready)
                return self._events(content)
            content += self._take(self._pending[:at])
            self._pending = self._pending[at + len(tag):]
            self._inside = not self._inside
            if self._inside:
                self._scanners.append(CallScanner())

    def finish(self) -> ParserEvents:
        rest, self._pending = self._pending, ""
        return self._events(self._take(rest))

    def _take(self, text: str) -> str:
        """Text inside a block goes to its scanner; outside, it is content."""
        if self._inside:
            self._scanners[-1].feed(text)
            return ""
        return text


class Llama3JsonParser(ToolParser):
    PYTHON_TAG = "<|python_tag|>"

    def __init__(self) -> None:
        super().__init__()
        self._mode: str | None = None  # None until the reply's first character says: "calls" | "content"
        self._head = ""

    def feed(self, text: str) -> ParserEvents:
        if self._mode is None:
            self._head += text
            head = self._head.lstrip()
            if head.startswith(self.PYTHON_TAG):
                head = head[len(self.PYTHON_TAG):].lstrip()
            elif self.PYTHON_TAG.startswith(head):
                return ParserEvents()  # maybe the tag, not yet whole
            if not head:
                return ParserEvents()
            self._mode = "calls" if head[0] == "{" else "content"
            text = head if self._mode == "calls" else self._head
            if self._mode == "calls":
                self._scanners.append(CallScanner())
        if self._mode == "calls":
            self._scanners[0].feed(text)
            return self._events("")
        return self._events(text)

    def finish(self) -> ParserEvents:
        if self._mode is None and self._head:  # whitespace only, or a lone partial tag
            self._mode = "content"
            return self._events(self._head)
        return self._events("")


class RequiredParser(ToolParser):
    """tool_choice "required": the grammar makes the reply a JSON array of {"name", "parameters"}."""

    def __init__(self) -> None:
        super().__init__()
        self._scanners.append(CallScanner())

    def feed(self, text: str) -> ParserEvents:
        self._scanners[0].feed(text)
        return self._events("")


class NamedParser(ToolParser):
    """tool_choice naming a function: the grammar makes the whole reply its arguments."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self._scanners.append(CallScanner())
        self._scanners[0].calls.append(ScannedCall(name=name))

    def feed(self, text: str) -> ParserEvents:
        self._calls[0].arguments += text
        return self._events("")

    def tool_calls(self) -> list[ToolCall] | None:
        self._calls[0].arguments_done = True
        return super().tool_calls()


def make_parser(name: str) -> ToolParser:
    if name == "hermes":
        return HermesParser()
    if name == "llama3_json":
        return Llama3JsonParser()
    if name in HARMONY_TOOL_PARSERS:
        from ladle.tools.harmony import HarmonyParser  # it builds on ToolParser, defined here

        return HarmonyParser()
    raise ValueError(f"unknown tool call parser {name!r}; choose from {', '.join(TOOL_CALL_PARSERS)}")


def _partial_tag_length(text: str, tag: str) -> int:
    """How many trailing characters of text could begin tag."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except json.JSONDecodeError:
        return False
    return True
