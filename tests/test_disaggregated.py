"""Disaggregated prefill/decode between two real servers: a prefill worker (kv_producer) computes
the prompt and its first token, a decode worker (kv_consumer) fetches the K/V over TCP and goes
on. The reference is the same request served whole (colocated) by a server of its own."""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Iterator

import httpx
import pytest

from ladle.config import EngineConfig
from tests.server_utils import Server, own_server

pytestmark = pytest.mark.slow  # starts worker processes: make test-fast leaves it out

CHAT = [{"role": "user", "content": "Describe the water cycle to a ten year old, step by step, in detail."}]
OTHER = [{"role": "user", "content": "List five facts about owls that most people do not know, briefly."}]


def config(role: str | None = None) -> EngineConfig:
    kv = {"kv_role": role, "kv_port": 0} if role else None
    return EngineConfig(num_kv_blocks=128, num_threads=1, kv_transfer_config=kv)


@pytest.fixture(scope="module")
def workers() -> Iterator[tuple[Server, Server, Server]]:
    """(colocated reference, prefill worker, decode worker)."""
    with own_server(config()) as ref, own_server(config("kv_producer")) as prefill, \
            own_server(config("kv_consumer")) as decode:
        yield ref, prefill, decode


def chat(server: Server, messages: list[dict], **extra) -> dict:
    body = {"messages": messages, "temperature": 0, "max_tokens": 24, **extra}
    r = httpx.post(f"{server.base_url}/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def prefill(server: Server, messages: list[dict]) -> dict:
    reply = chat(server, messages, max_tokens=1, kv_transfer_params={"do_remote_decode": True})
    params = reply["kv_transfer_params"]
    assert params["do_remote_prefill"] and params["transfer_id"] == reply["id"]
    return params


def test_decode_worker_continues_from_the_transferred_kv(workers) -> None:
    ref, producer, consumer = workers
    want = chat(ref, CHAT)
    params = prefill(producer, CHAT)
    got = chat(consumer, CHAT, kv_transfer_params=params)
    assert got["choices"][0]["message"]["content"] == want["choices"][0]["message"]["content"]
    usage = got["usage"]
    # the decode worker computed none of the prompt: every prompt token came from the transfer
    assert usage["prompt_tokens_details"]["cached_tokens"] == usage["prompt_tokens"] == want["usage"]["prompt_tokens"]
    m = consumer.scrape()
    assert m["ladle:kv_handoff_tokens_imported_total"] == usage["prompt_tokens"]
    assert m["ladle:kv_transfers_total{direction=received}"] == 1
    sent = producer.scrape()["ladle:kv_transfer_bytes_total{direction=sent}"]
    assert sent > 0 and m["ladle:kv_transfer_bytes_total{direction=received}"] == sent
    consumer.wait_idle()


def test_a_streamed_decode_equals_the_colocated_stream(workers) -> None:
    ref, producer, consumer = workers
    messages = [{"role": "user", "content": "Why is the sky blue? Answer like a physics teacher would."}]
    want = chat(ref, messages)["choices"][0]["message"]["content"]
    params = prefill(producer, messages)
    body = {"messages": messages, "temperature": 0, "max_tokens": 24, "stream": True, "kv_transfer_params": params}
    text = ""
    with httpx.stream("POST", f"{consumer.base_url}/chat/completions", json=body, timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                for choice in json.loads(line[6:])["choices"]:
                    text += choice["delta"].get("content") or ""
    assert text == want


class CorruptingProxy:
    """Forwards one TCP connection to the producer, flipping one byte deep in its reply."""

    def __init__(self, target: tuple[str, int], flip_at: int):
        self.target, self.flip_at = target, flip_at
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        client, _ = self.sock.accept()
        with client, socket.create_connection(self.target) as upstream:
            upstream.sendall(client.recv(4096))
            seen = 0
            while chunk := upstream.recv(1 << 16):
                data = bytearray(chunk)
                if seen <= self.flip_at < seen + len(data):
                    data[self.flip_at - seen] ^= 0x40
                seen += len(data)
                try:
                    client.sendall(data)
                except ConnectionError:  # the receiver saw the bad CRC and hung up: what the test wants
                    return


def test_a_corrupted_transfer_is_detected_and_the_prompt_recomputed(workers) -> None:
    ref, producer, consumer = workers
    want = chat(ref, OTHER)
    params = prefill(producer, OTHER)
    proxy = CorruptingProxy((params["remote_host"], params["remote_port"]), flip_at=100_000)
    before = consumer.scrape()
    got = chat(consumer, OTHER, kv_transfer_params={**params, "remote_port": proxy.port})
    assert got["choices"][0]["message"]["content"] == want["choices"][0]["message"]["content"]
    assert got["usage"]["prompt_tokens_details"]["cached_tokens"] < got["usage"]["prompt_tokens"]
    after = consumer.scrape()
    key = "ladle:kv_transfer_failures_total{reason=corrupt}"
    assert after[key] == before[key] + 1
    assert after["ladle:kv_handoffs_imported_total"] == before["ladle:kv_handoffs_imported_total"]
    consumer.wait_idle()


def test_an_unreachable_or_spent_transfer_is_recomputed(workers) -> None:
    ref, producer, consumer = workers
    messages = [{"role": "user", "content": "Name three rivers in Africa and one fact about each."}]
    want = chat(ref, messages)["choices"][0]["message"]["content"]
    params = prefill(producer, messages)
    assert chat(consumer, messages, kv_transfer_params=params)["choices"][0]["message"]["content"] == want
    before = consumer.scrape()
    again = chat(consumer, messages, kv_transfer_params=params)  # fetched once already: the producer let it go
    assert again["choices"][0]["message"]["content"] == want
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed_port = s.getsockname()[1]
    chat(consumer, messages, kv_transfer_params={**params, "remote_port": closed_port})
    after = consumer.scrape()
    for reason in ("not_found", "unreachable"):
        key = f"ladle:kv_transfer_failures_total{{reason={reason}}}"
        assert after[key] == before[key] + 1


@pytest.mark.parametrize("where,extra,why", [
    ("ref", {"kv_transfer_params": {"do_remote_decode": True}}, "prefill worker"),
    ("ref", {"kv_transfer_params": {"do_remote_prefill": True, "remote_host": "127.0.0.1", "remote_port": 9,
                                    "transfer_id": "x"}}, "decode worker"),
    ("prefill", {"kv_transfer_params": {"do_remote_decode": True}, "stream": True}, "not streamed"),
    ("prefill", {"kv_transfer_params": {"do_remote_decode": True}, "n": 2}, "n = 1"),
    ("decode", {"kv_transfer_params": {"do_remote_prefill": True}}, "remote_host"),
    ("decode", {"kv_transfer_params": {"do_remote_prefill": True, "engine": 3}}, "kv_transfer_params"),
])
def test_bad_kv_transfer_params_get_a_400_naming_the_field(workers, where: str, extra: dict, why: str) -> None:
    server = dict(zip(("ref", "prefill", "decode"), workers))[where]
    body = {"messages": CHAT, "max_tokens": 4, **extra}
    r = httpx.post(f"{server.base_url}/chat/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"].startswith("kv_transfer_params") and why in error["message"]
