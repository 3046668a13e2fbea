"""GET /metrics (vLLM's names, parsed by prometheus_client) and the prefix cache seen through it."""

from __future__ import annotations

import asyncio
import json
import random
import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from server_utils import MODEL, Server, own_server

from ladle.config import EngineConfig

REQUIRED = {
    "vllm:num_requests_running": "gauge", "vllm:num_requests_waiting": "gauge", "vllm:kv_cache_usage_perc": "gauge",
    "vllm:prefix_cache_queries": "counter", "vllm:prefix_cache_hits": "counter", "vllm:num_preemptions": "counter",
    "vllm:prompt_tokens": "counter", "vllm:generation_tokens": "counter", "vllm:request_success": "counter",
    "vllm:time_to_first_token_seconds": "histogram", "vllm:inter_token_latency_seconds": "histogram",
    "vllm:e2e_request_latency_seconds": "histogram", "vllm:request_queue_time_seconds": "histogram",
    "vllm:request_prefill_time_seconds": "histogram", "vllm:request_decode_time_seconds": "histogram",
}
HISTOGRAMS = [name for name, kind in REQUIRED.items() if kind == "histogram"]
BLOCK = 16


def delta(before: dict[str, float], after: dict[str, float], key: str) -> float:
    return after[key] - before.get(key, 0.0)


def complete(server: Server, prompt: list[int] | str, max_tokens: int = 8, **kw) -> dict:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True, **kw}
    r = httpx.post(f"{server.base_url}/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def random_ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(200, 40000) for _ in range(n)]


@pytest.fixture(scope="module")
def uncached() -> Iterator[Server]:
    """The reference: the same model with the prefix cache off."""
    with own_server(EngineConfig(enable_prefix_caching=False, num_kv_blocks=256)) as s:
        yield s


def test_metrics_parse_with_vllm_names_and_count_a_request(server: Server) -> None:
    families = {f.name: f for f in text_string_to_metric_families(server.metrics())}
    for name, kind in REQUIRED.items():
        assert name in families and families[name].type == kind, name
    reasons = {s.labels["finished_reason"] for s in families["vllm:request_success"].samples}
    assert {"stop", "length", "abort"} <= reasons
    ttft_buckets = [s.labels["le"] for s in families["vllm:time_to_first_token_seconds"].samples
                    if s.name.endswith("_bucket")]
    assert ttft_buckets[:3] == ["0.001", "0.005", "0.01"] and ttft_buckets[-1] == "+Inf"  # vLLM's buckets

    server.wait_idle()
    before = server.scrape()
    r = complete(server, "The three primary colours are", max_tokens=6)
    server.wait_idle()
    after = server.scrape()
    assert delta(before, after, "vllm:request_success_total{finished_reason=length}") == 1
    assert delta(before, after, "vllm:prompt_tokens_total") == r["usage"]["prompt_tokens"]
    assert delta(before, after, "vllm:generation_tokens_total") == 6
    for name in HISTOGRAMS:
        expected = 5 if name == "vllm:inter_token_latency_seconds" else 1  # a gap between each two tokens
        assert delta(before, after, f"{name}_count") == expected, name
    parts = [delta(before, after, f"vllm:{n}_sum") for n in ("request_queue_time_seconds",
                                                             "request_prefill_time_seconds",
                                                             "request_decode_time_seconds")]
    e2e = delta(before, after, "vllm:e2e_request_latency_seconds_sum")
    assert all(p >= 0 for p in parts) and sum(parts) == pytest.approx(e2e, abs=1e-6)
    ttft = delta(before, after, "vllm:time_to_first_token_seconds_sum")
    assert ttft == pytest.approx(parts[0] + parts[1], abs=1e-6)
    assert after["vllm:num_requests_running"] == after["vllm:num_requests_waiting"] == 0
    assert after["vllm:kv_cache_usage_perc"] == 0.0


def test_shared_1000_token_prefix_prefills_only_the_suffix(server: Server, uncached: Server) -> None:
    rng = random.Random(1000)
    prefix = random_ids(rng, 1000)
    prompts = [prefix + random_ids(rng, 24), prefix + random_ids(rng, 40)]
    server.wait_idle()
    m0 = server.scrape()
    first = complete(server, prompts[0])
    m1 = server.scrape()
    second = complete(server, prompts[1])
    m2 = server.scrape()
    assert delta(m0, m1, "vllm:prefix_cache_hits_total") == 0  # cold
    # the second finds the whole shared prefix (full blocks, then the shared start of the
    # next block) and computes only its own suffix
    assert delta(m1, m2, "vllm:prefix_cache_hits_total") == 1000
    assert delta(m1, m2, "vllm:prefix_cache_queries_total") == len(prompts[1])
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == 1000
    cold = [complete(uncached, p) for p in prompts]
    assert [first["choices"][0]["text"], second["choices"][0]["text"]] == [c["choices"][0]["text"] for c in cold]
    assert uncached.scrape().get("vllm:prefix_cache_hits_total", 0) == 0


def test_eviction_with_a_pool_smaller_than_the_prefixes_keeps_outputs_right(uncached: Server) -> None:
    rng = random.Random(7)
    prefixes = [random_ids(rng, 8 * BLOCK) for _ in range(6)]  # 48 blocks of distinct prefixes > 32 in the pool
    prompts = [p + random_ids(rng, 8) for p in prefixes for _ in range(2)]
    rng.shuffle(prompts)

    async def run(server: Server, batch: list[list[int]]) -> list[str]:
        async with httpx.AsyncClient(timeout=120) as client:
            bodies = [{"model": MODEL, "prompt": p, "max_tokens": 4, "temperature": 0.0, "ignore_eos": True}
                      for p in batch]
            rs = await asyncio.gather(*(client.post(f"{server.base_url}/completions", json=b) for b in bodies))
        assert all(r.status_code == 200 for r in rs), [r.text for r in rs if r.status_code != 200]
        return [r.json()["choices"][0]["text"] for r in rs]

    with own_server(EngineConfig(num_kv_blocks=32, max_num_seqs=3)) as small:
        got: list[str] = []
        for i in range(0, len(prompts), 3):  # waves: later ones find (or have lost) earlier prefixes
            got += asyncio.run(run(small, prompts[i : i + 3]))
        stats = small.wait_idle()
        metrics = small.scrape()
        kv = small.engine.engine.kv  # idle engine: safe to read from here
        assert all(c == 0 for c in kv.pool.ref_counts), "a block is still referenced"
        assert len(kv.pool.free_ids) + kv.num_cached_blocks == kv.num_blocks
    assert metrics["ladle:prefix_cache_evictions_total"] == stats["prefix_cache_evictions"] > 0
    assert metrics["vllm:prefix_cache_hits_total"] > 0
    assert metrics["vllm:kv_cache_usage_perc"] == 0.0 and stats["num_cached_blocks"] > 0
    assert got == asyncio.run(run(uncached, prompts))


def test_grafana_dashboard_uses_only_exposed_metrics(server: Server) -> None:
    dashboard = Path(__file__).parents[1] / "examples" / "grafana" / "ladle.json"
    exprs = [t["expr"] for p in json.loads(dashboard.read_text())["panels"] for t in p["targets"]]
    used = {m for e in exprs for m in re.findall(r"\b((?:vllm|ladle):\w+)", e)}
    exposed = {s.name for f in text_string_to_metric_families(server.metrics()) for s in f.samples}
    assert used and used <= exposed, used - exposed
    assert all('model_name="$model_name"' in e for e in exprs)
