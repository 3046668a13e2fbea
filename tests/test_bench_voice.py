"""`ladle bench voice` against a fake chat server with a known delay schedule (no engine, no model)."""

from __future__ import annotations

import asyncio
import json
import math
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import pytest

from ladle.bench.client import Target
from ladle.bench.voice import TurnRecord, VoiceRun, VoiceSpec, pass_order, played_text, run_voice
from ladle.bench.voice_script import load_scripts, normalize, parse_script, replicate, transcripts_match
from ladle.cli import main as ladle_main
from test_bench import read_body, serve

REPLY = ("Sure thing, I can help with that. Let me check what we have available for you this evening, "
         "it should only take a moment while I look through the bookings for the whole week ahead.")
SYSTEM = "You are a booking agent on a phone line. Answer in short spoken sentences."
TOLERANCE = 0.06  # seconds a client-measured time may exceed its schedule (a loaded 2-core machine)

# ---------------------------------------------------------------- the fake server


@dataclass
class Seen:
    """One chat request as the fake server saw it."""

    body: dict[str, Any]
    arrived: float  # time.perf_counter(): the same clock as the bench's, in this process
    chunks: int = 0  # content chunks sent
    late: float = 0.0  # the most a content chunk left behind its schedule (a loaded machine)
    ended: str = ""  # "finished" | "route" (cancelled by the route) | "disconnect"

    @property
    def user(self) -> str:
        return self.body["messages"][-1]["content"]


class FakeChat:
    """ASGI app: streaming /v1/chat/completions, the first content chunk `ttft` after the request arrives,
    then one word every `itl` (absolute deadlines), `reply` cut to max_tokens words. Honours request_id and
    POST /v1/requests/{id}/cancel (200, then a finish_reason "abort" chunk and the usage; 404 with the real
    server's body when no such request runs), stops streaming when the client disconnects, adds "timings" to the
    usage chunk with include_timings, and answers 500 to a user message containing "boom"."""

    def __init__(self, ttft: float = 0.2, itl: float = 0.02, reply: str = REPLY) -> None:
        self.ttft, self.itl, self.words = ttft, itl, reply.split(" ")
        self.seen: list[Seen] = []
        self.running: dict[str, tuple[Seen, asyncio.Event]] = {}
        self.cancels: list[tuple[str, int]] = []  # (id, status)
        self.stall = 0.0  # seconds: the longest this process went unscheduled while served (StallProbe)

    def chats(self) -> list[Seen]:
        """The requests after the warm-up."""
        return [s for s in self.seen if "[warm-up]" not in s.user]

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        raw = await read_body(receive)
        path = scope["path"]
        if path == "/v1/models":
            await _json(send, {"object": "list", "data": [{"id": "fake-model", "object": "model"}]})
        elif path == "/version":
            await _json(send, {"version": "fake-voice"})
        elif path == "/v1/chat/completions":
            await self._chat(json.loads(raw), receive, send)
        elif path.startswith("/v1/requests/") and path.endswith("/cancel"):
            rid = path[len("/v1/requests/"):-len("/cancel")]
            found = self.running.get(rid) or self.running.get(rid.removeprefix("chatcmpl-"))
            self.cancels.append((rid, 200 if found else 404))
            if found is None:
                await _json(send, cancel_not_found_body(rid), status=404)
                return
            found[0].ended = "route"
            found[1].set()
            await _json(send, {"id": rid, "object": "request.cancelled", "cancelled": True})
        else:
            await _json(send, {"error": {"message": "not found"}}, status=404)

    async def _chat(self, body: dict[str, Any], receive: Any, send: Any) -> None:
        seen = Seen(body, time.perf_counter())
        self.seen.append(seen)
        if "boom" in seen.user.lower():
            await _json(send, {"error": {"message": "boom", "type": "server_error"}}, status=500)
            return
        stop = asyncio.Event()
        rid = body.get("request_id")
        if rid:
            self.running[rid] = (seen, stop)

        async def watch() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass
            if not seen.ended:
                seen.ended = "disconnect"
            stop.set()

        watcher = asyncio.create_task(watch())
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream")]})

        async def event(data: Any) -> None:
            text = data if isinstance(data, str) else json.dumps(data)
            await send({"type": "http.response.body", "body": f"data: {text}\n\n".encode(), "more_body": True})

        loop = asyncio.get_running_loop()
        start = loop.time()
        words = self.words[: int(body["max_tokens"])]
        try:
            for k, word in enumerate(words):
                delay = start + self.ttft + k * self.itl - loop.time()
                if delay > 0:
                    try:
                        await asyncio.wait_for(stop.wait(), delay)
                    except TimeoutError:
                        pass
                if stop.is_set():
                    break
                seen.late = max(seen.late, loop.time() - start - self.ttft - k * self.itl)
                await event({"choices": [{"index": 0, "delta": {"content": word if k == 0 else " " + word}}]})
                seen.chunks += 1
            if seen.ended == "disconnect":
                return
            seen.ended = seen.ended or "finished"
            finish = "abort" if seen.ended == "route" else ("length" if len(words) < len(self.words) else "stop")
            await event({"choices": [{"index": 0, "delta": {}, "finish_reason": finish}]})
            prompt = sum(len(m["content"].split()) for m in body["messages"])
            usage: dict[str, Any] = {"choices": [], "usage": {
                "prompt_tokens": prompt, "completion_tokens": seen.chunks,
                "prompt_tokens_details": {"cached_tokens": len(SYSTEM.split())}}}
            if body.get("include_timings"):
                usage["timings"] = {"queued_ms": 0.5, "prefill_ms": 3.0, "first_token_ms": self.ttft * 1000,
                                    "last_token_ms": (loop.time() - start) * 1000, "prompt_tokens": prompt,
                                    "cached_tokens": 0, "completion_tokens": seen.chunks}
            await event(usage)
            await event("[DONE]")
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            watcher.cancel()
            if rid:
                self.running.pop(rid, None)


def cancel_not_found_body(rid: str) -> dict[str, Any]:
    """The real server's 404 for a cancel of no running request (tests/test_bench_live.py checks it against
    a live ladle server)."""
    return {"error": {"message": f"no running request {rid!r} (it finished, or was never sent)",
                      "type": "invalid_request_error", "param": "request_id", "code": "request_not_found"}}


async def _json(send: Any, data: Any, status: int = 200) -> None:
    await send({"type": "http.response.start", "status": status, "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": json.dumps(data).encode()})


class StallProbe:
    """The longest this process went unscheduled: a thread asks to wake every millisecond and records how
    late it woke. Other processes taking both cores of a loaded machine stall the bench and the fake alike,
    and the probe with them; a bench that blocks its own event loop does not stall the probe (a sleep
    releases the GIL, and busy Python hands it over every 5 ms)."""

    def __init__(self) -> None:
        self.longest = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            t = time.perf_counter()
            time.sleep(0.001)
            self.longest = max(self.longest, time.perf_counter() - t - 0.001)

    def __enter__(self) -> StallProbe:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


@contextmanager
def serving(app: FakeChat) -> Iterator[str]:
    """serve(app), then app.stall: the longest stall of this process meanwhile."""
    with serve(app) as url, StallProbe() as probe:
        yield url
    app.stall = probe.longest


# ---------------------------------------------------------------- scripts


def P(at: float, text: str) -> dict[str, Any]:
    return {"at": at, "type": "partial", "text": text}


def E(at: float, text: str) -> dict[str, Any]:
    return {"at": at, "type": "eager", "text": text}


def R(at: float) -> dict[str, Any]:
    return {"at": at, "type": "resumed"}


def END(at: float, text: str) -> dict[str, Any]:
    return {"at": at, "type": "end", "text": text}


def script(*turns: tuple[str, list[dict[str, Any]]] | tuple[str, list[dict[str, Any]], dict[str, Any]]) -> str:
    """JSONL of (conversation, events[, extra fields]) turns, numbered per conversation; the system prompt
    on each conversation's first turn."""
    lines, counts = [], {}
    for conv, events, *extra in turns:
        n = counts[conv] = counts.get(conv, -1) + 1
        line = {"conversation": conv, "turn": n, **({"system": SYSTEM} if n == 0 else {}), "events": events,
                **(extra[0] if extra else {})}
        lines.append(json.dumps(line))
    return "\n".join(lines) + "\n"


def replay(url: str, text: str, **spec: Any) -> VoiceRun:
    spec = {"turn_gap": 0.05, "modes": ("wait",), **spec}
    return asyncio.run(run_voice(Target(base_url=url, model="fake-model"), parse_script(text), VoiceSpec(**spec),
                                 progress=False))


def within(measured_ms: float | None, expected_s: float, slack: float = 0.0) -> bool:
    """`measured_ms` is `expected_s` give or take clock granularity, or up to TOLERANCE + `slack` later."""
    assert measured_ms is not None
    return expected_s - 0.005 <= measured_ms / 1000 <= expected_s + TOLERANCE + slack


def lateness(rec: TurnRecord, app: FakeChat) -> float:
    """Seconds the bench (handling events) and the fake (sending first chunks) ran behind their schedules,
    and the longest the process stalled (a stall between the two, in the request's or a chunk's transport,
    shows in neither)."""
    assert rec.event_lag_ms is not None
    return rec.event_lag_ms / 1000 + max(s.late for s in app.seen) + app.stall


# ---------------------------------------------------------------- the script format


def test_parse_script_reads_turns_conversations_and_speech_end():
    text = script(
        ("a", [P(0.1, "hi"), P(0.4, "hi there"), E(0.6, "hi there"), R(0.9), P(1.2, "hi there you"),
               END(1.6, "Hi there, you.")], {"barge_in_chars": 12}),
        ("b", [P(0.1, "yes"), END(0.5, "Yes.")]),
        ("a", [P(0.2, "ok"), E(0.4, "ok"), END(0.8, "OK.")]),
    ) + "\n"  # a blank line is skipped
    a, b = parse_script(text, "t.jsonl")
    assert (a.name, b.name) == ("a", "b") and a.system == SYSTEM and len(a.turns) == 2 and len(b.turns) == 1
    first = a.turns[0]
    assert first.speech_end == 1.2 and first.end.at == 1.6 and first.final_text == "Hi there, you."
    assert first.barge_in_chars == 12 and first.source == "t.jsonl line 1"
    assert [e.type for e in first.events] == ["partial", "partial", "eager", "resumed", "partial", "end"]
    assert a.turns[1].turn == 1 and a.turns[1].barge_in_chars is None and b.turns[0].speech_end == 0.1


def _line(**fields: Any) -> str:
    line = {"conversation": "c", "turn": 0, "events": [P(0.1, "hi"), END(0.5, "Hi.")], **fields}
    return json.dumps({k: v for k, v in line.items() if v is not None})


@pytest.mark.parametrize("text, message", [
    ("{not json", "line 1: not JSON"),
    ('["a list"]', "line 1: a turn is a JSON object"),
    (_line(speaker="x"), "line 1: unknown field 'speaker'"),
    (_line(events=None), "line 1: field 'events' is missing"),
    (_line(conversation=""), "field 'conversation'"),
    (_line(turn=-1), "field 'turn': a whole number >= 0"),
    (_line(turn=1), "field 'turn': expected 0 for conversation 'c', got 1"),
    (_line(barge_in_chars=0), "field 'barge_in_chars'"),
    (_line(events=[]), "field 'events': a non-empty list"),
    (_line(events=[P(0.1, "hi"), {"at": 0.2, "type": "final", "text": "Hi."}]), "'events[1].type': 'final' is not"),
    (_line(events=[P(0.1, "hi"), {"at": 0.2, "type": "end", "text": "x", "speaker": 1}]), "'events[1].speaker'"),
    (_line(events=[P(-1, "hi"), END(0.5, "Hi.")]), "'events[0].at': seconds >= 0"),
    (_line(events=[P(0.1, ""), END(0.5, "Hi.")]), "'events[0].text': a partial event needs"),
    (_line(events=[P(0.4, "hi"), END(0.3, "Hi.")]), "'events[1].at': 0.3 is before the previous event's 0.4"),
    (_line(events=[P(0.1, "hi"), END(0.3, "Hi."), P(0.4, "hi")]), "'events[1].type': the end must be the last"),
    (_line(events=[P(0.1, "hi"), E(0.3, "hi")]), "the last event must be the end, got 'eager'"),
    (_line(events=[END(0.3, "Hi.")]), "'events[0].type': an end needs a partial before it"),
    (_line(events=[E(0.1, "hi"), P(0.2, "hi"), END(0.3, "Hi.")]), "'events[0].type': an eager needs a partial"),
    (_line(events=[P(0.1, "hi"), R(0.2), END(0.3, "Hi.")]), "'events[1].type': a resumed must come right after"),
    (_line(events=[P(0.1, "hi"), E(0.2, "hi"), P(0.3, "hi you"), END(0.5, "Hi you.")]),
     "'events[2].type': a partial after an eager needs a resumed"),
    (_line(events=[P(0.1, "hi"), E(0.2, "hi"), {"at": 0.3, "type": "resumed", "text": "x"}, END(0.5, "x")]),
     "'events[2].text': a resumed event has no text"),
    (_line() + "\n" + json.dumps({"conversation": "c", "turn": 1, "system": "x",
                                  "events": [P(0.1, "a"), END(0.2, "A")]}), "line 2: field 'system': only"),
    ("\n\n", "no turns"),
])
def test_script_errors_name_the_line_and_field(text: str, message: str):
    with pytest.raises(ValueError) as err:
        parse_script(text, "bad.jsonl")
    assert message in str(err.value) and str(err.value).startswith("bad.jsonl")


def test_shipped_scripts_parse_and_cover_the_cases():
    conversations = load_scripts()
    turns = [t for c in conversations for t in c.turns]
    assert 3 <= len(conversations) <= 5 and 15 <= len(turns) <= 30
    assert all(c.system and len(c.system.split()) >= 150 for c in conversations)
    assert sum(t.barge_in_chars is not None for t in turns) >= 2
    resumed = [t for t in turns if any(e.type == "resumed" for e in t.events)]
    changed = [t for t in turns if not transcripts_match([e for e in t.events if e.type == "eager"][-1].text,
                                                          t.final_text)]
    assert len(resumed) >= 3 and len(changed) >= 2
    assert any(len(t.final_text.split()) <= 3 for t in turns)  # short confirmations
    assert any(t.speech_end >= 8.0 for t in turns)  # a caller describing a problem at length
    for t in turns:
        eager = [e for e in t.events if e.type == "eager"]
        assert 0.15 <= eager[-1].at - t.speech_end <= 0.3 and 0.3 <= t.end.at - eager[-1].at <= 0.6
        # partials every 0.3-0.6 s while the caller speaks
        assert all(0.3 - 1e-9 <= b.at - a.at <= 0.6 + 1e-9 for a, b in zip(t.events, t.events[1:])
                   if a.type == b.type == "partial")
    assert load_scripts(["booking"])[0].name == "booking"
    with pytest.raises(ValueError, match="no voice script 'nope'"):
        load_scripts(["nope"])


def test_match_rule_and_played_text():
    assert normalize("  Hi, I'd like  a TABLE... ") == "hi id like a table"
    assert transcripts_match("yes that's right", "Yes, that's right.")
    assert not transcripts_match("for for people", "for four people")
    assert played_text("Sure thing, I can help.", 12) == "Sure thing,"
    assert played_text("Sure thing, I can help.", 13) == "Sure thing, I"
    assert played_text("Sure thing, I can help.", 9) == "Sure"  # mid-word: back to the boundary
    assert played_text("Sure", 2) == "" and played_text("Hi there.", 50) == "Hi there."
    assert pass_order(("wait", "eager"), 3) == [("wait", 0), ("eager", 0), ("eager", 1), ("wait", 1), ("wait", 2),
                                                ("eager", 2)]


# ---------------------------------------------------------------- timing


TWO_TURNS = script(
    ("c", [P(0.05, "I'd like"), P(0.25, "I'd like a table"), E(0.45, "I'd like a table"),
           END(0.8, "I'd like a table.")]),
    # the draft (eager 0.45 + TTFT 0.2) comes after the end (0.55)
    ("c", [P(0.05, "for"), P(0.25, "for two"), E(0.45, "for two"), END(0.55, "For two.")]),
)


def test_wait_mode_first_token_is_the_end_of_turn_plus_ttft():
    app = FakeChat(ttft=0.2, itl=0.02)
    with serving(app) as url:
        run = replay(url, TWO_TURNS, modes=("wait",))
    assert run.failed_requests == 0 and run.passes == ["wait"]
    first, second = run.turns
    for rec, end in ((first, 0.8), (second, 0.55)):
        assert rec.error == "" and rec.reply_source == "final" and rec.drafts_started == 0
        slack = lateness(rec, app)
        assert within(rec.first_token_ms, end - 0.25 + 0.2, slack), rec.first_token_ms
        # the first sentence ends with "that." in the 7th chunk: 6 chunks after the first
        assert within(rec.first_sentence_ms, end - 0.25 + 0.2 + 6 * 0.02, slack), rec.first_sentence_ms
        assert within(rec.reply_ttft_ms, 0.2, slack)
        assert rec.cached_tokens == len(SYSTEM.split()) and rec.reply_tokens == len(REPLY.split(" "))
    chats = app.chats()
    assert len(chats) == 2  # no drafts
    body = chats[0].body
    assert body["stream"] and body["stream_options"] == {"include_usage": True} and body["temperature"] == 0
    assert body["max_tokens"] == 64 and "request_id" not in body and "include_timings" not in body
    assert body["messages"][0] == {"role": "system", "content": SYSTEM}
    tag = first.call_tag
    assert tag.startswith("[call ") and chats[0].user == tag + "I'd like a table."
    assert chats[1].body["messages"][1:] == [
        {"role": "user", "content": tag + "I'd like a table."},
        {"role": "assistant", "content": REPLY},
        {"role": "user", "content": "For two."}]
    # the next turn started a turn gap after the reply ended: 35 chunks, 0.2 + 34 * 0.02 s after it left
    gap = chats[1].arrived - chats[0].arrived
    assert 0.88 + 0.05 + 0.55 - 0.005 <= gap <= 0.88 + 0.05 + 0.55 + TOLERANCE + lateness(second, app)
    warm = [s for s in app.seen if "[warm-up]" in s.user]
    assert len(warm) == 1 and warm[0].body["max_tokens"] == 1 and warm[0].arrived < chats[0].arrived


def test_eager_mode_first_token_is_the_later_of_end_and_draft():
    app = FakeChat(ttft=0.2, itl=0.02)
    with serving(app) as url:
        run = replay(url, TWO_TURNS, modes=("eager",))
    assert run.failed_requests == 0
    first, second = run.turns
    for rec, end in ((first, 0.8), (second, 0.55)):
        assert rec.reply_source == "draft" and (rec.drafts_started, rec.drafts_used, rec.drafts_cancelled) == (1, 1, 0)
        assert rec.wasted_tokens == 0
        slack = lateness(rec, app)
        assert within(rec.first_token_ms, max(end, 0.45 + 0.2) - 0.25, slack), (rec.first_token_ms, end, slack)
        assert within(rec.reply_ttft_ms, 0.2, slack)
    # turn 0's draft was ready before the end: heard at the end (550 ms after speech), not 200 ms after eager
    assert first.first_token_ms > 500
    chats = app.chats()
    assert [c.user for c in chats] == [first.call_tag + "I'd like a table", "for two"]
    # the history keeps the draft's transcript, which the model saw
    assert chats[1].body["messages"][1]["content"] == first.call_tag + "I'd like a table"
    assert all(c.ended == "finished" for c in chats)


@pytest.mark.parametrize("cancel", ["disconnect", "route"])
def test_resumed_and_changed_finals_cancel_drafts(cancel: str):
    text = script(
        ("c", [P(0.05, "book a table"), E(0.2, "book a table"), R(0.52), P(0.6, "book a table for two"),
               E(0.75, "book a table for two"), END(1.0, "Book a table for two.")]),
        ("c", [P(0.05, "the name is al"), P(0.15, "the name is al vares"), E(0.3, "the name is al vares"),
               END(0.66, "The name is Alvarez.")]),
    )
    # cancels fall between two chunks (every 0.04 s from 0.1 s after a draft left), well clear of both
    app = FakeChat(ttft=0.1, itl=0.04)
    with serving(app) as url:
        run = replay(url, text, modes=("eager",), cancel=cancel, max_tokens=20)
    assert run.failed_requests == 0, run.errors
    first, second = run.turns
    assert (first.drafts_started, first.drafts_used, first.drafts_cancelled) == (2, 1, 1)
    assert first.reply_source == "draft" and first.cancel_via == [cancel]
    assert (second.drafts_started, second.drafts_used, second.drafts_cancelled) == (1, 0, 1)
    assert second.reply_source == "final" and second.user_text == "The name is Alvarez."
    chats = app.chats()
    users = [c.user for c in chats]
    tag = first.call_tag
    assert users == [tag + "book a table", tag + "book a table for two", "the name is al vares",
                     "The name is Alvarez."]
    resumed_draft, changed_draft = chats[0], chats[2]
    # cancelled while streaming: the resumed one (0.2 -> 0.52 s) after 6 of 20 chunks, the changed one
    # (0.3 -> 0.66 s) after 7, each cancel 20 ms from a chunk: on a loaded machine (a draft leaving late,
    # a cancel sent late) one chunk fewer or more, and a chunk more for every 0.04 s the bench fell behind
    for draft, rec, chunks in ((resumed_draft, first, 6), (changed_draft, second, 7)):
        assert draft.ended == cancel
        assert chunks - 1 <= draft.chunks <= chunks + 1 + math.ceil(lateness(rec, app) / 0.04), (draft.chunks, chunks)
        # the route reads the usage to its end; a disconnect counts the chunks that arrived
        sent = draft.chunks
        assert rec.wasted_tokens == sent if cancel == "route" else sent - 1 <= rec.wasted_tokens <= sent
    assert chats[1].ended == chats[3].ended == "finished"
    # the fresh request left at the end of turn: first token 0.1 s later
    assert within(second.first_token_ms, 0.66 - 0.15 + 0.1, lateness(second, app))
    if cancel == "route":
        assert all(c.body["request_id"] for c in chats)
        assert [rid for rid, status in app.cancels] == [resumed_draft.body["request_id"],
                                                        changed_draft.body["request_id"]]
        assert all(status == 200 for _, status in app.cancels)
    else:
        assert not app.cancels and all("request_id" not in c.body for c in chats)


@pytest.mark.parametrize("cancel", ["disconnect", "route"])
def test_barge_in_keeps_the_played_words_and_starts_the_next_turn(cancel: str):
    text = script(
        ("c", [P(0.05, "hello"), E(0.2, "hello"), END(0.4, "Hello.")], {"barge_in_chars": 24}),
        ("c", [P(0.05, "wait"), E(0.2, "wait"), END(0.4, "Wait.")]),
    )
    app = FakeChat(ttft=0.1, itl=0.03)
    with serving(app) as url:
        run = replay(url, text, modes=("wait",), cancel=cancel)
    assert run.failed_requests == 0
    first, second = run.turns
    # "Sure thing, I can help with" reaches 24 characters at "with", which is cut: the caller heard up to "help"
    assert first.barged_in and first.history_text == "Sure thing, I can help" and not second.barged_in
    chats = app.chats()
    assert chats[0].ended == cancel and chats[0].chunks < 20
    assert chats[1].body["messages"][-2] == {"role": "assistant", "content": "Sure thing, I can help"}
    # the next turn started at the barge-in: 6 chunks in, 0.1 + 5 * 0.03 s after the first request left
    gap = chats[1].arrived - chats[0].arrived
    assert 0.25 + 0.4 - 0.005 <= gap <= 0.25 + 0.4 + TOLERANCE + 0.03 + lateness(second, app)


# ---------------------------------------------------------------- the CLI end to end


def test_cli_writes_json_and_png(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    path = tmp_path / "calls.jsonl"
    path.write_text(script(
        ("a", [P(0.05, "hi"), P(0.2, "hi I need help"), E(0.35, "hi I need help"), END(0.6, "Hi, I need help.")]),
        ("b", [P(0.05, "yes"), E(0.2, "yes"), R(0.35), P(0.45, "yes please"), E(0.6, "yes please"),
               END(0.8, "Yes, please.")]),
        ("a", [P(0.05, "thanks"), E(0.2, "thanks"), END(0.45, "Thanks.")]),
    ))
    app = FakeChat(ttft=0.1, itl=0.01)
    png = tmp_path / "plots" / "voice.png"
    with serving(app) as url:
        rc = ladle_main(["bench", "voice", "--base-url", url + "/v1", "--script", str(path), "--repeat", "2",
                         "--max-tokens", "12", "--cancel", "route", "--server-timings", "--turn-gap", "0.05",
                         "--result-dir", str(tmp_path), "--plot", str(png), "--disable-tqdm"])
    assert rc == 0
    out = capsys.readouterr().out
    assert "Voice Turn Benchmark" in out and "End of speech -> first token p50 (ms)" in out
    assert "interleaved passes: wait, eager, eager, wait" in out and "eager/wait" in out
    [result_file] = tmp_path.glob("voice-concurrency4-fake-model-*.json")
    result = json.loads(result_file.read_text())
    assert result["model_id"] == "fake-model" and result["passes"] == ["wait", "eager", "eager", "wait"]
    assert result["failed_requests"] == 0 and result["provenance"]["target_version"] == {"version": "fake-voice"}
    wait, eager = result["summary"]["wait"], result["summary"]["eager"]
    assert wait["turns"] == eager["turns"] == 6 and wait["drafts_started"] == 0
    assert eager["drafts_started"] == 2 * 4 and eager["drafts_used"] == 2 * 3 and eager["drafts_cancelled"] == 2
    assert eager["draft_use_rate"] == pytest.approx(0.75) and eager["turns_answered_by_draft"] == pytest.approx(1.0)
    for key in ("p50_first_token_ms", "p95_first_token_ms", "p50_first_sentence_ms", "p95_first_sentence_ms"):
        assert wait[key] > 0 and eager[key] > 0
    assert eager["p50_first_token_ms"] < wait["p50_first_token_ms"]
    assert 0 < result["ratios"]["p50_first_token"] < 1 and result["ratios"]["paired_median_first_token"] < 1
    assert eager["server_p50_first_token_ms"] == pytest.approx(100.0)
    rows = result["turns"]
    assert len(rows) == 12 and set(rows[0]) == set(TurnRecord.__dataclass_fields__)
    assert all(r["server_timings"]["prefill_ms"] == 3.0 for r in rows)
    # every replay of a conversation has its own call tag; the system prompt is shared and warmed once
    tags = {(r["mode"], r["repeat"], r["conversation"]): r["call_tag"] for r in rows}
    assert len(set(tags.values())) == 8
    assert len([s for s in app.seen if "[warm-up]" in s.user]) == 1
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_fails_when_requests_fail(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    path = tmp_path / "boom.jsonl"
    path.write_text(script(
        ("a", [P(0.05, "boom"), E(0.15, "boom"), END(0.3, "Boom.")]),
        ("a", [P(0.05, "never"), E(0.15, "never"), END(0.3, "Never.")]),
    ))
    with serve(FakeChat(ttft=0.02, itl=0.01)) as url:
        rc = ladle_main(["bench", "voice", "--base-url", url, "--script", str(path), "--modes", "wait",
                         "--result-dir", str(tmp_path), "--result-filename", "r.json", "--disable-tqdm"])
    assert rc == 1
    result = json.loads((tmp_path / "r.json").read_text())
    assert result["failed_requests"] == 2 and result["ratios"] is None
    first, second = result["turns"]
    assert "HTTP 500" in first["error"] and second["error"] == "skipped: turn 0 failed"
    assert "HTTP 500" in capsys.readouterr().err


def test_copies_are_distinct_callers_of_the_same_script():
    shipped = load_scripts(["booking", "clinic"])
    copies = replicate(shipped, 3)
    assert [c.name for c in copies] == [f"{n}#{k}" for k in (1, 2, 3) for n in ("booking", "clinic")]
    for copy in copies:
        original = next(c for c in shipped if copy.name.startswith(c.name + "#"))
        assert copy.system == original.system and len(copy.turns) == len(original.turns)
        assert all(t.conversation == copy.name for t in copy.turns)  # rows pair up per caller across modes
        assert [t.events for t in copy.turns] == [t.events for t in original.turns]
    assert all(t.conversation == "booking" for t in shipped[0].turns)  # the scripts themselves unchanged
    assert replicate(shipped, 1) is shipped
