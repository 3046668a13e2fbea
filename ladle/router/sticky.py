"""Sticky routes: ids a worker handed out (response ids, client request ids) -> that worker's URL.

previous_response_id, GET/DELETE /v1/responses/{id} and POST /v1/requests/{id}/cancel only make
sense on the worker that holds the id. Bounded: the oldest ids are forgotten first.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

MAX_IDS = 100_000


@dataclass
class StickyTable:
    max_ids: int = MAX_IDS
    _owners: OrderedDict[str, str] = field(default_factory=OrderedDict)

    def record(self, ident: str, url: str) -> None:
        self._owners[ident] = url
        self._owners.move_to_end(ident)
        while len(self._owners) > self.max_ids:
            self._owners.popitem(last=False)

    def record_request_id(self, request_id: str, url: str) -> None:
        """A client's request_id, and the response ids the worker derives from it."""
        for ident in (request_id, f"chatcmpl-{request_id}", f"cmpl-{request_id}"):
            self.record(ident, url)

    def owner(self, ident: str) -> str | None:
        return self._owners.get(ident)

    def forget(self, ident: str) -> None:
        self._owners.pop(ident, None)
