"""`ladle bench` against a real ladle server on loopback (the default model, on CPU), and its
client-side TTFT against the server's own `vllm:time_to_first_token_seconds` histogram.
"""

from __future__ import annotations

import asyncio
import json
import math
import re
from pathlib import Path

import httpx
import numpy as np
import pytest

pytest.importorskip("ladle.server.app")
from server_utils import MODEL, Server  # noqa: E402

from ladle.bench.client import Target  # noqa: E402
from ladle.bench.datasets import random_dataset  # noqa: E402
from ladle.bench.metrics import compute_metrics  # noqa: E402
from ladle.bench.runner import LoadSpec, run_load  # noqa: E402
from ladle.cli import main as ladle_main  # noqa: E402

TTFT_HISTOGRAM = "vllm:time_to_first_token_seconds"


def _histogram(text: str, name: str) -> tuple[float, float]:
    """(sum, count) of a Prometheus histogram, summed over its label sets."""
    total = {"sum": 0.0, "count": 0.0}
    for line in text.splitlines():
        m = re.match(rf"^{re.escape(name)}_(sum|count)(\{{[^}}]*\}})?\s+(\S+)", line)
        if m:
            total[m.group(1)] += float(m.group(3))
    return total["sum"], total["count"]


def test_sweep_on_loopback(server: Server, tmp_path: Path):
    rc = ladle_main(["bench", "sweep", "--base-url", server.url, "--model", MODEL, "--num-prompts", "8",
                     "--random-input-len", "32", "--random-output-len", "8", "--loads", "1,2,4,8",
                     "--goodput", "ttft:2000", "tpot:500", "--result-dir", str(tmp_path),
                     "--result-filename", "live.json", "--disable-tqdm"])
    assert rc == 0
    sweep = json.loads((tmp_path / "live.json").read_text())
    assert sweep["tokens_per_word_source"] == "tokenize"  # calibrated on the server's own tokenizer
    assert sweep["provenance"]["target_version"]["version"]
    for step in sweep["steps"]:
        assert step["failed"] == 0
        assert step["request_goodput"] <= step["request_throughput"] + 1e-9
        # prompt tokens come from usage: 32 words of 1 token each, plus what the server adds (BOS)
        assert 32 <= step["total_input_tokens"] / step["completed"] <= 34
        assert step["total_output_tokens"] == 8 * step["completed"]  # ignore_eos
    assert (tmp_path / "live.png").stat().st_size > 10_000


def test_client_ttft_matches_server_histogram(server: Server):
    server.wait_idle()
    sum0, count0 = _histogram(httpx.get(f"{server.url}/metrics").text, TTFT_HISTOGRAM)
    requests = random_dataset(np.random.default_rng(0), 16, input_len=64, output_len=4, range_ratio=0.0,
                              prefix_len=0, tokens_per_word=1.0)
    target = Target(base_url=server.url, model=MODEL, ignore_eos=True)
    # a gentle, regular load: the comparison is of clocks, not of the server under pressure
    run = asyncio.run(run_load(target, requests, LoadSpec(request_rate=4.0, burstiness=math.inf), progress=False))
    server.wait_idle()
    sum1, count1 = _histogram(httpx.get(f"{server.url}/metrics").text, TTFT_HISTOGRAM)
    assert count1 - count0 == len(requests)
    server_ttft = (sum1 - sum0) / (count1 - count0)
    client_ttft = compute_metrics(run.results, run.duration, [99])["mean_ttft_ms"] / 1000.0
    assert all(r.success for r in run.results)
    assert client_ttft >= server_ttft * 0.99  # the client sees the first token after the server sends it
    assert abs(client_ttft - server_ttft) <= 0.1 * server_ttft
