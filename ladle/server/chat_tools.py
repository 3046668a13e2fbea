"""A chat choice's text as the API returns it: content, or content and tool calls, and a reasoning
model's think block apart (reasoning_content) when the server has a reasoning parser. gpt-oss's
harmony replies go through the harmony parser first: it takes the reasoning, and the calls under
tool_choice "auto"; what it leaves as content is parsed as any reply's (a grammar's JSON, under
"required" or a named function)."""

from __future__ import annotations

from dataclasses import dataclass

from ladle.reasoning.parser import ReasoningStream, ThinkTags, split_reasoning
from ladle.server.constraints import ToolPlan
from ladle.server.protocol import (
    AssistantMessage, DeltaMessage, FunctionCallDelta, FunctionCallOut, ToolCallDelta, ToolCallOut,
)
from ladle.tools.harmony import HarmonyParser
from ladle.tools.parsers import ParserEvents, ToolParser


@dataclass(frozen=True)
class Thinking:
    """How a request's replies split into thinking and answer: the tags, and whether its prompt
    left a think block open (the template opened it); or gpt-oss's harmony messages."""

    tags: ThinkTags
    opened_by_prompt: bool
    harmony: bool = False


def assistant_message(plan: ToolPlan | None, text: str, finish_reason: str | None,
                      thinking: Thinking | None = None) -> tuple[AssistantMessage, str | None]:
    """The whole reply as a message, and its finish reason ("tool_calls" when it made calls)."""
    if thinking is None:
        return _answer_message(plan, text, finish_reason)
    if thinking.harmony:
        return _harmony_message(plan, text, finish_reason, thinking)
    reasoning, content = split_reasoning(text, thinking.opened_by_prompt, thinking.tags)
    message, finish_reason = _answer_message(plan, content or "", finish_reason)
    return _with_reasoning(message, reasoning, content), finish_reason


def _harmony_message(plan: ToolPlan | None, text: str, finish_reason: str | None,
                     thinking: Thinking) -> tuple[AssistantMessage, str | None]:
    reader = _harmony_parser(plan, thinking)
    reader.feed(text)
    reader.finish()
    if _harmony_calls(plan):
        message, finish_reason = _calls_message(plan, reader, reader.content, finish_reason)
    else:
        message, finish_reason = _answer_message(plan, reader.content, finish_reason)
    reasoning = reader.reasoning if reader.reasoning_started else None
    return _with_reasoning(message, reasoning, reader.content), finish_reason


def _with_reasoning(message: AssistantMessage, reasoning: str | None, content: str | None) -> AssistantMessage:
    message.reasoning_content = reasoning
    if reasoning is not None and not content:
        message.content = None  # the reply never left its think block (or said nothing after it)
    return message


def _harmony_calls(plan: ToolPlan | None) -> bool:
    """Whether the harmony parser reads the calls: under "auto" (the others' calls are a grammar's JSON)."""
    return plan is not None and plan.mode == "auto"


def _harmony_parser(plan: ToolPlan | None, thinking: Thinking) -> HarmonyParser:
    return HarmonyParser(calls=_harmony_calls(plan), in_analysis=thinking.opened_by_prompt)


def _answer_message(plan: ToolPlan | None, text: str, finish_reason: str | None) -> tuple[AssistantMessage, str | None]:
    parser = plan.new_parser() if plan is not None else None
    if parser is None:
        return AssistantMessage(content=text), finish_reason
    parser.feed(text)
    parser.finish()
    return _calls_message(plan, parser, text, finish_reason)


def _calls_message(plan: ToolPlan, parser: ToolParser, text: str,
                   finish_reason: str | None) -> tuple[AssistantMessage, str | None]:
    """The message of a parsed reply: its calls, or its text when it made none."""
    calls = parser.tool_calls()
    if not calls:  # no call, or one that does not parse: the reply is text, as vLLM answers
        return AssistantMessage(content=text), finish_reason
    if not plan.parallel:
        calls = calls[:1]
    out = [ToolCallOut(id=c.id, function=FunctionCallOut(name=c.name, arguments=c.arguments)) for c in calls]
    content = parser.content.strip() or None
    return AssistantMessage(content=content, tool_calls=out), _tool_finish(finish_reason)


class ChoiceDeltas:
    """One choice's stream: text deltas in, delta messages out (content and tool-call deltas)."""

    def __init__(self, plan: ToolPlan | None, thinking: Thinking | None = None):
        harmony = thinking is not None and thinking.harmony
        self._harmony = _harmony_parser(plan, thinking) if harmony else None
        self._parser: ToolParser | None = None
        if plan is not None and not (harmony and _harmony_calls(plan)):
            self._parser = plan.new_parser()
        self._max_calls = None if plan is None or plan.parallel else 1
        self._thinking = None if thinking is None or harmony else \
            ReasoningStream(thinking.opened_by_prompt, thinking.tags)
        self.made_calls = False

    def delta(self, text: str, last: bool) -> DeltaMessage | None:
        """The delta for this text (None when it released nothing yet)."""
        if self._harmony is not None:
            return self._harmony_delta(text, last)
        if self._thinking is None:
            return self._answer_delta(text, last)
        reasoning, text = self._thinking.feed(text) if text else ("", "")
        if last:
            more_reasoning, more_text = self._thinking.finish()
            reasoning, text = reasoning + more_reasoning, text + more_text
        delta = self._answer_delta(text, last)
        if reasoning:
            delta = delta or DeltaMessage()
            delta.reasoning_content = reasoning
        return delta

    def _harmony_delta(self, text: str, last: bool) -> DeltaMessage | None:
        events = _feed(self._harmony, text, last)
        delta = self._answer_delta(events.content, last)  # what a grammar made content, parsed
        calls = self._tool_call_deltas(events)  # the harmony calls, under "auto"
        if events.reasoning or calls:
            delta = delta or DeltaMessage()
            delta.reasoning_content = events.reasoning or None
            delta.tool_calls = calls or delta.tool_calls
        return delta

    def _answer_delta(self, text: str, last: bool) -> DeltaMessage | None:
        if self._parser is None:
            return DeltaMessage(content=text) if text else None
        events = _feed(self._parser, text, last)
        calls = self._tool_call_deltas(events)
        if not (events.content or calls):
            return None
        return DeltaMessage(content=events.content or None, tool_calls=calls or None)

    def finish_reason(self, finish_reason: str | None) -> str | None:
        return _tool_finish(finish_reason) if self.made_calls else finish_reason

    def _tool_call_deltas(self, events: ParserEvents) -> list[ToolCallDelta]:
        allowed = (lambda i: True) if self._max_calls is None else (lambda i: i < self._max_calls)
        deltas = [ToolCallDelta(index=i, id=call_id, type="function", function=FunctionCallDelta(name=name, arguments=""))
                  for i, call_id, name in events.started if allowed(i)]
        deltas += [ToolCallDelta(index=i, function=FunctionCallDelta(arguments=text))
                   for i, text in events.arguments if allowed(i)]
        self.made_calls = self.made_calls or bool(deltas)
        return deltas


def _feed(parser: ToolParser, text: str, last: bool) -> ParserEvents:
    """What the parser releases for this text, and (for the reply's last text) all it held back."""
    events = parser.feed(text) if text else ParserEvents()
    if last:
        events.extend(parser.finish())
    return events


def _tool_finish(finish_reason: str | None) -> str | None:
    return "tool_calls" if finish_reason == "stop" else finish_reason
