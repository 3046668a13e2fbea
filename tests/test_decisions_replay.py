"""Replaying decisions: the same request cold, warm, alone and inside a batch of chat streams and other decisions.

With or without --deterministic the probabilities are bit-identical every time (decisions are
canonical sequences either way), and /v1/score replays them exactly. "Cold" after the first request means after a
prompt as long as the (small) KV pool has evicted every cached block. Private servers: the
session server's cache is left as other tests expect it.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from server_utils import MODEL, Server, own_server

from ladle.config import EngineConfig

POOL_BLOCKS = 64  # small, so one long request evicts every cached prefix
REQUEST = {
    "input": "Order 7731 arrived damaged and the customer wants a refund before the weekend.",
    "questions": [
        {"id": "team", "type": "choice", "question": "Which team should handle this ticket?",
         "options": [{"name": "billing"}, {"name": "technical"}, {"name": "sales"}]},
        {"id": "severity", "type": "score", "question": "How severe is it?", "levels": ["low", "medium", "high"]},
        {"id": "refund", "type": "yes_no", "question": "The customer asks for money back."},
    ],
    "return_prompt_token_ids": True,
}
OTHER = {**REQUEST, "input": "The dashboard loads slowly on Mondays."}


def decide(server: Server, body: dict = REQUEST) -> dict:
    r = httpx.post(f"{server.base_url}/decisions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def probabilities(body: dict) -> dict[str, list[float]]:
    return {k: list(a["probabilities"].values()) for k, a in body["answers"].items()}


def evict_everything(server: Server) -> None:
    """Run one prompt as long as the pool: every cached block is evicted to make room for it."""
    prompt = [(i % 1000) + 1000 for i in range(POOL_BLOCKS * 16 - 1)]
    r = httpx.post(f"{server.base_url}/completions", timeout=300,
                   json={"model": MODEL, "prompt": prompt, "max_tokens": 1})
    assert r.status_code == 200, r.text


class ChatTraffic:
    """Streamed chats decoding in the background (until stopped) while decisions run."""

    def __init__(self, server: Server, n: int = 3):
        self.client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=300)
        self.decoding = threading.Barrier(n + 1)
        self.stopped = threading.Event()
        self.pool = ThreadPoolExecutor(n)
        self.futures = [self.pool.submit(self._chat, i) for i in range(n)]
        self.decoding.wait(120)

    def _chat(self, i: int) -> bool:
        """True when the chat was still decoding when told to stop."""
        stream = self.client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": f"Write a long story about ship {i}."}],
            max_tokens=400, temperature=0.0, stream=True, extra_body={"ignore_eos": True})
        try:
            for n, _ in enumerate(stream):
                if n == 2:
                    self.decoding.wait(120)
                if self.stopped.is_set():
                    return True
            return False
        finally:
            stream.close()  # the server aborts the rest

    def stop(self) -> bool:
        """Stop the chats; True when every one was still running (so it shared the decisions' batches)."""
        self.stopped.set()
        running = all(f.result(300) for f in self.futures)
        self.pool.shutdown()
        self.client.close()
        return running


def batched(server: Server) -> tuple[dict, dict]:
    """The request twice inside a batch of chat streams, with another decision request alongside the first."""
    traffic = ChatTraffic(server)
    with ThreadPoolExecutor(1) as pool:
        other = pool.submit(decide, server, OTHER)
        first, second = decide(server), decide(server)
        other.result()
    assert traffic.stop(), "a chat ended before the decisions did: nothing was batched"
    return first, second


def replay(server: Server, body: dict) -> dict[str, list[float]]:
    """Each answer's prompt_token_ids and label_token_ids through /v1/score with apply_softmax."""
    out = {}
    for key, answer in body["answers"].items():
        r = httpx.post(f"{server.base_url}/score", timeout=120, json={
            "query": answer["prompt_token_ids"], "label_token_ids": answer["label_token_ids"], "apply_softmax": True})
        assert r.status_code == 200, r.text
        [out[key]] = r.json()["scores"]
    return out


def cached_tokens(body: dict) -> int:
    return body["usage"]["prompt_tokens_details"]["cached_tokens"]


@pytest.mark.parametrize("deterministic", [True, False], ids=["deterministic", "default"])
def test_cold_warm_alone_and_batched(deterministic: bool) -> None:
    with own_server(EngineConfig(num_kv_blocks=POOL_BLOCKS, deterministic=deterministic)) as server:
        cold, warm = decide(server), decide(server)
        assert cached_tokens(warm) > cached_tokens(cold)
        evict_everything(server)
        cold_batched, warm_batched = batched(server)
        assert cached_tokens(cold_batched) < cached_tokens(warm)  # evicted: computed afresh inside the batch
        expected = probabilities(cold)
        for run in (probabilities(warm), probabilities(cold_batched), probabilities(warm_batched),
                    replay(server, cold)):
            assert run == expected
