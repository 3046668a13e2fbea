"""`ladle bench` against a real ladle server on loopback (the default model, on CPU): a sweep; its
client-side TTFT against the server's own `vllm:time_to_first_token_seconds` histogram; `ladle bench
voice` cancelling drafts by the server's cancel route and reading its timings; and the agent dataset's
sessions against the server's prefix cache. The fakes of tests/test_bench_voice.py and
tests/test_bench_agent.py test the schedules; these, that the real server answers as the fakes do.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from server_utils import MODEL, Server
from test_bench_voice import END, E, P, R, cancel_not_found_body

from ladle.cli import main as ladle_main
from ladle.server.protocol import Timings

TTFT_HISTOGRAM = "vllm:time_to_first_token_seconds"
TPOT_HISTOGRAM = "vllm:request_time_per_output_token_seconds"


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
                     "--random-input-len", "32", "--random-output-len", "8", "--loads", "4,8,16,32",
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


def test_client_ttft_and_tpot_match_the_servers_histograms(server: Server, tmp_path: Path):
    """The client's mean TTFT and TPOT against the server's vllm:time_to_first_token_seconds and
    vllm:request_time_per_output_token_seconds (the histogram the goodput proxy query reads)."""
    server.wait_idle()
    before = httpx.get(f"{server.url}/metrics").text
    sum0, count0 = _histogram(before, TTFT_HISTOGRAM)
    tpot_sum0, tpot_count0 = _histogram(before, TPOT_HISTOGRAM)
    # The client runs in its own process: the server here is a thread of the test process, and a client
    # sharing its GIL would add its own parsing time to the TTFT it sees.
    subprocess.run([sys.executable, "-m", "ladle.cli", "bench", "serve", "--base-url", server.url, "--model", MODEL,
                    "--num-prompts", "16", "--random-input-len", "128", "--random-output-len", "12",
                    "--random-range-ratio", "0", "--tokens-per-word", "1.0", "--seed", "0",
                    # a gentle, regular load: the comparison is of clocks, not of the server under pressure;
                    # 128-token prompts keep the HTTP handling before the engine's arrival stamp (~7 ms) small
                    "--request-rate", "2", "--burstiness", "inf", "--skip-initial-test", "--disable-tqdm",
                    "--save-result", "--result-dir", str(tmp_path), "--result-filename", "ttft.json"],
                   check=True, capture_output=True, timeout=120)
    result = json.loads((tmp_path / "ttft.json").read_text())
    server.wait_idle()
    after = httpx.get(f"{server.url}/metrics").text
    sum1, count1 = _histogram(after, TTFT_HISTOGRAM)
    tpot_sum1, tpot_count1 = _histogram(after, TPOT_HISTOGRAM)
    assert result["completed"] == 16 and result["failed"] == 0
    assert count1 - count0 == 16
    server_ttft = (sum1 - sum0) / (count1 - count0)
    client_ttft = result["mean_ttft_ms"] / 1000.0
    assert client_ttft >= server_ttft * 0.99  # the client sees the first token after the server sends it
    assert abs(client_ttft - server_ttft) <= 0.1 * server_ttft
    assert tpot_count1 - tpot_count0 == 16
    server_tpot = (tpot_sum1 - tpot_sum0) / 16
    assert abs(result["mean_tpot_ms"] / 1000.0 - server_tpot) <= 0.1 * server_tpot


STORY = "You are a storyteller. Whatever you are asked, answer with a long story."


def test_voice_cancels_drafts_by_route_and_reads_the_servers_timings(server: Server, tmp_path: Path):
    """Both modes of `ladle bench voice` on the real server: turn 0's first draft is cancelled by POST
    /v1/requests/{id}/cancel (the caller resumed 0.3 s after it left; 48 tokens of a story take longer)
    and its stream ends by the server's abort; every reply carries the server's timings."""
    turns = [
        {"conversation": "story", "turn": 0, "system": STORY, "events": [
            P(0.05, "Tell me a story"), E(0.2, "Tell me a story"), R(0.5), P(0.6, "Tell me a story about the sea"),
            E(0.8, "Tell me a story about the sea"), END(1.1, "Tell me a story about the sea.")]},
        {"conversation": "story", "turn": 1, "events": [P(0.05, "Thanks"), E(0.2, "Thanks"), END(0.4, "Thanks.")]},
    ]
    path = tmp_path / "story.jsonl"
    path.write_text("".join(json.dumps(t) + "\n" for t in turns))
    server.wait_idle()
    aborted = server.scrape().get('vllm:request_success_total{finished_reason=abort}', 0.0)
    # its own process, as a caller is: the server here is a thread of the test process
    done = subprocess.run([sys.executable, "-m", "ladle.cli", "bench", "voice", "--base-url", server.base_url,
                           "--script", str(path), "--max-tokens", "48", "--cancel", "route", "--server-timings",
                           "--turn-gap", "0.05", "--result-dir", str(tmp_path), "--disable-tqdm"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "Voice Turn Benchmark" in done.stdout and "Server first token p50 (ms)" in done.stdout
    [result_file] = tmp_path.glob("voice-*.json")
    result = json.loads(result_file.read_text())
    assert result["model_id"] == MODEL and result["failed_requests"] == 0, result["errors"]
    rows = {(r["mode"], r["turn"]): r for r in result["turns"]}
    assert len(rows) == 4 and all(not r["error"] for r in rows.values())
    first = rows[("eager", 0)]
    assert (first["drafts_started"], first["drafts_used"], first["drafts_cancelled"]) == (2, 1, 1)
    assert first["cancel_via"] == ["route"]  # the route answered 200 and the stream then ended by itself
    assert 0 < first["wasted_tokens"] < 48  # cut short by the abort, after it had begun
    assert rows[("eager", 1)]["reply_source"] == "draft" and rows[("wait", 0)]["drafts_started"] == 0
    server.wait_idle()  # the cancelled draft's blocks are back in the pool
    assert server.scrape()['vllm:request_success_total{finished_reason=abort}'] - aborted == 1
    for r in rows.values():  # the server's own stages, as ladle's Timings names them
        t = r["server_timings"]
        assert set(t) == set(Timings.model_fields), t
        assert t["completion_tokens"] == r["reply_tokens"] and t["prompt_tokens"] == r["prompt_tokens"]
        assert 0 <= t["queued_ms"] <= t["first_token_ms"] <= t["last_token_ms"]
        assert t["first_token_ms"] <= r["reply_ttft_ms"]  # the client sees the first token after the server
    for mode in ("wait", "eager"):
        summary = result["summary"][mode]
        assert 0 < summary["server_p50_first_token_ms"] <= summary["p50_reply_ttft_ms"]


def test_the_fakes_cancel_404_is_the_real_servers(server: Server):
    """tests/test_bench_voice.py's fake answers a cancel of no running request with this server's body."""
    r = httpx.post(f"{server.base_url}/requests/no-such-request/cancel")
    assert r.status_code == 404 and r.json() == cancel_not_found_body("no-such-request")


def test_agent_sessions_reuse_the_servers_prefix_cache(server: Server, tmp_path: Path):
    """The agent dataset against the real server: each later turn's prompt extends its session's last one,
    so the server reports at least that prompt, less its unfilled last block, as cached."""
    rc = ladle_main(["bench", "serve", "--base-url", server.url, "--model", MODEL, "--dataset", "agent",
                     "--num-prompts", "6", "--agent-turns", "3", "--agent-system-len", "40",
                     "--agent-burst-len", "24", "--agent-output-len", "4", "--agent-think-time", "0.01",
                     "--seed", "7", "--save-result", "--save-detailed", "--result-dir", str(tmp_path),
                     "--result-filename", "agent.json", "--disable-tqdm"])
    assert rc == 0
    result = json.loads((tmp_path / "agent.json").read_text())
    assert result["completed"] == 6 and result["failed"] == 0
    assert result["turns"] == [0, 0, 1, 1, 2, 2]  # two sessions, interleaved turn by turn
    prompts, cached = result["input_lens"], result["cached_tokens"]
    block = server.engine.engine.config.block_size
    for k in range(2, 6):  # session k % 2's turn k // 2 after its turn k // 2 - 1
        assert prompts[k] > prompts[k - 2]
        assert prompts[k - 2] - block <= cached[k] < prompts[k], (k, prompts, cached)
    assert [t["turn"] for t in result["per_turn"]] == [0, 1, 2]
    assert result["agent"]["prefix_hit_rate"] == pytest.approx(sum(cached) / sum(prompts))


def test_reset_cache_makes_a_repeated_run_cold(server: Server, tmp_path: Path):
    """The same 3 prompts twice: the second run finds them cached; a third with --reset-cache finds nothing."""
    def run(name: str, *extra: str) -> dict:
        rc = ladle_main(["bench", "serve", "--base-url", server.url, "--model", MODEL, "--num-prompts", "3",
                         "--random-input-len", "48", "--random-output-len", "2", "--max-concurrency", "1",
                         "--tokens-per-word", "1.0", "--seed", "3", "--skip-initial-test", "--disable-tqdm",
                         "--save-result", "--save-detailed", "--result-dir", str(tmp_path), "--result-filename",
                         name, *extra])
        assert rc == 0
        return json.loads((tmp_path / name).read_text())

    run("first.json")
    warm = run("warm.json")
    cold = run("cold.json", "--reset-cache")
    assert warm["cache"] == "warm" and min(warm["cached_tokens"]) > 0
    assert cold["cache"] == "cold" and cold["cached_tokens"] == [0, 0, 0]
