"""A producer that dies mid-stream never looks like a finished reply (issue 48): a tensor-parallel rank of a
single server, and the decode worker of a prefill/decode pair behind the router. Each broken stream ends in
an error event in OpenAI's shape, never `[DONE]`, and the openai SDK raises; what is sent afterwards gets a
5xx in the error shape or is served. (The router's data-parallel case is in tests/test_router.py.)"""

from __future__ import annotations

import json
import threading

import httpx
import openai
import pytest
from server_utils import MODEL, free_port, own_server
from test_router import router, scrape, start_workers
from tiny_models import build_tiny_model

from ladle.config import EngineConfig

pytestmark = pytest.mark.slow  # starts worker processes

STORY = [{"role": "user", "content": "Tell me a long story about a lighthouse."}]


def read_stream(url: str, max_tokens: int, after_two_chunks=None) -> list[str]:
    """A chat stream's data payloads as the wire has them; after_two_chunks() runs once two have arrived."""
    body = {"model": MODEL, "messages": STORY, "max_tokens": max_tokens, "stream": True, "ignore_eos": True,
            "temperature": 0.0}
    events = []
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line.removeprefix("data: "))
                if len(events) == 2 and after_two_chunks is not None:
                    after_two_chunks()
    return events


def stream_in_background(url: str) -> tuple[list[list[str]], threading.Thread]:
    """A long stream read by a thread; returns once it is under way (its events land in the list)."""
    started, events = threading.Event(), []
    thread = threading.Thread(target=lambda: events.append(read_stream(url, 400, after_two_chunks=started.set)))
    thread.start()
    assert started.wait(120)
    return events, thread


def text_of(events: list[str]) -> str:
    return "".join(c["choices"][0]["delta"].get("content") or "" for c in map(json.loads, events[:-1]) if c["choices"])


def assert_broken_off(events: list[str]) -> dict:
    """The stream's last event is an error in OpenAI's shape, and no [DONE] and no finish_reason came."""
    assert "[DONE]" not in events, events[-3:]
    error = json.loads(events[-1])["error"]
    assert error["message"] and error["type"]
    for chunk in map(json.loads, events[:-1]):
        assert all(c.get("finish_reason") is None for c in chunk.get("choices", [])), chunk
    return error


def sdk_raises(url: str, before_reading) -> None:
    """The openai SDK, reading a stream whose producer dies (before_reading kills it after two chunks), raises."""
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    chunks = client.chat.completions.create(model=MODEL, messages=STORY, max_tokens=400, stream=True,
                                            temperature=0.0, extra_body={"ignore_eos": True})
    with pytest.raises(openai.APIError):
        for n, _ in enumerate(chunks):
            if n == 2:
                before_reading()


def test_a_tensor_parallel_rank_dying_mid_stream_breaks_the_stream_off(smollm2_dir, tmp_path) -> None:
    """TP=2 (a tiny Llama whose heads split in two): rank 1 SIGKILLed while two streams run. Both end in an
    error event (the SDK raises on one), and the server answers what comes after with a 503 in the error shape
    instead of hanging."""
    folder = build_tiny_model("llama", tmp_path / "llama", smollm2_dir)
    config = EngineConfig(model=str(folder), tensor_parallel_size=2, num_threads=1, num_kv_blocks=256)
    with own_server(config) as server:
        rank1 = server.engine.engine.runner.workers.ranks.procs[0]
        other, watcher = stream_in_background(server.url)
        sdk_raises(server.url, rank1.kill)
        watcher.join(120)
        assert_broken_off(other[0])
        after = httpx.post(f"{server.url}/v1/chat/completions", timeout=60,
                           json={"model": MODEL, "messages": STORY, "max_tokens": 2})
        assert after.status_code == 503 and after.json()["error"]["message"]


def test_a_decode_worker_dying_mid_stream_breaks_the_stream_off() -> None:
    """Prefill/decode behind the router: the decode worker SIGKILLed after the first chunks. The stream ends
    in an error event, the SDK raises on a second one, the router counts both, and with no decode worker
    left the next request gets a 503 in the error shape."""
    producer = json.dumps({"kv_role": "kv_producer", "kv_port": free_port()})
    prefill, decode = start_workers(2, [["--kv-transfer-config", producer],
                                        ["--kv-transfer-config", '{"kv_role": "kv_consumer"}']])
    try:
        with router(prefill=[prefill.url], decode=[decode.url], health_check_interval=600) as url:
            assert read_stream(url, 3)[-1] == "[DONE]"  # the pair serves, K/V handed over
            other, watcher = stream_in_background(url)
            sdk_raises(url, decode.proc.kill)
            watcher.join(120)
            assert_broken_off(other[0])
            failed = sum(v for k, v in scrape(url).items() if k.startswith("ladle_router_streams_failed_total"))
            assert failed == 2
            after = httpx.post(f"{url}/v1/chat/completions", timeout=60,
                               json={"model": MODEL, "messages": STORY, "max_tokens": 2})
            assert after.status_code in (502, 503) and after.json()["error"]["message"]
    finally:
        prefill.stop()
        decode.stop()


def test_the_prefill_worker_dying_after_the_hand_over_leaves_the_stream_whole() -> None:
    """Once the decode worker holds the K/V, its prefill worker is no longer needed: killing it mid-stream
    leaves the stream to finish with [DONE] (and the same tokens as an undisturbed one)."""
    producer = json.dumps({"kv_role": "kv_producer", "kv_port": free_port()})
    prefill, decode = start_workers(2, [["--kv-transfer-config", producer],
                                        ["--kv-transfer-config", '{"kv_role": "kv_consumer"}']])
    try:
        with router(prefill=[prefill.url], decode=[decode.url], health_check_interval=600) as url:
            whole = read_stream(url, 24)
            cut = read_stream(url, 24, after_two_chunks=prefill.proc.kill)
            assert cut[-1] == "[DONE]" and text_of(cut) == text_of(whole)
    finally:
        prefill.stop()
        decode.stop()
