"""A real ladle server for tests: uvicorn in a thread, on a socket bound to a free 127.0.0.1 port.

The socket is bound before uvicorn starts, so there is no race for the port. The session's
shared server (fixtures `async_engine` and `server`) is built in conftest.py; `own_server`
starts a private one for tests that need other engine flags.
"""

from __future__ import annotations

import shutil
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import uvicorn
from prometheus_client.parser import text_string_to_metric_families

from ladle.config import EngineConfig
from ladle.engine.async_engine import AsyncEngine
from ladle.engine.engine import LLMEngine
from ladle.server.app import create_app

MODEL = "SmolLM2-135M-Instruct"
NUM_KV_BLOCKS = 1024
# the labelled-set CLI tests' server: every rendered ticket (320 prompts of ~130 tokens) stays cached,
# with the option-order sample and the chat traffic of `calibrate check` beside them (2446 blocks in all)
LABELLED_KV_BLOCKS = 3072
GREEDY = dict(temperature=0.0)
HELLO = [{"role": "user", "content": "Say hello in one short sentence."}]
EXAMPLES = Path(__file__).parents[1] / "examples" / "decisions"  # labelled sets and their questions


class ServerThread:
    def __init__(self, app, log_level: str = "warning"):
        self.server = uvicorn.Server(uvicorn.Config(app, log_level=log_level, timeout_keep_alive=30))
        # IPPROTO_TCP: only then does asyncio set TCP_NODELAY on accepted connections;
        # without it every response with a body waits ~40 ms on a delayed ACK.
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def start(self, timeout: float = 30.0) -> "ServerThread":
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)
        self.sock.close()


@dataclass
class Server:
    url: str  # without /v1
    engine: AsyncEngine
    model: str = MODEL

    @property
    def base_url(self) -> str:
        return f"{self.url}/v1"

    def stats(self) -> dict:
        return httpx.get(f"{self.base_url}/engine/stats").json()

    def wait_idle(self, timeout: float = 60.0) -> dict:
        """Poll until no request is left in the engine and every KV block is free; returns the stats."""
        deadline = time.monotonic() + timeout
        while True:
            s = self.stats()
            if s["num_unfinished_requests"] == 0 and s["num_free_blocks"] == s["num_blocks"]:
                return s
            if time.monotonic() > deadline:
                raise AssertionError(f"engine not idle after {timeout} s: {s}")
            time.sleep(0.05)


    def metrics(self) -> str:
        return httpx.get(f"{self.url}/metrics").text

    def scrape(self) -> dict[str, float]:
        """/metrics parsed by prometheus_client: 'name{label=value,...}' -> value (model_name checked, left out)."""
        out = {}
        for family in text_string_to_metric_families(self.metrics()):
            for s in family.samples:
                assert s.labels.pop("model_name") == self.model, s
                labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
                out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
        return out


@contextmanager
def own_server(config: EngineConfig, **app_args) -> Iterator[Server]:
    """A private engine and server with these flags (the default model loads in ~2 s), stopped on exit;
    app_args go to create_app."""
    engine = AsyncEngine(LLMEngine(config))
    thread = ServerThread(create_app(engine, MODEL, **app_args)).start()
    try:
        yield Server(thread.url, engine)
    finally:
        thread.stop()
        engine.shutdown()


@contextmanager
def app_server(engine: AsyncEngine, cold: bool = False, **app_args) -> Iterator[Server]:
    """Another app, with these create_app options, over a running engine (the session's): app options
    without an engine of their own. cold: its prefix cache reset first, as a fresh engine's is empty."""
    thread = ServerThread(create_app(engine, MODEL, **app_args)).start()
    server = Server(thread.url, engine)
    try:
        if cold:
            server.wait_idle()
            assert httpx.post(f"{server.url}/reset_prefix_cache").status_code == 200
        yield server
    finally:
        thread.stop()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def labelled_set_args(server: Server, name: str = "tickets", heldout: bool = True,
                      examples: Path = EXAMPLES) -> list[str]:
    """--base-url, --data (the fit split), --heldout and --question of an example labelled set (in
    `examples`), as `ladle calibrate` and `ladle heads` take them."""
    args = ["--base-url", server.url, "--data", str(examples / f"{name}.fit.jsonl")]
    if heldout:
        args += ["--heldout", str(examples / f"{name}.heldout.jsonl")]
    return args + ["--question", str(examples / f"{name}.question.json")]


def every_nth_example(out: Path, step: int, name: str = "tickets") -> Path:
    """The example labelled set `name` with every `step`-th line of its fit and held-out splits (labels
    in about the same proportions), in `out`: the end-to-end fits over a share of the prefills."""
    for split in ("fit", "heldout"):
        lines = (EXAMPLES / f"{name}.{split}.jsonl").read_text().splitlines(keepends=True)
        (out / f"{name}.{split}.jsonl").write_text("".join(lines[::step]))
    shutil.copy(EXAMPLES / f"{name}.question.json", out)
    return out


def chat(client: openai.OpenAI, messages: list[dict] = HELLO, **kw):
    """A chat completion through the SDK: greedy, 16 tokens, unless kw says otherwise."""
    return client.chat.completions.create(model=MODEL, messages=messages, **{"max_tokens": 16, **GREEDY, **kw})
