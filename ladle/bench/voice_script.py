"""Voice-agent turn scripts: what a caller says and when, as a streaming speech recogniser reports it.

A script is JSONL, one caller turn a line (blank lines are skipped):

    {"conversation": "booking", "turn": 0, "system": "You are the booking line of ...",
     "events": [{"at": 0.4, "type": "partial", "text": "Hi, I'd like"},
                {"at": 0.9, "type": "partial", "text": "Hi, I'd like to book a table"},
                {"at": 1.1, "type": "eager", "text": "Hi, I'd like to book a table"},
                {"at": 1.5, "type": "resumed"},
                {"at": 1.9, "type": "partial", "text": "Hi, I'd like to book a table for four tonight"},
                {"at": 2.1, "type": "eager", "text": "Hi, I'd like to book a table for four tonight"},
                {"at": 2.5, "type": "end", "text": "Hi, I'd like to book a table for four tonight."}],
     "barge_in_chars": 60}

- conversation: a name. Its turns are numbered 0, 1, 2 ... in file order (lines of other
  conversations may come between); names are unique across the scripts of one run.
- system (optional, turn 0 only): the conversation's system prompt.
- events, in order of "at", seconds from the start of the turn (when the caller starts speaking):
  - partial: an interim transcript, the whole text so far. The last partial before the end is the
    end of speech, from which the bench measures latency.
  - eager: an early end-of-turn signal (a semantic end-of-turn detector's guess) with the transcript so far.
  - resumed: the caller kept talking; only right after an eager. After an eager comes another eager, a
    resumed or the end, never a partial.
  - end: the confirmed end of turn with the final transcript: exactly one, the last event, after at
    least one partial.
- barge_in_chars (optional): the caller interrupts the reply once that many of its characters have
  arrived (a stand-in for the audio played so far).

Unknown fields are errors, so a typo cannot silently change a run.
"""

from __future__ import annotations

import json
import math
import unicodedata
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

EVENT_TYPES = ("partial", "eager", "resumed", "end")
TURN_FIELDS = ("conversation", "turn", "system", "events", "barge_in_chars")
EVENT_FIELDS = ("at", "type", "text")
SHIPPED_DIR = Path(__file__).parent / "voice_scripts"


@dataclass(frozen=True)
class Event:
    at: float  # seconds from the start of the turn
    type: str  # one of EVENT_TYPES
    text: str = ""  # empty for resumed


@dataclass
class Turn:
    conversation: str
    turn: int
    events: list[Event]
    barge_in_chars: int | None = None
    source: str = ""  # "file.jsonl line 3", for messages

    @property
    def end(self) -> Event:
        return self.events[-1]

    @property
    def speech_end(self) -> float:
        """When the caller stopped speaking: the last partial before the end."""
        return [e for e in self.events if e.type == "partial"][-1].at

    @property
    def final_text(self) -> str:
        return self.end.text


@dataclass
class Conversation:
    name: str
    system: str | None = None
    turns: list[Turn] = field(default_factory=list)


def replicate(conversations: list[Conversation], copies: int) -> list[Conversation]:
    """Each conversation `copies` times as distinct callers ("booking#2"), so a pass loads the server as
    that many simultaneous calls would."""
    if copies == 1:
        return conversations
    out = []
    for k in range(1, copies + 1):
        for c in conversations:
            name = f"{c.name}#{k}"
            out.append(Conversation(name, c.system, [replace(t, conversation=name) for t in c.turns]))
    return out


def normalize(text: str) -> str:
    """The text a transcript match compares: lowercase, punctuation dropped, whitespace collapsed."""
    kept = "".join(c for c in text.lower() if not unicodedata.category(c).startswith("P"))
    return " ".join(kept.split())


def transcripts_match(a: str, b: str) -> bool:
    """Whether a draft's transcript is the final one, up to case, punctuation and spacing."""
    return normalize(a) == normalize(b)


def parse_script(text: str, source: str = "<script>") -> list[Conversation]:
    """Parse JSONL turn-script text; a ValueError names the line and field at fault."""
    conversations: dict[str, Conversation] = {}
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{source} line {number}"
        try:
            data = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{where}: not JSON: {e.msg}") from None
        turn, system = _parse_turn(data, where)
        conv = conversations.setdefault(turn.conversation, Conversation(turn.conversation))
        if turn.turn != len(conv.turns):
            raise ValueError(f"{where}: field 'turn': expected {len(conv.turns)} for conversation "
                             f"{turn.conversation!r}, got {turn.turn}")
        if system is not None and turn.turn != 0:
            raise ValueError(f"{where}: field 'system': only a conversation's turn 0 may set it")
        if system is not None:
            conv.system = system
        conv.turns.append(turn)
    if not conversations:
        raise ValueError(f"{source}: no turns")
    return list(conversations.values())


def load_script(path: str | Path) -> list[Conversation]:
    path = Path(path)
    return parse_script(path.read_text(encoding="utf-8"), path.name)


def shipped_scripts() -> list[Path]:
    return sorted(SHIPPED_DIR.glob("*.jsonl"))


def resolve_script(name: str | Path) -> list[Path]:
    """A script file, a folder of *.jsonl, or the name of a shipped script ("booking")."""
    path = Path(name)
    if path.is_dir():
        return sorted(path.glob("*.jsonl"))
    if path.exists():
        return [path]
    shipped = SHIPPED_DIR / f"{path.stem}.jsonl"
    if path.parent == Path(".") and shipped.exists():
        return [shipped]
    names = ", ".join(p.stem for p in shipped_scripts())
    raise ValueError(f"no voice script {str(name)!r} (shipped: {names})")


def load_scripts(names: list[str | Path] | None = None) -> list[Conversation]:
    """The conversations of several scripts (default: the shipped ones); names must not repeat."""
    paths = [p for name in names for p in resolve_script(name)] if names else shipped_scripts()
    if not paths:
        raise ValueError("no voice scripts to run")
    out: dict[str, Conversation] = {}
    for path in paths:
        for conv in load_script(path):
            if conv.name in out:
                raise ValueError(f"{path.name}: conversation {conv.name!r} appears in two scripts")
            out[conv.name] = conv
    return list(out.values())


def _parse_turn(data: Any, where: str) -> tuple[Turn, str | None]:
    if not isinstance(data, dict):
        raise ValueError(f"{where}: a turn is a JSON object, got {type(data).__name__}")
    unknown = sorted(set(data) - set(TURN_FIELDS))
    if unknown:
        raise ValueError(f"{where}: unknown field {unknown[0]!r} (fields: {', '.join(TURN_FIELDS)})")
    for name in ("conversation", "turn", "events"):
        if name not in data:
            raise ValueError(f"{where}: field {name!r} is missing")
    conversation = data["conversation"]
    if not isinstance(conversation, str) or not conversation.strip():
        raise ValueError(f"{where}: field 'conversation': a non-empty string")
    number = data["turn"]
    if isinstance(number, bool) or not isinstance(number, int) or number < 0:
        raise ValueError(f"{where}: field 'turn': a whole number >= 0, got {number!r}")
    system = data.get("system")
    if system is not None and (not isinstance(system, str) or not system.strip()):
        raise ValueError(f"{where}: field 'system': a non-empty string")
    barge = data.get("barge_in_chars")
    if barge is not None and (isinstance(barge, bool) or not isinstance(barge, int) or barge < 1):
        raise ValueError(f"{where}: field 'barge_in_chars': a whole number >= 1, got {barge!r}")
    raw = data["events"]
    if not isinstance(raw, list) or not raw:
        raise ValueError(f"{where}: field 'events': a non-empty list")
    events = [_parse_event(e, f"{where}: field 'events[{i}]") for i, e in enumerate(raw)]
    _check_order(events, where)
    return Turn(conversation, number, events, barge, where), system


def _parse_event(data: Any, where: str) -> Event:
    if not isinstance(data, dict):
        raise ValueError(f"{where}': an event is a JSON object")
    unknown = sorted(set(data) - set(EVENT_FIELDS))
    if unknown:
        raise ValueError(f"{where}.{unknown[0]}': unknown field (fields: {', '.join(EVENT_FIELDS)})")
    kind = data.get("type")
    if kind not in EVENT_TYPES:
        raise ValueError(f"{where}.type': {kind!r} is not one of {', '.join(EVENT_TYPES)}")
    at = data.get("at")
    if isinstance(at, bool) or not isinstance(at, (int, float)) or not math.isfinite(at) or at < 0:
        raise ValueError(f"{where}.at': seconds >= 0, got {at!r}")
    text = data.get("text")
    if kind == "resumed":
        if text is not None:
            raise ValueError(f"{where}.text': a resumed event has no text")
        return Event(float(at), kind)
    if not isinstance(text, str) or not text.strip():
        raise ValueError(f"{where}.text': a {kind} event needs a non-empty transcript")
    return Event(float(at), kind, text)


def _check_order(events: list[Event], where: str) -> None:
    previous: Event | None = None
    partials = 0
    for i, e in enumerate(events):
        field_ = f"{where}: field 'events[{i}]"
        if previous is not None and e.at < previous.at:
            raise ValueError(f"{field_}.at': {e.at:g} is before the previous event's {previous.at:g} "
                             f"(events are in order of time)")
        if e.type == "end" and i != len(events) - 1:
            raise ValueError(f"{field_}.type': the end must be the last event")
        if e.type in ("eager", "end") and partials == 0:
            raise ValueError(f"{field_}.type': an {e.type} needs a partial before it (the caller said something)")
        if e.type == "resumed" and (previous is None or previous.type != "eager"):
            raise ValueError(f"{field_}.type': a resumed must come right after an eager")
        if e.type == "partial" and previous is not None and previous.type == "eager":
            raise ValueError(f"{field_}.type': a partial after an eager needs a resumed between them")
        partials += e.type == "partial"
        previous = e
    if events[-1].type != "end":
        raise ValueError(f"{where}: field 'events': the last event must be the end, got {events[-1].type!r}")
