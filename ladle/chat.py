"""`ladle chat [MODEL] [--base-url URL]`: a terminal chat, as `ollama run` is.

With `--base-url` it talks to any OpenAI-compatible server (streamed /v1/chat/completions, read over
httpx); without, it runs MODEL (default: the embedded model) in this process, on the engine's own step
loop. Replies print as their tokens arrive. `/reset` forgets the conversation, `/exit`, `/quit` or
Ctrl-D leave, Ctrl-C stops a reply. Standard input need not be a terminal: it is read line by line.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Protocol

PROMPT = ">>> "
EXIT_COMMANDS = ("/exit", "/quit", "/bye")
HELP = "/reset clears the conversation, /exit (or Ctrl-D) leaves, Ctrl-C stops a reply"

Write = Callable[[str], None]


class ChatError(Exception):
    """A reply that could not be had (the server's error, a prompt too long): said, and the chat goes on."""


@dataclass
class Sampling:
    temperature: float | None = None  # None: the server's (or the engine's) default
    max_tokens: int | None = None  # None: until the model stops or the context is full


@dataclass
class Conversation:
    system: str | None = None
    turns: list[dict[str, str]] = field(default_factory=list)  # user and assistant messages, in order

    def with_user(self, text: str) -> list[dict[str, str]]:
        """The messages to send for a new user turn (the history is unchanged until `add`)."""
        system = [{"role": "system", "content": self.system}] if self.system else []
        return system + self.turns + [{"role": "user", "content": text}]

    def add(self, user: str, assistant: str) -> None:
        self.turns += [{"role": "user", "content": user}, {"role": "assistant", "content": assistant}]

    def reset(self) -> None:
        self.turns = []


class Backend(Protocol):
    def reply(self, messages: list[dict[str, str]], sampling: Sampling, write: Write) -> str:
        """Stream the assistant's reply to `write` piece by piece; return it whole."""


# -- over HTTP: any OpenAI-compatible server -----------------------------------------------------------


def sse_data(lines: Iterable[str]) -> Iterator[str]:
    """The `data:` payloads of a server-sent event stream, up to `[DONE]`."""
    for line in lines:
        if not line.startswith("data:"):
            continue  # blank separators, comments, event names
        data = line[5:].strip()
        if data == "[DONE]":
            return
        yield data


def content_deltas(lines: Iterable[str]) -> Iterator[str]:
    """The text pieces of a streamed chat completion, from its SSE lines."""
    for data in sse_data(lines):
        chunk = json.loads(data)
        if "error" in chunk:
            raise ChatError(_error_message(chunk))
        for choice in chunk.get("choices", []):
            piece = (choice.get("delta") or {}).get("content")
            if piece:
                yield piece


@dataclass
class RemoteChat:
    base_url: str  # the server's root; a trailing /v1 is fine
    api_key: str | None = None
    model: str | None = None  # None: the first model the server lists
    timeout: float = 600.0

    def __post_init__(self) -> None:
        import httpx

        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        root = self.base_url.rstrip("/").removesuffix("/v1")
        self.client = httpx.Client(base_url=f"{root}/v1", headers=headers,
                                   timeout=httpx.Timeout(self.timeout, connect=10.0))
        self.model = self.model or self._first_model()

    def _first_model(self) -> str:
        r = self._check(self.client.get("/models"))
        models = r.json().get("data") or []
        if not models:
            raise ChatError(f"{self.client.base_url} lists no models: name one with --model")
        return models[0]["id"]

    def reply(self, messages: list[dict[str, str]], sampling: Sampling, write: Write) -> str:
        body: dict[str, Any] = {"model": self.model, "messages": messages, "stream": True}
        body |= {k: v for k, v in vars(sampling).items() if v is not None}
        import httpx

        pieces = []
        try:
            with self.client.stream("POST", "/chat/completions", json=body) as r:
                if r.status_code != 200:
                    r.read()
                    self._check(r)
                for piece in content_deltas(r.iter_lines()):
                    write(piece)
                    pieces.append(piece)
        except httpx.HTTPError as e:
            raise ChatError(f"{self.client.base_url}: {type(e).__name__}: {e}") from e
        return "".join(pieces)

    def _check(self, r):
        if r.status_code != 200:
            try:
                message = _error_message(r.json())
            except ValueError:
                message = r.text[:200]
            raise ChatError(f"{r.request.method} {r.request.url}: {r.status_code}: {message}")
        return r

    def close(self) -> None:
        self.client.close()


def _error_message(body: Any) -> str:
    error = body.get("error") if isinstance(body, dict) else None
    if isinstance(error, dict):
        return str(error.get("message", error))
    return str(error or body)


# -- in this process: the engine's step loop ----------------------------------------------------------


class LocalChat:
    """An LLMEngine on this thread: each step's new text is written at once. Ctrl-C only raises a flag,
    seen between steps, so a step is never cut in half; the request is then aborted."""

    def __init__(self, args: argparse.Namespace):
        from ladle.config import engine_config_from_args
        from ladle.engine.engine import LLMEngine

        self.engine = LLMEngine(engine_config_from_args(args))
        self._ids = itertools.count()

    def reply(self, messages: list[dict[str, str]], sampling: Sampling, write: Write) -> str:
        from ladle.engine.sampling_params import SamplingParams
        from ladle.errors import InvalidRequestError

        params = SamplingParams(max_tokens=sampling.max_tokens)
        if sampling.temperature is not None:
            params.temperature = sampling.temperature
        prompt = self.engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        request_id = str(next(self._ids))
        try:
            self.engine.add_request(request_id, prompt, params)
        except InvalidRequestError as e:
            raise ChatError(str(e)) from e
        pieces = []
        with _sigint_flag() as interrupted:
            while self.engine.has_unfinished_requests():
                if interrupted.is_set():
                    self.engine.abort_request(request_id)
                    raise KeyboardInterrupt
                for out in self.engine.step():
                    for delta in out.deltas:
                        write(delta.text)
                        pieces.append(delta.text)
        return "".join(pieces)

    def close(self) -> None:
        pass


@contextmanager
def _sigint_flag() -> Iterator[threading.Event]:
    """Ctrl-C sets the event instead of raising, for the duration."""
    flag = threading.Event()
    previous = signal.signal(signal.SIGINT, lambda *_: flag.set())
    try:
        yield flag
    finally:
        signal.signal(signal.SIGINT, previous)


# -- the loop ------------------------------------------------------------------------------------------


def chat_loop(backend: Backend, conversation: Conversation, sampling: Sampling, interactive: bool) -> int:
    """Read a line, answer it, until /exit or end of input. Returns the exit status (0)."""
    if interactive:
        print(HELP, file=sys.stderr)
    while True:
        try:
            line = input(PROMPT if interactive else "")
        except EOFError:
            if interactive:
                print()
            return 0
        except KeyboardInterrupt:  # at the prompt: a fresh line, as a shell does
            print()
            continue
        text = line.strip()
        if not text:
            continue
        if text in EXIT_COMMANDS:
            return 0
        if text == "/reset":
            conversation.reset()
            print("(conversation cleared)\n", flush=True)
            continue
        if text.startswith("/") and " " not in text:
            print(f"unknown command {text}: {HELP}\n", flush=True)
            continue
        answer(backend, conversation, sampling, text)


def answer(backend: Backend, conversation: Conversation, sampling: Sampling, text: str) -> None:
    """Stream one reply; the exchange joins the history only when the reply is complete."""
    def write(piece: str) -> None:
        sys.stdout.write(piece)
        sys.stdout.flush()

    try:
        reply = backend.reply(conversation.with_user(text), sampling, write)
    except KeyboardInterrupt:
        print("\n(reply stopped)\n", flush=True)
        return
    except ChatError as e:
        if _interrupted(e):  # closing the stream after Ctrl-C failed: still a stopped reply
            print("\n(reply stopped)\n", flush=True)
        else:
            print(f"ladle chat: {e}", file=sys.stderr, flush=True)
        return
    print("\n", flush=True)
    conversation.add(text, reply)


def _interrupted(error: BaseException | None) -> bool:
    """Whether a KeyboardInterrupt is among the exceptions that led to `error`."""
    seen = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, KeyboardInterrupt):
            return True
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return False


# -- the command ---------------------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from ladle.config import add_engine_arguments

    add_engine_arguments(parser)  # MODEL and the engine flags: for the in-process engine
    c = parser.add_argument_group("chat")
    c.add_argument("--base-url", default=None,
                   help="talk to this OpenAI-compatible server (e.g. http://127.0.0.1:8000/v1) instead of "
                        "running MODEL in this process")
    c.add_argument("--api-key", default=os.environ.get("LADLE_API_KEY") or os.environ.get("OPENAI_API_KEY"),
                   help="Bearer key for --base-url (default: $LADLE_API_KEY, else $OPENAI_API_KEY)")
    c.add_argument("--model", dest="served_model", default=None, metavar="NAME",
                   help="the model to ask for at --base-url (default: the first of its /v1/models)")
    c.add_argument("--system", default=None, help="system prompt")
    c.add_argument("--temperature", type=float, default=None, help="(default: the server's or engine's)")
    c.add_argument("--max-tokens", type=int, default=None,
                   help="longest reply in tokens (default: until the model stops)")


def run(args: argparse.Namespace) -> int:
    # Ctrl-C stops a reply even where the chat was started with SIGINT ignored (a parent that ignores
    # it passes that on, and Python then never raises KeyboardInterrupt)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        backend = _backend(args)
    except (ChatError, FileNotFoundError, ValueError) as e:  # a bad model, flag or server: say so, no traceback
        print(f"ladle chat: {e}", file=sys.stderr)
        return 2
    try:
        return chat_loop(backend, Conversation(system=args.system),
                         Sampling(temperature=args.temperature, max_tokens=args.max_tokens), sys.stdin.isatty())
    finally:
        backend.close()


def _backend(args: argparse.Namespace) -> RemoteChat | LocalChat:
    if args.base_url is None:
        return LocalChat(args)
    import httpx

    try:
        return RemoteChat(args.base_url, args.api_key, args.served_model)
    except httpx.HTTPError as e:
        raise ChatError(f"cannot reach {args.base_url}: {e}") from e
