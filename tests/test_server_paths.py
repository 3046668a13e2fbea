"""Server paths that need an engine of their own: CLI flags that change the engine, a KV pool
smaller than the model's context, and /health once the engine is down."""

from __future__ import annotations

import argparse
from collections.abc import Iterator

import httpx
import openai
import pytest
from server_utils import MODEL, Server, ServerThread, own_server

from ladle.config import EngineConfig, engine_config_from_args
from ladle.engine.async_engine import AsyncEngine
from ladle.server import cli as serve_cli
from ladle.server.app import create_app

HELLO = [{"role": "user", "content": "Say hello in one short sentence."}]
BLOCK = EngineConfig.block_size


def parse(*argv: str) -> argparse.Namespace:
    """`ladle serve ARGV` as the command line parses it."""
    parser = argparse.ArgumentParser()
    serve_cli.add_arguments(parser)
    return parser.parse_args(list(argv))


def sdk(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=120)


def test_cli_aliases_parse_into_the_engine_config() -> None:
    default = engine_config_from_args(parse())
    assert (default.enable_prefix_caching, default.scheduling_policy, default.deterministic) == (True, "fcfs", False)
    config = engine_config_from_args(parse("--no-prefix-cache", "--schedule-policy", "priority", "--deterministic"))
    assert (config.enable_prefix_caching, config.scheduling_policy, config.deterministic) == (False, "priority", True)
    assert engine_config_from_args(parse("--scheduling-policy", "lpm")).scheduling_policy == "lpm"
    assert engine_config_from_args(parse("--quantization", "int8")).quantization == "int8"
    assert engine_config_from_args(parse()).quantization == "auto"
    with pytest.raises(SystemExit):  # the alias checks its choices too
        parse("--schedule-policy", "random")


def test_tool_call_flags() -> None:
    assert serve_cli.auto_tool_call_parser(parse()) is None
    assert serve_cli.auto_tool_call_parser(parse("--tool-call-parser", "hermes")) is None  # "auto" still off
    args = parse("--enable-auto-tool-choice", "--tool-call-parser", "llama3_json")
    assert serve_cli.auto_tool_call_parser(args) == "llama3_json"
    assert serve_cli.run(parse("--enable-auto-tool-choice")) == 2  # refused before anything loads
    with pytest.raises(SystemExit):
        parse("--tool-call-parser", "mistral")


def test_deterministic_and_schedule_policy_flags_take_effect() -> None:
    args = parse("--deterministic", "--schedule-policy", "priority", "--max-num-seqs", "1", "--num-kv-blocks", "64")
    with own_server(engine_config_from_args(args)) as server, sdk(server) as client:
        # --deterministic: generated tokens' K/V never enter the prefix cache, only the prompt's blocks
        # (its partly filled last one included)
        r = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=40, temperature=0,
                                           extra_body={"ignore_eos": True})
        assert r.usage.completion_tokens == 40
        assert server.wait_idle()["num_cached_blocks"] == -(-r.usage.prompt_tokens // BLOCK)

        # --schedule-policy priority (one sequence at a time): an urgent request preempts a running one
        # and finishes first; first come, first served would make it wait for the long one
        long = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=60, temperature=0, stream=True,
                                              extra_body={"ignore_eos": True, "priority": 5})
        next(c for c in long if c.choices and c.choices[0].delta.content)  # it is running
        urgent = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=2, temperature=0,
                                                extra_body={"ignore_eos": True, "priority": 0})
        stats = server.stats()
        assert urgent.usage.completion_tokens == 2
        assert stats["num_preemptions"] >= 1 and stats["num_unfinished_requests"] == 1, stats
        finishes = [c.choices[0].finish_reason for c in long if c.choices and c.choices[0].finish_reason]
        assert finishes == ["length"]  # the long one resumed and ran to its end


@pytest.fixture(scope="module")
def tiny_server() -> Iterator[Server]:
    """`--no-prefix-cache` and a KV pool of 8 blocks: 128 tokens, far below the model's 8192."""
    with own_server(engine_config_from_args(parse("--no-prefix-cache", "--num-kv-blocks", "8"))) as server:
        yield server


def test_no_prefix_cache_flag_takes_effect(tiny_server: Server) -> None:
    with sdk(tiny_server) as client:
        usages = [client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=2, temperature=0).usage
                  for _ in range(2)]
    assert usages[0].prompt_tokens >= BLOCK  # a full block the cache would have kept
    assert [u.prompt_tokens_details.cached_tokens for u in usages] == [0, 0]  # the same prompt, never cached
    stats = tiny_server.wait_idle()
    assert stats["num_cached_blocks"] == 0 and stats["prefix_cache_hits"] == 0


def test_max_model_len_is_capped_to_the_kv_pool(tiny_server: Server) -> None:
    pool = 8 * BLOCK
    assert httpx.get(f"{tiny_server.base_url}/models").json()["data"][0]["max_model_len"] == pool
    assert httpx.get(f"{tiny_server.base_url}/models/{MODEL}").json()["max_model_len"] == pool
    assert httpx.post(f"{tiny_server.url}/tokenize", json={"prompt": "hi"}).json()["max_model_len"] == pool
    url = f"{tiny_server.base_url}/completions"
    for body, param in [({"prompt": [1] * pool, "max_tokens": 1}, "prompt"),
                        ({"prompt": [1] * (pool - 8), "max_tokens": 9}, "max_tokens")]:
        r = httpx.post(url, json=body)
        error = r.json()["error"]
        assert r.status_code == 400 and error["param"] == param and error["code"] == "context_length_exceeded"
        assert f"maximum context length is {pool} tokens" in error["message"]
    # without max_tokens, a completion may run to the end of the pool and no further
    r = httpx.post(url, json={"prompt": [1] * (pool - 8), "max_tokens": None, "ignore_eos": True}, timeout=60).json()
    assert r["usage"]["completion_tokens"] == 8 and r["choices"][0]["finish_reason"] == "length"


def test_health_is_503_when_the_engine_is_down(monkeypatch: pytest.MonkeyPatch) -> None:
    def assert_down(server: Server, message: str) -> None:
        r = httpx.get(f"{server.url}/health")
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_unavailable", r.text
        r = httpx.post(f"{server.base_url}/chat/completions", json={"messages": HELLO, "max_tokens": 1})
        assert r.status_code == 503 and r.json()["error"]["type"] == "server_error", r.text
        assert message in r.json()["error"]["message"]

    with own_server(EngineConfig(num_kv_blocks=16)) as server:
        assert httpx.get(f"{server.url}/health").status_code == 200
        server.engine.shutdown()  # shut down
        assert_down(server, "not running")

        # the engine thread dies on a step that fails: a fresh AsyncEngine over the same LLMEngine
        llm = server.engine.engine

        def failing_step():
            raise RuntimeError("injected step failure")

        monkeypatch.setattr(llm, "step", failing_step)
        engine = AsyncEngine(llm)
        thread = ServerThread(create_app(engine, MODEL)).start()
        try:
            failed = Server(thread.url, engine)
            assert httpx.get(f"{failed.url}/health").status_code == 200
            r = httpx.post(f"{failed.base_url}/chat/completions", json={"messages": HELLO, "max_tokens": 1})
            assert r.status_code == 503 and "injected step failure" in r.json()["error"]["message"], r.text
            assert_down(failed, "not running")
        finally:
            thread.stop()
            engine.shutdown()
