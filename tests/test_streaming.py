"""Streaming through the server: SSE chunks against whole responses, usage in streams, concurrent
streams against solo runs, keep-alive, and clients that leave (their KV blocks are freed)."""

from __future__ import annotations

import asyncio
import http.client
import json

import httpx
import openai
import pytest
from server_utils import GREEDY, HELLO, MODEL, Server, chat


def test_streaming_chat_equals_non_streamed(client: openai.OpenAI) -> None:
    full = chat(client, max_completion_tokens=16, max_tokens=None)
    chunks = list(chat(client, max_completion_tokens=16, max_tokens=None, stream=True,
                        stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert len({c.id for c in chunks}) == 1 and len({c.created for c in chunks}) == 1
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [full.choices[0].finish_reason]
    usage_chunk = chunks[-1]
    assert usage_chunk.choices == [] and usage_chunk.usage is not None
    streamed_usage, full_usage = usage_chunk.usage.model_dump(), full.usage.model_dump()
    # the streamed request finds at least what the first one left in the prefix cache
    assert streamed_usage.pop("prompt_tokens_details")["cached_tokens"] >= \
        full_usage.pop("prompt_tokens_details")["cached_tokens"]
    assert streamed_usage == full_usage
    assert all(c.usage is None for c in chunks[:-1])


def test_stream_without_include_usage_has_no_usage_chunk(client: openai.OpenAI) -> None:
    chunks = list(chat(client, max_tokens=4, stream=True))
    assert all(c.choices for c in chunks) and all(c.usage is None for c in chunks)


CONTINUOUS = {"include_usage": True, "continuous_usage_stats": True}


def _check_running_usage(usages: list, prompt_tokens: int, final_completion_tokens: int) -> None:
    """Every chunk's usage: this prompt, the completion so far (growing), the total of both."""
    assert all(u is not None and u.prompt_tokens == prompt_tokens for u in usages), usages
    assert all(u.total_tokens == u.prompt_tokens + u.completion_tokens for u in usages)
    counts = [u.completion_tokens for u in usages]
    assert counts == sorted(set(counts)) and counts[-1] == final_completion_tokens, counts


def test_continuous_usage_stats_chat(client: openai.OpenAI) -> None:
    kw = dict(max_tokens=8, extra_body={"ignore_eos": True})
    *chunks, final = chat(client, stream=True, stream_options=CONTINUOUS, **kw)
    assert final.choices == [] and final.usage.completion_tokens == 8
    plain = chat(client, **kw).usage
    assert (final.usage.prompt_tokens, final.usage.total_tokens) == (plain.prompt_tokens, plain.total_tokens)
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].usage.completion_tokens == 0
    _check_running_usage([c.usage for c in chunks], final.usage.prompt_tokens, final.usage.completion_tokens)
    assert len(chunks) >= 5  # one per token or so: the counts really grew along the way
    # continuous_usage_stats without include_usage: no usage anywhere (as vLLM)
    plain = list(chat(client, stream=True, stream_options={"continuous_usage_stats": True}, max_tokens=3))
    assert plain and all(c.usage is None and c.choices for c in plain)


def test_continuous_usage_stats_completions(server: Server, client: openai.OpenAI) -> None:
    prompts = ["The capital of France is", "One, two, three, four,"]
    lengths = [httpx.post(f"{server.url}/tokenize", json={"prompt": p}).json()["count"] for p in prompts]
    *chunks, final = client.completions.create(model=MODEL, prompt=prompts, max_tokens=6, stream=True,
                                               stream_options=CONTINUOUS, extra_body={"ignore_eos": True}, **GREEDY)
    assert final.choices == [] and final.usage.prompt_tokens == sum(lengths)
    assert final.usage.completion_tokens == 12
    for index, length in enumerate(lengths):  # each choice counts its own prompt and completion
        mine = [c.usage for c in chunks if c.choices[0].index == index]
        _check_running_usage(mine, length, 6)
        assert len(mine) >= 3


def test_streamed_echo_equals_non_streamed(server: Server, client: openai.OpenAI) -> None:
    prompts = ["The capital of France is", "One, two, three,"]
    kw = dict(model=MODEL, prompt=prompts, max_tokens=6, echo=True, **GREEDY)
    full = client.completions.create(**kw)
    assert [c.text[: len(p)] for c, p in zip(full.choices, prompts)] == prompts
    texts: dict[int, list[str]] = {0: [], 1: []}
    for chunk in client.completions.create(stream=True, **kw):
        texts[chunk.choices[0].index].append(chunk.choices[0].text)
    assert [texts[0][0][: len(prompts[0])], texts[1][0][: len(prompts[1])]] == prompts  # the prompt comes first
    assert ["".join(texts[0]), "".join(texts[1])] == [c.text for c in full.choices]
    assert len(texts[0]) > 1  # and the completion after it, as it is generated
    # a prompt of token ids echoes as its text
    ids = httpx.post(f"{server.url}/tokenize", json={"prompt": prompts[1]}).json()["tokens"]
    by_ids = client.completions.create(**{**kw, "prompt": ids, "stream": True})
    assert "".join(c.choices[0].text for c in by_ids) == full.choices[1].text


def test_completions_token_ids_batch_and_stream(server: Server, client: openai.OpenAI) -> None:
    prompts = ["The capital of France is", "One, two, three,"]
    ids = [httpx.post(f"{server.url}/tokenize", json={"prompt": p}).json()["tokens"] for p in prompts]
    by_text = client.completions.create(model=MODEL, prompt=prompts, max_tokens=6, **GREEDY)
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=6, **GREEDY)
    assert [c.text for c in by_text.choices] == [c.text for c in by_ids.choices]
    assert [c.index for c in by_text.choices] == [0, 1]
    assert by_text.usage.prompt_tokens == sum(map(len, ids))
    texts = {0: "", 1: ""}
    chunks = list(client.completions.create(model=MODEL, prompt=prompts, max_tokens=6, stream=True,
                                            stream_options={"include_usage": True}, **GREEDY))
    for chunk in chunks[:-1]:
        for c in chunk.choices:
            texts[c.index] += c.text
    assert [texts[0], texts[1]] == [c.text for c in by_text.choices]
    assert chunks[-1].choices == [] and chunks[-1].usage.model_dump() == by_text.usage.model_dump()


# -- concurrency, keep-alive, disconnects ----------------------------------------

PROMPTS = ["Name a color.", "What is 2+2?", "Say something about cats.", "Describe the sea.",
           "Give me a fruit.", "What is Python?", "Tell me about the moon.", "Count to five."]


def test_32_concurrent_streams_match_solo_greedy(server: Server, client: openai.OpenAI) -> None:
    kw = dict(max_tokens=16, temperature=0.0)
    solo = {p: chat(client, [{"role": "user", "content": p}], **kw).choices[0].message.content for p in PROMPTS}
    jobs = [PROMPTS[i % len(PROMPTS)] for i in range(32)]
    steps_before = server.stats()["steps"]

    async def stream_one(aclient: openai.AsyncOpenAI, prompt: str) -> str:
        text = ""
        stream = await aclient.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompt}],
                                                       stream=True, **kw)
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
        return text

    async def run_all() -> list[str]:
        async with openai.AsyncOpenAI(base_url=server.base_url, api_key="x", max_retries=0, timeout=300) as ac:
            return await asyncio.gather(*(stream_one(ac, p) for p in jobs))

    outputs = asyncio.run(run_all())
    assert outputs == [solo[p] for p in jobs]
    stats = server.wait_idle()
    assert stats["steps"] - steps_before < 32 * 16 / 4  # the streams shared steps


def test_keep_alive_across_streamed_and_plain_requests(server: Server) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", int(server.url.rsplit(":", 1)[1]), timeout=60)
    body = json.dumps({"model": MODEL, "messages": HELLO, "max_tokens": 4, "stream": True})
    conn.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200 and resp.getheader("content-type").startswith("text/event-stream")
    events = resp.read().decode()
    assert events.rstrip().endswith("data: [DONE]") and not resp.will_close
    sock = conn.sock
    for path in ("/health", "/v1/models"):
        conn.request("GET", path)
        resp = conn.getresponse()
        resp.read()
        assert resp.status == 200 and conn.sock is sock  # same TCP connection
    conn.close()


def test_client_closing_a_stream_frees_its_blocks(server: Server, client: openai.OpenAI) -> None:
    server.wait_idle()
    before = server.stats()["generation_tokens"]
    stream = chat(client, max_tokens=2000, stream=True, extra_body={"ignore_eos": True})
    for i, _chunk in enumerate(stream):
        if i == 3:
            break
    assert server.stats()["num_unfinished_requests"] == 1
    stream.close()
    stats = server.wait_idle(timeout=30)
    assert stats["generation_tokens"] - before < 200  # aborted, not run to the end


def test_client_timing_out_on_a_plain_request_frees_its_blocks(server: Server) -> None:
    server.wait_idle()
    before = server.stats()["generation_tokens"]
    body = {"model": MODEL, "messages": HELLO, "max_tokens": 2000, "ignore_eos": True}
    with pytest.raises(httpx.TimeoutException):
        httpx.post(f"{server.base_url}/chat/completions", json=body, timeout=httpx.Timeout(5, read=1.0))
    stats = server.wait_idle(timeout=30)
    assert stats["generation_tokens"] - before < 200
