"""gpt-oss's harmony format: the messages of a reply, read from its text with the special tokens kept,
whole or as a stream of text deltas cut anywhere.

The prompt ends with `<|start|>assistant`, so a reply begins inside a message's header:

    <|channel|>analysis<|message|>thinking<|end|><|start|>assistant<|channel|>final<|message|>answer<|return|>

A message to a tool names its recipient in the header, after the channel or after the role:

    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{...}<|call|>
    <|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{...}<|call|>

The rules, the same for a whole reply and for any cut of it:
- a header runs up to `<|message|>` and is never text; one the reply never finishes is dropped;
- a body ends at `<|end|>`, `<|return|>` or `<|call|>` (the last two are stop tokens, so usually the
  reply ends there first), or where another message begins (`<|start|>`, or a bare `<|channel|>`);
- a reply that does not begin with a header (`<|channel|>`, or ` to=` after the prompt's role) is
  text outside any message, as are the characters between messages; outside text that is only
  whitespace up to the next marker (or the end) is dropped;
- markers out of place (`<|message|>` or `<|constrain|>` in a body, an end outside one) are dropped.

Only what may still become a marker (or, outside messages, whitespace that may still be dropped) is
held back; everything else is released at once.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass

START, END, MESSAGE, CHANNEL = "<|start|>", "<|end|>", "<|message|>", "<|channel|>"
CONSTRAIN, RETURN, CALL = "<|constrain|>", "<|return|>", "<|call|>"
MARKERS = (START, END, MESSAGE, CHANNEL, CONSTRAIN, RETURN, CALL)
ROLE_RECIPIENT = " to="  # a recipient in the role part: the reply's first characters
FUNCTIONS = "functions."  # the namespace of the request's tools
ANALYSIS_HEADER = f"{CHANNEL}analysis{MESSAGE}"
FINAL_HEADER = f"{START}assistant{CHANNEL}final{MESSAGE}"

_MARKER = re.compile("|".join(re.escape(m) for m in MARKERS))
_CHANNEL_NAME = re.compile(re.escape(CHANNEL) + r"\s*([^\s<]+)")
_RECIPIENT = re.compile(r"to=([^\s<]+)")


@dataclass(frozen=True)
class Header:
    channel: str | None  # analysis | commentary | final (None: the header names none)
    recipient: str | None = None  # functions.NAME for a call to a request's tool

    @classmethod
    def parse(cls, text: str) -> "Header":
        """A header's text, from after `<|start|>` (or the reply's start) up to `<|message|>`."""
        channel, recipient = _CHANNEL_NAME.search(text), _RECIPIENT.search(text)
        return cls(channel and channel.group(1), recipient and recipient.group(1))

    @property
    def function(self) -> str | None:
        """The tool a call names; None when the message is no call to a function."""
        if self.recipient is None or not self.recipient.startswith(FUNCTIONS):
            return None
        return self.recipient[len(FUNCTIONS):] or None


@dataclass(frozen=True)
class Opened:
    header: Header


@dataclass(frozen=True)
class Text:
    text: str  # of the open message's body, or outside any message when none is open


@dataclass(frozen=True)
class Closed:
    header: Header


Event = Opened | Text | Closed


class _State(enum.Enum):
    START = "start"  # nothing decided yet: a header, or a reply that is not harmony
    HEADER = "header"
    BODY = "body"
    OUTSIDE = "outside"  # between messages


class HarmonyReader:
    """One reply's text deltas in, events out (Opened, then its body's Text, then Closed, per message)."""

    def __init__(self, open_message: Header | None = None) -> None:
        """open_message: the message the prompt left open (its header written by the prompt)."""
        self._state = _State.START if open_message is None else _State.BODY
        self._header: Header | None = open_message
        self._pending = ""  # text received, not yet read
        self._header_text = ""  # the header being read
        self._outside_live = False  # outside text with more than whitespace: released as it comes
        self._events: list[Event] = [] if open_message is None else [Opened(open_message)]

    def feed(self, text: str) -> list[Event]:
        self._pending += text
        return self._read(final=False)

    def finish(self) -> list[Event]:
        """The rest, at the end of the reply (a message still open is closed)."""
        events = self._read(final=True)
        if self._state is _State.BODY:
            events.append(Closed(self._header))
            self._state = _State.OUTSIDE
        return events

    def _read(self, final: bool) -> list[Event]:
        while self._step(final):
            pass
        events, self._events = self._events, []
        return events

    def _step(self, final: bool) -> bool:
        """Read what can be read in the current state; True when the state changed (read on)."""
        if self._state is _State.START:
            return self._start(final)
        if self._state is _State.HEADER:
            return self._read_header(final)
        marker = _MARKER.search(self._pending)
        if marker is None:
            keep = 0 if final else _partial_marker_length(self._pending)
            taken = self._release(self._pending[: len(self._pending) - keep], ends_here=final)
            self._pending = self._pending[taken:]
            return False
        self._release(self._pending[: marker.start()], ends_here=True)
        self._pending = self._pending[marker.end():]
        self._marker(marker.group())
        return True

    def _start(self, final: bool) -> bool:
        head = self._pending
        if head.startswith((CHANNEL, ROLE_RECIPIENT)):
            self._state, self._header_text = _State.HEADER, ""
            return True
        if not final and (CHANNEL.startswith(head) or ROLE_RECIPIENT.startswith(head)):
            return False  # may still become a header
        self._state = _State.OUTSIDE
        return True

    def _read_header(self, final: bool) -> bool:
        at = self._pending.find(MESSAGE)
        if at < 0:
            if final:
                self._pending, self._state = "", _State.OUTSIDE  # a header cut short: no message
            return False
        self._header = Header.parse(self._header_text + self._pending[:at])
        self._pending = self._pending[at + len(MESSAGE):]
        self._events.append(Opened(self._header))
        self._state = _State.BODY
        return True

    def _release(self, text: str, ends_here: bool) -> int:
        """Release text read in a body or outside messages; returns how much of it was taken (the rest is
        held). ends_here: a marker or the reply's end follows it."""
        if self._state is _State.OUTSIDE and not self._outside_live and not text.strip():
            return len(text) if ends_here else 0  # whitespace alone between messages: dropped, or held
        if text:
            self._outside_live = self._state is _State.OUTSIDE
            self._events.append(Text(text))
        return len(text)

    def _marker(self, marker: str) -> None:
        if self._state is _State.BODY and marker in (MESSAGE, CONSTRAIN):
            return  # out of place in a body: dropped
        if self._state is _State.BODY:
            self._events.append(Closed(self._header))
        self._state, self._outside_live = _State.OUTSIDE, False
        if marker in (START, CHANNEL):
            self._state = _State.HEADER
            self._header_text = marker if marker == CHANNEL else ""


def _partial_marker_length(text: str) -> int:
    """The length of the longest end of text that is a proper prefix of a marker."""
    for n in range(min(len(CONSTRAIN) - 1, len(text)), 0, -1):
        if any(m.startswith(text[-n:]) for m in MARKERS):
            return n
    return 0
