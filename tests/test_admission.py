"""Who gets in and who goes first, at the server: the waiting bound (429 + Retry-After) and priorities."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
from server_utils import MODEL, Server, own_server

from ladle.config import EngineConfig


def _body(prompt: str, max_tokens: int, **kw) -> dict:
    return {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True, **kw}


def test_200_at_once_past_the_waiting_bound_get_429_and_the_rest_complete() -> None:
    async def burst(server: Server) -> list[httpx.Response]:
        limits = httpx.Limits(max_connections=200, max_keepalive_connections=0)
        async with httpx.AsyncClient(timeout=120, limits=limits) as client:
            return await asyncio.gather(*(client.post(f"{server.base_url}/completions",
                                                      json=_body(f"Request number {i} says", 4))
                                          for i in range(200)))

    with own_server(EngineConfig(max_waiting_requests=8, max_num_seqs=8, num_kv_blocks=256)) as server:
        responses = asyncio.run(burst(server))
        server.wait_idle()
        metrics = server.scrape()
        kv = server.engine.engine.kv  # idle engine: safe to read from here
        assert all(c == 0 for c in kv.pool.ref_counts), "a block is still referenced"
    ok = [r for r in responses if r.status_code == 200]
    refused = [r for r in responses if r.status_code == 429]
    assert len(ok) + len(refused) == 200 and refused and len(ok) >= 8
    for r in refused:
        assert int(r.headers["retry-after"]) >= 1
        assert r.json()["error"]["type"] == "rate_limit_exceeded" and r.json()["error"]["code"] == "rate_limit_exceeded"
        assert "waiting" in r.json()["error"]["message"]
    for r in ok:  # admitted requests are unaffected
        choice = r.json()["choices"][0]
        assert r.json()["usage"]["completion_tokens"] == 4 and choice["finish_reason"] == "length"
    assert metrics["ladle:requests_rejected_total"] == len(refused)
    assert metrics["vllm:request_success_total{finished_reason=length}"] == len(ok)


def test_high_priority_arrival_into_a_full_server_finishes_before_the_running_low_ones() -> None:
    async def stream_low(client: httpx.AsyncClient, server: Server, started: asyncio.Event,
                         finished: dict[str, float], name: str) -> str:
        text = ""
        async with client.stream("POST", f"{server.base_url}/completions",
                                 json=_body("Once upon a time", 48, stream=True, priority=10)) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    started.set()
                    text += json.loads(line[6:])["choices"][0]["text"]
        finished[name] = time.monotonic()
        return text

    async def main(server: Server) -> tuple[dict[str, float], list[str]]:
        finished: dict[str, float] = {}
        async with httpx.AsyncClient(timeout=120) as client:
            events = [asyncio.Event(), asyncio.Event()]
            lows = [asyncio.create_task(stream_low(client, server, events[i], finished, f"low{i}")) for i in range(2)]
            await asyncio.gather(*(e.wait() for e in events))  # both running: every slot is taken
            assert server.stats()["num_running"] == 2
            r = await client.post(f"{server.base_url}/completions", json=_body("Hello", 4, priority=0))
            finished["high"] = time.monotonic()
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
            texts = await asyncio.gather(*lows)
        return finished, texts

    with own_server(EngineConfig(scheduling_policy="priority", max_num_seqs=2, num_kv_blocks=64)) as server:
        finished, texts = asyncio.run(main(server))
        server.wait_idle()
        metrics = server.scrape()
    assert finished["high"] < min(finished["low0"], finished["low1"])
    assert metrics["vllm:num_preemptions_total"] >= 1  # a low one made room
    assert texts[0] == texts[1]  # the preempted one, recomputed, says what the other said
