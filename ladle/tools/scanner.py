"""Finds tool calls in JSON text as it streams: {"name": ..., "arguments" | "parameters": {...}}.

A call object is any JSON object not nested inside another call (at the top level, or an
element of a top-level array). Its name is known once its "name" string closes; its arguments
are the raw text of the "arguments" (or "parameters") value, character for character as the
model wrote it, so what a stream sends in pieces joins up to exactly what a whole response
sends. Arguments written as a JSON string holding JSON are decoded when the string closes.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

NAME_KEYS = ("name",)
ARGUMENT_KEYS = ("arguments", "parameters")


@dataclass
class ScannedCall:
    name: str | None = None
    arguments: str = ""  # raw text so far
    arguments_done: bool = False
    closed: bool = False  # the call object's closing brace was seen
    arguments_are_string: bool = False  # "arguments": "{...}" (released decoded, when complete)

    @property
    def released_arguments(self) -> str:
        """The part of the arguments that may be sent now."""
        if self.arguments_are_string:
            return _decode_string(self.arguments) if self.arguments_done else ""
        return self.arguments


class CallScanner:
    def __init__(self) -> None:
        self.calls: list[ScannedCall] = []
        self._stack: list[str] = []
        self._in_string = False
        self._escaped = False
        self._string = ""  # the string being read, raw (escapes undecoded)
        self._call_depth: int | None = None  # stack depth of the open call's own level
        self._expect = "key"  # at the call's level: key | colon | value | next
        self._key: str | None = None
        self._capture_depth: int | None = None  # arguments value being captured, its depth
        self._capture_string = False  # the arguments value is a string

    @property
    def _call(self) -> ScannedCall:
        return self.calls[-1]

    def feed(self, text: str) -> None:
        for ch in text:
            self._step(ch)

    def _step(self, ch: str) -> None:
        capturing = self._capture_depth is not None or self._capture_string
        if capturing:
            self._call.arguments += ch
        if self._in_string:
            self._string_char(ch)
            return
        at_call_level = self._call_depth is not None and len(self._stack) == self._call_depth
        if ch == '"':
            self._in_string, self._string = True, ""
            if at_call_level and self._expect == "value" and self._key in ARGUMENT_KEYS and not capturing:
                self._capture_string = True
                self._call.arguments_are_string = True
                self._call.arguments = ch
        elif ch in "{[":
            self._stack.append(ch)
            if self._call_depth is None and ch == "{":
                self.calls.append(ScannedCall())
                self._call_depth, self._expect = len(self._stack), "key"
            elif at_call_level and self._expect == "value" and self._key in ARGUMENT_KEYS and not capturing:
                self._capture_depth = len(self._stack)
                self._call.arguments = ch
        elif ch in "}]":
            if self._stack:
                self._stack.pop()
            if self._capture_depth is not None and len(self._stack) < self._capture_depth:
                self._capture_depth = None
                self._call.arguments_done = True
                self._expect = "next"
            if self._call_depth is not None and len(self._stack) < self._call_depth:
                self._call.closed = True
                self._call_depth = None
        elif at_call_level and ch == ":":
            self._expect = "value"
        elif at_call_level and ch == ",":
            self._expect = "key"

    def _string_char(self, ch: str) -> None:
        if self._escaped:
            self._escaped = False
        elif ch == "\\":
            self._escaped = True
        elif ch == '"':
            self._in_string = False
            self._string_closed()
            return
        self._string += ch

    def _string_closed(self) -> None:
        if self._capture_string:
            self._capture_string = False
            self._call.arguments_done = True
            self._expect = "next"
            return
        if self._call_depth is None or len(self._stack) != self._call_depth:
            return  # a string nested in some value
        if self._expect == "key":
            self._key, self._expect = _decode_string('"' + self._string + '"'), "colon"
        elif self._expect == "value":
            if self._key in NAME_KEYS and self._call.name is None:
                self._call.name = _decode_string('"' + self._string + '"')
            self._expect = "next"


def _decode_string(raw: str) -> str:
    try:
        return json.loads(raw)
    except json.JSONDecodeError:
        return raw.strip('"')
