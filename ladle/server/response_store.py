"""The responses kept for `previous_response_id` and GET /v1/responses/{id}: a bounded LRU in memory."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from ladle.server.protocol import ChatMessage
from ladle.server.responses_protocol import ResponseObject

DEFAULT_MAX_STORED_RESPONSES = 1000


@dataclass
class StoredResponse:
    body: ResponseObject
    # every turn's input up to this one, and this one's reply: what a next turn continues
    # (instructions are left out: OpenAI does not carry them over)
    conversation: list[ChatMessage]


@dataclass
class ResponseStore:
    capacity: int = DEFAULT_MAX_STORED_RESPONSES
    _items: OrderedDict[str, StoredResponse] = field(default_factory=OrderedDict)

    def put(self, stored: StoredResponse) -> None:
        self._items[stored.body.id] = stored
        self._items.move_to_end(stored.body.id)
        while len(self._items) > self.capacity:
            self._items.popitem(last=False)  # the least recently used

    def get(self, response_id: str) -> StoredResponse | None:
        stored = self._items.get(response_id)
        if stored is not None:
            self._items.move_to_end(response_id)
        return stored

    def delete(self, response_id: str) -> bool:
        return self._items.pop(response_id, None) is not None

    def __len__(self) -> int:
        return len(self._items)
