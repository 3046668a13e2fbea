"""Whether a forwarded event stream really ended, and the event that tells the client it did not.

A stream ends properly on its own last event: `data: [DONE]` (chat and completions), a Responses
stream's `response.completed`, `response.failed` or `response.incomplete`, or an error event the
worker sent itself. A worker that dies mid-stream leaves none of these, and a stream that just
stopped would read to a client as a short, finished answer. So the router ends such a stream with an
error event in OpenAI's shape (`data: {"error": {...}}`; for a Responses stream an `error` event),
never with `[DONE]`: the openai SDK raises on it.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

_ENDINGS = (b"data: [DONE]", b'data: {"error"', b"event: response.completed", b"event: response.failed",
            b"event: response.incomplete", b"event: error")
_KEEP = max(map(len, _ENDINGS))  # bytes kept across chunks: an ending split between two is still seen
_SEQUENCE = re.compile(rb'"sequence_number":\s*(\d+)')


@dataclass
class StreamEnd:
    responses: bool  # a /v1/responses stream (typed events with sequence numbers)
    ended: bool = False
    last_sequence: int = -1
    _tail: bytes = b""

    def feed(self, chunk: bytes) -> None:
        data = self._tail + chunk
        if not self.ended and any(ending in data for ending in _ENDINGS):
            self.ended = True
        if self.responses:
            for m in _SEQUENCE.finditer(data):
                self.last_sequence = max(self.last_sequence, int(m.group(1)))
        self._tail = data[-_KEEP:]

    def failure_event(self, message: str) -> bytes:
        """The event that ends a broken stream, after a blank line that closes any event cut short."""
        error = {"message": message, "type": "server_error", "param": None, "code": "worker_failed"}
        if self.responses:
            body = {"type": "error", "code": error["code"], "message": message, "param": None,
                    "sequence_number": self.last_sequence + 1}
            event = f"event: error\ndata: {json.dumps(body)}\n\n"
        else:
            event = f"data: {json.dumps({'error': error})}\n\n"
        opener = b"" if self._tail.endswith(b"\n\n") or not self._tail else b"\n\n"
        return opener + event.encode()
