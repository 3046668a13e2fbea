"""A /v1/responses reply's output items (a message, function calls): built whole from the reply,
or built as it streams, announcing each step as the typed events OpenAI sends."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Literal

from ladle.server.protocol import AssistantMessage, ChatMessage, DeltaMessage, FunctionCall, ToolCallMessage
from ladle.server.responses_protocol import FunctionCallItem, OutputItem, OutputMessage, OutputText

Status = Literal["in_progress", "completed", "incomplete"]
Event = Callable[..., str]  # (event type, **fields) -> one server-sent event


def openai_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def output_items(reply: AssistantMessage, message_id: str, status: Status) -> list[OutputItem]:
    """The items of a whole reply: its text as a message (when it has text or made no call), then
    one item per function call."""
    items: list[OutputItem] = []
    if reply.content is not None or not reply.tool_calls:
        items.append(OutputMessage(id=message_id, status=status, content=[OutputText(text=reply.content or "")]))
    items += [FunctionCallItem(id=openai_id("fc"), call_id=c.id, name=c.function.name,
                               arguments=c.function.arguments, status=status) for c in reply.tool_calls]
    return items


def assistant_turn(items: list[OutputItem]) -> ChatMessage:
    """The reply as the conversation's assistant message, for a later previous_response_id."""
    text = "".join(part.text for item in items if isinstance(item, OutputMessage) for part in item.content)
    calls = [ToolCallMessage(id=item.call_id, function=FunctionCall(name=item.name, arguments=item.arguments))
             for item in items if isinstance(item, FunctionCallItem)]
    return ChatMessage(role="assistant", content=text if text or not calls else None, tool_calls=calls or None)


class StreamedOutput:
    """The output items of a streamed reply, fed its chat deltas: yields the events that open an
    item, grow its text or arguments, and close every item at the end."""

    def __init__(self, event: Event, message_id: str):
        self._event = event
        self._message_id = message_id
        self.items: list[OutputItem] = []
        self._message: OutputMessage | None = None
        self._calls: dict[int, FunctionCallItem] = {}  # by the parser's call index

    def feed(self, delta: DeltaMessage) -> list[str]:
        events = []
        if delta.content:
            events += self._open_message()
            self._message.content[0].text += delta.content
            events.append(self._event("response.output_text.delta", **self._at_text(), delta=delta.content,
                                      logprobs=[]))
        for call in delta.tool_calls or []:
            if call.id is not None:  # a call's first delta names it
                item = FunctionCallItem(id=openai_id("fc"), call_id=call.id, name=call.function.name or "",
                                        arguments="", status="in_progress")
                self._calls[call.index] = item
                events.append(self._added(item))
            item = self._calls[call.index]
            if call.function.arguments:
                item.arguments += call.function.arguments
                events.append(self._event("response.function_call_arguments.delta", item_id=item.id,
                                          output_index=self.items.index(item), delta=call.function.arguments))
        return events

    def finish(self, status: Status) -> list[str]:
        """The closing events of every item (a reply with none gets an empty message)."""
        events = [] if self.items else self._open_message()
        for index, item in enumerate(self.items):
            item.status = status
            if isinstance(item, OutputMessage):
                text = item.content[0]
                events.append(self._event("response.output_text.done", **self._at_text(), text=text.text, logprobs=[]))
                events.append(self._event("response.content_part.done", **self._at_text(),
                                          part=text.model_dump(mode="json")))
            else:
                events.append(self._event("response.function_call_arguments.done", item_id=item.id,
                                          output_index=index, arguments=item.arguments))
            events.append(self._event("response.output_item.done", output_index=index,
                                      item=item.model_dump(mode="json")))
        return events

    def _open_message(self) -> list[str]:
        if self._message is not None:
            return []
        self._message = OutputMessage(id=self._message_id, status="in_progress", content=[OutputText(text="")])
        return [self._added(self._message),
                self._event("response.content_part.added", **self._at_text(), part=OutputText(text="").model_dump())]

    def _added(self, item: OutputItem) -> str:
        self.items.append(item)
        return self._event("response.output_item.added", output_index=len(self.items) - 1,
                           item=item.model_dump(mode="json"))

    def _at_text(self) -> dict:
        return {"item_id": self._message.id, "output_index": self.items.index(self._message), "content_index": 0}
