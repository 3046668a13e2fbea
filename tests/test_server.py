"""The OpenAI-compatible server, driven by the real `openai` SDK (and raw HTTP where the SDK hides things);
streaming, concurrency and disconnects are in test_streaming.py."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import httpx
import openai
import pytest
from server_utils import GREEDY, HELLO, MODEL, Server, ServerThread, chat, free_port

import ladle
from ladle.model import kernels
from ladle.server.app import create_app

# -- the basics ------------------------------------------------------------------


def test_models_health_version(server: Server, client: openai.OpenAI) -> None:
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    assert httpx.get(f"{server.url}/health").status_code == 200
    version = httpx.get(f"{server.url}/version").json()
    assert set(version) == {"version", "device", "dtype", "dtype_reason", "quantization", "weights", "kv_cache_dtype",
                            "kernels", "matmul"}
    assert version["version"] == ladle.__version__
    assert version["device"] == f"cpu ({os.cpu_count()} cores)"  # CI has no GPU
    # the suite pins float32 (conftest), so the choice is the one asked for
    assert version["dtype"] == version["kv_cache_dtype"] == "float32" and version["dtype_reason"] == "requested"
    # the default model's Q4_1 layers and tied Q8_0 head served from their blocks
    assert version["quantization"] == "auto"
    assert version["weights"] == "4-bit in groups of 32 (GGUF blocks) + int8 in groups of 32 (GGUF blocks)"
    native = kernels.native_kernels()
    assert version["kernels"] == (native.isa if native is not None else "torch")
    routing = server.engine.engine.runner.model.routing
    assert version["matmul"] == routing.table()


def test_chat(server: Server, client: openai.OpenAI) -> None:
    # a system prompt no other test sends: nothing of it is in the shared server's prefix cache
    messages = [{"role": "system", "content": "test_chat: a conversation of its own."}] + HELLO
    r = chat(client, messages)
    choice = r.choices[0]
    assert r.object == "chat.completion" and r.model == MODEL and r.id.startswith("chatcmpl-")
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason in ("stop", "length")
    tokenized = httpx.post(f"{server.url}/tokenize", json={"model": MODEL, "messages": messages}).json()
    assert r.usage.prompt_tokens == tokenized["count"]
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert 0 < r.usage.completion_tokens <= 16
    # other tests' chats share at most the template's opening tokens ("<|im_start|>system\n"); asked
    # again, everything but the last prompt token comes from the prefix cache
    assert r.usage.prompt_tokens_details.cached_tokens < 8
    assert chat(client, messages).usage.prompt_tokens_details.cached_tokens == r.usage.prompt_tokens - 1


def test_chat_content_parts_equal_string_content(client: openai.OpenAI) -> None:
    parts = [{"role": "user", "content": [{"type": "text", "text": HELLO[0]["content"]}]}]
    assert chat(client, parts).choices[0].message.content == chat(client).choices[0].message.content


def test_chat_logprobs(client: openai.OpenAI) -> None:
    r = chat(client, max_tokens=8, logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    assert "".join(t.token for t in content) == r.choices[0].message.content
    for t in content:
        assert len(t.top_logprobs) == 3
        assert [x.logprob for x in t.top_logprobs] == sorted((x.logprob for x in t.top_logprobs), reverse=True)
        assert t.top_logprobs[0].token == t.token and t.logprob == pytest.approx(t.top_logprobs[0].logprob)
        assert bytes(t.bytes).decode("utf-8") == t.token and t.logprob <= 0
    streamed = [lp for c in chat(client, max_tokens=8, logprobs=True, top_logprobs=3, stream=True)
                if c.choices and c.choices[0].logprobs for lp in c.choices[0].logprobs.content]
    assert [t.token for t in streamed] == [t.token for t in content]


def test_stop_string_and_length(client: openai.OpenAI) -> None:
    text = chat(client).choices[0].message.content
    stop = text.split()[1]  # a word the greedy answer will produce
    r = chat(client, stop=[stop])
    assert r.choices[0].finish_reason == "stop" and stop not in r.choices[0].message.content
    assert r.choices[0].message.content == text[: text.index(stop)]
    r = chat(client, max_tokens=3, extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 3


def test_n_and_seed(client: openai.OpenAI) -> None:
    kw = dict(n=3, seed=1234, temperature=1.0, max_tokens=8, top_p=0.95, presence_penalty=0.5,
              frequency_penalty=0.5, user="tests", extra_body={"top_k": 50, "min_p": 0.01, "repetition_penalty": 1.1})
    a, b = chat(client, **kw), chat(client, **kw)
    assert [c.index for c in a.choices] == [0, 1, 2]
    assert [c.message.content for c in a.choices] == [c.message.content for c in b.choices]
    assert 3 <= a.usage.completion_tokens <= 3 * 8
    streamed = {}
    for chunk in chat(client, stream=True, **kw):
        for c in chunk.choices:
            streamed[c.index] = streamed.get(c.index, "") + (c.delta.content or "")
    assert [streamed[i] for i in range(3)] == [c.message.content for c in a.choices]


def test_completions_with_logprobs_and_echo(client: openai.OpenAI) -> None:
    prompt = "The capital of France is"
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, logprobs=2, **GREEDY)
    lp = r.choices[0].logprobs
    assert r.object == "text_completion" and len(lp.tokens) == r.usage.completion_tokens
    assert "".join(lp.tokens) == r.choices[0].text
    assert all(v <= 0 for v in lp.token_logprobs) and all(len(t) >= 1 for t in lp.top_logprobs)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]

    e = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, logprobs=2, echo=True, **GREEDY)
    elp = e.choices[0].logprobs
    assert e.choices[0].text == prompt + r.choices[0].text
    assert len(elp.tokens) == e.usage.prompt_tokens + e.usage.completion_tokens
    assert elp.token_logprobs[0] is None and elp.top_logprobs[0] is None
    assert all(v is not None for v in elp.token_logprobs[1:])
    assert elp.tokens[e.usage.prompt_tokens:] == lp.tokens
    assert elp.token_logprobs[e.usage.prompt_tokens:] == pytest.approx(lp.token_logprobs, abs=1e-4)


def test_tokenize_detokenize(server: Server) -> None:
    r = httpx.post(f"{server.url}/tokenize", json={"model": MODEL, "prompt": "Hello world", "return_token_strs": True})
    body = r.json()
    assert r.status_code == 200 and body["count"] == len(body["tokens"]) == len(body["token_strs"])
    assert body["max_model_len"] > 0
    back = httpx.post(f"{server.url}/detokenize", json={"model": MODEL, "tokens": body["tokens"]}).json()
    assert back == {"prompt": "Hello world"}


# -- errors ----------------------------------------------------------------------


def test_bad_requests_raise_typed_errors(client: openai.OpenAI) -> None:
    cases = [
        (dict(temperature=-1.0), "temperature"),
        (dict(top_logprobs=50, logprobs=True), "top_logprobs"),
        (dict(n=0), "n"),
        (dict(extra_body={"top_k": "many"}), "top_k"),
        (dict(messages=[{"role": "wizard", "content": "hi"}]), "messages[0].role"),
        (dict(messages=[]), "messages"),
        (dict(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]),
         "messages[0].content[0].image_url"),  # a text-only model
        (dict(max_tokens=None, max_completion_tokens=10**6), "max_completion_tokens"),
        (dict(extra_body={"stop_token_ids": [10**9]}), "stop_token_ids"),
    ]
    for kw, param in cases:
        with pytest.raises(openai.BadRequestError) as err:
            chat(client, **kw)
        assert err.value.status_code == 400
        assert err.value.body["param"] == param, (kw, err.value.body)
        assert param in err.value.body["message"]


def test_unsupported_fields_are_refused_naming_them(client: openai.OpenAI) -> None:
    def complete(**kw):
        return client.completions.create(model=MODEL, prompt="Hello", max_tokens=2, **GREEDY, **kw)

    cases = [
        (lambda: complete(logit_bias={"15": 5}), "logit_bias"),
        (lambda: chat(client, logit_bias={"15": -100}), "logit_bias"),
        (lambda: chat(client, logit_bias={"15": 5}, stream=True), "logit_bias"),  # before the stream starts
        (lambda: complete(suffix=" world"), "suffix"),
        (lambda: complete(suffix=" world", stream=True), "suffix"),
        (lambda: complete(best_of=3), "best_of"),
        (lambda: complete(best_of=3, n=2), "best_of"),
        (lambda: complete(best_of=1, n=2), "best_of (1) must be at least n (2)"),  # invalid, not unsupported
    ]
    for call, says in cases:
        with pytest.raises(openai.BadRequestError) as err:
            call()
        body = err.value.body
        param = says.split()[0]
        assert err.value.status_code == 400 and body["param"] == param and says in body["message"], body
        assert body["type"] == "invalid_request_error"
    # what changes nothing is accepted: best_of equal to n (as vLLM), an empty logit_bias or suffix
    assert len(complete(best_of=1).choices) == 1
    assert len(complete(best_of=2, n=2, seed=1).choices) == 2
    assert complete(logit_bias={}, suffix="").choices[0].text == complete().choices[0].text


def test_continue_final_message(server: Server, client: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": "Name three colors."}, {"role": "assistant", "content": "Red, green and"}]
    flags = {"continue_final_message": True, "add_generation_prompt": False}
    r = chat(client, messages, max_tokens=6, extra_body=flags)
    # the prompt ends inside the assistant's message: no end-of-turn after it
    ids = httpx.post(f"{server.url}/tokenize", json={"messages": messages, **flags}).json()["tokens"]
    rendered = httpx.post(f"{server.url}/detokenize", json={"tokens": ids}).json()["prompt"]
    assert rendered.endswith("assistant\nRed, green and"), rendered
    assert r.usage.prompt_tokens == len(ids)
    # and the reply is what that prompt continues with
    plain = client.completions.create(model=MODEL, prompt=ids, max_tokens=6, **GREEDY)
    assert r.choices[0].message.content == plain.choices[0].text and plain.choices[0].text
    bad = [(messages, {"continue_final_message": True}),  # with add_generation_prompt (the default)
           (HELLO, flags)]  # the last message is not the assistant's
    for msgs, extra in bad:
        with pytest.raises(openai.BadRequestError) as err:
            chat(client, msgs, max_tokens=1, extra_body=extra)
        assert err.value.body["param"] == "continue_final_message"


def test_prompt_over_the_context_says_by_how_much(server: Server, client: openai.OpenAI) -> None:
    limit = server.engine.max_model_len
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=MODEL, prompt=[1] * (limit + 5), max_tokens=1)
    assert err.value.body["code"] == "context_length_exceeded" and err.value.body["param"] == "prompt"
    assert f"{limit}" in err.value.message and "6 over" in err.value.message


def test_unknown_model_and_unknown_route_are_not_found(server: Server, client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as err:  # as OpenAI and vLLM answer it
        client.chat.completions.create(model="gpt-4o", messages=HELLO, max_tokens=1)
    assert "gpt-4o" in err.value.message and err.value.body["code"] == "model_not_found"
    assert err.value.body["param"] == "model"
    with pytest.raises(openai.NotFoundError) as err:
        client.post("/no/such/route", cast_to=object, body={})
    assert "Invalid URL" in err.value.message
    r = httpx.get(f"{server.base_url}/completions")
    assert r.status_code == 405 and r.json()["error"]["type"] == "invalid_request_error"


def test_malformed_bodies_are_400_never_422_or_500(server: Server) -> None:
    url = f"{server.base_url}/chat/completions"
    for body in [b"{not json", b"[1, 2]", b"", b'{"messages": "hi"}', b'{"messages": [{"content": "x"}]}',
                 b'{"messages": [{"role": "user", "content": "x"}], "temperature": NaN}',
                 b'{"messages": [{"role": "user", "content": "x"}], "seed": 1e400}']:
        r = httpx.post(url, content=body, headers={"content-type": "application/json"})
        assert r.status_code == 400, (body, r.text)
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    for prompt in [[], [1, -5], [[1], "a"], [True], [1, 10**30]]:
        r = httpx.post(f"{server.base_url}/completions", json={"prompt": prompt, "max_tokens": 1})
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", (prompt, r.text)
    r = httpx.post(f"{server.url}/detokenize", json={"tokens": [-1]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tokens[0]"


def test_oversize_body_is_413(server: Server) -> None:
    big = json.dumps({"model": MODEL, "prompt": "a" * (17 * 2**20)}).encode()
    r = httpx.post(f"{server.base_url}/completions", content=big, headers={"content-type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"

    def chunked():  # no Content-Length: counted as it arrives
        for i in range(0, len(big), 2**20):
            yield big[i : i + 2**20]

    r = httpx.post(f"{server.base_url}/completions", content=chunked())
    assert r.status_code == 413


def test_api_key(async_engine) -> None:
    thread = ServerThread(create_app(async_engine, MODEL, api_key="sekrit")).start()
    try:
        base = f"{thread.url}/v1"
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=base, api_key="wrong", max_retries=0).models.list()
        assert httpx.get(f"{base}/models").status_code == 401
        good = openai.OpenAI(base_url=base, api_key="sekrit", max_retries=0)
        assert good.models.list().data[0].id == MODEL
        assert httpx.get(f"{thread.url}/health").status_code == 200  # not under /v1
    finally:
        thread.stop()


def test_reset_prefix_cache_route(server: Server, client: openai.OpenAI) -> None:
    """POST /reset_prefix_cache (vLLM's route): a cached prompt is computed again afterwards; while a
    request runs, its blocks stay and the answer is 409."""
    messages = [{"role": "system", "content": "test_reset_prefix_cache_route: its own prompt."}] + HELLO
    first = chat(client, messages)
    assert chat(client, messages).usage.prompt_tokens_details.cached_tokens == first.usage.prompt_tokens - 1
    server.wait_idle()
    assert httpx.post(f"{server.url}/reset_prefix_cache").status_code == 200
    assert server.stats()["num_cached_blocks"] == 0
    again = chat(client, messages)
    assert again.usage.prompt_tokens_details.cached_tokens == 0
    assert again.choices[0].message.content == first.choices[0].message.content
    with client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=200, stream=True, **GREEDY,
                                        extra_body={"ignore_eos": True}) as stream:
        next(iter(stream))  # decoding: it holds its blocks
        busy = httpx.post(f"{server.url}/reset_prefix_cache")
        assert busy.status_code == 409 and busy.json()["error"]["code"] == "prefix_cache_in_use"
        assert server.stats()["num_cached_blocks"] > 0
    server.wait_idle()
    assert httpx.post(f"{server.url}/reset_prefix_cache").status_code == 200


# -- the real command ------------------------------------------------------------


def test_ladle_serve_subprocess() -> None:
    port = free_port()
    cmd = [sys.executable, "-m", "ladle.cli", "serve", "--port", str(port), "--num-kv-blocks", "256",
           "--uvicorn-log-level", "warning", "--served-model-name", "tiny", "--kv-cache-dtype", "int8"]
    env = {k: v for k, v in os.environ.items() if k != "LADLE_API_KEY"}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert proc.poll() is None, proc.stdout.read()
            assert time.monotonic() < deadline, "ladle serve did not come up"
            time.sleep(0.25)
        c = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0)
        assert c.models.list().data[0].id == "tiny"
        assert httpx.get(f"http://127.0.0.1:{port}/version").json()["version"] == ladle.__version__
        r = c.chat.completions.create(model="tiny", messages=HELLO, max_tokens=5, temperature=0,
                                      extra_body={"ignore_eos": True})
        assert r.model == "tiny" and r.choices[0].finish_reason == "length"
        assert r.usage.completion_tokens == 5 and r.choices[0].message.content.strip()
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            out, _ = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate()
    assert proc.returncode == 0, out
    assert f"http://127.0.0.1:{port}/v1" in out
    assert "; dtype float32 (requested)" in out and "matmuls: 1 " in out  # LADLE_DTYPE from conftest
    assert f"ladle: device cpu ({os.cpu_count()} cores)" in out
    assert "KV cache int8 (256 blocks of 16 tokens)" in out
