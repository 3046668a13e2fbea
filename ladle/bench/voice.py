"""`ladle bench voice`: replay voice-agent turn scripts (voice_script) in real time against an
OpenAI-compatible chat server, answering each turn in one of two modes.

- wait: at the confirmed end of turn, send the chat request (history + the final transcript).
- eager: at each eager end-of-turn signal start a draft (history + the transcript so far), cancelling
  the draft before it; cancel the draft when the caller resumes. At the end, use the draft if its
  transcript matches the final one (voice_script.transcripts_match: equal after lowercasing, dropping
  punctuation and collapsing whitespace; the history then keeps the draft's transcript, which is what
  the model saw), else cancel it and send the final transcript.

What the caller hears, on the client's clock from the end of speech (the script's last partial):
- first token: max(end of turn handled, the delivered reply's first content token);
- first sentence: the same for the chunk holding the first ., ! or ? followed by whitespace or the end
  of the reply (the reply's last chunk when it has none), where a streaming TTS could start.
A reply's TTFT is from its own send. Every draft not used counts as cancelled, and its completion
tokens as wasted (the usage's count when the server sent one, else one a content chunk).

Barge-in: once `barge_in_chars` characters of the reply have arrived (not before the end of turn), the
caller interrupts: the reply is cancelled if still streaming, the history keeps what was "played" (cut
back to a word boundary) and the next turn starts at once. Otherwise the next turn starts `turn_gap`
seconds after the reply ended.

Cancelling: "disconnect" closes the stream (any server). "route" POSTs /v1/requests/{request_id}/cancel
(ladle) with the request_id the bench put in the body, then reads the stream to its end so the usage of
the work done is known; if the route answers anything but 200, or the stream does not end within
DRAIN_TIMEOUT_S, the stream is closed instead.

Fairness: every conversation replay opens its first user message with its own call tag ("[call 3-1f2a9c] ",
random per run), so no two replays share cache beyond the system prompt, which is warmed once before
measuring, as a production agent's would be. The modes run in interleaved passes (wait, eager, eager,
wait, ... for repeat 2); a pass replays every conversation once, at most `max_concurrency` at a time,
each in real time, turn after turn.
"""

from __future__ import annotations

import asyncio
import bisect
import itertools
import re
import secrets
import time
from dataclasses import dataclass, field
from typing import Any, Callable
from urllib.parse import quote

import httpx
import numpy as np
from tqdm import tqdm

from ladle.bench.client import StreamError, Target, http_error, make_http_client, sse_chunks
from ladle.bench.voice_script import Conversation, Turn, transcripts_match

CHAT = "/v1/chat/completions"
MODES = ("wait", "eager")
CANCEL_MODES = ("disconnect", "route")
SENTENCE_END = re.compile(r"[.!?](?=\s|$)")
DRAIN_TIMEOUT_S = 10.0  # --cancel route: how long a cancelled stream may take to end before it is closed
TIMING_FIELDS = ("queued_ms", "prefill_ms", "first_token_ms", "last_token_ms")


@dataclass
class VoiceSpec:
    modes: tuple[str, ...] = MODES
    cancel: str = "disconnect"
    repeat: int = 1
    max_concurrency: int = 4
    max_tokens: int = 64
    temperature: float = 0.0
    seed: int | None = None
    turn_gap: float = 0.3  # seconds from a reply's end to the caller's next turn
    server_timings: bool = False  # ask for ladle's "timings" object
    warmup: bool = True

    def validate(self) -> None:
        if not self.modes or any(m not in MODES for m in self.modes) or len(set(self.modes)) != len(self.modes):
            raise ValueError(f"modes must be distinct ones of {', '.join(MODES)}, got {','.join(self.modes)}")
        if self.cancel not in CANCEL_MODES:
            raise ValueError(f"cancel must be one of {', '.join(CANCEL_MODES)}")
        for name in ("repeat", "max_concurrency", "max_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name.replace('_', '-')} must be at least 1")
        if self.turn_gap < 0:
            raise ValueError("turn-gap must be >= 0")


@dataclass(eq=False)  # identity, not field-wise equality
class Reply:
    """One streamed chat request, a draft or a reply, filled in as its chunks arrive."""

    request_id: str
    transcript: str  # the caller's words it answers (without the call tag)
    sent_at: float = 0.0  # time.perf_counter()
    ended_at: float | None = None  # when its stream ended or was closed
    text: str = ""
    chunk_times: list[float] = field(default_factory=list)  # arrival of each chunk with content
    chunk_ends: list[int] = field(default_factory=list)  # len(text) after each of those chunks
    finish_reason: str | None = None
    usage_tokens: int | None = None  # usage.completion_tokens
    prompt_tokens: int | None = None
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens
    timings: dict[str, Any] | None = None
    error: str = ""
    stopping: bool = False  # the bench cancelled it
    cancel_via: str | None = None  # "disconnect" | "route" | "finished" (it had ended already)
    task: asyncio.Task | None = field(default=None, repr=False)
    changed: asyncio.Event = field(default_factory=asyncio.Event, repr=False)

    @property
    def done(self) -> bool:
        return self.ended_at is not None

    @property
    def first_token_at(self) -> float | None:
        return self.chunk_times[0] if self.chunk_times else None

    @property
    def first_sentence_at(self) -> float | None:
        if not self.text:
            return None
        match = SENTENCE_END.search(self.text)
        return self.time_of_char(match.start() if match else len(self.text) - 1)

    @property
    def completion_tokens(self) -> int:
        return self.usage_tokens if self.usage_tokens is not None else len(self.chunk_times)

    def time_of_char(self, index: int) -> float:
        """When the chunk holding character `index` of the text arrived."""
        return self.chunk_times[bisect.bisect_right(self.chunk_ends, index)]

    async def wait_chars(self, n: int) -> None:
        """Until `n` characters have arrived or the stream has ended."""
        while len(self.text) < n and not self.done:
            self.changed.clear()
            await self.changed.wait()

    def add(self, chunk: dict[str, Any], now: float) -> None:
        choices = chunk.get("choices") or []
        if choices:
            content = (choices[0].get("delta") or {}).get("content")
            if content:
                self.text += content
                self.chunk_times.append(now)
                self.chunk_ends.append(len(self.text))
            self.finish_reason = choices[0].get("finish_reason") or self.finish_reason
        usage = chunk.get("usage")
        if usage:
            if usage.get("completion_tokens") is not None:
                self.usage_tokens = int(usage["completion_tokens"])
            if usage.get("prompt_tokens") is not None:
                self.prompt_tokens = int(usage["prompt_tokens"])
            cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
            if cached is not None:
                self.cached_tokens = int(cached)
        if isinstance(chunk.get("timings"), dict):
            self.timings = chunk["timings"]
        self.changed.set()


@dataclass
class TurnRecord:
    """One turn as one mode answered it; times in ms from the end of speech unless named otherwise."""

    mode: str
    pass_no: int  # the pass's place in the run (0-based)
    repeat: int  # which replay of the scripts in this mode (0-based)
    conversation: str
    turn: int
    call_tag: str
    speech_end_s: float  # script time of the end of speech
    end_s: float  # script time of the confirmed end of turn
    event_lag_ms: float | None = None  # the latest the bench handled one of the turn's events (client lag)
    first_token_ms: float | None = None
    first_sentence_ms: float | None = None
    reply_ttft_ms: float | None = None  # from the delivered request's send
    reply_source: str = ""  # "final" (sent at the end) | "draft"
    drafts_started: int = 0
    drafts_used: int = 0
    drafts_cancelled: int = 0
    wasted_tokens: int = 0  # completion tokens of cancelled drafts
    cancel_via: list[str] = field(default_factory=list)  # how each cancelled draft was stopped
    reply_tokens: int | None = None
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    barged_in: bool = False
    user_text: str = ""  # the caller's words the reply answered
    reply_text: str = ""  # what arrived of the reply
    history_text: str = ""  # the assistant message the history kept (the played part after a barge-in)
    server_timings: dict[str, Any] | None = None
    error: str = ""


@dataclass
class VoiceRun:
    turns: list[TurnRecord]
    passes: list[str]  # each pass's mode, in the order run
    duration: float  # seconds, warm-up excluded
    failed_requests: int  # delivered replies and drafts that failed, turns skipped after a failure
    errors: list[str]


@dataclass
class _Played:
    """A turn while it plays: the requests it made and what the caller heard."""

    turn: Turn
    start: float  # time.perf_counter() when the caller started speaking
    end_at: float = 0.0  # when the bench handled the end event
    lag: float = 0.0  # the latest it handled an event, seconds after the event's time
    drafts: list[Reply] = field(default_factory=list)
    reply: Reply | None = None
    barged_in: bool = False
    history_text: str = ""


def pass_order(modes: tuple[str, ...], repeat: int) -> list[tuple[str, int]]:
    """(mode, repeat) per pass: interleaved, each repeat reversing the last so drift hits both modes."""
    out: list[tuple[str, int]] = []
    for r in range(repeat):
        out += [(m, r) for m in (modes if r % 2 == 0 else modes[::-1])]
    return out


def played_text(text: str, chars: int) -> str:
    """The first `chars` characters of a reply, cut back to a word boundary."""
    if len(text) <= chars:
        return text.strip()
    head = text[:chars]
    if not text[chars].isspace():
        cut = max(head.rfind(" "), head.rfind("\n"), head.rfind("\t"))
        head = head[:cut] if cut >= 0 else ""
    return head.strip()


async def _sleep_until(t: float) -> None:
    delay = t - time.perf_counter()
    if delay > 0:
        await asyncio.sleep(delay)


class _Replayer:
    def __init__(self, http: httpx.AsyncClient, target: Target, spec: VoiceSpec) -> None:
        self.http, self.target, self.spec = http, target, spec
        self.salt = secrets.token_hex(3)  # request ids and call tags differ from any other run's
        self.ids = itertools.count(1)
        self.calls = itertools.count(1)
        self.background: set[asyncio.Task] = set()
        self.errors: list[str] = []

    def call_tag(self) -> str:
        return f"[call {next(self.calls)}-{secrets.token_hex(3)}] "

    def start(self, history: list[dict[str, str]], user: str, transcript: str,
              max_tokens: int | None = None) -> Reply:
        reply = Reply(request_id=f"voice-{self.salt}-{next(self.ids)}", transcript=transcript)
        body: dict[str, Any] = {
            "model": self.target.model, "messages": [*history, {"role": "user", "content": user}],
            "max_tokens": max_tokens or self.spec.max_tokens, "temperature": self.spec.temperature, "stream": True,
            "stream_options": {"include_usage": True},
        }
        if self.spec.seed is not None:
            body["seed"] = self.spec.seed
        if self.spec.cancel == "route":
            body["request_id"] = reply.request_id
        if self.spec.server_timings:
            body["include_timings"] = True
        body.update(self.target.extra_body)
        reply.task = asyncio.create_task(self._stream(reply, body))
        return reply

    async def _stream(self, reply: Reply, body: dict[str, Any]) -> None:
        reply.sent_at = time.perf_counter()
        try:
            async with self.http.stream("POST", self.target.url(CHAT), json=body) as resp:
                if resp.status_code != 200:
                    reply.error = http_error(resp.status_code, await resp.aread())
                    return
                async for now, chunk in sse_chunks(resp):
                    reply.add(chunk, now)
        except StreamError as e:
            reply.error = str(e)
        except asyncio.CancelledError:
            if not reply.stopping:
                raise  # the run itself is being cancelled
        except Exception as e:  # noqa: BLE001 - recorded; the turn decides what it means
            if not reply.stopping:  # once cancelled, how the stream ends is no failure
                reply.error = f"{type(e).__name__}: {e}"
        finally:
            reply.ended_at = time.perf_counter()
            reply.changed.set()

    def stop(self, reply: Reply) -> None:
        """Cancel `reply` without waiting for it (a draft passed over, or a reply talked over)."""
        if reply.stopping:
            return
        reply.stopping = True
        if reply.done:
            reply.cancel_via = "finished"
        elif self.spec.cancel == "route":
            reply.cancel_via = "route"
            task = asyncio.create_task(self._cancel_by_route(reply))
            self.background.add(task)
            task.add_done_callback(self.background.discard)
        else:
            reply.cancel_via = "disconnect"
            assert reply.task is not None
            reply.task.cancel()

    async def _cancel_by_route(self, reply: Reply) -> None:
        assert reply.task is not None
        url = self.target.url(f"/v1/requests/{quote(reply.request_id, safe='')}/cancel")
        try:
            accepted = (await self.http.post(url, timeout=10.0)).status_code == 200
        except httpx.HTTPError:
            accepted = False
        if accepted:
            await asyncio.wait({reply.task}, timeout=DRAIN_TIMEOUT_S)
        if reply.done:
            if not accepted:
                reply.cancel_via = "finished"  # it ended before the route saw it
            return
        reply.cancel_via = "disconnect"  # no such route, or the request had not arrived yet
        reply.task.cancel()

    async def warm(self, conversations: list[Conversation]) -> None:
        """One short request per system prompt (its prefix cached for both modes alike); it also checks that
        the target answers at all."""
        systems = list(dict.fromkeys(c.system for c in conversations))
        for system in systems:
            history = [{"role": "system", "content": system}] if system else []
            reply = self.start(history, "[warm-up] Hello.", "Hello.", max_tokens=1)
            assert reply.task is not None
            await reply.task
            if reply.error:
                raise RuntimeError(f"the warm-up request to {self.target.url(CHAT)} failed "
                                   f"(check --base-url, --model): {reply.error}")

    async def conversation(self, conv: Conversation, mode: str,
                           on_turn: Callable[[], None]) -> tuple[str, list[_Played]]:
        """Play one conversation in real time; the turns played, up to and including a failed one."""
        tag = self.call_tag()
        history = [{"role": "system", "content": conv.system}] if conv.system else []
        played: list[_Played] = []
        start = time.perf_counter()
        for turn in conv.turns:
            p = await self._turn(turn, mode, history, tag if turn.turn == 0 else "", start)
            played.append(p)
            on_turn()
            reply = p.reply
            assert reply is not None
            if reply.error or (reply.done and not reply.text):
                break
            if p.barged_in:
                start = time.perf_counter()
            else:
                start = max(p.end_at, reply.ended_at or p.end_at) + self.spec.turn_gap
            history += [{"role": "user", "content": (tag if turn.turn == 0 else "") + reply.transcript},
                        {"role": "assistant", "content": p.history_text}]
        # cancelled streams still draining (--cancel route) decide the wasted tokens
        tasks = [r.task for p in played for r in (*p.drafts, p.reply) if r is not None and r.task is not None]
        if tasks:
            await asyncio.wait(tasks)
        return tag, played

    async def _turn(self, turn: Turn, mode: str, history: list[dict[str, str]], tag: str, start: float) -> _Played:
        await _sleep_until(start)
        p = _Played(turn, start)
        draft: Reply | None = None
        for event in turn.events:
            await _sleep_until(start + event.at)
            p.lag = max(p.lag, time.perf_counter() - start - event.at)
            if event.type == "end":
                p.end_at = time.perf_counter()
                if draft is not None and not draft.error and transcripts_match(draft.transcript, event.text):
                    p.reply = draft
                else:
                    if draft is not None:
                        self.stop(draft)
                    p.reply = self.start(history, tag + event.text, event.text)
            elif mode == "eager" and event.type == "eager":
                if draft is not None:
                    self.stop(draft)
                draft = self.start(history, tag + event.text, event.text)
                p.drafts.append(draft)
            elif mode == "eager" and event.type == "resumed" and draft is not None:
                self.stop(draft)
                draft = None
        reply = p.reply
        assert reply is not None and reply.task is not None
        chars = turn.barge_in_chars
        if chars is not None:
            await reply.wait_chars(chars)
            if len(reply.text) >= chars and not reply.error:
                p.barged_in = True
                p.history_text = played_text(reply.text, chars)
                self.stop(reply)
                return p
        await asyncio.wait({reply.task})
        p.history_text = reply.text.strip()
        return p


def _record(p: _Played, mode: str, pass_no: int, repeat: int, tag: str) -> TurnRecord:
    turn, reply = p.turn, p.reply
    assert reply is not None
    speech_end = p.start + turn.speech_end
    cancelled = [d for d in p.drafts if d is not reply]
    rec = TurnRecord(
        mode=mode, pass_no=pass_no, repeat=repeat, conversation=turn.conversation, turn=turn.turn, call_tag=tag,
        speech_end_s=turn.speech_end, end_s=turn.end.at, event_lag_ms=p.lag * 1000.0,
        reply_source="draft" if reply in p.drafts else "final", drafts_started=len(p.drafts),
        drafts_used=len(p.drafts) - len(cancelled), drafts_cancelled=len(cancelled),
        wasted_tokens=sum(d.completion_tokens for d in cancelled), cancel_via=[d.cancel_via or "" for d in cancelled],
        reply_tokens=reply.completion_tokens, prompt_tokens=reply.prompt_tokens, cached_tokens=reply.cached_tokens,
        barged_in=p.barged_in, user_text=reply.transcript, reply_text=reply.text, history_text=p.history_text,
        server_timings=reply.timings, error=reply.error,
    )
    if not rec.error and reply.first_token_at is None:
        rec.error = "the reply ended without text"
    if rec.error:
        return rec
    first_sentence = reply.first_sentence_at
    assert reply.first_token_at is not None and first_sentence is not None
    rec.first_token_ms = (max(p.end_at, reply.first_token_at) - speech_end) * 1000.0
    rec.first_sentence_ms = (max(p.end_at, first_sentence) - speech_end) * 1000.0
    rec.reply_ttft_ms = (reply.first_token_at - reply.sent_at) * 1000.0
    return rec


def _skipped(conv: Conversation, after: int, mode: str, pass_no: int, repeat: int, tag: str) -> list[TurnRecord]:
    return [TurnRecord(mode=mode, pass_no=pass_no, repeat=repeat, conversation=conv.name, turn=t.turn, call_tag=tag,
                       speech_end_s=t.speech_end, end_s=t.end.at, error=f"skipped: turn {after} failed")
            for t in conv.turns[after + 1:]]


async def run_voice(target: Target, conversations: list[Conversation], spec: VoiceSpec, *,
                    progress: bool = True) -> VoiceRun:
    """Warm the system prompts, then replay every conversation once per pass, passes in pass_order."""
    spec.validate()
    passes = pass_order(spec.modes, spec.repeat)
    turns_per_pass = sum(len(c.turns) for c in conversations)
    records: list[TurnRecord] = []
    failed = 0
    async with make_http_client(target) as http:
        replayer = _Replayer(http, target, spec)
        if spec.warmup:
            await replayer.warm(conversations)
        bar = tqdm(total=len(passes) * turns_per_pass, disable=not progress, unit="turn", dynamic_ncols=True)
        start = time.perf_counter()
        try:
            for pass_no, (mode, repeat) in enumerate(passes):
                bar.set_description(f"pass {pass_no + 1}/{len(passes)} {mode}")
                slots = asyncio.Semaphore(spec.max_concurrency)

                async def one(conv: Conversation, mode: str = mode) -> tuple[str, list[_Played]]:
                    async with slots:
                        return await replayer.conversation(conv, mode, lambda: bar.update(1))

                played = await asyncio.gather(*(one(c) for c in conversations))
                for conv, (tag, turns) in zip(conversations, played):
                    rows = [_record(p, mode, pass_no, repeat, tag) for p in turns]
                    if rows and rows[-1].error:
                        replayer.errors.append(f"{mode} {conv.name} turn {rows[-1].turn}: {rows[-1].error}")
                        rows += _skipped(conv, rows[-1].turn, mode, pass_no, repeat, tag)
                        bar.update(len(conv.turns) - len(turns))
                    failed += sum(bool(r.error) for r in rows)
                    failed += sum(bool(d.error) for p in turns for d in p.drafts if d is not p.reply)
                    replayer.errors += [f"{mode} {conv.name} turn {p.turn.turn} draft: {d.error}"
                                        for p in turns for d in p.drafts if d is not p.reply and d.error]
                    records += rows
            if replayer.background:
                await asyncio.wait(replayer.background)
        finally:
            bar.close()
        duration = time.perf_counter() - start
    return VoiceRun(records, [m for m, _ in passes], duration, failed, replayer.errors)


# ---------------------------------------------------------------- summaries


def _pct(values: list[float], p: float) -> float | None:
    return float(np.percentile(values, p)) if values else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def summarize_mode(rows: list[TurnRecord]) -> dict[str, Any]:
    """One mode's figures: p50/p95/mean latencies in ms, draft counts and rates, tokens."""
    ok = [r for r in rows if not r.error]
    out: dict[str, Any] = {"turns": len(rows), "completed_turns": len(ok), "failed_turns": len(rows) - len(ok)}
    for metric in ("first_token", "first_sentence", "reply_ttft"):
        values = [getattr(r, f"{metric}_ms") for r in ok]
        out[f"p50_{metric}_ms"] = _pct(values, 50)
        out[f"p95_{metric}_ms"] = _pct(values, 95)
        out[f"mean_{metric}_ms"] = float(np.mean(values)) if values else None
    started = sum(r.drafts_started for r in ok)
    used = sum(r.drafts_used for r in ok)
    cancelled = sum(r.drafts_cancelled for r in ok)
    wasted = sum(r.wasted_tokens for r in ok)
    out.update({
        "drafts_started": started, "drafts_used": used, "drafts_cancelled": cancelled,
        "draft_use_rate": used / started if started else None,
        "draft_cancel_rate": cancelled / started if started else None,
        "turns_answered_by_draft": used / len(ok) if ok else None,
        "wasted_tokens": wasted, "wasted_tokens_per_turn": wasted / len(ok) if ok else None,
        "reply_tokens": sum(r.reply_tokens or 0 for r in ok),
        "barge_ins": sum(r.barged_in for r in ok),
    })
    reported = [r for r in ok if r.cached_tokens is not None and r.prompt_tokens]
    prompt = sum(r.prompt_tokens or 0 for r in reported)
    out["prompt_tokens_mean"] = float(np.mean([r.prompt_tokens for r in reported])) if reported else None
    out["cached_tokens_mean"] = float(np.mean([r.cached_tokens for r in reported])) if reported else None
    out["prefix_hit_rate"] = sum(r.cached_tokens or 0 for r in reported) / prompt if prompt else None
    timed = [r.server_timings for r in ok if r.server_timings]
    if timed:
        for key in TIMING_FIELDS:
            values = [float(t[key]) for t in timed if isinstance(t.get(key), (int, float))]
            out[f"server_p50_{key}"] = _pct(values, 50)
            out[f"server_p95_{key}"] = _pct(values, 95)
    return out


def paired_ratios(rows: list[TurnRecord], metric: str, num: str = "eager", den: str = "wait") -> list[float]:
    """Per-turn num/den of `metric` for the same script turn in the same repeat."""
    by_key = {(r.repeat, r.conversation, r.turn): r for r in rows if r.mode == den and not r.error}
    out = []
    for r in rows:
        other = by_key.get((r.repeat, r.conversation, r.turn))
        if r.mode == num and not r.error and other is not None:
            a, b = getattr(r, f"{metric}_ms"), getattr(other, f"{metric}_ms")
            if a is not None and b:
                out.append(a / b)
    return out


def summarize(run: VoiceRun, modes: tuple[str, ...]) -> dict[str, Any]:
    """`summary` per mode, and eager/wait ratios when both modes ran."""
    summary = {mode: summarize_mode([r for r in run.turns if r.mode == mode]) for mode in modes}
    ratios = None
    if "wait" in summary and "eager" in summary:
        wait, eager = summary["wait"], summary["eager"]
        ratios = {}
        for metric in ("first_token", "first_sentence"):
            for p in ("p50", "p95"):
                ratios[f"{p}_{metric}"] = _ratio(eager[f"{p}_{metric}_ms"], wait[f"{p}_{metric}_ms"])
            paired = paired_ratios(run.turns, metric)
            ratios[f"paired_median_{metric}"] = float(np.median(paired)) if paired else None
    return {"summary": summary, "ratios": ratios}
