"""Server flags users bring from vLLM: CORS (--allowed-origins ...), --chat-template, --root-path,
--max-logprobs and the request log (--enable-log-requests / --disable-log-requests). Each test runs
an app built with the flag over the session's engine, and would fail were the flag ignored."""

from __future__ import annotations

import argparse
import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import openai
import pytest
from server_utils import GREEDY, HELLO, MODEL, ServerThread

from ladle.cli import subcommand_parser
from ladle.server import cli as serve_cli
from ladle.server.app import create_app

GOOD, EVIL = "http://app.example", "http://evil.example"
TEMPLATE = ("{% for m in messages %}[{{ m['role'] | upper }}] {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}[ASSISTANT] {% endif %}")


def parse(*argv: str) -> argparse.Namespace:
    return subcommand_parser("serve").parse_args(list(argv))


@contextmanager
def app_server(async_engine, *argv: str) -> Iterator[str]:
    """A server over the shared engine with `ladle serve ARGV`'s server flags; yields its URL."""
    thread = ServerThread(create_app(async_engine, MODEL, **serve_cli.app_options(parse(*argv)))).start()
    try:
        yield thread.url
    finally:
        thread.stop()


def sdk(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url, api_key="x", max_retries=0, timeout=120)


def preflight(url: str, origin: str, method: str = "POST") -> httpx.Response:
    return httpx.options(f"{url}/v1/chat/completions", headers={
        "Origin": origin, "Access-Control-Request-Method": method, "Access-Control-Request-Headers": "content-type"})


# -- CORS ------------------------------------------------------------------------


def test_cors_flags(async_engine) -> None:
    assert parse("--allowed-origins", f'["{GOOD}"]').allowed_origins == [GOOD]
    with pytest.raises(SystemExit):
        parse("--allowed-origins", GOOD)  # JSON, as vLLM takes it
    with app_server(async_engine, "--allowed-origins", f'["{GOOD}"]', "--allow-credentials",
                    "--allowed-methods", '["GET", "POST"]', "--api-key", "k") as url:
        ok = preflight(url, GOOD)
        assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == GOOD  # no key needed
        assert ok.headers["access-control-allow-credentials"] == "true"
        assert "POST" in ok.headers["access-control-allow-methods"]
        evil = preflight(url, EVIL)
        assert evil.status_code == 400 and "access-control-allow-origin" not in evil.headers
        assert preflight(url, GOOD, "DELETE").status_code == 400  # not an allowed method
        # a real cross-origin request gets the header, even when refused for want of the key
        r = httpx.get(f"{url}/v1/models", headers={"Origin": GOOD})
        assert r.status_code == 401 and r.headers["access-control-allow-origin"] == GOOD
        r = httpx.get(f"{url}/v1/models", headers={"Origin": EVIL, "Authorization": "Bearer k"})
        assert r.status_code == 200 and "access-control-allow-origin" not in r.headers
    with app_server(async_engine, "--allowed-origins", '["*"]') as url:
        assert preflight(url, EVIL).headers["access-control-allow-origin"] == "*"
    with app_server(async_engine) as url:  # by default no origin is allowed
        assert "access-control-allow-origin" not in preflight(url, GOOD).headers


# -- --chat-template -------------------------------------------------------------


def test_chat_template_flag_replaces_the_models(async_engine, tmp_path) -> None:
    path = tmp_path / "template.jinja"
    path.write_text(TEMPLATE)
    assert serve_cli.app_options(parse("--chat-template", str(path)))["chat_template"] == TEMPLATE
    assert serve_cli.app_options(parse("--chat-template", TEMPLATE))["chat_template"] == TEMPLATE
    for bad in (str(tmp_path / "missing.jinja"), "{% if %}"):
        with pytest.raises(ValueError, match="--chat-template"):
            serve_cli.app_options(parse("--chat-template", bad))
    assert serve_cli.run(parse("--chat-template", str(tmp_path / "missing.jinja"))) == 2  # before the model loads

    tok = async_engine.tokenizer
    ids = tok.encode(f"[USER] {HELLO[0]['content']}\n[ASSISTANT] ")
    with app_server(async_engine, "--chat-template", str(path)) as url, sdk(f"{url}/v1") as client:
        r = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=8, **GREEDY)
        plain = client.completions.create(model=MODEL, prompt=ids, max_tokens=8, **GREEDY)
        assert r.usage.prompt_tokens == len(ids)
        assert r.choices[0].message.content == plain.choices[0].text
        assert client.responses.create(model=MODEL, input=HELLO[0]["content"], max_output_tokens=8,
                                       **GREEDY).usage.input_tokens == len(ids)
        assert httpx.post(f"{url}/tokenize", json={"model": MODEL, "messages": HELLO}).json()["tokens"] == ids
    with app_server(async_engine) as url, sdk(f"{url}/v1") as client:  # the model's own template
        r = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=1, **GREEDY)
        assert r.usage.prompt_tokens != len(ids)


# -- --root-path -----------------------------------------------------------------


def test_root_path_serves_under_the_proxy_prefix(async_engine) -> None:
    with app_server(async_engine, "--root-path", "/llm", "--api-key", "k") as url:
        with sdk(f"{url}/llm/v1") as client:
            client.api_key = "k"
            assert client.models.list().data[0].id == MODEL
            r = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=2, **GREEDY)
            assert r.choices[0].message.content
        assert httpx.get(f"{url}/llm/v1/models").status_code == 401  # the key guards the prefixed path too
        assert httpx.get(f"{url}/v1/models", headers={"Authorization": "Bearer k"}).status_code == 200  # stripped
        assert httpx.get(f"{url}/llm/openapi.json").json()["servers"] == [{"url": "/llm"}]
    with app_server(async_engine) as url:
        assert httpx.get(f"{url}/llm/v1/models").status_code == 404


# -- --max-logprobs --------------------------------------------------------------


def test_max_logprobs_caps_what_requests_may_ask(async_engine) -> None:
    with pytest.raises(ValueError, match="--max-logprobs"):
        serve_cli.app_options(parse("--max-logprobs", "50"))  # the engine returns at most 20
    with app_server(async_engine, "--max-logprobs", "2") as url, sdk(f"{url}/v1") as client:
        r = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=2, logprobs=True, top_logprobs=2,
                                           **GREEDY)
        assert len(r.choices[0].logprobs.content[0].top_logprobs) == 2
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=2, logprobs=True, top_logprobs=3)
        assert err.value.body["param"] == "top_logprobs" and "--max-logprobs" in err.value.body["message"]
        with pytest.raises(openai.BadRequestError) as err:
            client.completions.create(model=MODEL, prompt="Hi", max_tokens=2, logprobs=3)
        assert err.value.body["param"] == "logprobs"
    with app_server(async_engine) as url, sdk(f"{url}/v1") as client:  # the default: 20
        r = client.completions.create(model=MODEL, prompt="Hi", max_tokens=1, logprobs=20, **GREEDY)
        assert len(r.choices[0].logprobs.top_logprobs[0]) == 20  # greedy: the sampled token is among them
        with pytest.raises(openai.BadRequestError) as err:
            client.completions.create(model=MODEL, prompt="Hi", max_tokens=1, logprobs=21)
        assert err.value.body["param"] == "logprobs"


# -- the request log -------------------------------------------------------------


class Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())

    def wait_for(self, n: int, timeout: float = 10.0) -> list[str]:
        """The response reaches the client just before its line is written: wait for it."""
        deadline = time.monotonic() + timeout
        while len(self.lines) < n and time.monotonic() < deadline:
            time.sleep(0.02)
        return self.lines


@pytest.fixture
def request_log() -> Iterator[Lines]:
    log = logging.getLogger("ladle.requests")
    handler, level = Lines(), log.level
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    yield handler
    log.removeHandler(handler)
    log.setLevel(level)


def test_enable_log_requests_logs_one_line_per_request_without_content(async_engine, request_log: Lines) -> None:
    assert parse("--enable-log-requests").enable_log_requests
    assert not parse().enable_log_requests and not parse("--disable-log-requests").enable_log_requests
    with app_server(async_engine, "--enable-log-requests") as url, sdk(f"{url}/v1") as client:
        r = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=4, **GREEDY)
        streamed = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=3, stream=True,
                                                  stream_options={"include_usage": True}, **GREEDY)
        usage = [c.usage for c in streamed if c.usage][0]
        resp = client.responses.create(model=MODEL, input="Name a fruit.", max_output_tokens=2, **GREEDY)
        with pytest.raises(openai.BadRequestError):
            client.chat.completions.create(model=MODEL, messages=HELLO, temperature=-1)
        lines = request_log.wait_for(4)
    assert len(lines) == 4, lines
    assert lines[0] == (f'request_id={r.id} route="POST /v1/chat/completions" status=200 prompt_tokens='
                        f"{r.usage.prompt_tokens} output_tokens={r.usage.completion_tokens} "
                        + lines[0].split(" ")[-1])
    assert lines[0].split(" ")[-1].startswith("latency_ms=")
    assert f"prompt_tokens={usage.prompt_tokens} output_tokens=3 " in lines[1] and "status=200" in lines[1]
    assert f"request_id={resp.id} " in lines[2] and "output_tokens=2 " in lines[2]
    assert 'route="POST /v1/chat/completions" status=400 prompt_tokens=- output_tokens=-' in lines[3]
    assert not any("hello" in line.lower() or "fruit" in line.lower() for line in lines)  # never the content

    for argv in ((), ("--disable-log-requests",)):
        request_log.lines.clear()
        with app_server(async_engine, *argv) as url, sdk(f"{url}/v1") as client:
            client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=1)
        assert request_log.wait_for(1, timeout=0.5) == []
