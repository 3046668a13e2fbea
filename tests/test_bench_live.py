"""`ladle bench` against a real ladle server on loopback (the default model, on CPU), and its
client-side TTFT against the server's own `vllm:time_to_first_token_seconds` histogram.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

pytest.importorskip("ladle.server.app")
from server_utils import MODEL, Server  # noqa: E402

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


def test_client_ttft_matches_server_histogram(server: Server, tmp_path: Path):
    server.wait_idle()
    sum0, count0 = _histogram(httpx.get(f"{server.url}/metrics").text, TTFT_HISTOGRAM)
    # The client runs in its own process: the server here is a thread of the test process, and a client
    # sharing its GIL would add its own parsing time to the TTFT it sees.
    subprocess.run([sys.executable, "-m", "ladle.cli", "bench", "serve", "--base-url", server.url, "--model", MODEL,
                    "--num-prompts", "16", "--random-input-len", "128", "--random-output-len", "4",
                    "--random-range-ratio", "0", "--tokens-per-word", "1.0", "--seed", "0",
                    # a gentle, regular load: the comparison is of clocks, not of the server under pressure;
                    # 128-token prompts keep the HTTP handling before the engine's arrival stamp (~7 ms) small
                    "--request-rate", "2", "--burstiness", "inf", "--skip-initial-test", "--disable-tqdm",
                    "--save-result", "--result-dir", str(tmp_path), "--result-filename", "ttft.json"],
                   check=True, capture_output=True, timeout=120)
    result = json.loads((tmp_path / "ttft.json").read_text())
    server.wait_idle()
    sum1, count1 = _histogram(httpx.get(f"{server.url}/metrics").text, TTFT_HISTOGRAM)
    assert result["completed"] == 16 and result["failed"] == 0
    assert count1 - count0 == 16
    server_ttft = (sum1 - sum0) / (count1 - count0)
    client_ttft = result["mean_ttft_ms"] / 1000.0
    assert client_ttft >= server_ttft * 0.99  # the client sees the first token after the server sends it
    assert abs(client_ttft - server_ttft) <= 0.1 * server_ttft
