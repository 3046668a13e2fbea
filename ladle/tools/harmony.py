"""gpt-oss's harmony replies as the API returns them: the analysis channel is reasoning, a message to
functions.NAME is a call to that tool (its body the arguments), and everything else (the final
channel, a commentary preamble before calls, text outside any message) is content. The markers
themselves never reach content.

Streamed or whole, the result is the same (ladle.reasoning.harmony reads the format). A call is
announced as soon as its header is read, so a whole reply keeps its calls as the stream announced
them, arguments as written even when they are not JSON (as vLLM's `openai` parser keeps them).
"""

from __future__ import annotations

from ladle.reasoning.harmony import Closed, Event, HarmonyReader, Header, Opened
from ladle.tools.parsers import ParserEvents, ToolCall, ToolParser, new_call_id
from ladle.tools.scanner import ScannedCall

ANALYSIS = Header("analysis")


class HarmonyParser(ToolParser):
    def __init__(self, calls: bool = True, in_analysis: bool = False) -> None:
        """calls: messages to functions.NAME are calls (else their text is content, as tool_choice
        "none" has it). in_analysis: the prompt opened an analysis message the reply continues."""
        super().__init__()
        self.reasoning = ""
        self.reasoning_started = in_analysis  # an analysis message was opened, by the prompt or the reply
        self._reader = HarmonyReader(ANALYSIS if in_analysis else None)
        self._read_calls = calls
        self._message: Header | None = None  # the open message's header; None outside messages
        self._harmony_calls: list[ScannedCall] = []

    @property
    def _calls(self) -> list[ScannedCall]:
        return self._harmony_calls

    def feed(self, text: str) -> ParserEvents:
        return self._apply(self._reader.feed(text))

    def finish(self) -> ParserEvents:
        return self._apply(self._reader.finish())

    def tool_calls(self) -> list[ToolCall]:
        return [ToolCall(self._ids[i] if i < len(self._ids) else new_call_id(), call.name, call.arguments)
                for i, call in enumerate(self._harmony_calls)]

    def _apply(self, events: list[Event]) -> ParserEvents:
        content = reasoning = ""
        for event in events:
            if isinstance(event, Opened):
                self._open(event.header)
            elif isinstance(event, Closed):
                if self._is_call(event.header):
                    self._harmony_calls[-1].arguments_done = True
                self._message = None
            elif self._is_call(self._message):  # Text of a call's body
                self._harmony_calls[-1].arguments += event.text
            elif self._message is not None and self._message.channel == ANALYSIS.channel:
                reasoning += event.text
            else:
                content += event.text
        self.reasoning += reasoning
        released = self._events(content)
        released.reasoning = reasoning
        return released

    def _open(self, header: Header) -> None:
        self._message = header
        if self._is_call(header):
            self._harmony_calls.append(ScannedCall(name=header.function))
        elif header.channel == ANALYSIS.channel:
            self.reasoning_started = True

    def _is_call(self, header: Header | None) -> bool:
        return self._read_calls and header is not None and header.function is not None

